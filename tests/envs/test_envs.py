"""Environments: the math verifier, grading in a child with a time limit, task splits and levels, SFT data
that the environments' own rewards accept, code rewards, and the registry."""

import ast
import hashlib
import json
import logging
import operator
import re
import threading
import time
from fractions import Fraction

import pytest

from hybridtron.envs import (CodeEnv, Environment, MathEnv, Task, assistant_turn, env_names, get_env,
                                  register, split_of, write_jsonl)
from hybridtron.envs.code import FAMILIES, extract_code
from hybridtron.envs.grading import GraderPool
from hybridtron.envs.math_verify import extract_answer, grade, parse_value
from hybridtron.envs.sandbox import SandboxConfig

FAST_SANDBOX = SandboxConfig(wall_s=1.0, cpu_s=1)


@pytest.fixture(scope="module")
def math_env():
    with MathEnv() as env:
        yield env


@pytest.fixture(scope="module")
def code_env():
    return CodeEnv(sandbox=FAST_SANDBOX)


GRADED = [  # (completion, answer key, reward)
    ("\\boxed{12}", "12", 1), ("\\boxed{ 12 }", "12", 1), ("$\\boxed{12}$", "12", 1), ("\\boxed{12.0}", "12", 1),
    ("\\boxed{012}", "12", 1), ("\\boxed{+12}", "12", 1), ("\\boxed{12.}", "12", 1), ("\\boxed{\\text{12}}", "12", 1),
    ("\\boxed{x = 12}", "12", 1), ("\\boxed{\\dfrac{24}{2}}", "12", 1), ("\\boxed{24/2}", "12", 1),
    ("\\boxed{12.5}", "12", 0), ("\\boxed{12 apples}", "12", 0), ("\\boxed{1e1}", "10", 0),
    ("Answer: 12", "12", 1), ("**Answer:** 12", "12", 1), ("Final answer: $12$", "12", 1), ("answer: 12.", "12", 1),
    ("The answer is 12", "12", 0), ("", "12", 0),
    ("\\boxed{1,234}", "1234", 1), ("\\boxed{1{,}234}", "1234", 1), ("\\boxed{1 234}", "1234", 1),
    ("\\boxed{1\\,234}", "1234", 1), ("\\boxed{12,34}", "1234", 0), ("\\boxed{1,234,567.5}", "2469135/2", 1),
    ("\\boxed{-\\frac{7}{24}}", "-7/24", 1), ("\\boxed{\\frac{-7}{24}}", "-7/24", 1),
    ("\\boxed{\\frac{7}{-24}}", "-7/24", 1),
    ("\\boxed{-7/24}", "-7/24", 1), ("\\boxed{\u22127/24}", "-7/24", 1), ("Answer: $-\\dfrac{14}{48}$", "-7/24", 1),
    ("\\boxed{7/24}", "-7/24", 0), ("\\boxed{-0.291666}", "-7/24", 0),
    ("\\boxed{0.5}", "1/2", 1), ("\\boxed{.5}", "1/2", 1), ("\\boxed{\\frac12}", "1/2", 1),
    ("\\boxed{\\tfrac{2}{4}}", "1/2", 1),
    ("\\boxed{\\left(\\frac{1}{2}\\right)}", "1/2", 1), ("\\[\\boxed{\\frac{1}{2}}\\]", "1/2", 1),
    ("\\boxed{1/0}", "1/2", 0),
    ("\\boxed{0.333}", "1/3", 0), ("\\boxed{0.3333333333333333}", "1/3", 0),
    ("\\boxed{-38}", "-38", 1), ("\\boxed{- 38}", "-38", 1), ("\\boxed{38}", "-38", 0), ("\\boxed{--38}", "-38", 0),
    ("\\boxed{" + "9" * 5000 + "}", "12", 0), ("Answer: " + "1" * 10000, "12", 0),
]


@pytest.mark.parametrize("completion, answer, reward", GRADED)
def test_math_verifier_on_formatting_variants(completion, answer, reward):
    assert grade(completion, answer) == reward


def test_child_grading_agrees_with_in_process_grading(math_env):
    completions, answers, expected = zip(*GRADED)
    tasks = [Task(prompt="p", answer=a, domain="math") for a in answers]
    assert math_env.rewards(tasks, list(completions)) == [float(r) for r in expected]


@pytest.mark.parametrize("completion, extracted", [
    ("\\boxed{3} then \\boxed{5}", "5"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{{1}+{2}}", "{1}+{2}"),
    ("\\fbox{7}", "7"),
    ("\\boxed{12", None),                                # never closes
    ("\\boxed{12\nAnswer: 13", "13"),                    # an unclosed box falls back to the answer line
    ("Answer: 5\n\\boxed{6}", "6"),                      # a box wins over an answer line
    ("Answer: 4\nno, wait\nAnswer: 5\n", "5"),           # the last answer line
    ("<think>\\boxed{5}</think>So \\boxed{6}.", "6"),    # only the text after the thinking counts
    ("<think>\\boxed{5}</think>", None),
    ("<think>I think it is \\boxed{5}", None),           # thinking that never closes has no answer
    ("<think>a</think><think>b</think>\\boxed{2}", "2"),
])
def test_answer_extraction_edge_cases(completion, extracted):
    assert extract_answer(completion) == extracted


def test_parse_value_is_exact():
    assert parse_value("\\frac{1}{3}") == Fraction(1, 3)
    assert parse_value("0.1") == Fraction(1, 10)
    assert parse_value("$1{,}000.25$") == Fraction(4001, 4)
    assert parse_value("1/3") != parse_value("0.3333333333333333")
    with pytest.raises(ValueError, match="answer key"):
        grade("\\boxed{1}", "one")


SLOW_GRADER = """
import json, os, sys, time
for line in sys.stdin.buffer:
    completion, answer = json.loads(line)
    if completion == "hang":
        time.sleep(60)
    if completion == "die":
        os._exit(1)
    if completion == "raise":
        sys.stdout.write("E ValueError: bad\\n")
    else:
        sys.stdout.write("1\\n" if completion == answer else "0\\n")
    sys.stdout.flush()
"""


def test_grading_timeout_in_the_child_scores_zero_and_is_counted(tmp_path, caplog):
    script = tmp_path / "slow_grader.py"
    script.write_text(SLOW_GRADER)
    pairs = [("a", "a"), ("hang", "x"), ("b", "b"), ("die", "x"), ("raise", "x"), ("c", "c"), ("d", "e")]
    with GraderPool(script, workers=2, timeout_s=0.3) as pool, caplog.at_level(logging.WARNING):
        start = time.monotonic()
        assert pool.grade(pairs) == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]
        assert time.monotonic() - start < 2.0
        assert (pool.stats.graded, pool.stats.timeouts, pool.stats.errors) == (7, 1, 2)
        assert pool.grade([("hang", "x"), ("a", "a")]) == [0.0, 1.0]  # the pool recovered; the count goes on
        assert pool.stats.timeouts == 2
    assert any("exceeded 0.30 s" in r.getMessage() for r in caplog.records)


def test_grading_works_off_the_main_thread(math_env):
    """No signal.alarm anywhere: a rollout thread gets the same rewards."""
    out = []
    task = Task(prompt="p", answer="3", domain="math")
    thread = threading.Thread(target=lambda: out.append(math_env.rewards([task] * 2, ["\\boxed{3}", "\\boxed{4}"])))
    thread.start()
    thread.join(10)
    assert out == [[1.0, 0.0]]


@pytest.mark.parametrize("env_fixture", ["math_env", "code_env"])
def test_tasks_are_deterministic_and_splits_disjoint(env_fixture, request):
    env = request.getfixturevalue(env_fixture)
    train = env.tasks("train", 400, seed=0)
    assert [t.id for t in train] == [t.id for t in env.tasks("train", 400, seed=0)]
    assert [t.id for t in train] != [t.id for t in env.tasks("train", 400, seed=1)]
    test = env.tasks("test", 40, seed=0)
    assert len({t.id for t in train}) == 400 and len({t.id for t in test}) == 40
    assert not {t.prompt for t in train} & {t.prompt for t in test}
    assert all(split_of(t.prompt) == "train" for t in train) and all(split_of(t.prompt) == "test" for t in test)
    more_test = env.tasks("test", 40, seed=7)
    assert not {t.prompt for t in train} & {t.prompt for t in more_test}


def test_task_ids_are_stable_across_runs():
    """Golden values: the same draws and ids on every machine and run (a curriculum keyed by task id, or a log,
    outlives the process). A change to a generator changes them, and should be made knowingly."""
    assert Task(prompt="What is 2 + 2?", answer="4", domain="math").id == \
        "math-" + hashlib.sha256(b"math\nWhat is 2 + 2?").hexdigest()[:16]
    first = MathEnv().tasks("train", 2, seed=0)
    assert [(t.id, t.prompt) for t in first] == [
        ("math-b7ff23b58c8cbf32", "A train goes 28 km an hour for 2 hours, then 27 km more. How far does it go?"),
        ("math-809a83161e6202fc", "What is 28 + 48?")]
    assert CodeEnv().tasks("train", 1, seed=0)[0].id == "code-b7e6079567d23ff4"


def test_difficulty_levels(math_env):
    for level in range(1, 6):
        tasks = MathEnv(levels=(level,)).tasks("train", 20, seed=0)
        assert {t.difficulty for t in tasks} == {level}
    mixed = math_env.tasks("train", 300, seed=0)
    assert {t.difficulty for t in mixed} == {1, 2, 3, 4, 5}
    assert all("/" in t.prompt for t in mixed if t.difficulty == 4)
    assert all(len(t.prompt.split()) >= 10 for t in mixed if t.difficulty == 5)  # word problems
    assert {t.difficulty for t in CodeEnv(levels=(2, 4)).tasks("train", 50, seed=0)} == {2, 4}
    with pytest.raises(ValueError, match=r"math: levels must be a non-empty subset of \(1, 2, 3, 4, 5\)"):
        MathEnv(levels=(0, 6))
    with pytest.raises(ValueError, match="code: levels"):
        CodeEnv(levels=())


def test_small_task_spaces_say_when_they_run_out():
    with pytest.raises(ValueError, match="only .* distinct test tasks"):
        MathEnv(levels=(1,)).tasks("test", 100, seed=0)  # single-digit sums: about 15 held out
    # a spent pool is found after a run of draws that bring nothing new, not after 200 draws per task asked for
    with pytest.raises(ValueError, match="only 11 distinct test tasks after .* draws, 5000 asked for") as error:
        MathEnv(levels=(1,)).tasks("test", 5000, seed=0)
    assert int(re.search(r"after (\d+) draws", str(error.value)).group(1)) < 20_000
    with pytest.raises(ValueError, match="split must be one of"):
        MathEnv().tasks("validation", 1)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def exact(node):
    """Evaluate + - * / on integers with Fractions (a trace's arithmetic, checked exactly)."""
    if isinstance(node, ast.Expression):
        return exact(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -exact(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](exact(node.left), exact(node.right))
    raise AssertionError(f"unexpected term {ast.dump(node)}")


THINK_BOXED = re.compile(r"<think>(.+)</think>\\boxed\{(.+)\}", re.DOTALL)


def test_math_sft_examples_are_correct(math_env):
    examples = math_env.sft_examples(500, seed=0)
    assert len(examples) == 500
    tasks = math_env.tasks("train", 500, seed=0)
    completions = []
    for example, task in zip(examples, tasks):
        assert example["domain"] == "math"
        assert [m["role"] for m in example["messages"]] == ["system", "user", "assistant"]
        assert example["messages"][1]["content"] == task.prompt
        content = example["messages"][2]["content"]
        trace, boxed = THINK_BOXED.fullmatch(content).groups()
        assert boxed == task.answer
        for step in trace.split(". "):  # every side of every "=" has the same value
            step = step.removeprefix("ones: ").removeprefix("tens: ")
            values = {exact(ast.parse(side, mode="eval")) for side in step.split(" = ")}
            assert len(values) == 1, step
        assert exact(ast.parse(trace.split(". ")[-1].split(" = ")[-1], mode="eval")) == parse_value(task.answer)
        assert len(content) < 160, content  # tens of tokens
        completions.append(content)
    assert math_env.rewards(tasks, completions) == [1.0] * 500
    level2 = [c for c, t in zip(completions, tasks) if t.difficulty == 2]
    columns = sum("ones: " in c for c in level2)
    assert 0.35 < columns / len(level2) < 0.65  # two trace styles, about half each


def test_code_sft_examples_pass_their_own_tests(code_env):
    examples = code_env.sft_examples(len(FAMILIES) * 2, seed=0)
    tasks = code_env.tasks("train", len(FAMILIES) * 2, seed=0)
    for example in examples:
        content = example["messages"][-1]["content"]
        assert re.fullmatch(r"<think>[^<]+</think>```python\ndef \w+\(\w+\):\n.+```", content, re.DOTALL), content
    assert code_env.rewards(tasks, [e["messages"][-1]["content"] for e in examples]) == [1.0] * len(tasks)
    assert {t.difficulty for t in tasks} == {1, 2, 3, 4, 5}


def test_code_rewards_are_the_share_of_hidden_tests_passed(code_env):
    task = Task(prompt="Complete the function.", domain="code",
                tests=("assert f(1) == 2", "assert f(2) == 4", "assert f(3) == 6", "assert f(0) == 0"))
    fenced = "<think>double it</think>```python\ndef f(x):\n    return {}\n```"
    assert code_env.reward(task, fenced.format("2 * x")) == 1.0
    assert code_env.reward(task, fenced.format("x + 1")) == 0.25  # right for x = 1 only
    assert code_env.reward(task, fenced.format("2 * x if x < 3 else 7")) == 0.75
    assert code_env.reward(task, fenced.format("'2'")) == 0.0
    assert code_env.reward(task, "def f(x):\n    return 2 * x\n") == 1.0  # no fence: the whole answer
    assert code_env.reward(task, "<think>```python\ndef f(x):\n    return 2 * x\n```") == 0.0  # never finished
    assert code_env.reward(task, "```python\nimport sys\nsys.exit(0)\n```") == 0.0
    with pytest.raises(ValueError, match="no hidden tests"):
        code_env.reward(Task(prompt="p", domain="code"), "x")


def test_code_extraction():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_code("<think>```python\nx = 1\n```</think>```python\nx = 3\n") == "x = 3\n"  # unclosed last
    assert extract_code("<think>plan</think>\ndef f(): pass") == "\ndef f(): pass"


def test_unknown_env_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown environment 'chess'; known: .*code.*math"):
        get_env("chess")


def test_a_user_environment_in_a_few_lines(tmp_path):
    @register("test-parity")
    class Parity(Environment):
        domain = "math"
        system_prompt = "Answer even or odd."

        def generate(self, rng):
            n = rng.randrange(10_000)
            answer = "even" if n % 2 == 0 else "odd"
            return Task(prompt=f"Is {n} even or odd?", answer=answer, domain=self.domain,
                        reference=assistant_turn(f"{n} % 2 = {n % 2}", answer))

        def reward(self, task, completion):
            return float(completion.rsplit("</think>", 1)[-1].strip() == task.answer)

    assert "test-parity" in env_names()
    env = get_env("test-parity")
    tasks = env.tasks("train", 5, seed=0)
    examples = env.sft_examples(5, seed=0)
    assert env.rewards(tasks, [e["messages"][-1]["content"] for e in examples]) == [1.0] * 5
    path = write_jsonl(tmp_path / "sft" / "parity.jsonl", examples)
    assert [json.loads(line) for line in path.read_text().splitlines()] == examples
    with pytest.raises(ValueError, match="already registered"):
        register("test-parity")(type("Other", (Parity,), {}))


def test_bad_tasks_and_envs_are_named():
    with pytest.raises(ValueError, match="Task.prompt must be a non-empty string"):
        Task(prompt="  ")
    with pytest.raises(ValueError, match="Task.difficulty must be an int >= 1"):
        Task(prompt="p", difficulty=0)
    with pytest.raises(ValueError, match="rewards: 2 tasks but 1 completions"):
        MathEnv().rewards([Task(prompt="p", answer="1")] * 2, ["x"])

    class NoReference(Environment):
        def generate(self, rng):
            return Task(prompt=f"q{rng.random()}")

        def reward(self, task, completion):
            return 0.0

    with pytest.raises(ValueError, match="has no reference solution"):
        NoReference().sft_examples(1)
