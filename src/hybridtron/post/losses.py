"""Policy-gradient losses of RLVR (GRPO) and multi-teacher on-policy distillation (MOPD), as small pure functions.

The recipe (the Ultra report's RLVR and MOPD stages, with the choices where miles, verl and NeMo-RL disagree):

- GRPO: per-prompt group z-score advantages (zero-variance groups give 0); PPO ratio clipped to [1 - 0.2, 1 + 0.28]
  (DAPO clip-higher), optional dual clip for A < 0; optional k3 KL to a frozen reference and entropy bonus (both
  off in the recipe); the rollout engine's log-probs corrected towards the trainer's by TIS or IcePop.
- MOPD: advantage A_t = sg[log pi_T - log pi_prox] from the prompt's domain teacher, the same clipped ratio against
  the proximal (trainer's pre-update) policy, the behaviour-to-proximal correction c_t truncated or masked; or
  (an option, not the report's) the reverse KL over the teacher's top-K tokens at every position.
- Aggregation: a sum over valid tokens divided by a count the caller computes over the WHOLE optimizer step (all
  micro-batches, all data-parallel ranks), so that summing the gradients of the micro-batches gives the gradient
  of the whole batch: grad_accum and world size do not change the update.

Everything here is a function of per-token tensors; nothing knows the model, the trainer or the rollout engine.
Log-probabilities other than the current policy's (`old`, `rollout`, `ref`, `teacher`, `prox`) are detached here,
so a caller cannot leak a gradient through them.

Shapes: B sequences, T completion tokens, V vocabulary, P prompts, G samples per prompt (group size).
`mask_BT` is True (or nonzero) on completion tokens that count; padded positions may hold any finite value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

MAX_LOG_RATIO = 20.0  # |log ratio| cap before exp(): e^20 ~ 5e8 stays finite in fp32 and far outside any clip
ADVANTAGE_MODES = ("zscore", "leave_one_out", "mean_only")
CORRECTIONS = ("tis", "icepop", "none")
CORRECTION_LEVELS = ("token", "sequence")
AGGREGATIONS = ("token_mean", "sequence_mean")


# --------------------------------------------------------------------------------------------- configs
@dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """Knobs shared by GRPO and MOPD.

    eps_clip / eps_clip_high: the ratio is clipped to [1 - eps_clip, 1 + eps_clip_high] (DAPO clip-higher).
    correction: how the trainer-vs-rollout weight w = pi_old_trainer / pi_rollout enters the loss: "tis" multiplies
      by clamp(w, tis_low, tis_high); "icepop" multiplies by w where w is in [icepop_low, icepop_high] and by 0
      elsewhere; "none" ignores it (the mismatch is still logged when rollout log-probs are given).
    correction_level: "token" (one w per token) or "sequence" (the geometric mean of w over the sequence's tokens).
    aggregation: "token_mean" (sum over tokens / the caller's global count) or "sequence_mean" (the GRPO paper's
      mean over each sequence's tokens, then sum / the global count of sequences).
    """

    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    correction: Literal["tis", "icepop", "none"] = "tis"
    correction_level: Literal["token", "sequence"] = "token"
    tis_low: float = 0.0
    tis_high: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 2.0
    aggregation: Literal["token_mean", "sequence_mean"] = "token_mean"

    def __post_init__(self):
        _check_choice("correction", self.correction, CORRECTIONS)
        _check_choice("correction_level", self.correction_level, CORRECTION_LEVELS)
        _check_choice("aggregation", self.aggregation, AGGREGATIONS)
        if not 0 <= self.eps_clip < 1:
            raise ValueError(f"eps_clip must be in [0, 1), got {self.eps_clip!r}")
        if not self.eps_clip_high >= 0:
            raise ValueError(f"eps_clip_high must be >= 0, got {self.eps_clip_high!r}")
        for name in ("tis", "icepop"):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            if not 0 <= low < high:
                raise ValueError(f"{name}_low / {name}_high must satisfy 0 <= low < high, got {low!r} / {high!r}")


@dataclass(frozen=True, kw_only=True)
class GRPOLossConfig(PolicyLossConfig):
    """GRPO: the shared knobs plus dual_clip (None, or c > 1: the loss of A < 0 tokens is capped at -c A; 3 in Ye
    et al.), kl_coef (weight of the k3 KL to the reference; 0 in the recipe), entropy_coef (weight of the entropy
    bonus; 0 in the recipe), and the advantage estimator that `group_advantages` uses (advantage_mode,
    advantage_eps)."""

    dual_clip: float | None = None
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    advantage_mode: Literal["zscore", "leave_one_out", "mean_only"] = "zscore"
    advantage_eps: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        _check_choice("advantage_mode", self.advantage_mode, ADVANTAGE_MODES)
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be None or > 1, got {self.dual_clip!r}")
        for name in ("kl_coef", "entropy_coef", "advantage_eps"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True)
class MOPDLossConfig(PolicyLossConfig):
    """MOPD: the shared knobs, with the correction defaulting to IcePop masking in [0.2, 5] (the bounds of NeMo-RL's
    Ultra MOPD recipe), and kl_top_k: 0 for the report's sampled reverse KL (a policy gradient on the sampled
    tokens), K > 0 for the reverse KL over the teacher's top-K tokens of every position (`topk_reverse_kl`)."""

    correction: Literal["tis", "icepop", "none"] = "icepop"
    icepop_low: float = 0.2
    icepop_high: float = 5.0
    kl_top_k: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.kl_top_k < 0:
            raise ValueError(f"kl_top_k must be >= 0 (0 = the sampled estimator), got {self.kl_top_k!r}")


def _check_choice(name: str, value, choices: tuple[str, ...]):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


# --------------------------------------------------------------------------------------------- advantages
def group_advantages(rewards: Tensor, group_size: int | None = None, mode: str = "zscore", eps: float = 1e-6) -> Tensor:
    """Advantages of G samples of one prompt relative to each other: rewards_PG [P, G], or flat rewards [P*G] with
    `group_size` (samples of a prompt contiguous); returns the same shape, in fp32.

    - "zscore" (GRPO, Shao et al. 2024): A_i = (r_i - mean) / (std + eps), std with Bessel's correction (torch.std,
      as verl and miles compute it; the paper does not say which).
    - "leave_one_out" (RLOO, Kool et al. 2019 / Ahmadian et al. 2024; NeMo-RL's baseline): A_i = r_i - mean of the
      other G - 1 rewards = G / (G - 1) (r_i - mean). Not divided by the std (NeMo-RL can add that on top).
    - "mean_only" (Dr.GRPO, Liu et al. 2025): A_i = r_i - mean; its other half, dropping the 1/|o_i| length
      normalisation, is the aggregation's business (`token_mean`).

    A group whose rewards all agree gets exactly 0 in every mode: it carries no signal, yet the mean's rounding
    leaves r - mean ~ 1e-8, which the z-score's / (std + eps) turns into advantages up to ~0.06 (16 rewards of 0.7
    in fp32). A group of one has no baseline: an error.
    """
    _check_choice("mode", mode, ADVANTAGE_MODES)
    if group_size is not None:
        if rewards.ndim != 1 or group_size < 2 or rewards.numel() % group_size:
            raise ValueError(f"flat rewards of shape {tuple(rewards.shape)} cannot be split into groups of "
                             f"group_size={group_size} (needs 1-D rewards, group_size >= 2 dividing their count)")
        rewards_PG = rewards.reshape(-1, group_size)
    elif rewards.ndim == 2 and rewards.shape[1] >= 2:
        rewards_PG = rewards
    else:
        raise ValueError(f"rewards must be [prompts, group >= 2] or flat with group_size; got {tuple(rewards.shape)}")
    if not torch.isfinite(rewards_PG).all():
        raise ValueError("rewards contain NaN or inf; a verifier must return a finite reward for every sample")
    rewards_PG = rewards_PG.float()
    G = rewards_PG.shape[1]
    centered_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if mode == "zscore":
        advantages_PG = centered_PG / (rewards_PG.std(dim=1, keepdim=True) + eps)
    elif mode == "leave_one_out":
        advantages_PG = centered_PG * (G / (G - 1))
    else:
        advantages_PG = centered_PG
    zero_variance_P1 = (rewards_PG.amax(dim=1) == rewards_PG.amin(dim=1)).unsqueeze(1)
    advantages_PG = advantages_PG.masked_fill(zero_variance_P1, 0.0)
    return advantages_PG.reshape(rewards.shape)


# --------------------------------------------------------------------------------------------- per-token terms
def policy_ratio(logp: Tensor, old_logp: Tensor, max_log_ratio: float = MAX_LOG_RATIO) -> Tensor:
    """r = exp(clamp(logp - old_logp, -20, 20)). The clamp keeps a token the two policies disagree on wildly from
    overflowing to inf (and inf * 0 = NaN); beyond e^+-20 the clipped loss has no gradient anyway, except on the
    unbounded A < 0 side without a dual clip, which the clamp caps."""
    return torch.exp(torch.clamp(logp - old_logp, -max_log_ratio, max_log_ratio))


def clipped_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_low: float = 0.2,
                        eps_high: float = 0.28, dual_clip: float | None = None) -> tuple[Tensor, Tensor]:
    """Per-token PPO loss and a per-token "a clip zeroed this token's gradient" indicator (for the clip fraction).

    loss = max(-r A, -clip(r, 1 - eps_low, 1 + eps_high) A); with dual_clip c, min(loss, -c A) where A < 0.
    `advantages` broadcasts against logp (GRPO's sequence advantage [B, 1], MOPD's per-token one [B, T]).

    Departures: PPO (Schulman et al. 2017) clips symmetrically; this is DAPO's clip-higher (Yu et al. 2025), whose
    larger upper bound lets rare tokens with A > 0 grow. The dual clip (Ye et al. 2020) bounds the loss of A < 0
    tokens whose ratio has run far above 1 + eps_high, which the pessimistic max alone leaves unbounded.
    """
    ratio = policy_ratio(logp, old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped  # max() chose the constant branch
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_active = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_active, cap, loss)
        was_clipped = was_clipped | dual_active
    return loss, was_clipped


def k3_kl(logp: Tensor, ref_logp: Tensor, max_value: float = 10.0) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) on samples of pi (Schulman, "Approximating KL divergence", 2020):
    exp(ref - lp) - 1 - (ref - lp), >= 0, unbiased, lower variance than lp - ref. This is verl's `low_var_kl`
    and the estimator the GRPO paper puts in its loss. Like verl, the log ratio is clamped to +-20 and the value to
    at most `max_value` (10): a token the reference finds vastly more likely cannot dominate the batch, at the
    price of no KL gradient for that token."""
    log_ratio = torch.clamp(ref_logp - logp, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.clamp(torch.exp(log_ratio) - 1 - log_ratio, max=max_value)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of each position's next-token distribution, logits [..., V] -> [...], in fp32:
    H = -sum_v p_v log p_v with log p = log_softmax(logits) (stable for any logit scale; verl's
    `entropy_from_logits` computes the same as logsumexp - sum p z). Tokens a sampler masked to -inf add 0 and get
    a zero gradient, not NaN. Reference in the tests: torch.distributions.Categorical(logits=...).entropy()."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    # 0 * -inf: replacing log p (not the product) by 0 keeps the backward's p * d(log p) and log p * dp finite
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(dim=-1)


# --------------------------------------------------------------------------------------------- rollout vs trainer
def importance_weights(trainer_old_logp: Tensor, rollout_logp: Tensor) -> Tensor:
    """w = pi_old_trainer / pi_rollout = exp(trainer_old_logp - rollout_logp) per token (log ratio clamped to +-20),
    detached. It corrects for the rollout engine sampling from a slightly different policy (kernels, precision,
    routing) than the one the trainer scores; in MOPD it is c_t = pi_prox / pi_behav."""
    return policy_ratio(trainer_old_logp.detach(), rollout_logp.detach())


def tis_weights(w: Tensor, low: float = 0.0, high: float = 2.0) -> Tensor:
    """Truncated importance sampling: clamp(w, low, high). Yao et al. 2025 ("Your efficient RL framework secretly
    brings you off-policy RL training") truncate from above only, min(w, C) with C = 2 (miles' default); the
    optional lower bound is NeMo-RL's (its Ultra config clamps to [0.2, 5])."""
    return torch.clamp(w, low, high)


def icepop_mask(w: Tensor, low: float = 0.5, high: float = 2.0) -> Tensor:
    """IcePop's acceptance region (Ring-1T report, Ling Team 2025): True where low <= w <= high. The correction
    multiplies the loss by w inside the region and by 0 outside (`rollout_correction`): tokens whose engines
    disagree that much are dropped rather than down-weighted."""
    return (w >= low) & (w <= high)


def sequence_geometric_mean(w: Tensor, mask: Tensor) -> Tensor:
    """One weight per sequence, w_BT -> w_B: exp(mean of log w over the sequence's valid tokens), 1 for a sequence
    with none. The geometric mean keeps a sequence-level ratio from drifting with length the way the product of
    per-token ratios does (TRL issue 4772); token level stays the default."""
    valid = mask != 0
    log_w = torch.where(valid, torch.log(w), 0.0)
    return torch.exp(log_w.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1))


def rollout_correction(trainer_old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: str, low: float,
                       high: float, level: str = "token") -> tuple[Tensor, Tensor]:
    """The per-token coefficient that multiplies the policy loss, and where the weight fell outside [low, high]
    (truncated under "tis", dropped under "icepop"), both [B, T] and detached. `level="sequence"` gives every token
    of a sequence its geometric-mean weight (and drops or truncates whole sequences)."""
    _check_choice("mode", mode, CORRECTIONS[:2])
    _check_choice("level", level, CORRECTION_LEVELS)
    w = importance_weights(trainer_old_logp, rollout_logp)
    if level == "sequence":
        w = sequence_geometric_mean(w, mask).unsqueeze(-1).expand_as(w)
    inside = icepop_mask(w, low, high)  # IcePop's region; for TIS, where the clamp leaves w unchanged
    coefficient = tis_weights(w, low, high) if mode == "tis" else torch.where(inside, w, 0.0)
    return coefficient, ~inside


def mismatch_metrics(trainer_old_logp: Tensor, rollout_logp: Tensor, mask: Tensor,
                     out_of_bounds: Tensor | None = None) -> dict[str, Tensor]:
    """Rollout-vs-trainer mismatch over this call's valid tokens: "is_mismatch" = mean |log w|, and, given the
    `out_of_bounds` of `rollout_correction`, "is_out_of_bounds_share" = the share of valid tokens it truncated
    (TIS) or dropped (IcePop). Detached 0-d tensors (no device sync)."""
    log_w = (trainer_old_logp.detach() - rollout_logp.detach()).abs()
    metrics = {"is_mismatch": masked_mean(log_w, mask)}
    if out_of_bounds is not None:
        metrics["is_out_of_bounds_share"] = masked_mean(out_of_bounds.float(), mask)
    return metrics


# --------------------------------------------------------------------------------------------- aggregation
def token_mean(values: Tensor, mask: Tensor, global_count: int | float | Tensor) -> Tensor:
    """sum(values over valid tokens) / global_count, where the caller counts the valid tokens of the WHOLE step:
    every micro-batch and every data-parallel rank. The loss of each micro-batch is then its share of the batch's
    token-mean, and summing their gradients gives the batch's gradient whatever the split. Dividing by each
    micro-batch's own count instead (a bug verl, TRL and open-instruct each shipped and fixed) weights the tokens
    of short micro-batches more and makes the update depend on grad_accum.

    The divisor is the caller's: valid tokens (token-mean, DAPO; the default), the number of sequences (verl's
    seq-mean-token-sum), or a constant such as sequences x max length (Dr.GRPO's normaliser). DDP and FSDP average
    gradients over ranks, i.e. divide by the world size once more: pass global_count / world_size there.
    """
    if not isinstance(global_count, Tensor) and not global_count > 0:
        raise ValueError(f"global_count must be > 0 (the step's count of valid tokens), got {global_count!r}")
    return torch.where(mask != 0, values, 0.0).sum() / global_count


def sequence_mean(values: Tensor, mask: Tensor, global_num_sequences: int | float | Tensor) -> Tensor:
    """The GRPO paper's aggregation: sum over sequences of (mean over the sequence's valid tokens) /
    global_num_sequences (all micro-batches and ranks, as in `token_mean`). Each sequence weighs the same whatever
    its length, so a long wrong answer is penalised less per token (the length bias Dr.GRPO points out)."""
    if not isinstance(global_num_sequences, Tensor) and not global_num_sequences > 0:
        raise ValueError(f"global_num_sequences must be > 0, got {global_num_sequences!r}")
    valid = mask != 0
    per_sequence = torch.where(valid, values, 0.0).sum(dim=-1) / valid.sum(dim=-1).clamp(min=1)
    return per_sequence.sum() / global_num_sequences


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over this call's valid tokens (0 if none), detached: for metrics, not losses. Per-domain figures (e.g.
    MOPD's reverse KL per teacher) are this with the mask restricted to the domain's sequences."""
    valid = mask != 0
    return (torch.where(valid, values.detach().float(), 0.0).sum() / valid.sum().clamp(min=1)).detach()


def masked_range(values: Tensor, mask: Tensor) -> Tensor:
    """[min, max] over this call's valid tokens ([inf, -inf] if none, which any other range absorbs), detached."""
    valid = mask != 0
    values = values.detach().float()
    return torch.stack([torch.where(valid, values, math.inf).min(), torch.where(valid, values, -math.inf).max()])


def _aggregate(values: Tensor, mask: Tensor, global_count, aggregation: str) -> Tensor:
    if aggregation == "sequence_mean":
        return sequence_mean(values, mask, global_count)
    return token_mean(values, mask, global_count)


# --------------------------------------------------------------------------------------------- composed losses
def _check_shapes(reference_name: str, reference: Tensor, **others: Tensor | None):
    if reference.ndim != 2:
        raise ValueError(f"{reference_name} must be [batch, tokens], got shape {tuple(reference.shape)}")
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != reference.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {tuple(reference.shape)} like "
                             f"{reference_name}")


def _corrected_policy_loss(logp, old_logp, advantages, mask, rollout_logp, config: PolicyLossConfig,
                           dual_clip: float | None, rollout_name: str) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token clipped loss times the rollout correction, and its metrics; shared by GRPO and MOPD. Besides
    clip_fraction (any clip, the dual one included): clip_fraction_low / clip_fraction_high, the tokens whose ratio
    the lower (A < 0, r < 1 - eps_clip) / upper (A > 0, r > 1 + eps_clip_high) bound cut off (verl's
    pg_clipfrac_lower counts the dual clip instead); approx_kl, the k3 estimate of KL(current || old) (`k3_kl`;
    verl's ppo_kl is the k1 mean of old - current, which a batch can make negative); ratio_range [min, max]."""
    loss, was_clipped = clipped_policy_loss(logp, old_logp, advantages, config.eps_clip, config.eps_clip_high,
                                            dual_clip)
    ratio = policy_ratio(logp.detach(), old_logp)
    advantages = advantages.expand_as(ratio)
    metrics = {"clip_fraction": masked_mean(was_clipped.float(), mask),
               "clip_fraction_low": masked_mean(((advantages < 0) & (ratio < 1 - config.eps_clip)).float(), mask),
               "clip_fraction_high": masked_mean(((advantages > 0) & (ratio > 1 + config.eps_clip_high)).float(),
                                                 mask),
               "ratio_mean": masked_mean(ratio, mask),
               "approx_kl": masked_mean(k3_kl(logp.detach(), old_logp), mask),
               "ratio_range": masked_range(ratio, mask)}
    loss, correction_metrics = _rollout_corrected(loss, old_logp, mask, rollout_logp, config, rollout_name)
    return loss, {**metrics, **correction_metrics}


def _rollout_corrected(loss, old_logp, mask, rollout_logp, config: PolicyLossConfig,
                       rollout_name: str) -> tuple[Tensor, dict[str, Tensor]]:
    """A per-token loss times the rollout correction c_t of the sampled tokens, and the mismatch metrics."""
    if config.correction != "none" and rollout_logp is None:
        raise ValueError(f"correction={config.correction!r} needs the rollout engine's log-probs ({rollout_name}); "
                         "pass them, or set correction='none'")
    metrics = {}
    if rollout_logp is not None:
        out_of_bounds = None
        if config.correction != "none":
            low, high = ((config.tis_low, config.tis_high) if config.correction == "tis"
                         else (config.icepop_low, config.icepop_high))
            coefficient, out_of_bounds = rollout_correction(old_logp, rollout_logp, mask, config.correction, low,
                                                            high, config.correction_level)
            loss = loss * coefficient
        metrics.update(mismatch_metrics(old_logp, rollout_logp, mask, out_of_bounds))
    return loss, metrics


def grpo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, global_count: int | float | Tensor,
              config: GRPOLossConfig = GRPOLossConfig(), *, rollout_logp: Tensor | None = None,
              ref_logp: Tensor | None = None, entropy: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO objective of one micro-batch: (loss, metrics).

    loss = agg(c_t * max(-r_t A, -clip(r_t) A)) + kl_coef * agg(k3(logp, ref_logp)) - entropy_coef * agg(entropy)

    logp [B, T] is the current policy's (with grad), old_logp the trainer's before this update, rollout_logp the
    rollout engine's (for c_t; required unless correction="none"), ref_logp the frozen reference's, entropy the
    per-token `token_entropy` (with grad if entropy_coef > 0); advantages [B] (one per sequence, `group_advantages`)
    or [B, T]. `global_count`: see `token_mean` (or the step's sequence count for aggregation="sequence_mean").
    Everything is computed in fp32. logp must come from the logits divided by the rollout's sampling temperature,
    or the ratio compares two different distributions.

    Metrics, detached 0-d tensors over this call's valid tokens: clip_fraction, clip_fraction_low,
    clip_fraction_high, ratio_mean, approx_kl (to the old policy), kl (with ref_logp), entropy (with entropy),
    is_mismatch and is_out_of_bounds_share (with rollout_logp); and ratio_range, [min, max] of the ratio.

    Departures from the GRPO paper (Shao et al. 2024): token-mean aggregation instead of the per-sequence mean
    (DAPO; the paper's is aggregation="sequence_mean"), asymmetric clip, the KL off by default (the paper uses
    beta = 0.04), and the rollout correction, which the paper (one engine) does not need. The KL and entropy terms
    are not multiplied by c_t (as in verl and miles).
    """
    _check_shapes("logp", logp, old_logp=old_logp, mask=mask, rollout_logp=rollout_logp, ref_logp=ref_logp,
                  entropy=entropy)
    if advantages.shape == logp.shape[:1]:
        advantages = advantages.unsqueeze(-1)
    elif advantages.shape != logp.shape:
        raise ValueError(f"advantages must be [batch] or [batch, tokens]; got {tuple(advantages.shape)} for logp "
                         f"{tuple(logp.shape)}")
    if config.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={config.kl_coef} needs the reference's log-probs (ref_logp)")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={config.entropy_coef} needs the per-token entropy (token_entropy(logits))")
    logp, old_logp, advantages = logp.float(), old_logp.detach().float(), advantages.detach().float()
    rollout_logp = None if rollout_logp is None else rollout_logp.detach().float()

    per_token, metrics = _corrected_policy_loss(logp, old_logp, advantages, mask, rollout_logp, config,
                                                config.dual_clip, "rollout_logp")
    loss = _aggregate(per_token, mask, global_count, config.aggregation)
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp.detach().float())
        metrics["kl"] = masked_mean(kl, mask)
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * _aggregate(kl, mask, global_count, config.aggregation)
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy, mask)
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * _aggregate(entropy.float(), mask, global_count, config.aggregation)
    return loss, metrics


def topk_reverse_kl(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """KL(student || teacher) of each position [B, T], between the two next-token distributions coarsened to K + 1
    outcomes: the teacher's top-K tokens and one bin for the rest of the vocabulary. student_logp, teacher_logp
    [B, T, K]: each model's full-vocabulary log-probs of those K tokens (the student's with grad).

        KL = sum_k p_k (log p_k - log q_k) + p_rest (log p_rest - log q_rest),   p_rest = 1 - sum_k p_k

    Merging outcomes cannot raise a KL, so this is a lower bound of the full reverse KL, equal to it when the K
    tokens are the whole vocabulary, and 0 exactly when the student gives each of the teacher's K tokens the
    teacher's probability. Without the rest bin (the K probabilities renormalised, as some top-K distillers do) a
    student that moved mass out of the teacher's top K would not be penalised. fp32; a rest mass that rounds to
    <= 0 is floored at 1e-30 (its term is then ~0, with no NaN gradient)."""
    if student_logp.ndim != 3 or student_logp.shape != teacher_logp.shape:
        raise ValueError(f"student_logp and teacher_logp must both be [batch, tokens, K]; got "
                         f"{tuple(student_logp.shape)} and {tuple(teacher_logp.shape)}")
    student_logp, teacher_logp = student_logp.float(), teacher_logp.detach().float()

    def log_rest(logp_K):  # log(1 - sum_k exp(logp_k)), stable as the K tokens' mass nears 1
        return torch.log((-torch.expm1(torch.logsumexp(logp_K, dim=-1).clamp(max=0.0))).clamp(min=1e-30))

    student_rest, teacher_rest = log_rest(student_logp), log_rest(teacher_logp)
    top = (student_logp.exp() * (student_logp - teacher_logp)).sum(dim=-1)
    return top + student_rest.exp() * (student_rest - teacher_rest)


def mopd_loss(logp: Tensor, prox_logp: Tensor, teacher_logp: Tensor, mask: Tensor,
              global_count: int | float | Tensor, config: MOPDLossConfig = MOPDLossConfig(), *,
              behav_logp: Tensor | None = None, topk_kl: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The MOPD objective of one micro-batch (its asynchronous form, see the module docstring): (loss, metrics).

    A_t = sg[log pi_T(y_t) - log pi_prox(y_t)], r_t = pi_theta / pi_prox, c_t = sg[pi_prox / pi_behav] truncated
    (TIS) or masked (IcePop), loss = -agg(c_t min(r_t A_t, clip(r_t) A_t)) = agg(c_t max(-r_t A_t, -clip(r_t) A_t)).

    logp [B, T]: the student being trained (with grad); prox_logp: the trainer's student before this update (the
    proximal policy); teacher_logp: the prompt's domain teacher on the same tokens; behav_logp: the rollout
    engine's (behaviour policy; required unless correction="none"). Same aggregation and `global_count` as
    `grpo_loss`; fp32.

    At r = c = 1 a token's gradient is -A_t grad log pi_theta: the policy gradient of the per-token reward
    log pi_T - log pi_theta (the negated reverse-KL sample) on the student's own samples, with no environment
    reward. Departure from the plain objective J: the teacher's log-prob enters as an advantage against the
    proximal policy (decoupled PPO, Hilton et al. 2022), with PPO's clip and the behaviour correction, so that
    rollouts one step stale still train correctly.

    With `config.kl_top_k` = K > 0 the per-token loss is instead c_t * topk_kl, where topk_kl [B, T] (with grad) is
    `topk_reverse_kl` of the student's and the teacher's log-probs of the teacher's top-K tokens at each position;
    its gradient is the exact one of that KL at the student's sampled states: on-policy distillation as GKD has it
    (Agarwal et al. 2024, reverse KL on student samples), where the report trains the sampled estimate (one token
    of the vocabulary per position). There is no ratio and no clip (the loss is not a policy gradient of the
    sampled token, and `logp` gets no gradient); c_t still weights (or IcePop drops) each position.

    Metrics: clip_fraction, clip_fraction_low / _high, ratio_mean, approx_kl and ratio_range ([min, max]) as in
    `grpo_loss` (sampled form), topk_reverse_kl (top-K form), is_mismatch and
    is_out_of_bounds_share (with behav_logp), and reverse_kl = mean(log pi_prox - log pi_T) over valid tokens, the
    sampled estimate of KL(student || teacher) in either form (log it per domain with `masked_mean` on the
    domain's tokens).
    """
    _check_shapes("logp", logp, prox_logp=prox_logp, teacher_logp=teacher_logp, mask=mask, behav_logp=behav_logp,
                  topk_kl=topk_kl)
    logp, prox_logp, teacher_logp = logp.float(), prox_logp.detach().float(), teacher_logp.detach().float()
    behav_logp = None if behav_logp is None else behav_logp.detach().float()
    advantages = teacher_logp - prox_logp
    if config.kl_top_k:
        if topk_kl is None:
            raise ValueError(f"kl_top_k={config.kl_top_k} needs topk_kl [batch, tokens]: topk_reverse_kl of both "
                             "models' log-probs of the teacher's top-K tokens")
        per_token, metrics = _rollout_corrected(topk_kl.float(), prox_logp, mask, behav_logp, config, "behav_logp")
        metrics["topk_reverse_kl"] = masked_mean(topk_kl, mask)
    else:
        per_token, metrics = _corrected_policy_loss(logp, prox_logp, advantages, mask, behav_logp, config, None,
                                                    "behav_logp")
    metrics["reverse_kl"] = masked_mean(-advantages, mask)
    return _aggregate(per_token, mask, global_count, config.aggregation), metrics
