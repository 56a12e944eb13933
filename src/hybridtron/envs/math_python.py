"""`math-python`: arithmetic and counting problems past what a small model computes in its head, with a `python`
tool that runs in the sandbox.

Levels: 1 a product of two 6- to 9-digit numbers; 2 a sum over a range (of squares, cubes, or of the multiples of
k); 3 counting (the integers up to N divisible by a but not by b; how often a digit is written from 1 to N);
4 dates (the days between two dates; the weekday count of a weekday in a year range). Every answer is an integer,
graded as `math` grades (`\\boxed{}` or an "Answer:" line, in child processes with a time limit).

Each task's `reference` is the first turn of a solving trajectory: one `python` call whose program prints the
answer; the answer itself is `Task.answer`. `sft_examples` are the expert's trajectories through the real tool,
successful and failed, each prefixed with its outcome (`hybridtron.envs.agentic_sft`; `expert_plans` below).
"""

from __future__ import annotations

import datetime
import math
import random
from typing import Sequence

from hybridtron.data.tools import parse_tool_calls
from hybridtron.envs.agentic import PYTHON_TOOL, SandboxEpisode
from hybridtron.envs.agentic_sft import FAILURE_SHARE, Plan, call_turn, expert_examples, misspelt, near_miss
from hybridtron.envs.base import Environment, Episode, Task, register
from hybridtron.envs.grading import GraderPool, GradingStats
from hybridtron.envs.math import VERIFIER

LEVELS = (1, 2, 3, 4)
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def _product(rng: random.Random) -> tuple[str, int, str]:
    a, b = rng.randint(10 ** 5, 10 ** 9 - 1), rng.randint(10 ** 5, 10 ** 9 - 1)
    return f"What is {a} * {b}?", a * b, f"print({a} * {b})"


def _power_sum(n: int, power: int) -> int:
    """1^p + ... + n^p for p in (1, 2, 3) (closed forms: the answers are computed without the loops they ask for)."""
    return (n * (n + 1) // 2, n * (n + 1) * (2 * n + 1) // 6, (n * (n + 1) // 2) ** 2)[power - 1]


def _digit_count(n: int, digit: int) -> int:
    """How often `digit` (1-9) is written in 1..n, position by position."""
    count, place = 0, 1
    while place <= n:
        high, current, low = n // (place * 10), n // place % 10, n % place
        count += high * place + (place if current > digit else low + 1 if current == digit else 0)
        place *= 10
    return count


def _range_sum(rng: random.Random) -> tuple[str, int, str]:
    lo = rng.randint(1, 500)
    hi = lo + rng.randint(100, 5000)
    kind = rng.choice(("squares", "cubes", "multiples"))
    if kind == "multiples":
        k = rng.randint(3, 19)
        return (f"What is the sum of the multiples of {k} from {lo} to {hi} (inclusive)?",
                k * (_power_sum(hi // k, 1) - _power_sum((lo - 1) // k, 1)),
                f"print(sum(n for n in range({lo}, {hi + 1}) if n % {k} == 0))")
    power = 2 if kind == "squares" else 3
    return (f"What is the sum of the {kind} of the integers from {lo} to {hi} (inclusive)?",
            _power_sum(hi, power) - _power_sum(lo - 1, power),
            f"print(sum(n ** {power} for n in range({lo}, {hi + 1})))")


def _counting(rng: random.Random) -> tuple[str, int, str]:
    n = rng.randint(10 ** 4, 10 ** 6)
    if rng.random() < 0.5:
        a, b = rng.sample(range(3, 30), 2)
        return (f"How many integers from 1 to {n} are divisible by {a} but not by {b}?",
                n // a - n // math.lcm(a, b),
                f"print(sum(1 for k in range(1, {n + 1}) if k % {a} == 0 and k % {b}))")
    digit = rng.randint(1, 9)
    return (f"How many times is the digit {digit} written when writing all the integers from 1 to {n}?",
            _digit_count(n, digit),
            f"print(sum(str(k).count('{digit}') for k in range(1, {n + 1})))")


def _dates(rng: random.Random) -> tuple[str, int, str]:
    if rng.random() < 0.5:
        start = datetime.date(1900, 1, 1) + datetime.timedelta(days=rng.randint(0, 60000))
        end = start + datetime.timedelta(days=rng.randint(100, 40000))
        return (f"How many days are there from {start.isoformat()} to {end.isoformat()}?", (end - start).days,
                f"import datetime\nprint((datetime.date.fromisoformat('{end.isoformat()}') - "
                f"datetime.date.fromisoformat('{start.isoformat()}')).days)")
    first = rng.randint(1901, 2090)
    last = first + rng.randint(1, 40)
    day = rng.randrange(7)
    count = sum(1 for y in range(first, last + 1) for m in range(1, 13) if datetime.date(y, m, 13).weekday() == day)
    return (f"How many months from January {first} to December {last} have their 13th day on a {WEEKDAYS[day]}?",
            count, f"import datetime\nprint(sum(1 for y in range({first}, {last + 1}) for m in range(1, 13) "
                   f"if datetime.date(y, m, 13).weekday() == {day}))")


GENERATORS = {1: _product, 2: _range_sum, 3: _counting, 4: _dates}


def python_call_turn(code: str, lead: str = "") -> str:
    return call_turn("python", {"code": code}, lead)


def answer_turn(value: str, lead: str = "The answer is") -> str:
    """A final turn: `lead`, then `value` in `\\boxed{}` (the `copy` environment's answers are worded so too)."""
    return f"{lead} \\boxed{{{value}}}."


def _printed(outputs: list[str]) -> str:
    """The number the last tool response printed (its last line)."""
    lines = outputs[-1].strip().splitlines()
    return lines[-1].strip() if lines else ""


@register("math-python")
class MathPythonEnv(Environment):
    """Problems whose answer a `python` call computes; reward 1.0 for the exact integer in `\\boxed{}` (or an
    "Answer:" line) of the final turn. `levels`: the kinds to draw from; `workers`, `timeout_s`: the grading
    children (as `math`); each trajectory's tool calls run in a sandbox directory of its own. `tool=False`: the
    same tasks with no tool declared and one turn, so the model must answer from its head (what the tool is worth:
    pass@1 with it against without it); it has no SFT data, as its expert solves with the tool."""

    domain = "math"
    system_prompt = ("Solve the problem. Use the python tool for any computation you cannot do exactly in your head, "
                     "then give the final answer in \\boxed{}.")
    tools = (PYTHON_TOOL,)
    max_turns = 4
    direct_prompt = "Solve the problem without any tool, then give the final answer in \\boxed{}."

    def __init__(self, levels: Sequence[int] = LEVELS, *, workers: int = 1, timeout_s: float = 1.0,
                 failure_share: float = FAILURE_SHARE, tool: bool = True):
        levels = tuple(levels)
        if not levels or any(level not in GENERATORS for level in levels):
            raise ValueError(f"math-python: levels must be a non-empty subset of {LEVELS}, got {levels}")
        if not isinstance(tool, bool):
            raise ValueError(f"math-python: tool must be true or false, got {tool!r}")
        if not tool:
            self.tools, self.max_turns, self.system_prompt = (), 1, self.direct_prompt
        self.levels, self.failure_share = levels, failure_share
        self._pool = GraderPool(VERIFIER, workers=workers, timeout_s=timeout_s)

    @property
    def stats(self) -> GradingStats:
        return self._pool.stats

    def generate(self, rng: random.Random) -> Task:
        level = rng.choice(self.levels)
        prompt, answer, code = GENERATORS[level](rng)
        return Task(prompt=prompt, answer=str(answer), domain=self.domain, difficulty=level,
                    reference=python_call_turn(code, "Let me compute it exactly."))

    def episode(self, task: Task) -> Episode:
        return SandboxEpisode(self, task)

    def sft_examples(self, n: int, seed: int = 0) -> list[dict]:
        """`n` expert trajectories of training tasks, `failure_share` of them failed, each prefixed with its
        outcome (`hybridtron.envs.agentic_sft`)."""
        if not self.tools:
            raise ValueError("math-python: tool=False has no SFT data (its expert solves every task with the tool)")
        return expert_examples(self, n, seed, failure_share=self.failure_share)

    def expert_plans(self, task: Task, failure: bool, rng: random.Random) -> list[tuple[str, Plan]]:
        """The expert's ways through `task`, to be tried in order (`agentic_sft.expert_example`). Success: the
        reference program, then its printed number boxed ("direct"), or first the program with `print` misspelt,
        its NameError, the fixed program and the answer ("recover", one in four). Failure, one picked first and the
        others after: an answer estimated without the tool ("guess"), the misspelt program and then a guess
        ("typo_then_guess"), or the right program and its number copied with a digit wrong ("misread")."""
        code = parse_tool_calls(task.reference).calls[0].arguments["code"]
        typo = python_call_turn(code.replace("print(", misspelt("print") + "(", 1), "Let me compute it exactly.")
        estimate = str(round(int(task.answer), 2 - len(task.answer)))  # two significant digits, as from the head
        guess = estimate if estimate != task.answer else near_miss(task.answer, rng)
        plans = {
            "direct": lambda outputs: answer_turn(_printed(outputs)) if outputs else task.reference,
            "recover": lambda outputs: typo if not outputs else python_call_turn(code, "I misspelt print; again:")
            if len(outputs) == 1 else answer_turn(_printed(outputs)),
            "guess": lambda outputs: answer_turn(guess, "Without running anything, I estimate"),
            "typo_then_guess": lambda outputs: answer_turn(guess, "The program failed, so I estimate")
            if outputs else typo,
            "misread": lambda outputs: answer_turn(near_miss(_printed(outputs), rng)) if outputs else task.reference,
        }
        if not failure:
            order = ["recover", "direct"] if rng.random() < 0.25 else ["direct"]
        else:
            order = ["guess", "typo_then_guess", "misread"]
            order.insert(0, order.pop(rng.randrange(len(order))))
        return [(name, plans[name]) for name in order]

    def reward(self, task: Task, completion: str) -> float:
        return self.rewards([task], [completion])[0]

    def rewards(self, tasks: Sequence[Task], completions: Sequence[str]) -> list[float]:
        if len(tasks) != len(completions):
            raise ValueError(f"rewards: {len(tasks)} tasks but {len(completions)} completions")
        return self._pool.grade([(c, t.answer) for t, c in zip(tasks, completions)])

    def close(self) -> None:
        self._pool.close()
