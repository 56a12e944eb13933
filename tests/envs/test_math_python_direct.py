"""`math-python` with `tool=False`: the same tasks with no tool declared and one turn, the baseline that says what
the tool is worth. The prompt renders without tools, a model that still calls `python` gets an error and no answer,
one that answers directly is graded as with the tool; it has no SFT data, and the class keeps its tool."""

from __future__ import annotations

import pytest

from hybridtron.data.chat import tokenize_chat
from hybridtron.envs import get_env
from hybridtron.post.agentic import run_episodes
from test_agentic import PARAMS, Scripted, solve, tokenizer  # noqa: F401  (tokenizer: the fixture)


def test_direct_env_has_the_same_tasks_without_the_tool(tokenizer):
    with get_env("math-python", levels=(1, 2), tool=False) as direct, \
            get_env("math-python", levels=(1, 2)) as tooled:
        assert direct.tools == () and direct.max_turns == 1 and tooled.tools and tooled.max_turns == 4
        tasks = direct.tasks("test", 6, seed=3)
        assert [(t.prompt, t.answer) for t in tasks] == [(t.prompt, t.answer) for t in tooled.tasks("test", 6, seed=3)]
        rendered = tokenizer.decode(tokenize_chat(tokenizer, direct.prompt_messages(tasks[0]),
                                                  add_generation_prompt=True).ids.tolist())
        assert "<tools>" not in rendered and "python tool" not in rendered and "without any tool" in rendered
    assert get_env("math-python").tools  # the option is the instance's; the class keeps its tool


def test_direct_env_grades_an_answer_and_refuses_a_call(tokenizer):
    with get_env("math-python", levels=(1,), tool=False) as env:
        tasks = env.tasks("test", 4, seed=0)
        answered = run_episodes(Scripted(tokenizer, tasks, lambda task, _: f"It is \\boxed{{{task.answer}}}."),
                                tokenizer, env, tasks, PARAMS)
        assert [(t.reward, t.finish, len(t.turns)) for t in answered] == [(1.0, "answer", 1)] * 4
        calling = run_episodes(Scripted(tokenizer, tasks, solve), tokenizer, env, tasks, PARAMS)
        assert [(t.reward, t.finish, t.stats.calls, t.stats.errors["unknown_tool"]) for t in calling] == \
            [(0.0, "turn_limit", 1, 1)] * 4


def test_direct_env_options_are_checked():
    with get_env("math-python", tool=False) as env, pytest.raises(ValueError, match="tool=False has no SFT data"):
        env.sft_examples(2)
    with pytest.raises(ValueError, match="math-python: tool must be true or false, got 'no'"):
        get_env("math-python", tool="no")
