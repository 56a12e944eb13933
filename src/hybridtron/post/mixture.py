"""Prompts from several environments at once: what multi-teacher distillation samples from.

MOPD's objective is a sum over domains, J = sum_i lambda_i E_{q ~ D_i, y ~ student}[...]: each optimizer step holds
prompts of every domain, and each prompt's domain picks the teacher that scores its completion
(hybridtron.post.teachers). Three pieces, each reusing the single-environment machinery of GRPO:

- `MixtureEnv`: several environments behind the one `Environment` interface. Its task pool is each member's tasks,
  `lambda_i` of them from member i; `reward`, `prompt_messages` and `sft_examples` dispatch on the task's domain
  (so every domain keeps its own system prompt and grader). Domains must be distinct.
- `DomainSampler`: a drop-in for the rollout role's curriculum that draws each step's prompts stratified by domain
  (a quota per domain, largest remainder of n x lambda_i, at least one each when n allows), uniformly within a
  domain. Stratifying keeps every domain, and so every teacher's reverse KL, in every step; MOPD has no reward to
  steer a pass-rate curriculum by (the running estimates are still kept, for the logs).
- `MixtureRolloutRole`: `hybridtron.post.rl.rollout.RolloutRole` on a `MixtureEnv` with the `DomainSampler`, adding
  each domain's reward and completion length to the batch's statistics. The rewards are logged, never trained on.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hybridtron.envs import Environment, Task
from hybridtron.post.rl.rollout import PassRateCurriculum, RolloutRole, load_env

MIXTURE_ENV = f"{__name__}:MixtureEnv"


def domain_quotas(n: int, weights: Sequence[float]) -> list[int]:
    """`n` split by `weights` (largest remainder; ties to the earlier member), every member given at least one
    when n >= len(weights), taken from the largest quota."""
    total = float(sum(weights))
    exact = [n * w / total for w in weights]
    quotas = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in by_remainder[:n - sum(quotas)]:
        quotas[i] += 1
    if n >= len(weights):
        for i, q in enumerate(quotas):
            if q == 0:
                quotas[max(range(len(quotas)), key=lambda j: quotas[j])] -= 1
                quotas[i] = 1
    return quotas


class MixtureEnv(Environment):
    """The environments `envs` (registered names or `module.path:Factory`, see `hybridtron.post.rl.rollout.load_env`)
    as one; `weights`: each one's share lambda_i of the tasks (empty: equal); `levels`: {environment: difficulty
    levels} passed to those members (a member not named: its default levels)."""

    name = "mixture"
    domain = "mixture"

    def __init__(self, envs: Sequence[str] = ("math", "code"), weights: Sequence[float] = (),
                 levels: dict[str, Sequence[int]] | None = None):
        envs, weights = tuple(envs), tuple(float(w) for w in weights)
        if not envs:
            raise ValueError("a mixture needs at least one environment (mopd.envs is empty)")
        if weights and len(weights) != len(envs):
            raise ValueError(f"mopd.domain_weights has {len(weights)} weights for {len(envs)} environments "
                             f"({', '.join(envs)}); give one per environment, or none for equal shares")
        if any(not w > 0 for w in weights):
            raise ValueError(f"mopd.domain_weights must all be > 0, got {list(weights)}")
        self.specs, self.weights = envs, weights or (1.0,) * len(envs)
        levels = dict(levels or {})
        unknown = sorted(set(levels) - set(envs))
        if unknown:
            raise ValueError(f"levels for {', '.join(unknown)}, which is not among the environments {', '.join(envs)}")
        self.members: list[Environment] = []
        for spec in envs:
            options = {"levels": tuple(levels[spec])} if levels.get(spec) else {}
            try:
                self.members.append(load_env(spec, **options))
            except TypeError as exc:
                raise ValueError(f"environment {spec!r} takes no levels (asked for {list(levels[spec])}): "
                                 f"{exc}") from None
        domains = [env.domain for env in self.members]
        if len(set(domains)) != len(domains):
            raise ValueError(f"the environments {', '.join(envs)} have the domains {domains}: each must have its own "
                             "(the domain picks the teacher)")
        self.by_domain = dict(zip(domains, self.members))

    @property
    def domains(self) -> list[str]:
        return list(self.by_domain)

    @property
    def domain_weights(self) -> dict[str, float]:
        total = sum(self.weights)
        return {domain: w / total for domain, w in zip(self.by_domain, self.weights)}

    def member(self, task: Task) -> Environment:
        env = self.by_domain.get(task.domain)
        if env is None:
            raise ValueError(f"task {task.id} has domain {task.domain!r}; this mixture's domains: "
                             f"{', '.join(self.by_domain)}")
        return env

    def tasks(self, split: str, n: int, seed: int = 0) -> list[Task]:
        out = []
        for env, quota in zip(self.members, domain_quotas(n, self.weights)):
            tasks = env.tasks(split, quota, seed)
            strays = {t.domain for t in tasks} - {env.domain}
            if strays:
                raise ValueError(f"environment {env.name or type(env).__name__!r} (domain {env.domain!r}) made tasks "
                                 f"of the domains {sorted(strays)}: a task's domain must be its environment's")
            out += tasks
        return out

    def reward(self, task: Task, completion: str) -> float:
        return self.member(task).reward(task, completion)

    def rewards(self, tasks: Sequence[Task], completions: Sequence[str]) -> list[float]:
        """Each member grades its own tasks in one batch (the code sandbox and math workers run theirs together)."""
        if len(tasks) != len(completions):
            raise ValueError(f"rewards: {len(tasks)} tasks but {len(completions)} completions")
        for task in tasks:
            self.member(task)  # a task of no member's domain is an error, not a silent 0
        rewards = [0.0] * len(tasks)
        for domain, env in self.by_domain.items():
            rows = [i for i, task in enumerate(tasks) if task.domain == domain]
            if rows:
                for i, value in zip(rows, env.rewards([tasks[i] for i in rows], [completions[i] for i in rows])):
                    rewards[i] = value
        return rewards

    def prompt_messages(self, task: Task) -> list[dict]:
        return self.member(task).prompt_messages(task)

    def sft_examples(self, n: int, seed: int = 0) -> list[dict]:
        return [example for env, quota in zip(self.members, domain_quotas(n, self.weights))
                for example in env.sft_examples(quota, seed)]

    def close(self) -> None:
        for env in self.members:
            env.close()


class DomainSampler(PassRateCurriculum):
    """Each step's prompts stratified by domain (see the module docstring): `sample` draws `domain_quotas(n,
    weights)` prompts of each domain, uniformly among those not excluded. The pass-rate estimates of the base class
    are kept (updated by the rollout role) but weigh nothing."""

    def __init__(self, domains: Sequence[str], difficulties: Sequence[int], weights: dict[str, float]):
        super().__init__(difficulties, enabled=False)
        self.domains = list(domains)
        self.weights_by_domain = dict(weights)
        self.indices = {d: [i for i, x in enumerate(self.domains) if x == d] for d in self.weights_by_domain}

    def sample(self, n: int, generator: torch.Generator, exclude: set[int] = frozenset()) -> list[int]:
        picked = []
        for domain, quota in zip(self.indices, domain_quotas(n, list(self.weights_by_domain.values()))):
            candidates = [i for i in self.indices[domain] if i not in exclude]
            order = torch.randperm(len(candidates), generator=generator)[:quota]
            picked += [candidates[j] for j in order.tolist()]
        return picked


class MixtureRolloutRole(RolloutRole):
    """The rollout role over a `MixtureEnv` of `envs` (with its `weights` and `levels`), prompts drawn by the
    `DomainSampler`. `config` gives the rollout settings (a `hybridtron.post.mopd.MOPDConfig`: one sample per
    prompt, no dynamic sampling). Adds `reward_mean/<domain>` and `response_length/<domain>` to the statistics."""

    def __init__(self, *, model_dir: str, model_config, envs: Sequence[str], weights: Sequence[float] = (),
                 levels: dict[str, Sequence[int]] | None = None, config, threads: int = 0, share=None):
        super().__init__(model_dir=model_dir, model_config=model_config, env=MIXTURE_ENV,
                         env_options={"envs": tuple(envs), "weights": tuple(weights), "levels": levels},
                         config=config, threads=threads, share=share)
        self.curriculum = DomainSampler([t.domain for t in self.tasks], [t.difficulty for t in self.tasks],
                                        self.env.domain_weights)

    def tool_env(self, task):
        member = self.env.member(task)  # a tool environment's tasks run its turn loop, the others one generation
        return member if member.tools else None

    def step(self, request):
        batch = super().step(request)
        for domain in self.env.domains:
            rows = [r for r in batch.rollouts if r.domain == domain]
            batch.stats[f"reward_mean/{domain}"] = sum(r.reward for r in rows) / max(len(rows), 1)
            lengths = [len(r.completion_ids) if r.completion_mask is None else int(r.completion_mask.sum())
                       for r in rows]  # a trajectory's: the model's tokens
            batch.stats[f"response_length/{domain}"] = sum(lengths) / max(len(rows), 1)
        return batch
