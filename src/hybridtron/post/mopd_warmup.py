"""The MOPD warmup: a light SFT of the student on each domain's data before distillation, so that its samples start
inside the teachers' support (the report: GDPVal 35.3 without it, 46.7 with it, teacher 49.5). One implementation,
which the `mopd` command runs as its first phase (`mopd.warmup_steps` > 0, in `OUT/warmup`) and the pipeline as
its `mopd_warmup` stage.

The data (`warmup_conversations`), `n_d` training tasks of each domain d:
- "env": the environments' worked solutions (`env.sft_examples`);
- "teacher": each task answered once by the domain's teacher, sampled at the rollouts' temperature (a completion
  cut at the length cap is kept as it stands);
- "verified": the first of `tries` teacher answers the environment scores 1 (rejection sampling; a task the
  teacher never solves is left out).
In an environment with tools (`terminal`, `math-python`) the worked solutions are its expert trajectories, each
prefixed with its outcome (hybridtron.envs.agentic_sft), and a teacher's answer is its whole trajectory through the
environment's turn loop (`hybridtron.post.teachers.teacher_trajectories`: `max_tokens` a turn, the teacher's context
in all), the tool responses the real ones: the report's warmup "is most pronounced in agentic domains", where the
student's own multi-turn rollouts stray furthest from the teacher's.
The training is an ordinary `hybridtron sft` run of those conversations (hybridtron.post.sft): a conversation with
tools is rendered with them, and its loss is on the assistant turns alone (tool responses and prompts masked).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from hybridtron.envs import write_jsonl
from hybridtron.post.teachers import teacher_answers

WARMUP_DATA = ("env", "teacher", "verified")


def warmup_conversations(draws: list[tuple[object, int]], kind: str, *, teacher_for: Callable[[str], str], seed: int,
                         temperature: float, max_tokens: Callable[[str], int], tries: int = 1, top_k: int = 0,
                         top_p: float = 1.0, enable_thinking: bool | None = None, batch_size: int = 64,
                         setting: str = "the warmup data") -> list[dict]:
    """The warmup's conversations: for each (environment, n) of `draws`, n training tasks (drawn with `seed`) made
    into conversations by `kind` (see the module docstring); `teacher_for(domain)` gives a domain's teacher
    checkpoint and `max_tokens(domain)` its answers' length cap. `setting` names the configuration in errors."""
    if kind not in WARMUP_DATA:
        raise ValueError(f"{setting}: expected one of {', '.join(WARMUP_DATA)}, got {kind!r}")
    examples = []
    for env, count in draws:
        if kind == "env":
            examples += env.sft_examples(count, seed)
            continue
        try:
            examples += teacher_answers(teacher_for(env.domain), env, env.tasks("train", count, seed),
                                        temperature=temperature, top_k=top_k, top_p=top_p,
                                        max_tokens=max_tokens(env.domain), seed=seed, enable_thinking=enable_thinking,
                                        batch_size=batch_size, tries=tries, verified=kind == "verified")
        except ValueError as exc:
            raise ValueError(f"{setting}: {exc}, so the warmup has no {env.domain} data; allow more tries, or use the "
                             f"teachers' unverified answers or the worked solutions") from None
    return examples


def write_once(path: Path, conversations: Callable[[], list[dict]]) -> Path:
    """`path` with the conversations `conversations()` makes, unless it exists: a resumed warmup reads the same ones.
    Under torchrun every rank makes the same file and renames its own copy into place."""
    if not path.is_file():
        staging = path.with_name(f"{path.name}.tmp{os.environ.get('RANK', '0')}")
        write_jsonl(staging, conversations()).replace(path)
    return path
