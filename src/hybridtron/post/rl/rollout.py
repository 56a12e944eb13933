"""Rollouts for on-policy RL: the rollout role that samples and grades them, the queue items it produces, and the
scoring roles that add per-token scores to them. (The learner's end, which turns them into micro-batches:
hybridtron.post.rl.batches.)

The rollout role (`RolloutRole`, one step per optimizer step of the learner):

1. draws `prompts_per_step` prompts from the environment's training tasks, weighted by the pass-rate curriculum
   (`PassRateCurriculum`), without repeats within a step;
2. samples `group_size` completions of each with the section's rollout engine (`engine`: hybridtron's own or
   vLLM, hybridtron.post.rl.engines; `generate(prompts, params, n=G, version=..., expert_ids=routing_replay)`, MTP
   speculative drafts on by default), keeping the engine's per-token log-probs and, for routing replay, the experts
   every backbone MoE layer chose for every token; the engine must hold the weights of the role's version (a task
   of an environment with tools: G trajectories through its turn loop instead, each one rollout whose tool
   responses are not trained, graded by its episode: hybridtron.post.rl.trajectories);
3. grades them with the environment (`env.rewards`) and computes each group's advantages
   (`hybridtron.post.losses.group_advantages`);
4. dynamic sampling (DAPO): a group whose rewards all agree carries no signal and is dropped, and new prompts are
   drawn to refill the step, for at most `max_refill_rounds` extra rounds of generation; if the cap leaves the
   step short it trains on the groups it has (and, if none, on the last round's, whose advantages are all 0);
5. updates the curriculum with every group it graded (dropped ones too) and returns a `RolloutBatch`.

Everything random in a step is drawn from seeds fixed by (`seed`, step index, refill round), and the curriculum is
the role's only state (`state_dict`), so a batch is a function of (role state, weights, index): the same in any
process, and again after a resume.

Queue items (what MOPD's teacher-scoring role reads and extends): a `RolloutBatch` holds `Rollout`s, each with
its prompt and completion ids, the engine's per-token log-probs, the expert ids, reward and advantage, the task's
domain, and `scores`: per-token tensors that a scoring role between rollout and learner adds under its own name
(a teacher's, a frozen reference's: `ScoringRole`), which the learner's end lays out beside the rollout's log-probs.

Shapes: B rows (rollouts), L positions (prompt + completion - 1), C completion tokens, K experts per token.
"""

from __future__ import annotations

import importlib
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from hybridtron.data.chat import load_chat_tokenizer, tokenize_chat
from hybridtron.envs import Environment, get_env
from hybridtron.post.losses import group_advantages
from hybridtron.post.rl.engines import rollout_engine
from hybridtron.post.rl.roles import Role, WorkShare
from hybridtron.post.rl.trajectories import TrajectorySample, sample_trajectories, trajectory_stats

ROLLOUT_ROLE = "rollout"


# ------------------------------------------------------------------------------------------------ items
@dataclass
class RolloutRequest:
    """Ask the rollout role for the batch of optimizer step `index` (1-based)."""

    index: int


@dataclass
class Rollout:
    """One sampled completion of a prompt.

    logprobs: float32 [C], the engine's log-probability of each completion token under the distribution it was
      sampled from (temperature, top-k, top-p). expert_ids: {backbone router name: int16 [P + C - 1, K]}, row t
      the experts chosen for the token at position t of prompt + completion, or None without routing replay.
    scores: per-token tensors [C, ...] added by scoring roles under their name (e.g. "teacher" in MOPD: log-probs).
    completion_mask: bool [C], the tokens the model sampled, for a multi-turn trajectory (the tool responses between
      its turns are not trained: hybridtron.post.rl.trajectories); None: every completion token."""

    task_id: str
    domain: str
    difficulty: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: torch.Tensor
    finish_reason: str
    reward: float = 0.0
    advantage: float = 0.0
    expert_ids: dict[str, torch.Tensor] | None = None
    scores: dict[str, torch.Tensor] = field(default_factory=dict)
    completion_mask: torch.Tensor | None = None


@dataclass
class RolloutBatch:
    """One optimizer step's rollouts: groups of `group_size` samples of one prompt each, contiguous.
    `policy_version`: the learner step whose weights sampled them. `stats`: what the rollout role measured
    (reward distribution, lengths, throughput, dynamic sampling), logged with the step's metrics."""

    index: int
    policy_version: int
    group_size: int
    rollouts: list[Rollout]
    stats: dict[str, float]


# ----------------------------------------------------------------------------------------- curriculum
class PassRateCurriculum:
    """Sampling weights for a fixed pool of prompts, highest where the policy's pass rate is near `target`:

        w_i = exp(-(p_i - target)^2 / (2 sigma^2))

    p_i is a running estimate of prompt i's pass rate (the mean reward of its group): the first group sets it, later
    ones move it by `ema` (p <- (1 - ema) p + ema r). A prompt not sampled yet takes the running estimate of its
    difficulty level, and a level not sampled yet the target itself (so unseen levels are explored first). None of
    the anchors ships a curriculum (verl has a sampler hook); this is the Gaussian the spec describes, with the level
    prior added because a run visits most prompts of a large pool at most once. `enabled=False`: uniform weights
    (the estimates are still kept, for the logs)."""

    def __init__(self, difficulties: Sequence[int], *, target: float = 0.5, sigma: float = 0.2, ema: float = 0.5,
                 enabled: bool = True):
        self.difficulties = list(difficulties)
        self.target, self.sigma, self.ema, self.enabled = target, sigma, ema, enabled
        self.estimates = torch.full((len(self.difficulties),), math.nan, dtype=torch.float64)
        self.level_estimates: dict[int, float] = {}

    def pass_rates(self) -> torch.Tensor:
        """Every prompt's current estimate (its own, else its level's, else the target)."""
        levels = torch.tensor([self.level_estimates.get(d, self.target) for d in self.difficulties],
                              dtype=torch.float64)
        return torch.where(torch.isnan(self.estimates), levels, self.estimates)

    def weights(self) -> torch.Tensor:
        if not self.enabled:
            return torch.ones(len(self.difficulties), dtype=torch.float64)
        return torch.exp(-(self.pass_rates() - self.target) ** 2 / (2 * self.sigma ** 2))

    def update(self, index: int, pass_rate: float) -> None:
        old = float(self.estimates[index])
        self.estimates[index] = pass_rate if math.isnan(old) else (1 - self.ema) * old + self.ema * pass_rate
        level = self.difficulties[index]
        previous = self.level_estimates.get(level)
        self.level_estimates[level] = pass_rate if previous is None else \
            (1 - self.ema) * previous + self.ema * pass_rate

    def sample(self, n: int, generator: torch.Generator, exclude: set[int] = frozenset()) -> list[int]:
        """`n` distinct prompt indices (fewer if the pool has fewer left), drawn by weight."""
        weights = self.weights().clone()
        if exclude:
            weights[list(exclude)] = 0.0
        available = int((weights > 0).sum())
        if available == 0 or n == 0:
            return []
        return torch.multinomial(weights, min(n, available), replacement=False, generator=generator).tolist()

    def state_dict(self) -> dict:
        return {"estimates": self.estimates.clone(), "level_estimates": dict(self.level_estimates)}

    def load_state_dict(self, state: dict) -> None:
        if len(state["estimates"]) != len(self.difficulties):
            raise ValueError(f"curriculum state for {len(state['estimates'])} prompts, but the pool has "
                             f"{len(self.difficulties)}: the run's [grpo] task pool changed since the checkpoint")
        self.estimates = state["estimates"].clone()
        self.level_estimates = dict(state["level_estimates"])


def load_env(spec: str, **options):
    """An environment from its registered name (`hybridtron.envs.get_env`), or from `module.path:Factory`, a
    class or function importable by every process (a custom environment: a rollout process or Ray actor imports the
    module itself, whereas a name registered in the learner's script only exists in the learner's process)."""
    if ":" not in spec:
        return get_env(spec, **options)
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"environment {spec!r}: cannot import {attr} from {module_name} ({exc})") from None
    env = factory(**options)
    if not isinstance(env, Environment):
        raise ValueError(f"environment {spec!r} built {type(env).__name__}, not a hybridtron.envs.Environment")
    return env


def step_seed(seed: int, index: int, round_: int) -> int:
    """The seed of one generation round of one step: a function of nothing else."""
    return (seed * 1_000_003 + index * 9_176 + round_ * 131) % (2 ** 31 - 1)


# --------------------------------------------------------------------------------------- the rollout role
class RolloutRole(Role):
    """Samples and grades one step's rollouts (see the module docstring). Built from plain values, so that it can
    be built in another process: `model_dir` (for the tokenizer and its chat template), `model_config` (the
    architecture; the weights arrive through `load_weights` before the first request), the environment (a
    registered name or `module:Factory`, see `load_env`) and its options, and `config` (a
    `hybridtron.post.rl.config.RolloutConfig`: GRPO's or MOPD's section). `share`: this process's part of the
    generation (`roles.WorkShare`: every torchrun rank running the role inline, or the role's replicas)."""

    name = ROLLOUT_ROLE

    def __init__(self, *, model_dir: str, model_config, env: str, env_options: dict, config, threads: int = 0,
                 share: "WorkShare | None" = None):
        if threads:
            torch.set_num_threads(threads)
        self.config = config
        self.tokenizer = load_chat_tokenizer(model_dir, vocab_size=model_config.vocab_size)
        # the weights come from the learner (`load_weights`), before the first request
        self.engine = rollout_engine(config, model_dir=model_dir, model_config=model_config, tokenizer=self.tokenizer)
        self.env = load_env(env, **env_options)
        self.token_budget = model_config.max_position_embeddings  # a trajectory's, prompt and tool responses included
        self.tasks = self.env.tasks("train", config.task_pool, config.seed)
        self.curriculum = PassRateCurriculum([t.difficulty for t in self.tasks], target=config.curriculum_target,
                                             sigma=config.curriculum_sigma, ema=config.curriculum_ema,
                                             enabled=config.curriculum)
        self.prompt_cache: dict[int, list[int]] = {}
        self.version: int | None = None
        self.share = share

    # ---------------------------------------------------------------------------------------- the role
    def load_weights(self, version: int, state_dict: dict) -> None:
        self.engine.load_weights(version, state_dict)
        self.version = version

    def state_dict(self) -> dict:
        return {"curriculum": self.curriculum.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.curriculum.load_state_dict(state["curriculum"])

    def close(self) -> None:
        self.env.close()
        self.engine.close()

    def step(self, request: RolloutRequest) -> RolloutBatch:
        if self.version is None:
            raise RuntimeError("the rollout role got a request before any weights")
        cfg = self.config
        groups, used, last_round = [], set(), []
        totals = dict(samples=0, tokens=0, truncated=0, generate_s=0.0, grade_s=0.0, drafts=0, verify_steps=0,
                      dropped=0, rewards=[], lengths=[], trajectories=[])
        rounds = 0
        while True:
            generator = torch.Generator().manual_seed(step_seed(cfg.seed, request.index, rounds))
            picked = self.curriculum.sample(cfg.prompts_per_step - len(groups), generator, exclude=used)
            if not picked:
                break
            used.update(picked)
            last_round = self._sample_groups(picked, step_seed(cfg.seed, request.index, rounds), totals)
            rounds += 1
            for group in last_round:
                informative = len({r.reward for r in group}) > 1
                if informative or not cfg.dynamic_sampling:
                    groups.append(group)
                else:
                    totals["dropped"] += 1
            if not cfg.dynamic_sampling or len(groups) >= cfg.prompts_per_step or rounds > cfg.max_refill_rounds:
                break
        if not groups:  # every group agreed, even after the refills: train on the last round (advantages 0)
            groups = last_round
        rewards = torch.tensor(totals["rewards"], dtype=torch.float64)
        lengths = torch.tensor(totals["lengths"], dtype=torch.float64)
        stats = {
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "reward_zero_share": float((rewards == 0).double().mean()),
            "reward_one_share": float((rewards == 1).double().mean()),
            "response_length": float(lengths.mean()), "response_length_max": float(lengths.max()),
            "truncated_share": totals["truncated"] / totals["samples"],
            "groups_trained": float(len(groups)), "groups_dropped": float(totals["dropped"]),
            "generation_rounds": float(rounds),
            "rollout_tokens": float(totals["tokens"]), "rollout_seconds": totals["generate_s"],
            "rollout_tokens_per_s": totals["tokens"] / max(totals["generate_s"], 1e-9),
            "grading_seconds": totals["grade_s"],
            "curriculum_pass_rate": float(self.curriculum.pass_rates().mean()),
            "rollout_ranks": float(self.share.world if self.share is not None else 1),
        }
        if totals["trajectories"]:
            stats.update(trajectory_stats(totals["trajectories"]))
        if totals["verify_steps"]:
            stats["mtp_acceptance_length"] = (totals["drafts"] + totals["verify_steps"]) / totals["verify_steps"]
        return RolloutBatch(index=request.index, policy_version=self.version, group_size=cfg.group_size,
                            rollouts=[r for group in groups for r in group], stats=stats)

    # ------------------------------------------------------------------------------------------ helpers
    def prompt_ids(self, index: int) -> list[int]:
        if index not in self.prompt_cache:
            messages = self.env.prompt_messages(self.tasks[index])
            self.prompt_cache[index] = tokenize_chat(self.tokenizer, messages, add_generation_prompt=True,
                                                     enable_thinking=self.config.enable_thinking).ids.tolist()
        return self.prompt_cache[index]

    def _sample_groups(self, picked: list[int], seed: int, totals: dict) -> list[list[Rollout]]:
        """Generate, grade and score the groups of the prompts `picked`; update the curriculum. With a `share`,
        this rank generates and grades its slice of them and gathers everyone's."""
        start, stop = self.share.span(len(picked)) if self.share is not None else (0, len(picked))
        part = self._generate_and_grade(picked[start:stop], seed, start)
        if self.share is not None:
            parts = self.share.gather(part)
            part = {"completions": [c for p in parts for c in p["completions"]],
                    "rewards": [r for p in parts for r in p["rewards"]],
                    **{key: max(p[key] for p in parts) for key in ("generate_s", "grade_s")},  # side by side
                    **{key: sum(p[key] for p in parts) for key in ("drafts", "verify_steps")}}
        completions, rewards = part["completions"], part["rewards"]
        for key in ("generate_s", "grade_s", "drafts", "verify_steps"):
            totals[key] += part[key]
        for samples in completions:
            for c in samples:
                trajectory = isinstance(c, TrajectorySample)
                generated = c.generated if trajectory else len(c.token_ids)
                totals["samples"] += 1
                totals["tokens"] += generated
                totals["truncated"] += c.finish_reason not in ("stop", "answer")
                totals["lengths"].append(generated)
                if trajectory:
                    totals["trajectories"].append(c)
        totals["rewards"] += rewards
        return self._groups(picked, completions, rewards)

    def tool_env(self, task) -> Environment | None:
        """The multi-turn environment whose turn loop samples `task`'s rollouts (hybridtron.post.rl.trajectories),
        or None: one generation, graded by `env.rewards`."""
        return self.env if self.env.tools else None

    def _generate_and_grade(self, picked: list[int], seed: int, first_prompt: int) -> dict:
        """The completions of the prompts `picked` (positions `first_prompt`.. of the round's list, which fixes
        their noise keys) and their rewards, with the time each took and the MTP drafts accepted. The prompts of a
        tool environment go through its turn loop (after the others, in the order picked, one loop per
        environment), whose rewards come with its trajectories."""
        cfg = self.config
        part = {"completions": [None] * len(picked), "rewards": [None] * len(picked), "generate_s": 0.0,
                "grade_s": 0.0, "drafts": 0, "verify_steps": 0}
        if not picked:
            return part
        by_env: dict[int, tuple[Environment, list[int]]] = {}
        single = []
        for j, i in enumerate(picked):
            env = self.tool_env(self.tasks[i])
            if env is None:
                single.append(j)
            else:
                by_env.setdefault(id(env), (env, []))[1].append(j)
        if single:
            self._generate_single_turn(picked, single, seed, first_prompt, part)
        offset = first_prompt + len(single)
        for env, rows in by_env.values():
            started = time.perf_counter()
            groups, drafted = sample_trajectories(
                self.engine, self.tokenizer, env, [self.tasks[picked[j]] for j in rows], cfg.sampling_params(seed),
                group_size=cfg.group_size, version=self.version, expert_ids=cfg.routing_replay, first_prompt=offset,
                token_budget=self.token_budget, enable_thinking=cfg.enable_thinking)
            part["generate_s"] += time.perf_counter() - started  # the tool calls and grading included
            for key in drafted:
                part[key] += drafted[key]
            for j, samples in zip(rows, groups):
                part["completions"][j], part["rewards"][j] = samples, [c.reward for c in samples]
            offset += len(rows)
        part["rewards"] = [r for rewards in part["rewards"] for r in rewards]
        return part

    def _generate_single_turn(self, picked: list[int], rows: list[int], seed: int, first_prompt: int,
                              part: dict) -> None:
        """Generate and grade the prompts `picked[j]` for j in `rows` into `part` (positions `j` of its lists)."""
        cfg = self.config
        indices = [picked[j] for j in rows]
        started = time.perf_counter()
        completions = self.engine.generate([self.prompt_ids(i) for i in indices], cfg.sampling_params(seed),
                                           n=cfg.group_size, version=self.version, expert_ids=cfg.routing_replay,
                                           first_prompt=first_prompt)
        part["generate_s"] += time.perf_counter() - started
        stats = getattr(self.engine, "last_stats", None)  # MTP acceptance of this generation, when it drafted
        if stats is not None and getattr(stats, "steps", 0):
            part["drafts"] += stats.accepted
            part["verify_steps"] += stats.steps
        texts, tasks = [], []
        opening = "<think>\n" if cfg.enable_thinking is True else ""  # the generation prompt wrote it
        for i, samples in zip(indices, completions):
            for c in samples:
                ended = c.finish_reason == "stop"  # the end token closes the completion: not part of its text
                texts.append(opening + self.tokenizer.decode(c.token_ids[:-1] if ended else c.token_ids))
                tasks.append(self.tasks[i])
        started = time.perf_counter()
        rewards = self.env.rewards(tasks, texts)
        part["grade_s"] += time.perf_counter() - started
        G = cfg.group_size
        for n, (j, samples) in enumerate(zip(rows, completions)):
            part["completions"][j], part["rewards"][j] = samples, rewards[n * G:(n + 1) * G]

    def _groups(self, picked: list[int], completions, rewards: list[float]) -> list[list[Rollout]]:
        """The graded completions as groups of `Rollout`s, with their advantages; the curriculum updated."""
        cfg = self.config
        rewards_PG = torch.tensor(rewards, dtype=torch.float32).view(len(picked), cfg.group_size)
        # G = 1 (MOPD): no group baseline; the learner's advantages come from a teacher, not from these rewards
        advantages_PG = group_advantages(rewards_PG, mode=cfg.advantage_mode, eps=cfg.advantage_eps) \
            if cfg.group_size > 1 else torch.zeros_like(rewards_PG)
        groups = []
        for p, (i, samples) in enumerate(zip(picked, completions)):
            task = self.tasks[i]
            self.curriculum.update(i, float(rewards_PG[p].mean()))
            groups.append([Rollout(
                task_id=task.id, domain=task.domain, difficulty=task.difficulty, prompt_ids=list(c.prompt_ids),
                completion_ids=list(c.token_ids), logprobs=c.logprobs, finish_reason=c.finish_reason,
                reward=float(rewards_PG[p, g]), advantage=float(advantages_PG[p, g]),
                expert_ids={name: ids.to(torch.int16) for name, ids in c.expert_ids.items()}
                if c.expert_ids else None,  # a dense model's ({}: no router) replays nothing
                completion_mask=c.model_mask if isinstance(c, TrajectorySample) else None)
                for g, c in enumerate(samples)])
        return groups


# ------------------------------------------------------------------------------------- scoring roles
class ScoringRole(Role):
    """A role between rollout and learner that adds per-token scores to every rollout of a batch (MOPD's teachers,
    GRPO's frozen reference), which `pack_micro_batches` lays out beside the rollout's log-probs. Subclasses say
    which model scores which rollouts (`models_for`) and what one forward writes into `Rollout.scores` (`score`).
    Rollouts go through in forwards of `batch_size`, sorted by length so that each pads little. `share`
    (`roles.WorkShare`: every torchrun rank running the roles inline, or the role's replicas): this process scores
    its share of the batch's rollouts, and every one gathers all the scores. The time it took (the slowest
    process's) goes into the batch's stats as `seconds_key`."""

    seconds_key = "scoring_seconds"

    def __init__(self, *, batch_size: int, share: "WorkShare | None" = None):
        self.batch_size, self.share = batch_size, share

    def models_for(self, rollouts: list[Rollout]) -> list[tuple[torch.nn.Module, list[Rollout]]]:
        raise NotImplementedError

    def score(self, model: torch.nn.Module, rollouts: list[Rollout]) -> None:
        raise NotImplementedError

    def step(self, batch: RolloutBatch) -> RolloutBatch:
        started = time.perf_counter()
        start, stop = self.share.span(len(batch.rollouts)) if self.share is not None else (0, len(batch.rollouts))
        mine = batch.rollouts[start:stop]
        for model, rollouts in self.models_for(mine):
            rollouts = sorted(rollouts, key=lambda r: len(r.prompt_ids) + len(r.completion_ids))
            with torch.no_grad():
                for first in range(0, len(rollouts), self.batch_size):
                    self.score(model, rollouts[first:first + self.batch_size])
        seconds = time.perf_counter() - started
        if self.share is not None:  # everyone's scores, in the order of the batch's rollouts
            parts = self.share.gather(([r.scores for r in mine], seconds))
            for rollout, scores in zip(batch.rollouts, [s for p in parts for s in p[0]]):
                rollout.scores = scores
            seconds = max(p[1] for p in parts)
        batch.stats[self.seconds_key] = seconds
        return batch


def completion_scores(rollouts: list[Rollout], name: str, values_BL: torch.Tensor) -> None:
    """Each rollout's completion positions of `values_BL` [B, L, ...] (rows of `rollout_rows(rollouts)`) into its
    `scores[name]` ([C, ...])."""
    for b, r in enumerate(rollouts):
        P, C = len(r.prompt_ids), len(r.completion_ids)
        r.scores[name] = values_BL[b, P - 1:P + C - 1].clone()
