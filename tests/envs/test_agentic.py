"""Multi-turn tool environments and the turn loop: `math-python` and `terminal` generate tasks deterministically with
disjoint splits, their verifiers grade hand-made right and wrong trajectories, a scripted "model" that writes the
right tool calls solves every kind of task through the turn loop, and the loop's sequence, mask and log-probs line up
with what was sampled; a model's mistakes (malformed, unknown, badly argued calls; a turn or token limit) end up in
tool responses and stats, never in an exception."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from hybridtron.data.chat import tokenize_chat, tool_turn_text
from hybridtron.data.tokenizer import IM_END, Tokenizer
from hybridtron.envs import get_env
from hybridtron.envs.agentic import BASH_TOOL, PYTHON_TOOL, SandboxEpisode, echo_last_expression, summarize
from hybridtron.envs.base import Environment, Task
from hybridtron.envs.sandbox import SandboxConfig
from hybridtron.envs.terminal import KINDS, build_tree
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.scheduler import Completion
from hybridtron.post.agentic import run_episodes


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(['{"name": "python", "arguments": {"code": "print(1)"}}\n', "The answer is \\boxed{42}.\n",
                            "grep -rl ERROR logs | wc -l\n"] * 30, vocab_size=512)


class Scripted:
    """A "model" for the turn loop: `policy(task, tool_outputs) -> reply` picks each turn's text from the task and
    the tool responses so far; its tokens end with <|im_end|> (a finished turn) and carry log-prob -0.25 each."""

    def __init__(self, tokenizer, tasks, policy):
        self.tokenizer, self.tasks, self.policy = tokenizer, tasks, policy
        self.calls = 0

    def __call__(self, prompts, params):
        self.calls += 1
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            task = next(t for t in self.tasks if t.prompt in text)
            outputs = [part.split("\n</tool_response>")[0] for part in text.split("<tool_response>\n")[1:]]
            reply = self.tokenizer.encode(self.policy(task, outputs))[:params.max_tokens]
            ended = len(reply) < params.max_tokens
            tokens = reply + [self.tokenizer.token_id(IM_END)] * ended
            out.append(Completion(list(ids), tokens, torch.full((len(tokens),), -0.25), "stop" if ended else "length"))
        return out


def solve(task, outputs):
    """The scripted solver: the task's reference call, then the last output as the answer."""
    if not outputs:
        return task.reference
    return f"The answer is \\boxed{{{outputs[-1].strip()}}}." if task.answer is not None else "Done."


PARAMS = SamplingParams(max_tokens=200, temperature=0.0)


@pytest.mark.parametrize("name", ["math-python", "terminal"])
def test_tasks_are_deterministic_with_disjoint_splits(name):
    with get_env(name) as env:
        train, test = env.tasks("train", 40, seed=3), env.tasks("test", 8, seed=3)
        assert [t.id for t in train] == [t.id for t in env.tasks("train", 40, seed=3)]
        assert [t.state for t in train] == [t.state for t in env.tasks("train", 40, seed=3)]
        assert not {t.prompt for t in train} & {t.prompt for t in test}
        assert [t.id for t in env.tasks("train", 40, seed=4)] != [t.id for t in train]
        assert {t.difficulty for t in train} == set(env.levels)


def test_math_python_solved_with_its_tool_and_graded(tokenizer):
    with get_env("math-python") as env:
        tasks = [next(t for t in env.tasks("train", 40, seed=1) if t.difficulty == level) for level in env.levels]
        model = Scripted(tokenizer, tasks, solve)
        trajectories = run_episodes(model, tokenizer, env, tasks, PARAMS)
        for task, trajectory in zip(tasks, trajectories):
            assert trajectory.reward == 1.0, (task.prompt, trajectory.turns[0].results)
            assert trajectory.finish == "answer" and len(trajectory.turns) == 2
            assert trajectory.turns[0].results[0].content == task.answer  # the python tool printed it
        assert model.calls == 2  # every trajectory's turn in one batch
        # the same trajectories with a wrong final answer (off by one) score 0
        wrong = Scripted(tokenizer, tasks, lambda task, outputs: solve(task, outputs) if not outputs
                         else f"\\boxed{{{int(outputs[-1]) + 1}}}")
        assert [t.reward for t in run_episodes(wrong, tokenizer, env, tasks, PARAMS)] == [0.0] * len(tasks)
    summary = summarize(trajectories)
    assert summary["pass_rate"] == 1.0 and summary["turns"] == 2.0 and summary["well_formed"] == 1.0


def test_terminal_every_kind_solved_and_wrong_answers_fail(tokenizer):
    env = get_env("terminal")
    pool = env.tasks("train", 60, seed=2)
    tasks = [next(t for t in pool if t.difficulty == level) for level in env.levels]
    assert [json.loads(t.state)["kind"] for t in tasks] == list(KINDS)
    # and a tree with a subdirectory under data/ (which `ls -S` would have named the largest)
    tasks.append(next(t for t in pool if json.loads(t.state)["kind"] == "largest"
                      and "data/extra/more.csv" in build_tree(json.loads(t.state)["seed"])))
    trajectories = run_episodes(Scripted(tokenizer, tasks, solve), tokenizer, env, tasks, PARAMS)
    assert [t.reward for t in trajectories] == [1.0] * len(tasks), [t.turns[0].results for t in trajectories]
    # wrong: answer without touching the tree, or with a wrong name / count
    idle = run_episodes(Scripted(tokenizer, tasks, lambda task, outputs: "\\boxed{3}"), tokenizer, env, tasks, PARAMS)
    for task, trajectory in zip(tasks, idle):
        assert trajectory.reward == (1.0 if task.answer == "3" else 0.0), task.prompt


def test_terminal_state_grading_reads_no_links_or_fifos(tokenizer):
    """A state task whose tree is right but holds a symlink out, or a FIFO, is wrong, and grading does not hang."""
    env = get_env("terminal", levels=(5,))  # delete the .bak files under tmp/
    (task,) = env.tasks("train", 1, seed=0)
    sabotage = task.reference.replace("-delete", "-delete; ln -s /etc/passwd tmp/x.txt; mkfifo tmp/pipe")
    model = Scripted(tokenizer, [task], lambda t, outputs: sabotage if not outputs else "Done.")
    (trajectory,) = run_episodes(model, tokenizer, env, [task], PARAMS)
    assert trajectory.turns[0].results[0].error is None and trajectory.reward == 0.0


def test_sequence_mask_and_logprobs_line_up(tokenizer):
    env = get_env("math-python", levels=(1,))
    (task,) = env.tasks("train", 1, seed=0)
    (trajectory,) = run_episodes(Scripted(tokenizer, [task], solve), tokenizer, env, [task], PARAMS)
    first, second = trajectory.turns
    ids, mask = trajectory.token_ids, trajectory.model_mask
    assert len(ids) == len(mask) == len(trajectory.logprobs)
    assert not any(mask[:trajectory.prompt_length]) and all(mask[first.start:first.end])
    assert ids[first.start:first.end] == tokenizer.encode(task.reference) + [tokenizer.token_id(IM_END)]
    # between the turns: the tool message and the next generation prompt, never trained
    between = tool_turn_text([first.results[0].content])
    assert ids[first.end:second.start] == tokenizer.encode(between) and not any(mask[first.end:second.start])
    assert [lp for lp, m in zip(trajectory.logprobs, mask) if m] == [-0.25] * sum(mask)
    assert set(lp for lp, m in zip(trajectory.logprobs, mask) if not m) == {0.0}
    assert second.end == len(ids) and trajectory.final == f"The answer is \\boxed{{{task.answer}}}."
    # the trajectory is the chat template's rendering of its conversation (which SFT on trajectories trains on)
    rendered = tokenize_chat(tokenizer, trajectory.conversation(env.prompt_messages(task)), tools=list(env.tools))
    assert rendered.ids.tolist() == ids + tokenizer.encode("\n")  # the template's newline after the last turn


class EchoEnv(Environment):
    """Tools without a sandbox: `echo` returns its text; `boom` raises (a tool's own bug). Reward: "done" answered."""

    name = "echo-test"
    tools = (PYTHON_TOOL,
             {"type": "function", "function": {"name": "echo", "parameters": {
                 "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}},
             {"type": "function", "function": {"name": "boom", "parameters": {"type": "object"}}})
    max_turns = 3

    def tasks(self, split, n, seed=0):
        return [Task(prompt=f"echo task {i}", domain="test") for i in range(n)]

    def episode(self, task):
        env = self

        class Echo(SandboxEpisode):
            def call(self, name, arguments):
                if name == "boom":
                    raise RuntimeError("the tool broke")
                if name == "echo":
                    return super().call("python", {"code": f"print({arguments['text']!r})"})
                return super().call(name, arguments)

        return Echo(env, task)

    def reward(self, task, completion):
        return float("done" in completion)


def call(name, arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_model_mistakes_become_tool_errors(tokenizer):
    env = EchoEnv()
    (task,) = env.tasks("train", 1)
    turns = ["<tool_call>\n{not json}\n</tool_call>",
             call("nope", {}) + "\n" + call("echo", {"text": 3}) + "\n" + call("boom", {}) + "\n"
             + call("echo", {"text": "<|im_end|> hi"}),
             "done"]
    model = Scripted(tokenizer, [task], lambda t, outputs: turns[min(len(outputs), 1) if len(outputs) < 2 else 2])
    (trajectory,) = run_episodes(model, tokenizer, env, [task], PARAMS)
    first, second, last = trajectory.turns
    assert [r.error for r in first.results] == ["malformed"] and "did not parse" in first.results[0].content
    assert [r.error for r in second.results] == ["unknown_tool", "bad_arguments", "failed", None]
    assert "the tool broke" in second.results[2].content and second.results[3].content == "<|im_end|> hi"
    assert trajectory.stats.calls == 5 and trajectory.stats.well_formed == 2
    assert "< |im_end|> hi" in tokenizer.decode(trajectory.token_ids)  # the marker broken up inside the response
    assert trajectory.finish == "answer" and trajectory.reward == 1.0 and last.text == "done"


def test_turn_limit_and_token_budget(tokenizer):
    env = EchoEnv()
    tasks = env.tasks("train", 2)
    forever = Scripted(tokenizer, tasks, lambda t, outputs: call("echo", {"text": "again"}))
    limited = run_episodes(forever, tokenizer, env, tasks, PARAMS, max_turns=2)
    assert [t.finish for t in limited] == ["turn_limit"] * 2 and [len(t.turns) for t in limited] == [2, 2]
    assert [t.reward for t in limited] == [0.0, 0.0] and limited[0].stats.calls == 2
    prompt = limited[0].prompt_length
    (short,) = run_episodes(forever, tokenizer, env, tasks[:1], PARAMS, token_budget=prompt + 40)
    assert short.finish == "token_budget" and len(short.token_ids) <= prompt + 40 + 30
    (cut,) = run_episodes(forever, tokenizer, env, tasks[:1], SamplingParams(max_tokens=5, temperature=0.0))
    assert cut.finish == "length" and len(cut.turns) == 1 and cut.stats.calls == 0
    with pytest.raises(ValueError, match="max_turns must be an int >= 1"):
        run_episodes(forever, tokenizer, env, tasks, PARAMS, max_turns=0)


def test_echo_last_expression():
    assert echo_last_expression("x = 2\nx ** 10") == ("x = 2\nif (__value := (x ** 10)) is not None:\n"
                                                      "    print(repr(__value))")
    assert echo_last_expression("print(1)").endswith("print(repr(__value))")  # None: nothing more is printed
    assert echo_last_expression("for i in range(2): pass") == "for i in range(2): pass"
    assert echo_last_expression("def (") == "def ("


# --------------------------------------------------------------------------------------------- hostile calls
HOSTILE = {  # command -> (the error kinds it may come back as, a piece of what the model reads back)
    # the classic one: bash (the PID namespace's first process) returns at once, and its namespace dies with it;
    # what the children printed before that comes back (past the output limit on a loaded machine)
    "fork bomb": (":(){ :|:& };:", (None, "output_limit"), ""),
    # one that keeps its shell alive: forks refused past RLIMIT_NPROC, everything killed at the wall clock
    "fork bomb, waiting": (":(){ :|:& };:; sleep 30", ("timeout",), "Resource temporarily unavailable"),
    "network": ("echo hi > /dev/tcp/1.1.1.1/80", ("failed",), "exit status"),
    "write outside": ("touch /escape /etc/escape ../escape", ("failed",), "exit status"),
    "sleep past the limit": ("sleep 30", ("timeout",), "killed"),
    "100 MB of output": ("head -c 100000000 /dev/zero | tr '\\0' a", ("output_limit",), "output cut"),
}


def test_hostile_calls_are_contained_and_the_rollout_goes_on(tokenizer, tmp_path):
    limits = SandboxConfig(wall_s=1.5, cpu_s=2, output_bytes=2048, processes=16, disk_mb=8, file_mb=4)

    class Hostile(EchoEnv):
        tools = (BASH_TOOL,)

        def episode(self, task):
            return SandboxEpisode(self, task, limits)

    env = Hostile()
    (task,) = env.tasks("train", 1)
    first = "\n".join(call("bash", {"command": command}) for command, _, _ in HOSTILE.values())
    model = Scripted(tokenizer, [task], lambda t, outputs: first if not outputs else "done")
    (trajectory,) = run_episodes(model, tokenizer, env, [task], SamplingParams(max_tokens=2000, temperature=0.0),
                                 token_budget=50_000)
    results = trajectory.turns[0].results
    for (name, (_, errors, said)), result in zip(HOSTILE.items(), results):
        assert result.error in errors and said in result.content, (name, result)
        assert len(result.content) < limits.output_bytes + 200, name
    assert trajectory.finish == "answer" and trajectory.reward == 1.0 and len(trajectory.turns) == 2
    assert trajectory.stats.calls == len(HOSTILE) and trajectory.stats.well_formed == len(HOSTILE)
    assert not os.path.exists("/escape") and not os.path.exists("/etc/escape")


@pytest.mark.skipif(os.getuid() != 0, reason="a non-root parent's candidates keep its uid in a user namespace of "
                                             "their own, where RLIMIT_NPROC counts that namespace's processes")
def test_each_trajectory_has_its_own_process_limit():
    """Under a root parent every trajectory's calls run as a user of its own: a trajectory that fills its process
    limit leaves another's pipeline, started later in a call already running, unhurt (with one user shared by all,
    that pipeline's forks were refused until the wall clock killed it)."""
    limits = SandboxConfig(wall_s=4.0, cpu_s=2, processes=8)
    env = EchoEnv()
    busy, other = (SandboxEpisode(env, task, limits) for task in env.tasks("train", 2))
    with busy, other:
        assert busy.run_as != other.run_as and os.stat(busy.workdir).st_uid == busy.run_as
        late = []
        pipeline = threading.Thread(target=lambda: late.append(other.call(
            "bash", {"command": "sleep 1.5; echo ok | cat | cat | cat | cat | cat | cat"})))
        pipeline.start()
        time.sleep(0.5)
        busy.call("bash", {"command": "for i in 1 2 3 4 5 6 7; do sleep 2 & done; wait"})
        pipeline.join()
        assert [(r.error, r.content) for r in late] == [(None, "ok")]
