"""The interface an environment implements, its registry, and the SFT example format.

An environment hands out tasks and scores completions of them:

- `tasks(split, n, seed)`: deterministic for a given (split, n, seed); "train" and "test" never share a
  prompt, because a task's split is a hash of its prompt (`split_of`), not of the draw order;
- `reward(task, completion) -> float in [0, 1]` (and `rewards` for a batch);
- `sft_examples(n, seed)`: conversations whose assistant turn is `<think>REASONING</think>FINAL`, for SFT and
  for the warm-up of on-policy distillation; each task's `reference` holds that turn.

A procedural environment only writes `generate(rng) -> Task` and `reward`; `tasks` draws from `generate`,
keeps the tasks of the requested split and drops repeats.

A multi-turn environment also declares `tools` (OpenAI-style function declarations, which the chat template renders
into the system turn) and opens an `Episode` per trajectory (`episode(task)`): the trajectory's own state (a fresh
sandbox directory), its tools (`Episode.call(name, arguments) -> ToolResult`, which never raises: a tool that fails,
times out or floods its output answers with an error) and the verifier on the final state (`Episode.reward(final)`).
The turn loop that drives a model through an episode is `hybridtron.post.agentic`; the trajectory it returns,
`hybridtron.envs.agentic`. A single-turn environment is an episode of one turn whose reward is `reward(task, final)`.
"""

from __future__ import annotations

import hashlib
import json
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Iterable, Sequence

from hybridtron.data.tokenizer import THINK_END, THINK_START

SPLITS = ("train", "test")
TEST_SHARE_PER_MILLE = 100  # one prompt in ten is held out


def split_of(prompt: str) -> str:
    """The split a prompt belongs to, the same on every machine and run."""
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big") % 1000
    return "test" if bucket < TEST_SHARE_PER_MILLE else "train"


@dataclass(frozen=True)
class Task:
    """One prompt with what it takes to score it.

    `answer` is the exact value a math completion must reach; `tests` are hidden unit tests
    (`assert EXPR == LITERAL`) for code; `reference` is a worked assistant turn for SFT, never shown to the
    policy. `id` defaults to a hash of domain and prompt, so it is stable across runs and machines."""

    prompt: str
    answer: str | None = None
    tests: tuple[str, ...] | None = None
    domain: str = "general"
    difficulty: int = 1
    reference: str | None = None
    id: str = ""
    state: str | None = None  # what a multi-turn environment rebuilds the task's starting state from (e.g. JSON)

    def __post_init__(self):
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError(f"Task.prompt must be a non-empty string, got {self.prompt!r}")
        if type(self.difficulty) is not int or self.difficulty < 1:
            raise ValueError(f"Task.difficulty must be an int >= 1, got {self.difficulty!r}")
        if self.tests is not None:
            tests = tuple(self.tests)
            if not all(isinstance(t, str) for t in tests):
                raise ValueError(f"Task.tests must be strings, got {tests!r}")
            object.__setattr__(self, "tests", tests)
        if not self.id:
            digest = hashlib.sha256(f"{self.domain}\n{self.prompt}".encode()).hexdigest()[:16]
            object.__setattr__(self, "id", f"{self.domain}-{digest}")


TOOL_ERRORS = ("malformed", "unknown_tool", "bad_arguments", "failed", "timeout", "output_limit", "disk_limit")


@dataclass(frozen=True)
class ToolResult:
    """What one tool call gave back: `content`, the `tool` message the model reads next, and `error`, one of
    `TOOL_ERRORS` where the call went wrong (the content then says what happened), counted in the trajectory's
    stats: "malformed" a call that did not parse, "unknown_tool" a name not declared, "bad_arguments" arguments
    against the declaration, "failed" an exception or a non-zero exit, "timeout" the wall clock or CPU limit,
    "output_limit" output cut at the limit, "disk_limit" the task directory grown past its size limit."""

    content: str
    error: str | None = None

    def __post_init__(self):
        if self.error is not None and self.error not in TOOL_ERRORS:
            raise ValueError(f"ToolResult.error must be one of {TOOL_ERRORS} or None, got {self.error!r}")


class Episode:
    """One trajectory of a task: the state the tools act on and the verifier on the final state. This base is a
    single-turn episode (no tools; the reward is the environment's on the final answer); a multi-turn environment
    subclasses it. Use as a context manager, or call `close()`, to release the state (its sandbox directory)."""

    def __init__(self, env: "Environment", task: Task):
        self.env, self.task = env, task

    def call(self, name: str, arguments: dict) -> ToolResult:
        """Run the tool `name`; the turn loop has checked that `name` is declared and `arguments` is an object.
        Must not raise for anything the model did: report it in the result."""
        return ToolResult(f"error: this environment has no tool {name!r}", "unknown_tool")

    def reward(self, final: str) -> float:
        """The verifier's score of the trajectory, in [0, 1], from its final answer (the text of the model's last
        turn) and the episode's final state."""
        return self.env.reward(self.task, final)

    def close(self) -> None:
        """Release the episode's state."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def assistant_turn(reasoning: str, final: str) -> str:
    """The assistant content of an SFT example: reasoning inside the think tags, then the final answer."""
    return f"{THINK_START}{reasoning}{THINK_END}{final}"


class Environment(ABC):
    """Subclass, set `domain` and `system_prompt`, write `generate` (or override `tasks`) and `reward`, and
    register it with `@register("name")`."""

    name: ClassVar[str] = ""
    domain: ClassVar[str] = "general"
    system_prompt: ClassVar[str] = ""
    tools: ClassVar[tuple[dict, ...]] = ()  # declarations (hybridtron.data.tools.function_tool); none: single-turn
    max_turns: ClassVar[int] = 1  # model turns per trajectory (the turn loop's default limit)

    def episode(self, task: Task) -> Episode:
        """A fresh trajectory of `task` (see `Episode`); a multi-turn environment returns its own kind."""
        return Episode(self, task)

    def generate(self, rng: random.Random) -> Task:
        """One task drawn at random (procedural environments). Either this or `tasks` must be overridden."""
        raise NotImplementedError(f"environment {self.name or type(self).__name__!r} implements neither "
                                  "generate(rng) nor tasks(split, n, seed)")

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if type(n) is not int or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        rng = random.Random(f"{self.name or type(self).__name__}/{split}/{seed}")
        out: list[Task] = []
        seen: set[str] = set()
        draws = since_new = 0
        while len(out) < n:
            # the pool is taken to be spent when a long run of draws (10,000 + 100 for each task found so far; the
            # built-in environments' longest gap is under 1,000 + 58 per task) brings nothing new: a request beyond
            # it then fails in seconds, not after 200 draws for every task asked for
            if since_new >= 100 * len(out) + 10_000 or draws >= 200 * n + 1000:
                raise ValueError(f"environment {self.name!r}: only {len(out)} distinct {split} tasks after "
                                 f"{draws} draws, {n} asked for; ask for fewer or widen its levels")
            draws, since_new = draws + 1, since_new + 1
            task = self.generate(rng)
            if task.id not in seen and split_of(task.prompt) == split:
                seen.add(task.id)
                out.append(task)
                since_new = 0
        return out

    @abstractmethod
    def reward(self, task: Task, completion: str) -> float:
        """The score of one completion, in [0, 1]."""

    def rewards(self, tasks: Sequence[Task], completions: Sequence[str]) -> list[float]:
        if len(tasks) != len(completions):
            raise ValueError(f"rewards: {len(tasks)} tasks but {len(completions)} completions")
        return [self.reward(t, c) for t, c in zip(tasks, completions)]

    def prompt_messages(self, task: Task) -> list[dict]:
        """The conversation the policy continues: the environment's system prompt, then the task."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": task.prompt}]

    def sft_examples(self, n: int, seed: int = 0) -> list[dict]:
        """`n` training-split conversations ending in the task's reference turn."""
        if self.tools:
            raise ValueError(f"environment {self.name!r} is multi-turn (tools: "
                             f"{', '.join(t['function']['name'] for t in self.tools)}): its SFT data are trajectories, "
                             "not single reference turns; give it expert_plans and an sft_examples that calls "
                             "hybridtron.envs.agentic_sft.expert_examples")
        examples = []
        for task in self.tasks("train", n, seed):
            if task.reference is None:
                raise ValueError(f"environment {self.name!r}: task {task.id} has no reference solution, so "
                                 "there is no SFT data; set Task.reference or override sft_examples")
            messages = self.prompt_messages(task) + [{"role": "assistant", "content": task.reference}]
            examples.append({"messages": messages, "domain": task.domain})
        return examples

    def close(self) -> None:
        """Release child processes (grading workers); the environment stays usable and restarts them."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_jsonl(path: str | Path, examples: Iterable[dict]) -> Path:
    """One JSON object per line (UTF-8), e.g. `env.sft_examples(n)` for `hybridtron sft --data`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for example in examples:
            f.write(json.dumps(example, ensure_ascii=False) + "\n")
    return path


_REGISTRY: dict[str, Callable[..., Environment]] = {}


def register(name: str, factory: Callable[..., Environment] | None = None):
    """Register an environment class (or any factory returning one) under `name`; usable as a decorator."""
    if not name or not isinstance(name, str):
        raise ValueError(f"an environment name must be a non-empty string, got {name!r}")

    def add(obj):
        if name in _REGISTRY and _REGISTRY[name] is not obj:
            raise ValueError(f"environment {name!r} is already registered ({_REGISTRY[name]!r})")
        if isinstance(obj, type) and issubclass(obj, Environment):
            obj.name = name
        _REGISTRY[name] = obj
        return obj

    return add if factory is None else add(factory)


ENV_PREFIX = "env:"  # a data source naming an environment: `env:math` is its worked solutions as SFT conversations


def env_sft_examples(source: str, n: int, seed: int = 0, levels: Sequence[int] = ()) -> list[dict]:
    """The SFT examples of the data source `env:NAME`: `n` training-split conversations drawn with `seed`, of
    `levels` where given (an environment that takes levels). A bad name or levels is a ValueError naming `source`."""
    name = source.removeprefix(ENV_PREFIX)
    options = {"levels": tuple(levels)} if levels else {}
    try:
        env = get_env(name, **options)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    except TypeError as exc:  # the environment's constructor takes no levels
        raise ValueError(f"{source}: levels {list(levels)} given, but environment {name!r} takes no levels "
                         f"({exc})") from None
    with env:
        return env.sft_examples(n, seed)


def env_names() -> list[str]:
    return sorted(_REGISTRY)


def get_env(name: str, **kwargs) -> Environment:
    """A new instance of the environment registered as `name`, built with `kwargs`."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(env_names()) or 'none'}")
    env = _REGISTRY[name](**kwargs)
    if not isinstance(env, Environment):
        raise ValueError(f"environment {name!r}: its factory returned {type(env).__name__}, not an Environment")
    return env
