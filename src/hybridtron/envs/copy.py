"""`copy`: repeat a number or a name exactly, in `\\boxed{}`: the skill every tool environment rests on.

A tool pays only if the model copies: the numbers of the question into its call, and the tool's output into its
answer (`math-python`), or a count and a file name from a `bash` output (`terminal`). Large models learn to copy from
their pretraining text (induction heads); the tiny preset, 400 steps on the stdlib, does not: after agentic SFT alone
it wrote a fixed program and a memorised answer (docs/LOG.md, 2026-12-06). SFT on `copy` first makes it copy, and its
pass@1 is the copying a checkpoint can do. Levels: 1 a number of 3-9 digits; 2 a number of 10-18 digits; 3 a name
such as a file or a function (letters, digits, `_`, `-` and `.`, 6-24 characters). Reward 1.0 for the exact text in
the final turn's last `\\boxed{}`.
"""

from __future__ import annotations

import random
import string
from typing import Sequence

from hybridtron.envs.base import Environment, Task, register
from hybridtron.envs.math_python import answer_turn  # worded as math-python's answer, so the skill carries over
from hybridtron.envs.math_verify import extract_answer

LEVELS = (1, 2, 3)
_NAME_CHARS = string.ascii_lowercase + string.digits + "_-."


def _number(rng: random.Random, low: int, high: int) -> str:
    digits = rng.randint(low, high)
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def _name(rng: random.Random) -> str:
    return rng.choice(string.ascii_lowercase) + "".join(rng.choice(_NAME_CHARS) for _ in range(rng.randint(5, 23)))


GENERATORS = {1: lambda rng: _number(rng, 3, 9), 2: lambda rng: _number(rng, 10, 18), 3: _name}


@register("copy")
class CopyEnv(Environment):
    """Repeat the text of the question exactly; `levels`: the kinds to draw from (`LEVELS`)."""

    domain = "copy"
    system_prompt = "Repeat the text exactly, then nothing else, in \\boxed{}."

    def __init__(self, levels: Sequence[int] = LEVELS):
        levels = tuple(levels)
        if not levels or any(level not in GENERATORS for level in levels):
            raise ValueError(f"copy: levels must be a non-empty subset of {LEVELS}, got {levels}")
        self.levels = levels

    def generate(self, rng: random.Random) -> Task:
        level = rng.choice(self.levels)
        text = GENERATORS[level](rng)
        return Task(prompt=f"Repeat: {text}", answer=text, domain=self.domain, difficulty=level,
                    reference=answer_turn(text))

    def reward(self, task: Task, completion: str) -> float:
        return float(extract_answer(completion) == task.answer)
