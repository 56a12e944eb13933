"""Small Python function tasks with hidden unit tests, scored in the sandbox by the share of tests passed.

Each task is a function family at a difficulty level (1: one arithmetic or string operation; 2: one pass over
a list; 3: slicing, clipping, counting; 4: a loop with state; 5: a loop with a condition across items), with
a constant drawn per task ("greater than 7"), a signature and a docstring as the prompt, and five hidden
tests (`assert f(INPUT) == EXPECTED`) on inputs drawn from a generator seeded by the prompt. The expected
values come from running the family's reference solution here, in the trusted process; the same solution,
fenced, is the reference turn for SFT: `<think>ONE SENTENCE</think>```python ... ````.

The completion's code is the last ```python fenced block after `</think>` (or all of the text after it when
there is no fence); it runs in `sandbox.run_tests`, which compares the values it returns with the expected
values it never sees.
"""

from __future__ import annotations

import logging
import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

from hybridtron.envs.base import Environment, Task, assistant_turn, register
from hybridtron.envs.math_verify import final_text
from hybridtron.envs.sandbox import SandboxConfig, run_tests

log = logging.getLogger(__name__)

LEVELS = (1, 2, 3, 4, 5)
TESTS_PER_TASK = 5
_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_WORDS = ("cat", "sun", "apple", "tree", "river", "a", "blue", "stone", "window", "go", "light", "zebra", "ox")


def _ints(rng, lo=-50, hi=50):
    return rng.randint(lo, hi)


def _int_list(rng, lo=-20, hi=20):
    return [rng.randint(lo, hi) for _ in range(rng.randint(0, 12))]


def _word(rng):
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(0, 7)))


def _sentence(rng):
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(0, 6)))


@dataclass(frozen=True)
class Family:
    """A function family: templates over the task's constants (`{k}` and the like)."""

    level: int
    name: str
    arg: str
    doc: str
    body: str                       # the reference solution's body, indented by four spaces per level
    reasoning: str
    constants: Callable[[random.Random], dict]
    inputs: Callable[[random.Random], object]
    edge_inputs: tuple = field(default=())


FAMILIES = (
    Family(1, "add_const", "x", "Return x plus {k}.", "return x + {k}", "Add {k} to x.",
           lambda r: {"k": r.randint(1, 99)}, _ints, (0,)),
    Family(1, "times_const", "x", "Return x times {k}.", "return x * {k}", "Multiply x by {k}.",
           lambda r: {"k": r.randint(2, 30)}, _ints, (0,)),
    Family(1, "is_multiple", "x", "Return True if x is divisible by {k}, else False.", "return x % {k} == 0",
           "x is divisible by {k} when x % {k} is 0.", lambda r: {"k": r.randint(2, 40)}, _ints, (0,)),
    Family(1, "repeat_text", "s", "Return s repeated {k} times.", "return s * {k}",
           "Multiplying a string repeats it.", lambda r: {"k": r.randint(2, 9)}, _word, ("",)),
    Family(2, "count_above", "xs", "Return how many numbers in xs are greater than {k}.",
           "return sum(1 for x in xs if x > {k})", "Count the items above {k}.",
           lambda r: {"k": r.randint(-15, 15)}, _int_list, ([],)),
    Family(2, "keep_below", "xs", "Return the numbers in xs that are less than {k}, in order.",
           "return [x for x in xs if x < {k}]", "Filter xs with a list comprehension.",
           lambda r: {"k": r.randint(-15, 15)}, _int_list, ([],)),
    Family(2, "scale_all", "xs", "Return a list with every number in xs multiplied by {k}.",
           "return [x * {k} for x in xs]", "Multiply each item by {k}.",
           lambda r: {"k": r.randint(-9, 30)}, _int_list, ([],)),
    Family(2, "last_items", "xs", "Return the last {k} items of xs (all of them if xs is shorter).",
           "return xs[-{k}:]", "A negative slice start takes the tail.",
           lambda r: {"k": r.randint(1, 9)}, _int_list, ([],)),
    Family(3, "count_letter", "s", "Return how many times the letter '{c}' appears in s.",
           "return s.count('{c}')", "str.count counts the letter.",
           lambda r: {"c": r.choice("abcdefghijklmnopqrstuvwxyz")}, _word, ("",)),
    Family(3, "clip_all", "xs", "Return xs with every number clipped to the range [{lo}, {hi}].",
           "return [min(max(x, {lo}), {hi}) for x in xs]", "Clip each item with max then min.",
           lambda r: (lambda lo: {"lo": lo, "hi": lo + r.randint(1, 20)})(r.randint(-15, 10)), _int_list, ([],)),
    Family(3, "chunks", "xs", "Split xs into lists of {k} items; the last one may be shorter.",
           "return [xs[i:i + {k}] for i in range(0, len(xs), {k})]", "Slice xs every {k} items.",
           lambda r: {"k": r.randint(2, 5)}, _int_list, ([],)),
    Family(3, "rotate_left", "xs", "Rotate xs left by {k} places.",
           "if not xs:\n        return []\n    k = {k} % len(xs)\n    return xs[k:] + xs[:k]",
           "Take {k} modulo the length, then join the two slices.",
           lambda r: {"k": r.randint(1, 12)}, _int_list, ([],)),
    Family(4, "first_multiple", "xs", "Return the first number in xs divisible by {k}, or None if there is none.",
           "for x in xs:\n        if x % {k} == 0:\n            return x\n    return None",
           "Scan xs and return at the first multiple of {k}.",
           lambda r: {"k": r.randint(2, 9)}, _int_list, ([],)),
    Family(4, "long_words", "s", "Return how many words in s have more than {k} letters.",
           "return sum(1 for w in s.split() if len(w) > {k})", "Split s into words and count the long ones.",
           lambda r: {"k": r.randint(1, 5)}, _sentence, ("",)),
    Family(4, "digit_sum", "n", "Return the sum of the digits of n (n >= 0) written in base {b}.",
           "total = 0\n    while n:\n        total += n % {b}\n        n //= {b}\n    return total",
           "Take digits with % {b} and // {b} until n is 0.",
           lambda r: {"b": r.randint(2, 16)}, lambda r: r.randint(0, 10 ** r.randint(1, 6)), (0,)),
    Family(4, "fib_mod", "n", "Return the n-th Fibonacci number modulo {m}, with fib(0) = 0 and fib(1) = 1.",
           "a, b = 0, 1\n    for _ in range(n):\n        a, b = b, (a + b) % {m}\n    return a",
           "Iterate the pair (a, b) n times, modulo {m}.",
           lambda r: {"m": r.randint(2, 1000)}, lambda r: r.randint(0, 60), (0, 1)),
    Family(5, "shift_letters", "s",
           "Shift each lowercase letter of s {k} places forward in the alphabet, wrapping around; "
           "keep other characters.",
           "return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' else c for c in s)",
           "Shift by ord, modulo 26, only for a to z.",
           lambda r: {"k": r.randint(1, 25)}, _sentence, ("",)),
    Family(5, "longest_run", "xs", "Return the length of the longest run of consecutive items of xs equal to {k}.",
           "best = run = 0\n    for x in xs:\n        run = run + 1 if x == {k} else 0\n        best = max(best, run)\n"
           "    return best", "Track the current run of {k} and the best one.",
           lambda r: {"k": r.randint(0, 3)}, lambda r: [r.randint(0, 3) for _ in range(r.randint(0, 10))], ([],)),
    Family(5, "has_pair_sum", "xs", "Return True if two items at different positions of xs add up to {k}.",
           "seen = set()\n    for x in xs:\n        if {k} - x in seen:\n            return True\n        seen.add(x)\n"
           "    return False", "Keep the items seen; look for {k} minus each item.",
           lambda r: {"k": r.randint(-10, 20)}, _int_list, ([],)),
)


def extract_code(completion: str) -> str:
    """The last fenced block after the thinking (an unclosed last fence runs to the end), else the text."""
    text = final_text(completion)
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


@dataclass
class SandboxStats:
    runs: int = 0
    timeouts: int = 0  # candidates stopped at the wall clock (scored on the tests they finished first)
    errors: int = 0    # the sandbox itself failed (scored 0, logged): a machine problem, not the policy's


@register("code")
class CodeEnv(Environment):
    """Python function tasks; reward = share of hidden unit tests passed in the sandbox.

    `levels`: difficulties to draw from; `sandbox`: limits per run; `workers`: sandboxes run at once by
    `rewards` (each is a process; the threads here only wait on them)."""

    domain = "code"
    system_prompt = "Reason briefly, then write the function in a ```python block."

    def __init__(self, levels: Sequence[int] = LEVELS, *, sandbox: SandboxConfig = SandboxConfig(),
                 workers: int = 2):
        levels = tuple(levels)
        if not levels or any(lv not in LEVELS for lv in levels):
            raise ValueError(f"code: levels must be a non-empty subset of {LEVELS}, got {levels}")
        if workers < 1:
            raise ValueError(f"code: workers must be >= 1, got {workers}")
        self.levels, self.sandbox, self.workers = levels, sandbox, workers
        self._families = [f for f in FAMILIES if f.level in levels]
        self.stats = SandboxStats()
        self._stats_lock = threading.Lock()

    def generate(self, rng: random.Random) -> Task:
        family = rng.choice(self._families)
        constants = family.constants(rng)
        doc, body = family.doc.format(**constants), family.body.format(**constants)
        signature = f"def {family.name}({family.arg}):"
        prompt = f'Complete the function.\n```python\n{signature}\n    """{doc}"""\n```'
        solution = f"{signature}\n    {body}\n"
        return Task(prompt=prompt, tests=_hidden_tests(family, solution, prompt), domain=self.domain,
                    difficulty=family.level,
                    reference=assistant_turn(family.reasoning.format(**constants), f"```python\n{solution}```"))

    def reward(self, task: Task, completion: str) -> float:
        if not task.tests:
            raise ValueError(f"code: task {task.id} has no hidden tests")
        report = run_tests(extract_code(completion), task.tests, self.sandbox)
        failed = report.result.supervisor_error
        with self._stats_lock:
            self.stats.runs += 1
            self.stats.timeouts += report.result.timed_out
            self.stats.errors += failed is not None
        if failed:
            log.error("code: the sandbox itself failed on task %s (scored 0): %s", task.id, failed)
            return 0.0
        return report.share

    def rewards(self, tasks: Sequence[Task], completions: Sequence[str]) -> list[float]:
        if len(tasks) != len(completions):
            raise ValueError(f"rewards: {len(tasks)} tasks but {len(completions)} completions")
        with ThreadPoolExecutor(self.workers) as pool:
            return list(pool.map(self.reward, tasks, completions))


def _hidden_tests(family: Family, solution: str, prompt: str) -> tuple[str, ...]:
    """Inputs from a generator seeded by the prompt (the same tests every run); expected values from the
    reference solution, run here."""
    rng = random.Random(prompt)
    inputs = list(family.edge_inputs)
    while len(inputs) < TESTS_PER_TASK:
        inputs.append(family.inputs(rng))
    scope: dict = {}
    exec(solution, scope)  # our own reference solution
    fn = scope[family.name]
    return tuple(f"assert {family.name}({value!r}) == {fn(value)!r}" for value in inputs)
