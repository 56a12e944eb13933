"""Rollouts for on-policy RL: the rollout role that samples and grades them, the queue items it produces, and the
learner's end of the pipeline that turns them into the trainer's micro-batches.

The rollout role (`RolloutRole`, one step per optimizer step of the learner):

1. draws `prompts_per_step` prompts from the environment's training tasks, weighted by the pass-rate curriculum
   (`PassRateCurriculum`), without repeats within a step;
2. samples `group_size` completions of each with the inference engine (`HybridEngine.generate(prompts, params,
   n=G, logprobs=True, expert_ids=routing_replay)`; MTP speculative drafts on by default), keeping the engine's
   per-token log-probs and, for routing replay, the experts every backbone MoE layer chose for every token;
3. grades them with the environment (`env.rewards`) and computes each group's advantages
   (`hybridtron.post.losses.group_advantages`);
4. dynamic sampling (DAPO): a group whose rewards all agree carries no signal and is dropped, and new prompts are
   drawn to refill the step, for at most `max_refill_rounds` extra rounds of generation; if the cap leaves the
   step short it trains on the groups it has (and, if none, on the last round's, whose advantages are all 0);
5. updates the curriculum with every group it graded (dropped ones too) and returns a `RolloutBatch`.

Everything random in a step is drawn from seeds fixed by (`seed`, step index, refill round), and the curriculum is
the role's only state (`state_dict`), so a batch is a function of (role state, weights, index): the same in any
process, and again after a resume.

The learner's end (`RolloutBatches`) keeps the pipeline `staleness + 1` batches ahead and hands the learner's
weights to the rollout role before each new request (hybridtron.post.roles): batch n is generated with the
weights after optimizer step max(0, n - 1 - staleness). Staleness 0 is synchronous RL: batch n + 1 is sampled
after step n's update. Staleness 1 is Ultra's one-step off-policy mode: batch n + 1 is sampled (in the rollout
process) while step n trains, with the weights step n started from.

Queue items (what MOPD's teacher-scoring role reads and extends): a `RolloutBatch` holds `Rollout`s, each with
its prompt and completion ids, the engine's per-token log-probs, the expert ids, reward and advantage, the task's
domain, and `scores`: per-token tensors that a scoring role between rollout and learner adds under its own name
(a teacher's, a frozen reference's), which `pack_micro_batches` lays out beside the rollout's log-probs.

Shapes: B rows (rollouts), L positions (prompt + completion - 1), C completion tokens, K experts per token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.post.roles import Role, RolePipeline, WorkShare

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
    scores: per-token tensors [C, ...] added by scoring roles under their name (e.g. "teacher" in MOPD: log-probs)."""

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
    """An environment from its registered name (`hybridtron.post.envs.get_env`), or from `module.path:Factory`, a
    class or function importable by every process (a custom environment: a rollout process or Ray actor imports the
    module itself, whereas a name registered in the learner's script only exists in the learner's process)."""
    import importlib

    from hybridtron.post.envs import Environment, get_env

    if ":" not in spec:
        return get_env(spec, **options)
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"environment {spec!r}: cannot import {attr} from {module_name} ({exc})") from None
    env = factory(**options)
    if not isinstance(env, Environment):
        raise ValueError(f"environment {spec!r} built {type(env).__name__}, not a hybridtron.post.envs.Environment")
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
    `hybridtron.post.grpo.GRPOConfig`, or anything with its rollout fields). `share`: this process's part of the
    generation (`roles.WorkShare`: every torchrun rank running the role inline, or the role's replicas)."""

    name = ROLLOUT_ROLE

    def __init__(self, *, model_dir: str, model_config, env: str, env_options: dict, config, threads: int = 0,
                 share: "WorkShare | None" = None):
        from hybridtron.data.chat import load_chat_tokenizer
        from hybridtron.infer.engine import HybridEngine
        from hybridtron.model.lm import HybridLM

        if threads:
            torch.set_num_threads(threads)
        self.config = config
        self.tokenizer = load_chat_tokenizer(model_dir, vocab_size=model_config.vocab_size)
        model = HybridLM(model_config, init=False)  # the weights come from the learner
        self.engine = HybridEngine.from_model(model, self.tokenizer, model_name="policy",
                                              speculative=config.speculative, draft_length=config.draft_length)
        self.env = load_env(env, **env_options)
        self.tasks = self.env.tasks("train", config.task_pool, config.seed)
        self.curriculum = PassRateCurriculum([t.difficulty for t in self.tasks], target=config.curriculum_target,
                                             sigma=config.curriculum_sigma, ema=config.curriculum_ema,
                                             enabled=config.curriculum)
        self.prompt_cache: dict[int, list[int]] = {}
        self.version: int | None = None
        self.share = share

    # ---------------------------------------------------------------------------------------- the role
    def load_weights(self, version: int, state_dict: dict) -> None:
        self.engine.load_weights(state_dict)
        self.version = version

    def state_dict(self) -> dict:
        return {"curriculum": self.curriculum.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.curriculum.load_state_dict(state["curriculum"])

    def close(self) -> None:
        self.env.close()

    def step(self, request: RolloutRequest) -> RolloutBatch:
        if self.version is None:
            raise RuntimeError("the rollout role got a request before any weights")
        cfg = self.config
        groups, used, last_round = [], set(), []
        totals = dict(samples=0, tokens=0, truncated=0, generate_s=0.0, grade_s=0.0, drafts=0, verify_steps=0,
                      dropped=0, rewards=[], lengths=[])
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
        if totals["verify_steps"]:
            stats["mtp_acceptance_length"] = (totals["drafts"] + totals["verify_steps"]) / totals["verify_steps"]
        return RolloutBatch(index=request.index, policy_version=self.version, group_size=cfg.group_size,
                            rollouts=[r for group in groups for r in group], stats=stats)

    # ------------------------------------------------------------------------------------------ helpers
    def prompt_ids(self, index: int) -> list[int]:
        from hybridtron.data.chat import tokenize_chat

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
                totals["samples"] += 1
                totals["tokens"] += len(c.token_ids)
                totals["truncated"] += c.finish_reason != "stop"
                totals["lengths"].append(len(c.token_ids))
        totals["rewards"] += rewards
        return self._groups(picked, completions, rewards)

    def _generate_and_grade(self, picked: list[int], seed: int, first_prompt: int) -> dict:
        """The completions of the prompts `picked` (positions `first_prompt`.. of the round's list, which fixes
        their noise keys) and their rewards, with the time each took and the MTP drafts accepted."""
        cfg = self.config
        part = {"completions": [], "rewards": [], "generate_s": 0.0, "grade_s": 0.0, "drafts": 0, "verify_steps": 0}
        if not picked:
            return part
        started = time.perf_counter()
        part["completions"] = self.engine.generate([self.prompt_ids(i) for i in picked], cfg.sampling_params(seed),
                                                   n=cfg.group_size, logprobs=True, expert_ids=cfg.routing_replay,
                                                   first_prompt=first_prompt)
        part["generate_s"] = time.perf_counter() - started
        stats = getattr(self.engine, "last_stats", None)  # MTP acceptance of this generation, when it drafted
        if stats is not None and getattr(stats, "steps", 0):
            part["drafts"], part["verify_steps"] = stats.accepted, stats.steps
        texts, tasks = [], []
        opening = "<think>\n" if cfg.enable_thinking is True else ""  # the generation prompt wrote it
        for i, samples in zip(picked, part["completions"]):
            for c in samples:
                ended = c.finish_reason == "stop"  # the end token closes the completion: not part of its text
                texts.append(opening + self.tokenizer.decode(c.token_ids[:-1] if ended else c.token_ids))
                tasks.append(self.tasks[i])
        started = time.perf_counter()
        part["rewards"] = self.env.rewards(tasks, texts)
        part["grade_s"] = time.perf_counter() - started
        return part

    def _groups(self, picked: list[int], completions, rewards: list[float]) -> list[list[Rollout]]:
        """The graded completions as groups of `Rollout`s, with their advantages; the curriculum updated."""
        from hybridtron.post.losses import group_advantages

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
                if c.expert_ids is not None else None)
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


# ------------------------------------------------------------------------------------------- packing
@dataclass
class RolloutMicroBatch:
    """Rows of prompt + completion for the learner's forward, right-padded to the longest row.

    input_ids [B, L]: prompt + completion[:-1]; labels [B, L]: the completion token each position predicts,
    IGNORE_INDEX on the prompt and the padding; rollout_logprobs [B, L] beside them (0 elsewhere); advantages [B];
    trained [B]: False for rows of groups whose rewards all agree (they carry no signal and are kept out of the
    policy loss); valid [B, L]: not padding; expert_ids {router: [B, L, K]} (padding: experts 0..K-1); scores
    {name: [B, L, ...]}; stats: the batch's rollout statistics (the same for every micro-batch of the step); domains:
    each row's task domain (per-domain metrics: MOPD's reverse KL to each domain's teacher). Under context
    parallelism a micro-batch is one share of the rows' positions (`share`): following_ids, following_labels and
    following_valid [B, <= D] are the ids, labels and validity after it, which the MTP depths at its last positions
    read and are scored against (None for whole rows)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    trained: torch.Tensor
    valid: torch.Tensor
    expert_ids: dict[str, torch.Tensor] | None
    scores: dict[str, torch.Tensor]
    stats: dict[str, float]
    domains: list[str] = field(default_factory=list)
    following_ids: torch.Tensor | None = None
    following_labels: torch.Tensor | None = None
    following_valid: torch.Tensor | None = None

    @property
    def completion_mask(self) -> torch.Tensor:
        return self.labels != IGNORE_INDEX

    @property
    def counted(self) -> torch.Tensor:
        """The real positions, and under CP those after the share: the learner's expert counts leave out the
        padding, whose amount depends on how rows were batched and sharded (`HybridLM.forward(counted=...)`)."""
        return self.valid if self.following_valid is None else torch.cat([self.valid, self.following_valid], dim=1)

    def mtp_targets(self, depth: int) -> torch.Tensor:
        """MTP depth `depth`'s targets [B, L] (`hybridtron.model.lm.mtp_targets`), a share's last ones completed by
        the labels after it."""
        from hybridtron.train.objectives import window_targets

        labels = self.labels if self.following_labels is None else torch.cat([self.labels, self.following_labels], 1)
        return window_targets(labels, depth, self.labels.shape[1])

    @property
    def policy_mask(self) -> torch.Tensor:
        """The tokens of the policy loss: completion tokens of informative groups."""
        return self.completion_mask & self.trained.unsqueeze(1)

    def padded(self, rows: int, length: int, pad_id: int = 0) -> "RolloutMicroBatch":
        """This micro-batch with padding rows and positions appended up to [rows, length]: padding is no
        completion token and not valid, so it adds nothing to any loss, count or metric."""
        B, L = self.input_ids.shape
        if (rows, length) == (B, L):
            return self

        def grown(tensor, fill):
            out = torch.full((rows, length, *tensor.shape[2:]), fill, dtype=tensor.dtype)
            out[:B, :L] = tensor
            return out

        expert_ids = None
        if self.expert_ids is not None:  # padding routes to experts 0..K-1, as rollout_rows pads
            expert_ids = {}
            for name, ids in self.expert_ids.items():
                full = torch.arange(ids.shape[-1]).expand(rows, length, ids.shape[-1]).clone()
                full[:B, :L] = ids
                expert_ids[name] = full
        advantages, trained = torch.zeros(rows), torch.zeros(rows, dtype=torch.bool)
        advantages[:B], trained[:B] = self.advantages, self.trained
        return RolloutMicroBatch(
            input_ids=grown(self.input_ids, pad_id), labels=grown(self.labels, IGNORE_INDEX),
            rollout_logprobs=grown(self.rollout_logprobs, 0.0), advantages=advantages, trained=trained,
            valid=grown(self.valid, False), expert_ids=expert_ids,
            scores={name: grown(value, 0.0) for name, value in self.scores.items()}, stats=self.stats,
            domains=self.domains + [""] * (rows - B))

    def rows(self, start: int, stop: int, device=None) -> "RolloutMicroBatch":
        """Rows [start, stop) (a data-parallel rank's share), on `device`."""
        def take(tensor):
            return tensor[start:stop].to(device)

        return RolloutMicroBatch(
            input_ids=take(self.input_ids), labels=take(self.labels), rollout_logprobs=take(self.rollout_logprobs),
            advantages=take(self.advantages), trained=take(self.trained), valid=take(self.valid),
            expert_ids=None if self.expert_ids is None else {k: take(v) for k, v in self.expert_ids.items()},
            scores={k: take(v) for k, v in self.scores.items()}, stats=self.stats, domains=self.domains[start:stop])


    def share(self, rank: int, size: int, lookahead: int) -> "RolloutMicroBatch":
        """Cp rank `rank` of `size`'s part of every row (context parallelism: its head and tail chunks of the row's
        positions as two rows, `hybridtron.dist.context_parallel.shard_sequence`), with the `lookahead` ids and
        labels after each chunk. A row's own values (advantage, trained, domain) go with both its chunks."""
        from hybridtron.dist.context_parallel import chunk_rows, chunk_rows_ahead, shard_sequence

        input_ids, labels_ahead, following_ids = shard_sequence(self.input_ids, self.labels, rank, size, lookahead)
        length = input_ids.shape[1]
        valid_ahead = chunk_rows_ahead(self.valid, rank, size, lookahead, False)

        def cut(tensor):
            return chunk_rows(tensor, rank, size)

        return RolloutMicroBatch(
            input_ids=input_ids, labels=labels_ahead[:, :length], rollout_logprobs=cut(self.rollout_logprobs),
            advantages=self.advantages.repeat_interleave(2), trained=self.trained.repeat_interleave(2),
            valid=valid_ahead[:, :length], expert_ids=None if self.expert_ids is None else
            {k: cut(v) for k, v in self.expert_ids.items()},
            scores={k: cut(v) for k, v in self.scores.items()}, stats=self.stats,
            domains=[domain for domain in self.domains for _ in range(2)],
            following_ids=following_ids, following_labels=labels_ahead[:, length:],
            following_valid=valid_ahead[:, length:])


def sharded_length(length: int, cp: int, tp: int, min_chunk: int) -> int:
    """The positions a micro-batch of `length` is padded to so that it splits over tp, and under CP into the 2 x cp
    head-and-tail chunks of `dist.context_parallel` (each cut into tp sequence shards), each chunk at least
    `min_chunk` long (the Mamba conv reads the previous chunk's last inputs)."""
    if cp == 1:
        return -(-length // tp) * tp
    split = 2 * cp * tp
    return -(-max(length, 2 * cp * min_chunk) // split) * split


def shard_micro_batch(mb: RolloutMicroBatch, parallel, pad_id: int = 0, *, lookahead: int = 0,
                      min_chunk: int = 1) -> RolloutMicroBatch:
    """This rank's part of a micro-batch: padded to whole rows per data-parallel rank and to `sharded_length`
    positions (the layout check's rules for cp and tp; each CP chunk at least `min_chunk` long), then this
    data-parallel rank's rows, and under CP its chunks of their positions with the `lookahead` (the
    model's MTP depths) ids and labels after it. Padding at the end of a row changes nothing before it."""
    ranks, tp, cp = parallel.layout.dp, parallel.layout.tp, parallel.layout.cp
    B, L = mb.input_ids.shape
    per_rank = -(-B // ranks)
    mb = mb.padded(per_rank * ranks, sharded_length(L, cp, tp, min_chunk), pad_id)
    start = parallel.data_rank * per_rank
    mb = mb.rows(start, start + per_rank, parallel.device)
    return mb.share(parallel.coordinate("cp"), cp, lookahead) if cp > 1 else mb


def pack_micro_batches(batch: RolloutBatch, micro_batches: int, pad_id: int = 0) -> list[RolloutMicroBatch]:
    """Split a step's rollouts into `micro_batches` micro-batches of (nearly) equal row counts (fewer if there are
    fewer rows), rows sorted by length so that each micro-batch pads little; the losses are sums over tokens, so
    the order changes nothing but the padding. A group is informative (its rows `trained`) when its rewards do
    not all agree."""
    rollouts = batch.rollouts
    if not rollouts:
        raise ValueError(f"rollout batch {batch.index} holds no rollouts")
    G = batch.group_size
    trained = []
    for start in range(0, len(rollouts), G):
        group = rollouts[start:start + G]
        trained += [len({r.reward for r in group}) > 1] * len(group)
    order = sorted(range(len(rollouts)), key=lambda i: len(rollouts[i].prompt_ids) + len(rollouts[i].completion_ids))
    rollouts, trained = [rollouts[i] for i in order], [trained[i] for i in order]
    count = min(micro_batches, len(rollouts))
    bounds = [round(i * len(rollouts) / count) for i in range(count + 1)]
    return [rollout_rows(rollouts[a:b], pad_id, trained[a:b], batch.stats) for a, b in zip(bounds, bounds[1:])]


def uniform_micro_batches(micro_batches: list[RolloutMicroBatch], count: int, pad_id: int = 0
                          ) -> list[RolloutMicroBatch]:
    """`count` micro-batches of one shape, for a pipeline schedule (its stages exchange fixed-shape activations, and
    it runs a fixed number of micro-batches): each padded to the most rows and positions of any, and empty ones (all
    padding) appended. Padding adds nothing to any loss, count or metric, so the step is the same."""
    rows = max(mb.input_ids.shape[0] for mb in micro_batches)
    length = max(mb.input_ids.shape[1] for mb in micro_batches)
    empty = micro_batches[0].rows(0, 0)
    return [mb.padded(rows, length, pad_id) for mb in micro_batches] + \
        [empty.padded(rows, length, pad_id) for _ in range(count - len(micro_batches))]


def rollout_rows(rollouts: list[Rollout], pad_id: int = 0, trained: list[bool] | None = None,
                 stats: dict | None = None) -> RolloutMicroBatch:
    """One micro-batch of `rollouts` (see RolloutMicroBatch; `trained` default: every row)."""
    lengths = [len(r.prompt_ids) + len(r.completion_ids) - 1 for r in rollouts]
    B, L = len(rollouts), max(lengths)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    labels = torch.full((B, L), IGNORE_INDEX, dtype=torch.long)
    rollout_logprobs = torch.zeros(B, L, dtype=torch.float32)
    valid = torch.zeros(B, L, dtype=torch.bool)
    first = rollouts[0].scores
    names = sorted(first)
    scores = {name: torch.zeros(B, L, *first[name].shape[1:], dtype=first[name].dtype) for name in names}
    replay = rollouts[0].expert_ids is not None
    expert_ids = None
    if replay:
        k = next(iter(rollouts[0].expert_ids.values())).shape[-1]
        expert_ids = {name: torch.arange(k).expand(B, L, k).clone() for name in rollouts[0].expert_ids}
    for b, r in enumerate(rollouts):
        P, C = len(r.prompt_ids), len(r.completion_ids)
        if C == 0:
            raise ValueError(f"rollout of task {r.task_id} has an empty completion (max_new_tokens must be >= 1)")
        full = torch.tensor(r.prompt_ids + r.completion_ids, dtype=torch.long)
        input_ids[b, :P + C - 1] = full[:-1]
        labels[b, P - 1:P + C - 1] = full[P:]
        rollout_logprobs[b, P - 1:P + C - 1] = r.logprobs
        valid[b, :P + C - 1] = True
        for name in names:
            scores[name][b, P - 1:P + C - 1] = r.scores[name]
        if replay:
            for name, ids in r.expert_ids.items():
                expert_ids[name][b, :P + C - 1] = ids.long()
    return RolloutMicroBatch(
        input_ids=input_ids, labels=labels, rollout_logprobs=rollout_logprobs,
        advantages=torch.tensor([r.advantage for r in rollouts], dtype=torch.float32),
        trained=torch.tensor([True] * B if trained is None else trained, dtype=torch.bool), valid=valid,
        expert_ids=expert_ids, scores=scores, stats=dict(stats or {}), domains=[r.domain for r in rollouts])


def rollout_router_counts(model, out) -> dict[str, torch.Tensor]:
    """The expert counts of a learner forward on rollouts (`ObjectiveOutput.counts`; the forward counted the real
    tokens only, `HybridLM.forward(counted=valid)`); the MTP block's routers, when the MTP loss did not run them,
    count none."""
    from hybridtron.train.objectives import router_counts

    counts = router_counts(model, out)
    for name, moe in model.routers().items():
        counts.setdefault(name, torch.zeros(moe.gate.num_experts, dtype=torch.long))
    return counts


# ------------------------------------------------------------------------------------ the learner's end
class RolloutBatches:
    """The learner's end of the rollout pipeline: the trainer's batch source (hybridtron.train.objectives), each
    step's rollouts split into `grad_accum` micro-batches (fewer if the step has fewer rows).

    `pipeline`: builds a `RolePipeline` whose first role is the rollout role (more roles may follow it: scoring
    roles that add `Rollout.scores`). `bind(trainer)` (assemble_trainer calls it) gives the learner: its model,
    whose weights go to the rollout role before each new request, and its schedule's last step (no batch is
    requested past it).

    `parallel` (a sharded learner under torchrun, hybridtron.dist): each rank trains on its data-parallel rows of
    every micro-batch (`shard_micro_batch`), so the step is the one a single process takes. With `shared` (inline
    roles, built with a `WorkShare`) every rank runs the pipeline on the full weights, which every rank gathers
    (`dist.step.full_state_dict`), each generating and scoring its share of the step's rollouts, and every rank
    ends with the whole batch. Otherwise (roles in processes or Ray actors) the pipeline runs on global rank 0
    alone, with the full weights gathered there, and rank 0 broadcasts the step's batch.

    The protocol (see the module docstring): before the batch of step n is taken, the weights after step n - 1 go
    to the rollout role, followed by the request for batch n + staleness; so batch m is always sampled with the
    weights after step max(0, m - 1 - staleness), whatever the speed of either side.

    State (`state_dict`, at a step boundary): the batches consumed, the next `staleness` batches (waited for:
    they were sampled with weights the checkpoint does not hold) and the role states after the last of them, so a
    resumed run consumes exactly the batches the uninterrupted run would have. After a rollback (the monitor
    restoring an older checkpoint) the run reads on with those prefetched batches, sampled by the abandoned
    policy; the IS correction weights them as it does any stale batch."""

    def __init__(self, pipeline: Callable[[], RolePipeline], *, staleness: int, grad_accum: int, pad_id: int = 0,
                 parallel=None, shared: bool = False):
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.make_pipeline, self.parallel, self.trainer = pipeline, parallel, None
        self.shared = shared and parallel is not None
        self.drives_pipeline = parallel is None or parallel.is_main or self.shared
        self.staleness, self.grad_accum, self.pad_id = staleness, grad_accum, pad_id
        self.pipeline: RolePipeline | None = None
        self.consumed = 0  # batches the learner has taken (= its step, unless a rollback rewound it)
        self.requested = 0  # the highest batch index requested from the pipeline
        self.prefetched: list[RolloutBatch] = []  # received, not yet consumed
        self.role_states: dict[str, dict] | None = None  # after the last batch received
        self.last_wait_s = 0.0

    def bind(self, trainer) -> None:
        self.trainer = trainer

    # ------------------------------------------------------------------------------------------ protocol
    def _start(self) -> None:
        self.pipeline = self.make_pipeline().start()
        if self.role_states:
            for role, state in self.role_states.items():
                if state:
                    self.pipeline.send_state(role, state)
        self.requested = self.consumed + len(self.prefetched)

    def next_step(self) -> list[RolloutMicroBatch]:
        started = time.perf_counter()
        if self.parallel is None:
            weights = self.trainer.model.state_dict()
        else:
            from hybridtron.dist.step import full_state_dict

            # every rank gathers; rank 0 holds the result, or every rank when each samples its share
            weights = full_state_dict(self.trainer.model, self.parallel, everywhere=self.shared)
        batch = self._next_batch(weights) if self.drives_pipeline else None
        if self.parallel is not None and not self.shared:
            batch = self.parallel.broadcast_object(batch)
        self.last_wait_s = time.perf_counter() - started
        assert batch.index == self.consumed + 1, f"batch {batch.index} arrived for step {self.consumed + 1}"
        self.consumed += 1
        stats = {**batch.stats, "rollout_wait_s": self.last_wait_s,
                 "policy_staleness": float(batch.index - 1 - batch.policy_version)}
        batch.stats = stats
        micro_batches = pack_micro_batches(batch, self.grad_accum, self.pad_id)
        if self.parallel is not None and self.parallel.layout.pp > 1:
            micro_batches = uniform_micro_batches(micro_batches, self.grad_accum, self.pad_id)
        if self.parallel is not None:
            config = self.trainer.model.config
            micro_batches = [shard_micro_batch(mb, self.parallel, self.pad_id, lookahead=config.mtp_depths,
                                               min_chunk=config.conv_kernel - 1) for mb in micro_batches]
        return micro_batches

    def _next_batch(self, weights) -> RolloutBatch:
        if self.pipeline is None:
            self._start()
        self.pipeline.send_weights(ROLLOUT_ROLE, self.consumed, weights)
        total_steps = self.trainer.schedule.total_steps
        last = min(self.consumed + 1 + self.staleness, max(total_steps, self.consumed + 1))
        while self.requested < last:
            self.requested += 1
            self.pipeline.submit(RolloutRequest(self.requested))
        return self.prefetched.pop(0) if self.prefetched else self._receive()

    def _receive(self) -> RolloutBatch:
        delivery = self.pipeline.receive()
        self.role_states = delivery.states
        return delivery.item

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None

    # --------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """(Under torchrun the checkpoint keeps global rank 0's, which drives the pipeline; with `shared`, every
        rank's is the same.)"""
        if self.pipeline is not None:  # wait for the batches sampled with weights older than the checkpoint's
            wanted = min(self.consumed + self.staleness, self.requested)
            while self.consumed + len(self.prefetched) < wanted:
                self.prefetched.append(self._receive())
        return {"consumed": self.consumed, "prefetched": list(self.prefetched),
                "role_states": self.role_states}

    def load_state_dict(self, state: dict) -> None:
        self.close()  # a resume or a rollback: the roles restart from the state's point
        self.consumed = state["consumed"]
        if self.drives_pipeline:
            self.prefetched = list(state["prefetched"])
            self.role_states = state["role_states"]


def learner_layout(dist_config, model_config, learner_config, *, rows: int, seq_len: int, grad_accum: int,
                   what: str) -> dict:
    """The `start_parallel` arguments of an RL learner (GRPO, MOPD; `learner_config` its [grpo] or [mopd] section)
    whose steps hold `grad_accum` micro-batches of `rows` rollouts of up to `seq_len` positions, after the checks of
    `dist.mesh.check_run_layout` (rows and positions are padded to whole shares, so only the structural rules apply,
    and under PP the micro-batches to one shape: `uniform_micro_batches`) and the RL learner's own: no routing replay
    under TP, and under CP only the token-level loss (a sequence-level aggregation or correction needs each whole
    sequence on one rank). A ValueError names the setting; no process group is built."""
    from hybridtron.dist.mesh import Layout, check_run_layout, world_from_env

    world = world_from_env()[0]
    layout = Layout(**dist_config.degrees(world))
    section = what.lower()
    if layout.tp > 1 and learner_config.routing_replay:
        raise ValueError(f"dist.tp={layout.tp}: routing replay is not supported under tensor parallelism; set "
                         f"{section}.routing_replay=false or dist.tp=1")
    if layout.cp > 1:
        for name in ("aggregation", "correction_level"):
            value = getattr(learner_config, name)
            if value.startswith("sequence"):
                raise ValueError(f"dist.cp={layout.cp}: {section}.{name}={value} needs each whole sequence on one "
                                 f"rank, and under context parallelism a rank holds a share of its positions; use "
                                 f"the token-level default or dist.cp=1")
    sizes = dict(batch_size=-(-rows // layout.dp) * layout.dp, grad_accum=grad_accum, context_parallel=True,
                 seq_len=sharded_length(seq_len, layout.cp, layout.tp, model_config.conv_kernel - 1))
    check_run_layout(dist_config, model_config, world, **sizes)
    return sizes


def rollout_pipeline_factory(specs: Sequence, backend: str, staleness: int, timeout_s: float = 3600.0
                             ) -> Callable[[], RolePipeline]:
    """A function building the pipeline of `specs` (rollout role first) on `backend`, its queues sized for
    `staleness + 1` batches in flight plus the weights sent before each."""
    capacity = 2 * (staleness + 2)

    def build() -> RolePipeline:
        return RolePipeline(list(specs), backend, capacity=capacity, timeout_s=timeout_s)

    return build

