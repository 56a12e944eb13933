"""`hybridtron grpo`: reinforcement learning with verifiable rewards (GRPO), as Nemotron 3 Ultra's RLVR stage ran it.

One optimizer step:

1. Rollouts (hybridtron.post.rl.rollout): `prompts_per_step` prompts drawn by the pass-rate curriculum, `group_size`
   (G = 16) completions each from the inference engine with MTP speculative drafts, graded by the environment;
   group advantages (z-score; leave-one-out and mean-only as options); dynamic sampling drops the groups whose
   rewards all agree and refills the step, with a cap on the extra rounds.
2. Weight hand-over: after every optimizer step the trainer hands the learner's weights to the rollout role
   (`sync_weights`, the loop's last step; the role loads them with `HybridEngine.load_weights`), followed by the
   request for the next batch. Synchronous (`grpo.async_rollouts = false`, the default): batch n + 1 is sampled
   after step n's update. Asynchronous (Ultra's one-step off-policy mode): batch n + 1 is sampled in another
   process (or Ray actor) while step n trains, with the weights step n started from; `grpo.staleness` bounds how
   many steps old those weights may be (1; 0 is the synchronous schedule run on the asynchronous machinery).
3. The learner (`GRPOObjective`, the same `Trainer` as pretraining and SFT): per micro-batch, the log-probs of the
   sampled completion tokens under the current policy at the rollout's temperature (and top-k / top-p, as the
   engine sampled them: `sampled_logprobs`, `grpo.logprob_chunk` rows at a time through lm_head, never the
   [tokens, vocab] logits: hybridtron.post.rl.objective), with routing replay (R3) forcing the rollout's experts in
   every backbone MoE layer while the gate weights come from the current router scores; then
   `hybridtron.post.losses.grpo_loss`: DAPO clip-higher (0.2 / 0.28), optional dual clip, k3 KL to the frozen
   initial model (whose log-probs a reference-scoring role adds to the rollouts: hybridtron.post.reference) and
   entropy bonus (both off by default, as the recipe), the rollout-vs-trainer correction
   w = exp(old_trainer - rollout) by TIS (clamp to [0, 2], the default) or IcePop, and token-mean aggregation
   normalised by the step's GLOBAL count of policy tokens (all micro-batches; under torchrun summed over
   data-parallel ranks), so `train.grad_accum` does not change the gradient.
4. The MTP loss stays on during RL (`grpo.mtp_loss_weight`, masked CE of the MTP depths on the completion tokens,
   as miles' `--enable-mtp-training`), so the drafter keeps up with the policy it drafts for.

Optimizer steps per rollout batch (`grpo.global_batch`, `grpo.epochs`; shared with MOPD: hybridtron.post.rl.config).
By default one, as verl's defaults (rollout batch = mini-batch, one epoch): the "old" policy is the learner at the
start of the step and, no update happening within a step, old = current detached, so the ratio is exactly 1 and the
clip idle (clip_fraction 0) on every token; what drifts between the sampling and the learning policy is then the
rollout engine's numerics and, asynchronously, the staleness, which the TIS / IcePop weight w corrects. With
`global_batch` < the rollout batch's rows (miles' Ultra recipe: 32 x 8 = 256 rollouts, 128 a step,
configs/grpo_miles.toml) or `epochs` > 1, a rollout batch trains over rows / global_batch x epochs steps against
old log-probs the learner computed before the batch's first update (one no-grad forward, fixed for all of its
steps, `RolloutBatches`): the first step's ratio is 1, every later one is off-policy by the updates since, and the
clip (0.2 / 0.28) bounds them. The weights go to the rollout role after a rollout batch's last step.

Rows whose group rewards all agree (when dynamic sampling is off, or could not refill) are kept out of the policy
loss altogether, tokens and count: they carry no signal, and counting their tokens would only dilute the others'.

Held-out evaluation (`HeldOutAccuracy`): pass@1 with greedy decoding on `grpo.eval_tasks` test-split tasks
(hybridtron.eval.tasks), at step 0, every `grpo.eval_every` steps and at the end.

The run directory (the run scaffold's rules: hybridtron.train.run):

    run_config.json   --model, --env and the resolved [model], [grpo], [train], [monitor]
    metrics.jsonl     one line per step: loss, policy_loss, mtp_loss_<d>, reward_mean/std/zero_share/one_share,
                      response_length, clip_fraction (_low, _high), ratio_mean, ratio_min, ratio_max, approx_kl
                      (k3 to the old policy), is_mismatch, is_out_of_bounds_share, entropy, rollout_step,
                      kl (to the initial model, with grpo.kl_coef > 0 or grpo.reference_kl), groups_trained/dropped,
                      rollout_tokens_per_s, mtp_acceptance_length, rollout_wait_s, policy_staleness, tokens_per_s,
                      ...; pass_at_1 (and per level) on evaluation steps
    events.jsonl      the stability monitor's detections and actions
    checkpoints/      DCP checkpoints (the rollout side's curriculum and in-flight batches included)
    hf/               the trained policy: config.json, safetensors, tokenizer files with the chat template

The shared RL machinery (the rollout role, the role pipeline, the learner's batch source, the rollout settings
and objective base, the evaluation) is hybridtron.post.rl; this module holds what is GRPO's own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from hybridtron.config import ModelConfig
from hybridtron.distributed.config import DistConfig
from hybridtron.envs import env_names
from hybridtron.post.losses import (GRPOLossConfig, grpo_loss, masked_mean, masked_range, mismatch_metrics,
                                    rollout_correction)
from hybridtron.post.reference import REFERENCE_SCORE, ReferenceScoringRole
from hybridtron.post.rl.command import RolloutRunCommand
from hybridtron.post.rl.config import RESUMABLE_ROLLOUT_FIELDS, RolloutConfig
from hybridtron.post.rl.evaluation import HeldOutAccuracy
from hybridtron.post.rl.objective import RolloutObjective, as_head_outputs
from hybridtron.post.rl.roles import RoleSpec
from hybridtron.post.rl.rollout import RolloutRole, load_env
from hybridtron.train.config import SectionedConfig, TrainConfig
from hybridtron.train.monitor.config import MonitorConfig
from hybridtron.train.run import Input

# [train] defaults of GRPO over pretraining's: a small constant LR after a short warmup (RL recipes decay nothing),
# 4 micro-batches a step, a checkpoint every 20 steps; the rest (AdamW, clipping at 1.0, fp32) is pretraining's.
# train.val_every does not apply: GRPO has no validation loss; its held-out pass@1 runs every grpo.eval_every.
GRPO_TRAIN = dict(steps=100, lr=1e-4, warmup_steps=5, decay_fraction=0.0, grad_accum=4, checkpoint_every=20)


@dataclass(frozen=True, kw_only=True)
class GRPOConfig(RolloutConfig):
    """The `[grpo]` section: the shared rollout settings (hybridtron.post.rl.config), and GRPO's groups, dynamic
    sampling, curriculum, KL to the reference, entropy bonus and advantages."""

    SECTION = "grpo"
    RESUMABLE = (*RESUMABLE_ROLLOUT_FIELDS, "max_refill_rounds", "dual_clip", "kl_coef", "entropy_coef",
                 "reference_batch_size")

    # groups
    group_size: int = 16  # G completions per prompt (Ultra: 16)
    prompts_per_step: int = 8  # prompts per rollout batch: up to prompts_per_step x G rollouts (one step unless
    #   global_batch splits them)
    # dynamic sampling (DAPO)
    dynamic_sampling: bool = True  # drop groups whose rewards all agree and refill the step with new prompts
    max_refill_rounds: int = 2  # extra generation rounds a step may take to refill
    # curriculum: weight exp(-(p - target)^2 / (2 sigma^2)) on each prompt's running pass-rate estimate p
    curriculum: bool = True  # false: prompts drawn uniformly
    curriculum_target: float = 0.5  # the pass rate the curriculum steers towards
    curriculum_sigma: float = 0.2  # width of the Gaussian
    curriculum_ema: float = 0.5  # weight of a new group's pass rate in a prompt's estimate
    # GRPO's own loss settings (hybridtron.post.losses.GRPOLossConfig)
    dual_clip: float | None = None  # none, or c > 1: the loss of A < 0 tokens capped at -c A (3 in Ye et al.)
    kl_coef: float = 0.0  # weight of the k3 KL to the frozen initial model (0 in the recipe; > 0 adds its role)
    reference_kl: bool = False  # log `kl` (k3 to the frozen initial model) even with kl_coef = 0: how far the
    #   policy has moved; costs the reference-scoring role (a copy of the model, one no-grad forward a rollout)
    reference_batch_size: int = 16  # rollouts per forward of the reference-scoring role
    entropy_coef: float = 0.0  # weight of the entropy bonus (0 in the recipe)
    advantage_mode: str = "zscore"  # zscore (GRPO), leave_one_out (RLOO, NeMo-RL), mean_only (Dr.GRPO)
    advantage_eps: float = 1e-6  # z-score: A = (r - mean) / (std + eps)

    @property
    def uses_reference(self) -> bool:
        """The k3 KL to the frozen initial model is computed (trained on, or only logged): the reference role runs."""
        return self.kl_coef > 0 or self.reference_kl

    def loss_config(self) -> GRPOLossConfig:
        try:
            return GRPOLossConfig(**{f.name: getattr(self, f.name) for f in fields(GRPOLossConfig)})
        except ValueError as exc:  # name the section: "grpo.tis_low / grpo.tis_high must ..."
            raise ValueError(f"grpo: {exc}") from None

    def validate(self) -> None:
        super().validate()
        if self.reference_batch_size < 1:
            raise ValueError(f"grpo.reference_batch_size must be >= 1, got {self.reference_batch_size}")
        if self.group_size < 2:
            raise ValueError(f"grpo.group_size must be >= 2 (a group's advantages need a baseline), got "
                             f"{self.group_size}")
        if self.max_refill_rounds < 0:
            raise ValueError(f"grpo.max_refill_rounds must be >= 0, got {self.max_refill_rounds}")
        if not 0 <= self.curriculum_target <= 1:
            raise ValueError(f"grpo.curriculum_target must be in [0, 1], got {self.curriculum_target}")
        if not self.curriculum_sigma > 0:
            raise ValueError(f"grpo.curriculum_sigma must be > 0, got {self.curriculum_sigma}")
        if not 0 < self.curriculum_ema <= 1:
            raise ValueError(f"grpo.curriculum_ema must be in (0, 1], got {self.curriculum_ema}")

    def env_options(self) -> dict:
        return {"levels": self.levels} if self.levels else {}


@dataclass(frozen=True, kw_only=True)
class GRPORunConfig(SectionedConfig):
    """What `hybridtron grpo` runs: the policy and environment as given on the command line, and the sections."""

    MODEL_FROM = "base_model"

    base_model: str  # --model: an HF checkpoint directory with tokenizer files (the SFT model)
    env: str  # --env: a registered environment (hybridtron.envs), or module.path:Class
    model: ModelConfig  # the checkpoint's config.json (read-only)
    grpo: GRPOConfig = GRPOConfig()
    train: TrainConfig = TrainConfig(**GRPO_TRAIN)
    monitor: MonitorConfig = MonitorConfig()
    dist: DistConfig = DistConfig()  # the learner's layout under torchrun (pretraining's [dist])

    def command_line(self) -> str:
        return f"hybridtron grpo --model {self.base_model} --env {self.env}"


# ---------------------------------------------------------------------------------------------- the loss
class GRPOObjective(RolloutObjective):
    """The GRPO loss of a micro-batch of rollouts (`hybridtron.post.rl.batches.RolloutMicroBatch`), as a `Trainer`
    objective; see the module docstring.

    The k3 KL to the frozen initial model (kl_coef > 0, or only logged: reference_kl) reads its log-probs from the
    rollouts' `scores["reference"]` (the reference-scoring role, hybridtron.post.reference). `parallel` (a sharded
    learner, hybridtron.distributed): see RolloutObjective. `mtp_depths`: the model's.

    Metrics, each the step's value: loss, policy_loss, mtp_loss_<d>; over the policy tokens: clip_fraction,
    clip_fraction_low / _high, ratio_mean, approx_kl (k3 to the old policy), kl (with a reference), and the ratio's
    range (`ObjectiveOutput.ranges`: ratio_min, ratio_max); over every completion token (the engines' agreement
    and the policy's spread do not depend on the advantages): is_mismatch (mean |log w|), is_out_of_bounds_share
    (the share TIS truncates / IcePop drops), entropy; policy_tokens; and the rollout statistics of the batch."""

    headline = ("reward_mean", "reward")

    def row_counts(self, mb) -> list:
        """completion tokens, policy tokens, policy sequences"""
        mask = mb.policy_mask
        return [mb.completion_mask.sum(), mask.sum(), mask.any(dim=1).sum()]

    def loss_from_outputs(self, model, outputs, mb, expert_counts=None):
        """The GRPO loss and metrics of a micro-batch from the learner's outputs (`forward`'s, or a pipeline's last
        stage's: lm_head's inputs, `as_head_outputs`; the expert counts are then the pipeline's)."""
        cfg, loss_cfg = self.config, self.loss_config
        head = as_head_outputs(model, outputs)
        scored = self.scores(head, mb, entropy=True)  # the entropy has a gradient where entropy_coef uses it
        logp, entropy = scored.logp, scored.entropy
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
        rollout_logp = mb.rollout_logprobs  # with correction "none" the mismatch is still logged
        # the old policy: the learner before the rollout batch's first update (fixed over its mini-batches), or
        # with one step a batch the learner before this step's update, i.e. now
        old = logp.detach() if mb.old_logprobs is None else mb.old_logprobs
        if global_policy > 0:
            policy_loss, policy_metrics = grpo_loss(logp, old, mb.advantages, mask, global_policy,
                                                    loss_cfg, rollout_logp=rollout_logp, ref_logp=ref_logp,
                                                    entropy=entropy)
        else:  # every group of the step agreed: no policy gradient (the MTP loss may still train)
            policy_loss = logp.sum() * 0.0
            _, policy_metrics = grpo_loss(logp.detach(), old, mb.advantages, mask, 1.0, loss_cfg,
                                          rollout_logp=rollout_logp, ref_logp=ref_logp, entropy=entropy)
        # the trainer logs the mean over micro-batches of each metric: scale each share by their number
        # (the rollout-vs-trainer mismatch and the entropy over every completion token, the rest over the policy's)
        scale, share = self.micro_batches, tokens / global_tokens if global_tokens > 0 else 0.0
        completion_share = float(completion.sum()) / self.counts[0]
        # and the largest (smallest) rollout-vs-trainer weight w = exp(old - rollout) of the step: is_weight_max
        ranges = {"ratio": policy_metrics.pop("ratio_range"),
                  "is_weight": masked_range((old - rollout_logp).exp(), completion)}
        low, high = (loss_cfg.tis_low, loss_cfg.tis_high) if loss_cfg.correction != "icepop" else \
            (loss_cfg.icepop_low, loss_cfg.icepop_high)
        _, out_of_bounds = rollout_correction(old, rollout_logp, completion,
                                              "icepop" if loss_cfg.correction == "icepop" else "tis", low, high,
                                              loss_cfg.correction_level)
        engine_metrics = {**mismatch_metrics(old, rollout_logp, completion, out_of_bounds),
                          "entropy": masked_mean(entropy, completion)}
        metrics = {**{key: value.float() * share * scale for key, value in policy_metrics.items()
                      if key not in engine_metrics},
                   **{key: value.float() * completion_share * scale for key, value in engine_metrics.items()},
                   "policy_tokens": torch.tensor(global_tokens / self.data_ranks, dtype=torch.float32)}
        return self.objective_output(head, mb, policy_loss, metrics, ranges, self.counts[3:], expert_counts)


# ------------------------------------------------------------------------------------------------ the command
class GRPO(RolloutRunCommand):
    name = "grpo"
    config_class = GRPORunConfig
    section = "grpo"
    default_steps = GRPO_TRAIN["steps"]
    set_example = "--set grpo.group_size=8 --set grpo.async_rollouts=true"
    inputs = (Input("--model", "base_model", "the policy to train: an HF checkpoint directory with its tokenizer "
                                             "files and chat template, or a run directory (its hf/ export; "
                                             "e.g. runs/sft)", checkpoint=True),
              Input("--env", "env", "the environment that grades the rollouts: math, code, or module.path:Class for "
                                    "your own"))

    def default_config(self, args, inputs):
        return GRPORunConfig(model=ModelConfig.from_hf(inputs["base_model"]), **inputs)

    def check_inputs(self, config):
        env = config.env
        if ":" not in env and env not in env_names():
            raise ValueError(f"--env {env}: unknown environment; known: {', '.join(env_names())} (or "
                             f"module.path:Class for your own)")
        try:
            load_env(env, **config.grpo.env_options()).close()
        except TypeError as exc:  # the environment's constructor takes no levels
            raise ValueError(f"--env {env}: grpo.levels={list(config.grpo.levels)}, but it takes no levels "
                             f"({exc})") from None
        except ValueError as exc:
            raise ValueError(f"--env {env}: {exc}") from None

    def role_specs(self, config, policy_dir, backend, share):
        grpo, threads = config.grpo, config.grpo.rollout_threads if backend != "inline" else 0
        specs = [RoleSpec(RolloutRole, dict(model_dir=str(policy_dir), model_config=config.model, env=config.env,
                                            env_options=grpo.env_options(), config=grpo, threads=threads,
                                            share=share), replicas=grpo.rollout_replicas)]
        if grpo.uses_reference:  # the frozen initial policy scores the rollouts for the KL
            specs.append(RoleSpec(ReferenceScoringRole, dict(model_dir=str(policy_dir), model_config=config.model,
                                                             config=grpo, threads=threads, share=share)))
        return specs

    def objective(self, config, parallel):
        return GRPOObjective(config.grpo, config.model.mtp_depths, parallel=parallel)

    def evaluators(self, config, tokenizer):
        grpo = config.grpo
        if not grpo.eval_tasks:
            return [], []
        env = load_env(config.env, **grpo.env_options())
        tasks = env.tasks("test", grpo.eval_tasks, grpo.seed)
        return [HeldOutAccuracy(env, tasks, tokenizer, grpo.eval_every, max_tokens=grpo.eval_max_tokens,
                                batch_size=grpo.eval_batch_size, enable_thinking=grpo.enable_thinking)], [env.close]


COMMAND = GRPO()
add_arguments, run = COMMAND.add_arguments, COMMAND.run
