"""`hybridtron grpo`: reinforcement learning with verifiable rewards (GRPO), as Nemotron 3 Ultra's RLVR stage ran it.

One optimizer step:

1. Rollouts (hybridtron.post.rollout): `prompts_per_step` prompts drawn by the pass-rate curriculum, `group_size`
   (G = 16) completions each from the inference engine with MTP speculative drafts, graded by the environment;
   group advantages (z-score; leave-one-out and mean-only as options); dynamic sampling drops the groups whose
   rewards all agree and refills the step, with a cap on the extra rounds.
2. Weight hand-over: before each new batch is requested, the learner's weights go to the rollout engine
   (`HybridEngine.load_weights`). Synchronous (`grpo.async_rollouts = false`, the default): batch n + 1 is sampled
   after step n's update. Asynchronous (Ultra's one-step off-policy mode): batch n + 1 is sampled in another
   process (or Ray actor) while step n trains, with the weights step n started from; `grpo.staleness` bounds how
   many steps old those weights may be (1; 0 is the synchronous schedule run on the asynchronous machinery).
3. The learner (`GRPOObjective`, the same `Trainer` as pretraining and SFT): per micro-batch, the log-probs of the
   sampled completion tokens under the current policy at the rollout's temperature (and top-k / top-p, as the
   engine sampled them: `sampled_logprobs`), with routing replay (R3) forcing the rollout's experts in every
   backbone MoE layer while the gate weights come from the current router scores; then
   `hybridtron.post.losses.grpo_loss`: DAPO clip-higher (0.2 / 0.28), optional dual clip, k3 KL to the frozen
   initial model (whose log-probs a reference-scoring role adds to the rollouts: hybridtron.post.reference) and
   entropy bonus (both off by default, as the recipe), the rollout-vs-trainer correction
   w = exp(old_trainer - rollout) by TIS (clamp to [0, 2], the default) or IcePop, and token-mean aggregation
   normalised by the step's GLOBAL count of policy tokens (all micro-batches; under torchrun summed over
   data-parallel ranks), so `train.grad_accum` does not change the gradient.
4. The MTP loss stays on during RL (`grpo.mtp_loss_weight`, masked CE of the MTP depths on the completion tokens,
   as miles' `--enable-mtp-training`), so the drafter keeps up with the policy it drafts for.

One policy step per batch (no PPO epochs), as miles' Ultra recipe (rollout batch = global batch) and verl by
default: the "old" policy is the learner at the start of the step, and since no update happens within a step,
old = current detached. The ratio is therefore exactly 1 and the clip inactive (clip_fraction 0) on every token;
what the clip would bound, the drift between the sampling and the learning policy, is here the rollout engine's
numerical mismatch and, in asynchronous mode, the one-step staleness, and that is what the TIS / IcePop weight w
corrects. Several epochs over a batch would make the clip bite; they are not offered, because Ultra did not use
them and a one-step-stale batch already sits one update from the learner.

Rows whose group rewards all agree (when dynamic sampling is off, or could not refill) are kept out of the policy
loss altogether, tokens and count: they carry no signal, and counting their tokens would only dilute the others'.

Held-out evaluation (`HeldOutAccuracy`): pass@1 with greedy decoding on `grpo.eval_tasks` test-split tasks
(hybridtron.post.evaluate), at step 0, every `grpo.eval_every` steps and at the end.

The run directory (the rules of every training command: hybridtron.train.run):

    run_config.json   --model, --env and the resolved [model], [grpo], [train], [monitor]
    metrics.jsonl     one line per step: loss, policy_loss, mtp_loss_<d>, reward_mean/std/zero_share/one_share,
                      response_length, clip_fraction, ratio_mean, is_mismatch, is_out_of_bounds_share, entropy,
                      kl (to the initial model, with grpo.kl_coef > 0 or grpo.reference_kl), groups_trained/dropped,
                      rollout_tokens_per_s, mtp_acceptance_length, rollout_wait_s, policy_staleness, tokens_per_s,
                      ...; pass_at_1 (and per level) on evaluation steps
    events.jsonl      the stability monitor's detections and actions
    checkpoints/      DCP checkpoints (the rollout side's curriculum and in-flight batches included)
    hf/               the trained policy: config.json, safetensors, tokenizer files with the chat template

This module's top-level imports stay light (the CLI builds its parser from it); torch loads when a run starts.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from hybridtron.config import ModelConfig
from hybridtron.dist.config import DistConfig
from hybridtron.post.roles import BACKENDS, check_replicas

if TYPE_CHECKING:  # imported with torch, when a run starts
    from hybridtron.train.config import TrainConfig
    from hybridtron.train.monitor.config import MonitorConfig

# [train] defaults of GRPO over pretraining's: a small constant LR after a short warmup (RL recipes decay nothing),
# 4 micro-batches a step, a checkpoint every 20 steps; the rest (AdamW, clipping at 1.0, fp32) is pretraining's.
# train.val_every does not apply: GRPO has no validation loss; its held-out pass@1 runs every grpo.eval_every.
GRPO_TRAIN = dict(steps=100, lr=1e-4, warmup_steps=5, decay_fraction=0.0, grad_accum=4, checkpoint_every=20)
MODEL_FIXED = "the model is fixed by --model (its config.json); GRPO trains the weights, not the architecture"
THINKING = {"auto": None, "on": True, "off": False}  # the generation prompt's thinking switch (and MOPD's)
LOGP_FLOOR = -50.0  # a sampled token the learner's top-k / top-p would have filtered out: log-prob floored here


@dataclass(frozen=True, kw_only=True)
class GRPOConfig:
    """The `[grpo]` section: rollouts, asynchrony, dynamic sampling, curriculum, the loss and the evaluation."""

    # rollouts
    group_size: int = 16  # G completions per prompt (Ultra: 16)
    prompts_per_step: int = 8  # prompts per optimizer step: up to prompts_per_step x G rollouts a step
    task_pool: int = 2000  # training-split tasks drawn from the environment once; the curriculum samples among them
    levels: tuple[int, ...] = ()  # the environment's difficulty levels; empty = its default (all)
    temperature: float = 1.0  # sampling temperature of the rollouts (the learner's log-probs use the same)
    top_p: float = 1.0  # nucleus filter of the rollouts (1 = off; the learner renormalises over the same nucleus)
    top_k: int = 0  # top-k filter of the rollouts (0 = off)
    max_new_tokens: int = 128  # completion length cap; a completion cut there is graded as it stands
    thinking: str = "auto"  # the generation prompt's thinking switch: auto (the model decides), on, off
    routing_replay: bool = True  # R3: record the rollout's experts and force them in the learner's forward
    speculative: bool = True  # MTP speculative drafts in the rollouts (the output distribution is unchanged)
    draft_length: int = 3  # tokens drafted per verification step (Ultra measured 1.46x at k = 5 on its scale)
    # dynamic sampling (DAPO)
    dynamic_sampling: bool = True  # drop groups whose rewards all agree and refill the step with new prompts
    max_refill_rounds: int = 2  # extra generation rounds a step may take to refill
    # curriculum: weight exp(-(p - target)^2 / (2 sigma^2)) on each prompt's running pass-rate estimate p
    curriculum: bool = True  # false: prompts drawn uniformly
    curriculum_target: float = 0.5  # the pass rate the curriculum steers towards
    curriculum_sigma: float = 0.2  # width of the Gaussian
    curriculum_ema: float = 0.5  # weight of a new group's pass rate in a prompt's estimate
    # asynchrony
    async_rollouts: bool = False  # true: rollouts in another process, overlapping training (one step off-policy)
    staleness: int = 1  # async: batch n is sampled with the weights after step n - 1 - staleness (0 = synchronous)
    rollout_backend: str = "process"  # async: process (torch.multiprocessing) or ray (the rl extra); inline: tests
    rollout_threads: int = 1  # async: torch threads of each rollout process (0 = torch's default)
    rollout_replicas: int = 1  # async: rollout processes (or Ray actors), each generating a share of every step
    # the loss (hybridtron.post.losses.GRPOLossConfig)
    eps_clip: float = 0.2  # ratio clipped to [1 - eps_clip, 1 + eps_clip_high] (DAPO clip-higher)
    eps_clip_high: float = 0.28
    dual_clip: float | None = None  # none, or c > 1: the loss of A < 0 tokens capped at -c A (3 in Ye et al.)
    kl_coef: float = 0.0  # weight of the k3 KL to the frozen initial model (0 in the recipe; > 0 adds its role)
    reference_kl: bool = False  # log `kl` (k3 to the frozen initial model) even with kl_coef = 0: how far the
    #   policy has moved; costs the reference-scoring role (a copy of the model, one no-grad forward a rollout)
    reference_batch_size: int = 16  # rollouts per forward of the reference-scoring role
    entropy_coef: float = 0.0  # weight of the entropy bonus (0 in the recipe)
    advantage_mode: str = "zscore"  # zscore (GRPO), leave_one_out (RLOO, NeMo-RL), mean_only (Dr.GRPO)
    advantage_eps: float = 1e-6  # z-score: A = (r - mean) / (std + eps)
    correction: str = "tis"  # rollout-vs-trainer weight w: tis (multiply by clamp(w)), icepop (mask), none
    correction_level: str = "token"  # token, or sequence (the geometric mean of w over the completion)
    tis_low: float = 0.0  # TIS: clamp(w, tis_low, tis_high) (miles: [0, 2]; NeMo-RL's Ultra config: [0.2, 5])
    tis_high: float = 2.0
    icepop_low: float = 0.5  # IcePop: tokens with w outside [icepop_low, icepop_high] dropped
    icepop_high: float = 2.0
    aggregation: str = "token_mean"  # token_mean (DAPO, the default) or sequence_mean (the GRPO paper)
    mtp_loss_weight: float = 0.1  # MTP CE on the completions, so the drafter follows the policy (0 = off)
    # held-out evaluation: greedy pass@1 on the environment's test split
    eval_tasks: int = 200  # 0 = no evaluation
    eval_every: int = 10  # steps between evaluations (and at step 0 and the end)
    eval_max_tokens: int = 128  # completion length cap of the evaluation
    eval_batch_size: int = 64  # prompts decoded together
    seed: int = 0  # the task pool, the prompt draws and the sampling of every step

    @property
    def enable_thinking(self) -> bool | None:
        return THINKING[self.thinking]

    @property
    def uses_reference(self) -> bool:
        """The k3 KL to the frozen initial model is computed (trained on, or only logged): the reference role runs."""
        return self.kl_coef > 0 or self.reference_kl

    def loss_config(self):
        from hybridtron.post.losses import GRPOLossConfig

        values = {f.name: getattr(self, f.name) for f in fields(GRPOLossConfig)}
        try:
            return GRPOLossConfig(**values)
        except ValueError as exc:  # name the section: "grpo.tis_low / grpo.tis_high must ..."
            raise ValueError(f"grpo: {exc}") from None

    def sampling_params(self, seed: int):
        from hybridtron.infer.sampling import SamplingParams

        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed,
                              max_tokens=self.max_new_tokens)

    def validate(self) -> None:
        for name in ("prompts_per_step", "max_new_tokens", "draft_length", "eval_every", "eval_max_tokens",
                     "eval_batch_size", "reference_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"grpo.{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"grpo.group_size must be >= 2 (a group's advantages need a baseline), got "
                             f"{self.group_size}")
        if self.task_pool < self.prompts_per_step:
            raise ValueError(f"grpo.task_pool ({self.task_pool}) must be at least grpo.prompts_per_step "
                             f"({self.prompts_per_step})")
        for name in ("max_refill_rounds", "staleness", "rollout_threads", "eval_tasks", "top_k"):
            if getattr(self, name) < 0:
                raise ValueError(f"grpo.{name} must be >= 0, got {getattr(self, name)}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"grpo.temperature must be > 0 (GRPO samples; greedy rollouts would all agree), got "
                             f"{self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"grpo.top_p must be in (0, 1], got {self.top_p}")
        if self.thinking not in THINKING:
            raise ValueError(f"grpo.thinking must be one of {', '.join(THINKING)}, got {self.thinking!r}")
        if self.rollout_backend not in BACKENDS:
            raise ValueError(f"grpo.rollout_backend must be one of {', '.join(BACKENDS)}, got "
                             f"{self.rollout_backend!r}")
        check_replicas("grpo", {"rollout_replicas": self.rollout_replicas}, async_rollouts=self.async_rollouts,
                       backend=self.rollout_backend)
        if not 0 <= self.curriculum_target <= 1:
            raise ValueError(f"grpo.curriculum_target must be in [0, 1], got {self.curriculum_target}")
        if not self.curriculum_sigma > 0:
            raise ValueError(f"grpo.curriculum_sigma must be > 0, got {self.curriculum_sigma}")
        if not 0 < self.curriculum_ema <= 1:
            raise ValueError(f"grpo.curriculum_ema must be in (0, 1], got {self.curriculum_ema}")
        if not (self.mtp_loss_weight >= 0 and math.isfinite(self.mtp_loss_weight)):
            raise ValueError(f"grpo.mtp_loss_weight must be >= 0, got {self.mtp_loss_weight}")
        if any(level < 1 for level in self.levels):
            raise ValueError(f"grpo.levels must be positive difficulty levels, got {list(self.levels)}")
        self.loss_config()

    def env_options(self) -> dict:
        return {"levels": self.levels} if self.levels else {}


@dataclass(frozen=True, kw_only=True)
class GRPORunConfig:
    """What `hybridtron grpo` runs: the policy and environment as given on the command line, and the sections."""

    base_model: str  # --model: an HF checkpoint directory with tokenizer files (the SFT model)
    env: str  # --env: a registered environment (hybridtron.post.envs)
    model: ModelConfig  # the checkpoint's config.json (read-only)
    grpo: GRPOConfig
    train: TrainConfig
    monitor: MonitorConfig
    dist: DistConfig = DistConfig()  # the learner's layout under torchrun (hybridtron.dist; pretraining's [dist])

    def sections(self) -> dict:
        return {"grpo": self.grpo, "train": self.train, "monitor": self.monitor, "dist": self.dist}

    def to_dict(self) -> dict:
        from hybridtron.train.config import _plain

        return {"base_model": self.base_model, "env": self.env, "model": self.model.to_hf(),
                **{name: _plain(section) for name, section in self.sections().items()}}

    def save(self, path: str | Path) -> None:
        from hybridtron.files import atomic_write_json

        atomic_write_json(path, self.to_dict())

    def to_toml(self) -> str:
        """[grpo], [train], [monitor] and [dist] as TOML that `--config` reads back; [model] is the checkpoint's."""
        from hybridtron.train.run import sections_toml

        return (f"# hybridtron grpo --model {self.base_model} --env {self.env}\n"
                f"# [model] is {self.base_model}/config.json, fixed by --model\n\n" + sections_toml(self.sections()))

    @classmethod
    def load(cls, path: str | Path) -> "GRPORunConfig":
        from hybridtron.train.config import TrainConfig, _build, read_run_config
        from hybridtron.train.monitor.config import MonitorConfig

        raw = read_run_config(path, ("base_model", "env", "model", "grpo", "train"), "a GRPO run")
        return cls(base_model=raw["base_model"], env=raw["env"], model=ModelConfig.from_hf(raw["model"]),
                   grpo=_build(GRPOConfig, raw["grpo"], "grpo"), train=_build(TrainConfig, raw["train"], "train"),
                   monitor=_build(MonitorConfig, raw.get("monitor", {}), "monitor"),
                   dist=_build(DistConfig, raw.get("dist", {}), "dist"))


def default_sections() -> dict:
    from hybridtron.train.config import TrainConfig
    from hybridtron.train.monitor.config import MonitorConfig

    return {"grpo": GRPOConfig(), "train": TrainConfig(**GRPO_TRAIN), "monitor": MonitorConfig(), "dist": DistConfig()}


def resolve_config(args) -> GRPORunConfig:
    """defaults (or, with --resume, the run's saved config; or a run's run_config.json as --config) <- the TOML
    file <- --set overrides <- --steps. [model] is read from --model and cannot be set. The environment must be
    registered, and a fault that corrupts batches cannot be injected (GRPO's batches are rollouts, not token
    rows)."""
    from hybridtron.post.envs import env_names
    from hybridtron.train.run import saved_config_file

    toml_path, base = args.config, None
    if args.resume:
        base = GRPORunConfig.load(saved_config_file(args))
        if args.model is not None and Path(args.model).resolve() != Path(base.base_model).resolve():
            raise ValueError(f"--resume: --model {args.model} is not the run's ({base.base_model}, in "
                             f"{args.out}/run_config.json); resume with the run's model, or start a new run")
        if args.env is not None and args.env != base.env:
            raise ValueError(f"--resume: --env {args.env} is not the run's ({base.env}); resume with the run's "
                             f"environment, or start a new run in another --out")
        base_model, env = base.base_model, base.env
    else:
        for flag, value in (("--model", args.model), ("--env", args.env)):
            if not value:
                raise ValueError(f"{flag} is required (see hybridtron grpo --help)")
        base_model, env = args.model, args.env
        if toml_path is not None and Path(toml_path).suffix == ".json":  # a run's own run_config.json
            if not Path(toml_path).is_file():
                raise FileNotFoundError(f"{toml_path}: config file not found")
            base, toml_path = GRPORunConfig.load(toml_path), None
    if ":" not in env and env not in env_names():
        raise ValueError(f"--env {env}: unknown environment; known: {', '.join(env_names())} (or module.path:Class "
                         f"for your own)")
    model = ModelConfig.from_hf(base_model)
    if args.resume and model != base.model:
        raise ValueError(f"--resume: {base_model}/config.json changed since the run started; the run trains the "
                         f"model it began with (see {args.out}/run_config.json)")
    sections = rollout_run_sections(base.sections() if base is not None else default_sections(), toml_path, args,
                                    MODEL_FIXED, "GRPO")
    return GRPORunConfig(base_model=base_model, env=env, model=model, **sections)


def rollout_run_sections(base: dict, toml_path, args, model_fixed: str, what: str) -> dict:
    """The sections of an RL command (GRPO, MOPD): `base` <- the TOML file <- --set <- --steps, [model] fixed
    (`model_fixed` says why); a fault that corrupts batches cannot be injected (the batches are rollouts, not token
    rows)."""
    from hybridtron.train.run import merge_sections, step_overrides

    sections = merge_sections(base, toml_path, step_overrides(args), fixed={"model": model_fixed})
    if "corrupt_batch" in sections["monitor"].inject_fault:
        raise ValueError(f"monitor.inject_fault: corrupt_batch garbles token rows, and {what}'s batches are "
                         "rollouts; inject lr_spike, nan_grad or router_bias instead")
    return sections


# ---------------------------------------------------------------------------------------------- the loss
def sampled_logprobs(logits_BTV, tokens_BT, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """log p(token) [B, T] under the distribution the rollout engine sampled from: the logits divided by the
    temperature, then top-k and top-p filtered and renormalised (`hybridtron.infer.sampling.probs_from_logits`,
    whose kept set is used here as a constant mask), in fp32, differentiable. Positions whose token is negative
    (IGNORE_INDEX) get a finite value that callers mask out. With a filter, a token outside the learner's own kept
    set (the two engines' logits differ slightly) would be -inf: it is floored at LOGP_FLOOR, where its IS weight
    w ~ 0 drops it, and gets no gradient."""
    import torch

    from hybridtron.infer.sampling import probs_from_logits

    scaled = logits_BTV.float() / temperature
    filtered = top_k > 0 or top_p < 1.0
    if filtered:
        with torch.no_grad():
            kept = probs_from_logits(logits_BTV.detach(), temperature, top_k, top_p) > 0
        scaled = scaled.masked_fill(~kept, -math.inf)
    logp = torch.log_softmax(scaled, dim=-1).gather(-1, tokens_BT.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logp.clamp(min=LOGP_FLOOR) if filtered else logp


class RolloutObjective:
    """What the objectives on rollouts (GRPO's, MOPD's) share: their config (`loss_config()`, `mtp_loss_weight`), the
    MTP depths trained (none with the MTP loss off), and the step's global counts that every micro-batch's loss is
    normalised by (`begin_step`: `row_counts(mb)` of each micro-batch, then each MTP depth's targets, summed over the
    step and, under torchrun, over the data-parallel ranks). `data_ranks`: the metrics every rank holds whole are
    divided by it, since the trainer sums the ranks' metrics. A micro-batch's loss is `loss_from_outputs` of the
    learner's forward with routing replay (`__call__`), or under PP of the last stage's outputs (`stage_inputs`:
    what the stages read)."""

    def __init__(self, config, mtp_depths: int, parallel=None):
        self.config, self.loss_config = config, config.loss_config()
        self.mtp_depths = mtp_depths if config.mtp_loss_weight > 0 else 0
        self.data_sum = parallel.sum_over_data if parallel is not None else None
        self.data_ranks = parallel.layout.dp * parallel.layout.cp if parallel is not None else 1  # sum_over_data's
        self.counts: list[float] = []  # row_counts' values, then the MTP targets of each depth
        self.micro_batches = 1

    def row_counts(self, mb) -> list:
        raise NotImplementedError

    def begin_step(self, micro_batches) -> None:
        import torch

        from hybridtron.ops.cross_entropy import IGNORE_INDEX

        rows = [self.row_counts(mb) + [(mb.mtp_targets(d) != IGNORE_INDEX).sum()
                                       for d in range(1, self.mtp_depths + 1)] for mb in micro_batches]
        device = micro_batches[0].labels.device  # a collective's tensor lives on the run's device (NCCL: CUDA)
        counts = torch.tensor([[float(x) for x in row] for row in rows], dtype=torch.float64, device=device).sum(dim=0)
        if self.data_sum is not None:
            counts = self.data_sum(counts)
        self.counts = counts.tolist()
        self.micro_batches = len(micro_batches)

    def stage_inputs(self, mb):
        """Under PP: what the stages read of a micro-batch of rollouts: its ids (and under CP the ids after the
        share), the rollout's experts to replay, its real tokens (the positions whose routing counts)."""
        import torch

        from hybridtron.dist.pipeline import MicroBatchInputs

        following = [] if mb.following_ids is None else [mb.following_ids]
        return MicroBatchInputs(torch.cat([mb.input_ids, *following], dim=1), tokens=int(mb.valid.sum()),
                                lookahead=following[0].shape[1] if following else 0,
                                expert_ids=mb.expert_ids if self.config.routing_replay else None,
                                counted=mb.counted)

    def forward(self, model, mb):
        """The learner's forward on a micro-batch of rollouts, with routing replay: (logits, *MTP logits), counts."""
        from hybridtron.post.rollout import rollout_router_counts

        replay = mb.expert_ids if self.config.routing_replay else None
        out = model(mb.input_ids, expert_ids=replay, mtp=self.mtp_depths > 0, following_ids=mb.following_ids,
                    counted=mb.counted)
        return (out.logits, *out.mtp_logits), rollout_router_counts(model, out)

    def __call__(self, model, mb):
        outputs, counts = self.forward(model, mb)
        return self.loss_from_outputs(model, outputs, mb, counts)


class GRPOObjective(RolloutObjective):
    """The GRPO loss of a micro-batch of rollouts (`hybridtron.post.rollout.RolloutMicroBatch`), as a `Trainer`
    objective; see the module docstring.

    The k3 KL to the frozen initial model (kl_coef > 0, or only logged: reference_kl) reads its log-probs from the
    rollouts' `scores["reference"]` (the reference-scoring role, hybridtron.post.reference). `parallel` (a sharded
    learner, hybridtron.dist): see RolloutObjective. `mtp_depths`: the model's.

    Metrics, each the step's value: loss, policy_loss, mtp_loss_<d>; over the policy tokens: clip_fraction,
    ratio_mean, kl (with a reference); over every completion token (the engines' agreement and the policy's
    spread do not depend on the advantages): is_mismatch (mean |log w|), is_out_of_bounds_share (the share TIS
    truncates / IcePop drops), entropy; policy_tokens; and the rollout statistics of the batch."""

    headline = ("reward_mean", "reward")

    def __init__(self, config: GRPOConfig, mtp_depths: int, *, parallel=None):
        super().__init__(config, mtp_depths, parallel)

    def row_counts(self, mb) -> list:
        """completion tokens, policy tokens, policy sequences"""
        mask = mb.policy_mask
        return [mb.completion_mask.sum(), mask.sum(), mask.any(dim=1).sum()]

    def policy_logprobs(self, model, mb):
        """(the model's outputs (logits, *MTP logits), log-probs [B, L] of the labels) of one micro-batch, with
        routing replay."""
        outputs, _ = self.forward(model, mb)
        cfg = self.config
        return outputs, sampled_logprobs(outputs[0], mb.labels, cfg.temperature, cfg.top_k, cfg.top_p)

    def loss_from_outputs(self, model, outputs, mb, expert_counts=None):
        """The GRPO loss and metrics of a micro-batch from the learner's (logits, *MTP logits) (a pipeline's last
        stage calls it; the expert counts are then the pipeline's)."""
        import torch

        from hybridtron.post.losses import (grpo_loss, masked_mean, mismatch_metrics, rollout_correction,
                                            token_entropy)
        from hybridtron.post.reference import REFERENCE_SCORE
        from hybridtron.post.sft import sft_loss
        from hybridtron.train.objectives import ObjectiveOutput

        cfg, loss_cfg = self.config, self.loss_config
        logits, *mtp_logits = outputs
        logp = sampled_logprobs(logits, mb.labels, cfg.temperature, cfg.top_k, cfg.top_p)
        mask, completion = mb.policy_mask, mb.completion_mask
        tokens, global_tokens = float(mask.sum()), self.counts[1]
        # the loss's divisor: the step's policy tokens (token_mean) or sequences (sequence_mean)
        global_policy = self.counts[2] if loss_cfg.aggregation == "sequence_mean" else global_tokens
        ref_logp = None
        if cfg.uses_reference:
            if REFERENCE_SCORE not in mb.scores:
                raise ValueError(f"grpo.kl_coef={cfg.kl_coef}, grpo.reference_kl={cfg.reference_kl}: the KL needs the "
                                 f"reference's log-probs, but the rollouts carry no scores[{REFERENCE_SCORE!r}] "
                                 f"(the reference-scoring role adds them: hybridtron.post.reference)")
            ref_logp = mb.scores[REFERENCE_SCORE]
        with torch.set_grad_enabled(torch.is_grad_enabled() and loss_cfg.entropy_coef > 0):
            entropy = token_entropy(logits.float() / cfg.temperature)
        rollout_logp = mb.rollout_logprobs  # with correction "none" the mismatch is still logged
        if global_policy > 0:
            # one policy step per batch: the "old" policy is the learner before this step's update, i.e. now
            policy_loss, policy_metrics = grpo_loss(logp, logp.detach(), mb.advantages, mask, global_policy,
                                                    loss_cfg, rollout_logp=rollout_logp, ref_logp=ref_logp,
                                                    entropy=entropy)
        else:  # every group of the step agreed: no policy gradient (the MTP loss may still train)
            policy_loss = logp.sum() * 0.0
            _, policy_metrics = grpo_loss(logp.detach(), logp.detach(), mb.advantages, mask, 1.0, loss_cfg,
                                          rollout_logp=rollout_logp, ref_logp=ref_logp, entropy=entropy)
        loss = policy_loss
        mtp_losses = [sft_loss(depth_logits, mb.mtp_targets(depth), self.counts[2 + depth])
                      for depth, depth_logits in enumerate(mtp_logits[:self.mtp_depths], start=1)]
        if mtp_losses:
            loss = loss + cfg.mtp_loss_weight * torch.stack(mtp_losses).mean()
        # the trainer logs the mean over micro-batches of each metric: scale each share by their number
        # (the rollout-vs-trainer mismatch and the entropy over every completion token, the rest over the policy's)
        scale, share = self.micro_batches, tokens / global_tokens if global_tokens > 0 else 0.0
        completion_share = float(completion.sum()) / self.counts[0]
        low, high = (loss_cfg.tis_low, loss_cfg.tis_high) if loss_cfg.correction != "icepop" else \
            (loss_cfg.icepop_low, loss_cfg.icepop_high)
        _, out_of_bounds = rollout_correction(logp.detach(), rollout_logp, completion,
                                              "icepop" if loss_cfg.correction == "icepop" else "tis", low, high,
                                              loss_cfg.correction_level)
        engine_metrics = {**mismatch_metrics(logp.detach(), rollout_logp, completion, out_of_bounds),
                          "entropy": masked_mean(entropy, completion)}
        metrics = {"loss": loss.detach() * scale, "policy_loss": policy_loss.detach() * scale,
                   **{f"mtp_loss_{d}": m.detach() * scale for d, m in enumerate(mtp_losses, start=1)},
                   **{key: value.float() * share * scale for key, value in policy_metrics.items()
                      if key not in engine_metrics},
                   **{key: value.float() * completion_share * scale for key, value in engine_metrics.items()},
                   "policy_tokens": torch.tensor(global_tokens / self.data_ranks, dtype=torch.float32)}
        metrics.update({key: torch.tensor(float(value) / self.data_ranks) for key, value in mb.stats.items()})
        return ObjectiveOutput(loss, metrics, int(mb.valid.sum()), expert_counts or {})


# --------------------------------------------------------------------------------------------- evaluation
class PolicySnapshot:
    """The learner's policy as one unsharded model that the decoder can run: the trainer's model itself in one
    process; under torchrun a full copy on global rank 0 (None on the other ranks), refreshed from the shards by a
    gathering every rank joins."""

    def __init__(self):
        self.copy = None

    def __call__(self, trainer):
        if trainer.parallel is None:
            return trainer.model
        from hybridtron.dist.step import full_state_dict
        from hybridtron.model.lm import HybridLM

        state = full_state_dict(trainer.model, trainer.parallel)
        if state is None:
            return None
        if self.copy is None:  # on the run's device (the gathered tensors arrive on the CPU)
            self.copy = HybridLM(trainer.model.config, init=False).to(trainer.parallel.device)
        self.copy.load_state_dict(state)
        return self.copy


def evaluate_on_main(trainer, snapshot: PolicySnapshot, evaluate) -> dict[str, float]:
    """`evaluate(model)` on the policy (`snapshot`), on global rank 0 under torchrun, its values on every rank."""
    model = snapshot(trainer)
    was_training = model.training if model is not None else False
    values = evaluate(model) if model is not None else None
    if model is not None:
        model.train(was_training)
    return values if trainer.parallel is None else trainer.parallel.broadcast_object(values)


class HeldOutAccuracy:
    """An evaluator (hybridtron.train.evaluate): greedy pass@1 of the learner on fixed test-split tasks
    (`hybridtron.post.evaluate.evaluate_env`), overall and per difficulty level, plus the mean reward and
    completion length. Its history is the run's pass@1 curve."""

    key = "pass_at_1"

    def __init__(self, env, tasks, tokenizer, every: int, *, max_tokens: int, batch_size: int,
                 enable_thinking: bool | None):
        self.env, self.tasks, self.tokenizer, self.every = env, tasks, tokenizer, every
        self.max_tokens, self.batch_size, self.enable_thinking = max_tokens, batch_size, enable_thinking
        self.history: list[tuple[int, float]] = []
        self.snapshot = PolicySnapshot()

    def due(self, step: int, total_steps: int) -> bool:
        return step % self.every == 0 or step == total_steps

    def measure(self, model) -> dict[str, float]:
        """The metrics of one unsharded `model` (put in eval mode)."""
        from hybridtron.post.evaluate import evaluate_env

        result = evaluate_env(model, self.tokenizer, self.env, self.tasks, max_tokens=self.max_tokens,
                              batch_size=self.batch_size, enable_thinking=self.enable_thinking)
        return {self.key: result.pass_at_1, "eval_mean_reward": result.mean_reward,
                "eval_response_length": result.mean_completion_tokens,
                **{f"pass_at_1/L{level}": value for level, value in result.by_difficulty.items()}}

    def evaluate(self, trainer) -> dict[str, float]:
        values = evaluate_on_main(trainer, self.snapshot, self.measure)
        self.history.append((trainer.step, values[self.key]))
        return values

    def state_dict(self):
        return {"history": list(self.history)}

    def load_state_dict(self, state):
        self.history = [tuple(x) for x in state["history"]]


# ------------------------------------------------------------------------------------------------- the run
@dataclass
class RunParts:
    """What a GRPO or MOPD run holds besides the trainer, closed when the run ends."""

    tokenizer: object
    rollouts: object  # RolloutBatches
    eval_env: object | None

    def close(self) -> None:
        self.rollouts.close()
        if self.eval_env is not None:
            self.eval_env.close()


def micro_batch_shape(config: GRPORunConfig) -> tuple[int, int]:
    """(rows, positions) of a micro-batch at most: a step's rollouts over grad_accum micro-batches, each a prompt
    (128 tokens budgeted) plus its completion."""
    grpo = config.grpo
    rows = -(-grpo.prompts_per_step * grpo.group_size // config.train.grad_accum)
    return rows, min(config.model.max_position_embeddings, 128 + grpo.max_new_tokens)


def build_trainer(config: GRPORunConfig, out: Path, checkpoints, *, quiet: bool, stream=None):
    """The GRPO run of `config` in `out`: the policy of --model, its rollout pipeline, the objective, the
    held-out evaluation, the trainer. Returns (trainer, RunParts)."""
    import torch

    from hybridtron.checkpoint import load_pretrained
    from hybridtron.data.chat import load_chat_tokenizer
    from hybridtron.post.reference import ReferenceScoringRole
    from hybridtron.post.roles import RoleSpec, WorkShare
    from hybridtron.post.rollout import (RolloutBatches, RolloutRole, learner_layout, load_env,
                                         rollout_pipeline_factory)
    from hybridtron.train.run import assemble_trainer, prepare_process, start_parallel

    stream = sys.stderr if stream is None else stream
    train, grpo = config.train, config.grpo
    model_config = config.model
    rows, seq_len = micro_batch_shape(config)
    # under torchrun: every rank trains on its rows of each micro-batch; the rollouts are split over the ranks
    # (inline roles) or run on rank 0 (roles in processes or Ray actors): RolloutBatches
    parallel = start_parallel(config.dist, model_config, **learner_layout(
        config.dist, model_config, grpo, rows=rows, seq_len=seq_len, grad_accum=config.train.grad_accum,
        what="GRPO"))
    quiet = quiet or (parallel is not None and not parallel.is_main)
    tokenizer = load_chat_tokenizer(config.base_model, vocab_size=model_config.vocab_size)
    prepare_process(train, model_config, rows * seq_len, stream)

    model = load_pretrained(config.base_model, config=model_config, dtype=torch.float32)
    async_mode = grpo.async_rollouts
    staleness = grpo.staleness if async_mode else 0
    backend = grpo.rollout_backend if async_mode else "inline"
    shared = parallel is not None and backend == "inline"  # every rank generates its share of each step's prompts
    threads, share = grpo.rollout_threads if backend != "inline" else 0, WorkShare() if shared else None
    specs = [RoleSpec(RolloutRole, dict(model_dir=str(config.base_model), model_config=model_config, env=config.env,
                                        env_options=grpo.env_options(), config=grpo, threads=threads, share=share),
                      replicas=grpo.rollout_replicas)]
    if grpo.uses_reference:  # the frozen initial policy scores the rollouts for the KL
        specs.append(RoleSpec(ReferenceScoringRole, dict(model_dir=str(config.base_model), model_config=model_config,
                                                         config=grpo, threads=threads, share=share)))
    rollouts = RolloutBatches(rollout_pipeline_factory(specs, backend, staleness), staleness=staleness,
                              grad_accum=train.grad_accum, pad_id=model_config.pad_token_id or 0, parallel=parallel,
                              shared=shared)
    evaluators, eval_env = [], None
    if grpo.eval_tasks:
        eval_env = load_env(config.env, **grpo.env_options())
        tasks = eval_env.tasks("test", grpo.eval_tasks, grpo.seed)
        evaluators.append(HeldOutAccuracy(eval_env, tasks, tokenizer, grpo.eval_every, max_tokens=grpo.eval_max_tokens,
                                          batch_size=grpo.eval_batch_size, enable_thinking=grpo.enable_thinking))
    objective = GRPOObjective(grpo, model_config.mtp_depths, parallel=parallel)
    trainer = assemble_trainer(model, objective, rollouts, evaluators, train=train, monitor_config=config.monitor,
                               out=out, checkpoints=checkpoints, quiet=quiet, stream=stream, parallel=parallel)
    return trainer, RunParts(tokenizer, rollouts, eval_env)


def check_inputs(config: GRPORunConfig) -> None:
    """Before anything is written: the layout runs here, the model has a chat tokenizer, and the environment builds
    with its options."""
    from hybridtron.data.chat import load_chat_tokenizer
    from hybridtron.post.rollout import learner_layout, load_env

    rows, seq_len = micro_batch_shape(config)
    learner_layout(config.dist, config.model, config.grpo, rows=rows, seq_len=seq_len,
                   grad_accum=config.train.grad_accum, what="GRPO")

    load_chat_tokenizer(config.base_model, vocab_size=config.model.vocab_size, require_template=True)
    try:
        load_env(config.env, **config.grpo.env_options()).close()
    except TypeError as exc:  # the environment's constructor takes no levels
        raise ValueError(f"--env {config.env}: grpo.levels={list(config.grpo.levels)}, but it takes no levels "
                         f"({exc})") from None
    except ValueError as exc:
        raise ValueError(f"--env {config.env}: {exc}") from None
    if config.grpo.max_new_tokens + 2 > config.model.max_position_embeddings:
        raise ValueError(f"grpo.max_new_tokens={config.grpo.max_new_tokens} leaves no room for a prompt in the "
                         f"model's {config.model.max_position_embeddings} positions")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hybridtron.train.run import add_run_arguments

    parser.add_argument("--model", help="the policy to train: an HF checkpoint directory with its tokenizer files "
                                        "and chat template (e.g. runs/sft/hf; required unless --resume)")
    parser.add_argument("--env", help="the environment that grades the rollouts: math, code, or module.path:Class "
                                      "for your own (required unless --resume)")
    add_run_arguments(parser, sections="[grpo], [train], [monitor] and [dist]", default_steps=GRPO_TRAIN["steps"],
                      set_example="--set grpo.group_size=8 --set grpo.async_rollouts=true",
                      config_default="GRPO's defaults", quiet_help="no progress bar")


def run(args) -> int:
    from hybridtron.train.run import finish_run, pass_at_1_line, train_in_run_dir

    config = resolve_config(args)
    if args.print_config:
        print(config.to_toml(), end="")
        return 0
    check_inputs(config)
    built: list[RunParts] = []

    def build(out, checkpoints):
        trainer, parts = build_trainer(config, out, checkpoints, quiet=args.quiet)
        built.append(parts)
        return trainer, parts

    try:
        result = train_in_run_dir(args, config, GRPORunConfig.load, build)
    finally:
        for parts in built:
            parts.close()
    if result is None:  # the run in --out was already complete
        return 0
    trainer, parts = result
    finish_run(trainer, Path(args.out), parts.tokenizer, config.model.max_position_embeddings, pass_at_1_line)
    return 0
