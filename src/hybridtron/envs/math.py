"""Procedural arithmetic and word problems with exact answers, five difficulty levels, and short traces.

Levels: 1 single-digit addition or subtraction; 2 two-digit addition or subtraction (results may be
negative); 3 a multiplication, or two operations with precedence; 4 fractions (add, subtract, multiply; the
answer reduced); 5 word problems of two or three steps.

Each task's reference turn is `<think>TRACE</think>\\boxed{ANSWER}`, the trace a few equations that a test
checks one by one (every side of every "=" has the same value), tens of tokens long, so that a model of a
few million parameters learns the format (and some arithmetic) from SFT in minutes on a CPU.

Rewards come from `math_verify.grade` run in persistent child processes with a hard time limit per
completion (`grading.GraderPool`); a timeout scores 0 and is counted in `env.stats.timeouts`.
"""

from __future__ import annotations

import random
import zlib
from fractions import Fraction
from pathlib import Path
from typing import Sequence

from hybridtron.envs.base import Environment, Task, assistant_turn, register
from hybridtron.envs.grading import GraderPool, GradingStats

LEVELS = (1, 2, 3, 4, 5)
NAMES = ("Tom", "Ana", "Mia", "Ben", "Lea", "Sam", "Ivy", "Max", "Zoe", "Leo")
VERIFIER = Path(__file__).with_name("math_verify.py")


def fraction_text(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _add_or_subtract(a: int, b: int, op: str) -> tuple[int, str]:
    """a op b (a >= b for "-") with b's tens and ones split: 47 + 85 = 47 + 80 + 5 = 127 + 5 = 132."""
    assert op == "+" or a >= b
    result = a + b if op == "+" else a - b
    tens, ones = b - b % 10, b % 10
    if b < 10 or ones == 0:
        return result, f"{a} {op} {b} = {result}"
    if op == "+":
        return result, f"{a} + {b} = {a} + {tens} + {ones} = {a + tens} + {ones} = {result}"
    return result, f"{a} - {b} = {a} - {tens} - {ones} = {a - tens} - {ones} = {result}"


def level1(rng: random.Random) -> tuple[str, Fraction, str]:
    a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-")
    if op == "-" and a < b:
        a, b = b, a
    result = a + b if op == "+" else a - b
    return f"What is {a} {op} {b}?", Fraction(result), f"{a} {op} {b} = {result}"


def _column(a: int, b: int, op: str) -> tuple[int, str]:
    """a op b (a >= b for "-") digit by digit, each step a one-digit fact:
    47 + 85 -> "ones: 7 + 5 = 12. tens: 4 + 8 + 1 = 13. 47 + 85 = 132";
    85 - 47 -> "ones: 15 - 7 = 8. tens: 8 - 1 - 4 = 3. 85 - 47 = 38"."""
    assert op == "+" or a >= b
    (a_tens, a_ones), (b_tens, b_ones) = divmod(a, 10), divmod(b, 10)
    if op == "+":
        carry = int(a_ones + b_ones >= 10)
        ones = f"{a_ones} + {b_ones} = {a_ones + b_ones}"
        tens = f"{a_tens} + {b_tens}" + (" + 1" if carry else "") + f" = {a_tens + b_tens + carry}"
        result = a + b
    else:
        borrow = int(a_ones < b_ones)
        ones = f"{a_ones + 10 * borrow} - {b_ones} = {a_ones + 10 * borrow - b_ones}"
        tens = f"{a_tens}" + (" - 1" if borrow else "") + f" - {b_tens} = {a_tens - borrow - b_tens}"
        result = a - b
    return result, f"ones: {ones}. tens: {tens}. {a} {op} {b} = {result}"


def level2(rng: random.Random) -> tuple[str, Fraction, str]:
    """Two-digit + or -, traced in one of two styles (half the prompts each, fixed by the prompt's text so
    that the task set does not depend on it): tens split off (`_add_or_subtract`) or digit columns
    (`_column`). SFT teaches both, and a policy may learn which one to choose: the column style needs only
    one-digit facts, and the tiny SFT model is right on 23% of the tasks it traces that way against 3% the
    other way (docs/LOG.md, 2026-12-01, session 5)."""
    a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
    prompt = f"What is {a} {op} {b}?"
    trace_of = _column if zlib.crc32(prompt.encode()) % 2 else _add_or_subtract
    if op == "+" or a >= b:
        result, trace = trace_of(a, b, op)
    elif trace_of is _column:  # 47 - 85 = -(85 - 47), then 85 - 47 by columns
        difference, inner = _column(b, a, "-")
        result = -difference
        trace = f"{a} - {b} = -({b} - {a}). " + inner.rsplit(". ", 1)[0] + f". {a} - {b} = {result}"
    else:  # 47 - 85 = -(85 - 40 - 7) = -(45 - 7) = -38
        difference, inner = _add_or_subtract(b, a, "-")
        result, steps = -difference, inner.split(" = ")[1:-1]
        trace = " = ".join([f"{a} - {b}"] + [f"-({s})" for s in steps] + [str(result)])
    return prompt, Fraction(result), trace


def level3(rng: random.Random) -> tuple[str, Fraction, str]:
    if rng.random() < 0.5:
        a, b = rng.randint(11, 99), rng.randint(2, 9)
        result, tens, ones = a * b, a - a % 10, a % 10
        if ones == 0:
            trace = f"{a} * {b} = {result}"
        else:
            trace = f"{a} * {b} = {tens} * {b} + {ones} * {b} = {tens * b} + {ones * b} = {result}"
        return f"What is {a} * {b}?", Fraction(result), trace
    a, b, c = rng.randint(2, 12), rng.randint(2, 12), rng.randint(2, 12)
    form = rng.randrange(4)
    if form == 0:
        expr, steps = f"{a} + {b} * {c}", [f"{a} + {b * c}", str(a + b * c)]
    elif form == 1:
        expr, steps = f"{a} * {b} - {c}", [f"{a * b} - {c}", str(a * b - c)]
    elif form == 2:
        expr, steps = f"({a} + {b}) * {c}", [f"{a + b} * {c}", str((a + b) * c)]
    else:
        expr, steps = f"{a} - {b} * {c}", [f"{a} - {b * c}", str(a - b * c)]
    return f"What is {expr}?", Fraction(int(steps[-1])), " = ".join([expr] + steps)


def level4(rng: random.Random) -> tuple[str, Fraction, str]:
    b, d = rng.randint(2, 9), rng.randint(2, 9)
    a, c = rng.randint(1, b - 1), rng.randint(1, d - 1)
    x, y = Fraction(a, b), Fraction(c, d)
    op = rng.choice("+-*")
    expr = f"{a}/{b} {op} {c}/{d}"
    if op == "*":
        result = x * y
        steps = [f"{a * c}/{b * d}"]
    else:
        result = x + y if op == "+" else x - y
        lcm = b * d // _gcd(b, d)
        top1, top2 = a * lcm // b, c * lcm // d
        total = top1 + top2 if op == "+" else top1 - top2
        steps = [] if b == d else [f"{top1}/{lcm} {op} {top2}/{lcm}"]
        steps.append(f"{total}/{lcm}")
    if steps[-1] != fraction_text(result):
        steps.append(fraction_text(result))
    return f"What is {expr}?", result, " = ".join([expr] + steps)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def level5(rng: random.Random) -> tuple[str, Fraction, str]:
    name = rng.choice(NAMES)
    form = rng.randrange(6)
    if form == 0:
        a, b, c = rng.randint(2, 20), rng.randint(2, 6), rng.randint(2, 9)
        d = rng.randint(1, a + b * c)
        prompt = (f"{name} has {a} apples, buys {b} bags of {c} apples and gives away {d}. "
                  "How many apples are left?")
        steps = [f"{b} * {c} = {b * c}", f"{a} + {b * c} = {a + b * c}", f"{a + b * c} - {d} = {a + b * c - d}"]
    elif form == 1:
        price, count = rng.randint(2, 9), rng.randint(2, 9)
        paid = price * count + rng.randint(1, 20)
        prompt = (f"Pens cost {price} dollars each. {name} buys {count} pens and pays {paid} dollars. "
                  "What is the change?")
        steps = [f"{count} * {price} = {count * price}", f"{paid} - {count * price} = {paid - count * price}"]
    elif form == 2:
        speed, hours, extra = rng.randint(20, 90), rng.randint(2, 5), rng.randint(5, 60)
        prompt = f"A train goes {speed} km an hour for {hours} hours, then {extra} km more. How far does it go?"
        steps = [f"{speed} * {hours} = {speed * hours}", f"{speed * hours} + {extra} = {speed * hours + extra}"]
    elif form == 3:
        friends, each = rng.randint(2, 6), rng.randint(2, 9)
        boxes = rng.choice([k for k in range(2, 9) if (friends * each) % k == 0])
        per_box = friends * each // boxes
        prompt = (f"{friends} friends share {boxes} boxes of {per_box} cookies equally. "
                  "How many cookies does each get?")
        steps = [f"{boxes} * {per_box} = {boxes * per_box}", f"{boxes * per_box} / {friends} = {each}"]
    elif form == 4:
        daily, days, more = rng.randint(5, 30), rng.randint(2, 7), rng.randint(1, 30)
        total = daily * days + more + rng.randint(1, 100)
        read = daily * days + more
        prompt = (f"A book has {total} pages. {name} reads {daily} pages a day for {days} days, then {more} more. "
                  "How many pages are left?")
        steps = [f"{daily} * {days} = {daily * days}", f"{daily * days} + {more} = {read}",
                 f"{total} - {read} = {total - read}"]
    else:
        cows, hens = rng.randint(1, 20), rng.randint(1, 30)
        prompt = f"A farm has {cows} cows and {hens} hens. How many legs do they have?"
        legs = cows * 4 + hens * 2
        steps = [f"{cows} * 4 = {cows * 4}", f"{hens} * 2 = {hens * 2}", f"{cows * 4} + {hens * 2} = {legs}"]
    answer = Fraction(int(steps[-1].rsplit(" = ", 1)[1]))
    return prompt, answer, ". ".join(steps)


GENERATORS = {1: level1, 2: level2, 3: level3, 4: level4, 5: level5}


@register("math")
class MathEnv(Environment):
    """Arithmetic and word problems; reward 1.0 for the exact value in \\boxed{} (or an "Answer:" line).

    `levels`: the difficulties to draw from (uniformly); `workers`: grading child processes;
    `timeout_s`: the wall-clock limit per completion; `memory_mb`: each grading child's address space."""

    domain = "math"
    system_prompt = "Reason step by step, then give the final answer in \\boxed{}."

    def __init__(self, levels: Sequence[int] = LEVELS, *, workers: int = 1, timeout_s: float = 1.0,
                 memory_mb: int = 1024):
        levels = tuple(levels)
        unknown = [lv for lv in levels if lv not in GENERATORS]
        if not levels or unknown:
            raise ValueError(f"math: levels must be a non-empty subset of {LEVELS}, got {levels}")
        self.levels = levels
        self._pool = GraderPool(VERIFIER, workers=workers, timeout_s=timeout_s, memory_mb=memory_mb)

    @property
    def stats(self) -> GradingStats:
        """graded / timeouts / errors since this environment was made."""
        return self._pool.stats

    def generate(self, rng: random.Random) -> Task:
        level = rng.choice(self.levels)
        prompt, answer, trace = GENERATORS[level](rng)
        text = fraction_text(answer)
        return Task(prompt=prompt, answer=text, domain=self.domain, difficulty=level,
                    reference=assistant_turn(trace, f"\\boxed{{{text}}}"))

    def reward(self, task: Task, completion: str) -> float:
        return self.rewards([task], [completion])[0]

    def rewards(self, tasks: Sequence[Task], completions: Sequence[str]) -> list[float]:
        if len(tasks) != len(completions):
            raise ValueError(f"rewards: {len(tasks)} tasks but {len(completions)} completions")
        for task in tasks:
            if task.answer is None:
                raise ValueError(f"math: task {task.id} has no answer to grade against")
        return self._pool.grade([(c, t.answer) for t, c in zip(tasks, completions)])

    def close(self) -> None:
        self._pool.close()
