"""What one optimizer step measured: `StepStats`, the typed record that the monitor and the hooks read.

The trainer fills it in this order: the objective's metrics and each MTP depth's loss (averaged over the step's
micro-batches), the tokens, every router's expert counts, the gradient norms before clipping (global and per
parameter group), every router's MaxVio, then the monitor's signals, and the held-out evaluations that are due.
`record()` flattens it into the one line per step of metrics.jsonl; the keys are stable:

    step, lr, loss, lm_loss, ...                 the objective's metrics (pretraining: CE + MTP, CE)
    mtp_loss_<d>                                 each MTP depth's loss (`mtp_losses[d - 1]`); absent on a step
                                                 where depth d had no target (sequences of <= d tokens)
    grad_norm                                    global L2 norm of the gradients, before clipping
    wgrad_norm/<group>                           per group: embeddings, layer.<i>, norm_f, lm_head, mtp
    tokens, tokens_per_s
    <name>_min, <name>_max                       the step's range of a per-token statistic (RL: ratio_min, ratio_max;
                                                 is_weight_min, is_weight_max: the rollout-vs-trainer weight)
    maxvio/<router>                              each router's MaxVio (hybridtron.train.balance)
    residual_rms/<layer>                         the residual stream's RMS after each block, on sampled steps
    tool_calls_per_trajectory, ...               RL on a tool environment: the rollout batch's agentic statistics
                                                 (turns_per_trajectory, tool_calls_well_formed, tool_errors/<kind>:
                                                 hybridtron.post.rl.trajectories.trajectory_stats), with the losses
    ...                                          the other signals (hybridtron.train.monitor.signals)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class StepStats:
    step: int  # the step this is (counted from 1)
    lr: float
    losses: dict[str, float]  # the objective's metrics, averaged over the micro-batches
    tokens: int  # tokens the step trained on
    expert_counts: dict[str, torch.Tensor]  # router name -> tokens routed to each expert [E], summed over the step
    # the loss of MTP depth d at index d - 1, over the micro-batches that had targets at that depth; None where none
    # had (the depth had weight zero in the step's loss: `hybridtron.model.lm`)
    mtp_losses: list[float | None] = field(default_factory=list)
    grad_norm: float = math.nan  # global, before clipping
    group_grad_norms: dict[str, float] = field(default_factory=dict)  # per parameter group, before clipping
    maxvio: dict[str, float] = field(default_factory=dict)  # router name -> MaxVio over the balance window
    residual_rms: dict[int, float] = field(default_factory=dict)  # backbone layer -> residual RMS (sampled steps)
    seconds: float = 0.0  # wall time of forward, backward and update
    signals: dict[str, float] = field(default_factory=dict)  # the monitor's other signals
    evaluation: dict[str, float] = field(default_factory=dict)  # held-out results, on the steps they are due
    events: list[str] = field(default_factory=list)  # "detector:action" of what the monitor decided on this step
    # name -> (min, max) of a per-token statistic over the step (`ObjectiveOutput.ranges`; RL: the policy ratio)
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)

    def record(self) -> dict:
        """The step's metrics.jsonl line."""
        line = {"step": self.step, **self.losses,
                **self.depth_losses(),
                "lr": self.lr, "grad_norm": self.grad_norm,
                **{f"wgrad_norm/{group}": value for group, value in self.group_grad_norms.items()},
                "tokens": self.tokens, "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
                **{f"maxvio/{router}": value for router, value in self.maxvio.items()},
                **{f"residual_rms/{layer}": value for layer, value in self.residual_rms.items()},
                **{f"{name}_{end}": value for name, extremes in self.ranges.items()
                   for end, value in zip(("min", "max"), extremes)},
                **self.signals, **self.evaluation}
        if self.events:
            line["events"] = list(self.events)
        return line

    def depth_losses(self) -> dict[str, float]:
        """`mtp_loss_<d>` -> the loss of MTP depth d, for the depths that had targets this step."""
        return {f"mtp_loss_{depth}": value for depth, value in enumerate(self.mtp_losses, start=1)
                if value is not None}


def depth_mean(loss_sum: float, share_sum: float) -> float | None:
    """An MTP depth's loss for the step from the sums over the micro-batches (and the data-parallel ranks) of its
    losses and its shares (`ObjectiveOutput.mtp_shares`); None where the shares sum to 0: no target anywhere."""
    return loss_sum / share_sum if share_sum > 0 else None


def merge_ranges(ranges: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The micro-batches' [min, max] of each statistic (`ObjectiveOutput.ranges`) as the step's."""
    return {name: torch.stack([torch.stack([r[name][0] for r in ranges]).min(),
                               torch.stack([r[name][1] for r in ranges]).max()]) for name in ranges[0]} \
        if ranges else {}


def range_values(ranges: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """`StepStats.ranges` from the step's [min, max] tensors: NaN for a statistic no token of the step had."""
    values = {name: tuple(extremes.tolist()) for name, extremes in ranges.items()}
    return {name: (low, high) if low <= high else (math.nan, math.nan) for name, (low, high) in values.items()}


def parameter_group(name: str) -> str:
    """`backbone.layers.3.mixer.in_proj.weight` -> `layer.3`; lm_head, embeddings, norm_f, mtp on their own."""
    parts = name.split(".")
    if parts[0] == "backbone":
        return f"layer.{parts[2]}" if parts[1] == "layers" else parts[1]
    return parts[0]


def group_norms_ref(named_grads: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Per-group L2 norm of the gradients: the plain loop that defines `group_norms`."""
    squares: dict[str, float] = {}
    for name, grad in named_grads:
        group = parameter_group(name)
        squares[group] = squares.get(group, 0.0) + float(grad.double().pow(2).sum())
    return {group: math.sqrt(value) for group, value in squares.items()}


def group_norms(named_grads: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Per-group L2 norm: one fused norm over every gradient, a scatter-add of the squares, one host sync."""
    if not named_grads:
        return {}
    groups = list(dict.fromkeys(parameter_group(name) for name, _ in named_grads))
    norms = torch.stack(torch._foreach_norm([grad for _, grad in named_grads])).double()
    index = torch.tensor([groups.index(parameter_group(name)) for name, _ in named_grads], device=norms.device)
    values = norms.new_zeros(len(groups)).index_add_(0, index, norms.pow(2)).sqrt()
    return dict(zip(groups, values.tolist()))
