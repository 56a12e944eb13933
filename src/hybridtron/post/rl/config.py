"""The settings every on-policy RL section shares (`[grpo]`, `[mopd]`): how the rollouts are sampled, how the three
roles run (synchronously, or asynchronously one step off-policy), the policy-gradient loss's clip and its
rollout-vs-trainer correction, the MTP loss that keeps the drafter trained, and the held-out evaluation. Each
command's section subclasses `RolloutConfig`, adds its own loss settings, and may change a default by declaring the
field again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from hybridtron.data.chat import THINKING_SWITCH
from hybridtron.distributed.vllm_layout import EngineLayout
from hybridtron.infer.sampling import SamplingParams
from hybridtron.post.rl.engines.base import ENGINES, WEIGHT_SYNCS
from hybridtron.post.rl.roles import BACKENDS, check_replicas

# Rows of lm_head + log-softmax per block in the RL log-prob passes (`logprob_chunk`, ops/linear_logprobs.py): miles'
# `--log-probs-chunk-size` default. In rows rather than elements because that is the unit the memory a user budgets
# for scales with at a given vocabulary: at Ultra's 131,072 a block's fp32 logits are 64 MiB and the intermediates of
# the log-softmax, entropy and top-p sort a few times that (against 32 GiB a [tokens, vocab] tensor at 64K tokens),
# while the block's GEMM, [128, hidden] x [hidden, vocab], stays wide enough to run near a GPU's peak.
LOGPROB_CHUNK = 128

# What a resumed run may change in a rollout section (hybridtron.train.config): the sampling, the loss and its
# correction, the evaluation, and how many processes share the work. What fixes the run's prompts (the task pool,
# its levels and seed, the curriculum, the prompts a step) and its schedule of roles (asynchrony, staleness,
# backend) stays.
RESUMABLE_ROLLOUT_FIELDS = (
    "temperature", "top_p", "top_k", "max_new_tokens", "speculative", "draft_length", "rollout_threads",
    "rollout_replicas", "eps_clip", "eps_clip_high", "correction", "correction_level", "tis_low", "tis_high",
    "icepop_low", "icepop_high", "aggregation", "mtp_loss_weight", "eval_tasks", "eval_every", "eval_max_tokens",
    "eval_batch_size", "logprob_chunk", "engine", "weight_sync", "vllm_tensor_parallel", "vllm_data_parallel",
    "vllm_expert_parallel", "vllm_gpu_memory_utilization")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """The rollout, asynchrony, loss and evaluation settings of an RL section; `SECTION` names it in errors. What the
    rollout role also reads of a section (`group_size`, `dynamic_sampling`, the curriculum, the advantages:
    hybridtron.post.rl.rollout.RolloutRole) each command's section defines: GRPO's as fields, MOPD's as constants
    (one sample a prompt, no reward to steer by)."""

    SECTION: ClassVar[str] = "rollout"
    RESUMABLE: ClassVar = RESUMABLE_ROLLOUT_FIELDS

    # prompts
    prompts_per_step: int = 8  # prompts per rollout batch (per optimizer step unless global_batch splits it)
    task_pool: int = 2000  # training-split tasks drawn from the environment once; a step samples among them
    levels: tuple[int, ...] = ()  # the environment's difficulty levels; empty = its default (all)
    # mini-batches: each rollout batch (prompts_per_step x group_size rows) trains over
    # rollout rows / global_batch x epochs optimizer steps, every one measured against the log-probs the learner
    # gave the batch before its first update (the old policy of the ratio, so the clip bites from the second step)
    global_batch: int = 0  # rows per optimizer step; 0 = the whole rollout batch (one step, today's default)
    epochs: int = 1  # passes over the rollout batch's mini-batches (verl's ppo_epochs)
    # rollouts
    engine: str = "hybridtron"  # what generates them: hybridtron (its own engine) or vllm (hybridtron.post.rl.engines)
    weight_sync: str = "reload"  # vllm: how the weights reach it, reload (from a directory) or nccl (GPUs)
    # vllm: the engine's layout (hybridtron.distributed.vllm_layout; `hybridtron plan --rollout` proposes one), an
    # engine of tensor x data parallel GPUs
    vllm_tensor_parallel: int = 1  # GPUs attention, Mamba and MLP split over (divides the heads and n_groups)
    vllm_data_parallel: int = 1  # data-parallel ranks, each with its own requests (DP attention)
    vllm_expert_parallel: bool = False  # true: whole routed experts on each GPU, spread over all of them (EP)
    vllm_gpu_memory_utilization: float = 0.9  # the share of each GPU's memory the engine takes
    temperature: float = 1.0  # sampling temperature of the rollouts (the learner's log-probs use the same)
    top_p: float = 1.0  # nucleus filter of the rollouts (1 = off; the learner renormalises over the same nucleus)
    top_k: int = 0  # top-k filter of the rollouts (0 = off)
    max_new_tokens: int = 128  # completion length cap; a completion cut there is graded as it stands
    thinking: str = "auto"  # the generation prompt's thinking switch: auto (the model decides), on, off
    routing_replay: bool = True  # R3: record the rollout's experts and force them in the learner's forward
    speculative: bool = True  # MTP speculative drafts in the rollouts (the output distribution is unchanged)
    draft_length: int = 3  # tokens drafted per verification step (Ultra measured 1.46x at k = 5 on its scale)
    # asynchrony (the roles: rollout, scoring, learning)
    async_rollouts: bool = False  # true: rollouts in other processes, overlapping training (one step off-policy)
    staleness: int = 1  # async: batch n is sampled with the weights after step n - 1 - staleness (0 = synchronous)
    rollout_backend: str = "process"  # async: process (torch.multiprocessing) or ray (the rl extra); inline: tests
    rollout_threads: int = 1  # async: torch threads of each role process (0 = torch's default)
    rollout_replicas: int = 1  # async: rollout processes (or Ray actors), each generating a share of every step
    # the policy-gradient loss (hybridtron.post.losses)
    eps_clip: float = 0.2  # ratio clipped to [1 - eps_clip, 1 + eps_clip_high] (DAPO clip-higher)
    eps_clip_high: float = 0.28
    correction: str = "tis"  # rollout-vs-trainer weight w: tis (multiply by clamp(w)), icepop (mask), none
    correction_level: str = "token"  # token, or sequence (the geometric mean of w over the completion)
    tis_low: float = 0.0  # TIS: clamp(w, tis_low, tis_high) (miles: [0, 2]; NeMo-RL's Ultra config: [0.2, 5])
    tis_high: float = 2.0
    icepop_low: float = 0.5  # IcePop: tokens with w outside [icepop_low, icepop_high] dropped
    icepop_high: float = 2.0
    aggregation: str = "token_mean"  # token_mean (DAPO, the default) or sequence_mean (the GRPO paper)
    mtp_loss_weight: float = 0.1  # MTP CE on the completions, so the drafter follows the policy (0 = off)
    logprob_chunk: int = LOGPROB_CHUNK  # rows per block of the learner's, reference's and teachers' log-probs
    # held-out evaluation: greedy pass@1 on the environment's test split
    eval_tasks: int = 200  # 0 = no evaluation
    eval_every: int = 10  # steps between evaluations (and at step 0 and the end)
    eval_max_tokens: int = 128  # completion length cap of the evaluation
    eval_batch_size: int = 64  # prompts decoded together
    seed: int = 0  # the task pool, the prompt draws and the sampling of every step

    @property
    def rollout_batch_rows(self) -> int:
        """Rows a rollout batch holds (dynamic sampling may leave one short): prompts x samples of each."""
        return self.prompts_per_step * self.group_size

    @property
    def mini_batches(self) -> int:
        """Optimizer steps of one pass over a rollout batch."""
        return self.rollout_batch_rows // self.global_batch if self.global_batch else 1

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps a rollout batch trains (miles: rollout batch x samples / global batch; verl: x epochs)."""
        return self.mini_batches * self.epochs

    def vllm_layout(self) -> EngineLayout:
        return EngineLayout(self.vllm_tensor_parallel, self.vllm_data_parallel, self.vllm_expert_parallel,
                            self.vllm_gpu_memory_utilization)

    @property
    def enable_thinking(self) -> bool | None:
        return THINKING_SWITCH[self.thinking]

    def sampling_params(self, seed: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed,
                              max_tokens=self.max_new_tokens)

    def loss_config(self):
        """The section's loss settings as the loss function's config (hybridtron.post.losses)."""
        raise NotImplementedError

    def replica_counts(self) -> dict[str, int]:
        """The section's replica fields and their counts (a scoring role with replicas adds its own)."""
        return {"rollout_replicas": self.rollout_replicas}

    def validate(self) -> None:
        section = self.SECTION
        for name in ("prompts_per_step", "max_new_tokens", "draft_length", "eval_every", "eval_max_tokens",
                     "eval_batch_size", "logprob_chunk", "vllm_tensor_parallel", "vllm_data_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{section}.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("staleness", "rollout_threads", "eval_tasks", "top_k", "global_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{section}.{name} must be >= 0, got {getattr(self, name)}")
        if self.epochs < 1:
            raise ValueError(f"{section}.epochs must be >= 1, got {self.epochs}")
        if self.global_batch and self.rollout_batch_rows % self.global_batch:
            raise ValueError(f"{section}.global_batch={self.global_batch} must divide the rollout batch's "
                             f"{self.rollout_batch_rows} rows ({section}.prompts_per_step={self.prompts_per_step} x "
                             f"{self.group_size} samples a prompt): one optimizer step a global_batch of them")
        if self.task_pool < self.prompts_per_step:
            raise ValueError(f"{section}.task_pool ({self.task_pool}) must be at least {section}.prompts_per_step "
                             f"({self.prompts_per_step})")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"{section}.temperature must be > 0 (the policy samples its rollouts), got "
                             f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{section}.top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(f"{section}.vllm_gpu_memory_utilization must be in (0, 1] (a share of each GPU's "
                             f"memory), got {self.vllm_gpu_memory_utilization}")
        for name, value, choices in (("thinking", self.thinking, THINKING_SWITCH),
                                     ("rollout_backend", self.rollout_backend, BACKENDS),
                                     ("engine", self.engine, ENGINES), ("weight_sync", self.weight_sync, WEIGHT_SYNCS)):
            if value not in choices:
                raise ValueError(f"{section}.{name} must be one of {', '.join(choices)}, got {value!r}")
        check_replicas(section, self.replica_counts(), async_rollouts=self.async_rollouts,
                       backend=self.rollout_backend)
        if not (self.mtp_loss_weight >= 0 and math.isfinite(self.mtp_loss_weight)):
            raise ValueError(f"{section}.mtp_loss_weight must be >= 0, got {self.mtp_loss_weight}")
        if any(level < 1 for level in self.levels):
            raise ValueError(f"{section}.levels must be positive difficulty levels, got {list(self.levels)}")
        self.loss_config()  # the loss's own checks, named by section

    def micro_batch_shape(self, grad_accum: int, max_positions: int) -> tuple[int, int]:
        """(rows, positions) of a learner micro-batch at most: a step's rollouts (`global_batch` of them, or the
        whole rollout batch) over `grad_accum` micro-batches, each a prompt (128 tokens budgeted) plus its
        completion."""
        rows = -(-(self.global_batch or self.rollout_batch_rows) // grad_accum)
        return rows, min(max_positions, 128 + self.max_new_tokens)
