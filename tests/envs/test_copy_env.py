"""`copy`: repeat a number or a name exactly in `\\boxed{}` (the copying the tool environments rest on)."""

from __future__ import annotations

import pytest

from hybridtron.envs import env_sft_examples, get_env
from hybridtron.envs.copy import LEVELS


def test_tasks_by_level_and_exact_reward():
    env = get_env("copy")
    for level in LEVELS:
        tasks = get_env("copy", levels=(level,)).tasks("train", 20, seed=1)
        assert {t.difficulty for t in tasks} == {level} and all(t.prompt == f"Repeat: {t.answer}" for t in tasks)
        shortest, longest = {1: (3, 9), 2: (10, 18), 3: (6, 24)}[level]
        assert all(shortest <= len(t.answer) <= longest for t in tasks)
        assert all(t.answer.isdigit() for t in tasks) == (level != 3)
    task = get_env("copy", levels=(2,)).tasks("test", 1, seed=0)[0]
    assert env.reward(task, task.reference) == 1.0
    assert env.reward(task, f"<think>it is {task.answer}</think>The answer is \\boxed{{{task.answer}}}.") == 1.0
    wrong = task.answer[:-1] + str((int(task.answer[-1]) + 1) % 10)
    assert env.reward(task, f"\\boxed{{{wrong}}}") == 0.0  # one digit off
    assert env.reward(task, f"\\boxed{{{task.answer}0}}") == 0.0  # one digit more
    assert env.reward(task, task.answer) == 0.0  # not boxed
    assert env.reward(task, f"<think>\\boxed{{{task.answer}}}</think>") == 0.0  # only inside the reasoning


def test_splits_are_disjoint_and_sft_examples_end_in_the_reference():
    env = get_env("copy")
    train = {t.prompt for t in env.tasks("train", 300, seed=0)}
    assert not train & {t.prompt for t in env.tasks("test", 300, seed=0)}
    examples = env_sft_examples("env:copy", 10, seed=0, levels=(1,))
    for example in examples:
        messages = example["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant"] and example["domain"] == "copy"
        number = messages[1]["content"].removeprefix("Repeat: ")
        assert number.isdigit() and messages[2]["content"] == f"The answer is \\boxed{{{number}}}."


def test_bad_levels_are_named():
    with pytest.raises(ValueError, match=r"copy: levels must be a non-empty subset of \(1, 2, 3\), got \(4,\)"):
        get_env("copy", levels=(4,))
    with pytest.raises(ValueError, match="copy: levels must be a non-empty subset"):
        get_env("copy", levels=())
