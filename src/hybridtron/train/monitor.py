"""Stability monitoring: the signals the Ultra report watched, detectors on them, and automatic responses.

Ultra's pretraining diverged twice (SPEC-nvfp4.md). What showed it: the loss together with the weight-gradient L2
norm; the MTP-2 loss spiking first; expert imbalance (the first MoE layer's MaxVio 4.8 -> about 12, bound 23.27);
residual norms spreading four orders of magnitude across layers. What fixed it: a rollback with FP32 gradient
reduction; a rollback with immediate LR annealing and a cut budget. This module watches those signals in every run
and acts on them, as hooks of the training loop (each with a state_dict).

Signals: stable keys added to the step's metrics dict, so every line of metrics.jsonl carries them.

    loss, lm_loss, mtp_loss_<d>, grad_norm   from the loop (grad_norm: global L2 norm before clipping)
    maxvio/<i>                 from the ExpertLoad hook: max/mean expert load of MoE layer i over its window
    wgrad_norm/<group>         WgradNorms: L2 norm of the weight gradient before clipping, per group: embeddings,
                               layer.<i>, norm_f, lm_head (the output layer on its own), mtp
    residual_rms/<i>           ResidualRMS: RMS of the residual stream after block i (forward hooks, sampled)
    router_bias_spread/<i>     RouterBiasSpread: max - min of MoE layer i's router bias
    update_ratio[/lm_head]     UpdateRatio: ||W_after - W_before|| / ||W_before|| of the step (sampled)
    underflow/<module>         Underflow: share of non-zero fprop operand values that quantization flushed to zero,
                               per quantized linear or grouped matmul (only when the model has any; sampled)

Detectors (thresholds in MonitorConfig). Each is judged on the step's signals against its own rolling history of
the steps whose update was applied; skipped and abandoned steps never enter the history.

    nonfinite        NaN or Inf in a loss, grad_norm or any wgrad_norm/<group>
    loss_spike       lm_loss > mean + loss_spike_sigma * std of the last `window` steps, and > mean * (1 + min_rel)
    wgrad_growth     grad_norm or wgrad_norm/lm_head > wgrad_growth_factor x its rolling median
    mtp_leads        an MTP depth's loss degrades while the main loss does not (Divergence 1's signature): the gap
                     g_d = mtp_loss_d - lm_loss (same batch, so the batch's difficulty cancels) spikes above
                     mean + mtp_lead_sigma * std while lm_loss itself is not spiking; or the EMA of mtp_loss_d rises
                     more than mtp_lead_rise above its running minimum while the EMA of lm_loss rose less than half
                     as much; judged from step mtp_lead_after on
    maxvio           a layer's MaxVio > maxvio_share x its bound E/K (the report: 4.8 -> 12 of 23.27 before trouble);
                     judged from step min_history on
    residual_spread  log10(max / min residual RMS across layers) > residual_spread_orders (the report saw 4)

Responses, chosen per detector (`on_<detector>`):

    warn      an event, once per episode (an episode ends when the detector has been quiet for `window` steps)
    skip      drop the step's update (after_backward returns False); `escalate_after` consecutive skips roll back
    rollback  restore the newest GOOD checkpoint and continue reading the data after the window that caused the
              trouble (the batches from the checkpoint to the bad step are never seen again); optionally scale the LR
              (rollback_lr_scale) and switch train.grad_accum_dtype from bf16 to fp32 (rollback_fp32_grad_accum)
    anneal    a rollback that also starts the schedule's decay at once and ends the run `anneal_steps` later
              (WSDSchedule.anneal_now), as the report did at 15T after its second divergence

skip is only possible for detectors judged before the update (all but maxvio, which reads the loads after it).

Bookkeeping, all in the run directory:

- events.jsonl: one line per event or action (detections, skips, rollbacks, GOOD marks, resumes), append-only;
  each is also printed on stderr.
- Checkpoints: a step-0 checkpoint is written and marked GOOD at the start (the initialization has no past to be
  wrong about). Any other checkpoint is marked GOOD once `good_after` steps past it have run without a rollback;
  a rollback deletes the checkpoints newer than its target (they belong to the abandoned trajectory and would
  otherwise be what `--resume` picks).
- metrics.jsonl keeps one line per step of the trajectory that counts. The lines of abandoned steps (the
  checkpoint's step + 1 up to the bad step) move to metrics.rolled_back.jsonl with `"rolled_back": <rollback
  number>`, in the order they were written; nothing is dropped. The bad step's own line also carries
  `"rollback": <target step>`; a skipped step's line carries `"skipped": true`.

The monitor's state has two parts: the trajectory (detector histories), which a rollback restores from the
checkpoint like every other hook's state, and the run's history (rollbacks done, LR scale, the fp32 switch, the
budget cut), which a rollback keeps and a resume restores.

Fault injection, for tests and drills only (off by default): `monitor.inject_fault = "KIND@STEP[,KIND@STEP...]"`
with KIND one of lr_spike (the LR x inject_lr_factor for that step's update), corrupt_batch (that step's batches
replaced by random tokens whose labels are all one never-seen token: a huge-loss batch), nan_grad (a NaN in one
element of the final norm's weight gradient), router_bias (after that step, the first MoE layer's bias of expert 0
raised by inject_router_bias, so that expert takes every token). Each fault fires once per run, even if a rollback
re-runs its step.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hybridtron.errors import RunStopped
from hybridtron.checkpoint.dcp import GOOD, step_of
from hybridtron.train.hooks import Hook, ProgressBar

RESPONSES = ("warn", "skip", "rollback", "anneal")
SEVERITY = {name: rank for rank, name in enumerate(RESPONSES)}
DETECTORS = ("nonfinite", "loss_spike", "wgrad_growth", "mtp_leads", "maxvio", "residual_spread")
POST_UPDATE_DETECTORS = ("maxvio",)  # judged in on_step_end: the loads are counted by then, the update applied
FAULT_KINDS = ("lr_spike", "corrupt_batch", "nan_grad", "router_bias")
EVENTS_FILE, ROLLED_BACK_FILE = "events.jsonl", "metrics.rolled_back.jsonl"


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """The `[monitor]` section: signals, detector thresholds and the response of each detector."""

    enabled: bool = True
    # signals (sampled ones every N steps; per-layer weight-gradient norms and router bias spread every step)
    residual_every: int = 10  # residual-stream RMS per layer
    update_ratio_every: int = 10  # update-to-weight ratio (copies the weights once per sampled step)
    underflow_every: int = 10  # quantization flush-to-zero share (counts every quantized operand that step)
    # detectors
    window: int = 50  # steps of rolling history each detector compares against
    min_history: int = 20  # steps of history before a detector may fire
    loss_spike_sigma: float = 6.0
    loss_spike_min_rel: float = 0.05
    wgrad_growth_factor: float = 10.0
    mtp_lead_sigma: float = 6.0
    mtp_lead_rise: float = 0.05  # smoothed MTP loss this share above its minimum (the main loss not following)
    mtp_lead_ema: float = 0.95  # EMA decay per step (about a 20-step memory)
    mtp_lead_after: int = 100  # steps before mtp_leads judges: early on the MTP depths learn more slowly than the
    #                            main head, so their gap grows by itself
    maxvio_share: float = 0.5  # of the bound E/K
    residual_spread_orders: float = 3.0
    # responses: warn | skip | rollback | anneal
    on_nonfinite: str = "skip"
    on_loss_spike: str = "skip"
    on_wgrad_growth: str = "warn"
    on_mtp_leads: str = "warn"
    on_maxvio: str = "warn"
    on_residual_spread: str = "warn"
    escalate_after: int = 3  # consecutive skipped steps turn into a rollback
    good_after: int = 20  # steps past a checkpoint the detectors must see before it is marked GOOD
    rollback_lr_scale: float = 1.0  # LR multiplier applied at each rollback (compounds)
    rollback_fp32_grad_accum: bool = True  # a rollback switches train.grad_accum_dtype bf16 -> fp32
    max_rollbacks: int = 5  # one more request stops the run with DivergenceError
    anneal_steps: int = 0  # decay length after an anneal; 0 = the planned decay length
    # fault injection, for tests and drills only
    inject_fault: str = ""  # "KIND@STEP[,KIND@STEP...]", KIND in lr_spike, corrupt_batch, nan_grad, router_bias
    inject_lr_factor: float = 1000.0
    inject_router_bias: float = 1.0

    def validate(self) -> None:
        for name in ("mtp_lead_after", "anneal_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"monitor.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("residual_every", "update_ratio_every", "underflow_every", "window", "min_history",
                     "escalate_after", "good_after", "max_rollbacks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"monitor.{name} must be positive, got {getattr(self, name)}")
        if self.min_history > self.window:
            raise ValueError(f"monitor.min_history ({self.min_history}) must not exceed monitor.window "
                             f"({self.window})")
        for name in ("loss_spike_sigma", "loss_spike_min_rel", "wgrad_growth_factor", "mtp_lead_sigma",
                     "mtp_lead_rise", "maxvio_share", "residual_spread_orders", "rollback_lr_scale",
                     "inject_lr_factor"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"monitor.{name} must be a positive finite number, got {getattr(self, name)}")
        if not 0 < self.mtp_lead_ema < 1:
            raise ValueError(f"monitor.mtp_lead_ema must be in (0, 1), got {self.mtp_lead_ema}")
        for detector in DETECTORS:
            response = self.response(detector)
            if response not in RESPONSES:
                raise ValueError(f"monitor.on_{detector} must be one of {', '.join(RESPONSES)}; got {response!r}")
            if response == "skip" and detector in POST_UPDATE_DETECTORS:
                raise ValueError(f"monitor.on_{detector} = 'skip' is impossible: {detector} is judged after the "
                                 f"update; use warn, rollback or anneal")
        parse_faults(self.inject_fault)

    def response(self, detector: str) -> str:
        return getattr(self, f"on_{detector}")


def parse_faults(spec: str) -> dict[int, list[str]]:
    """"lr_spike@30,nan_grad@50" -> {30: ["lr_spike"], 50: ["nan_grad"]}."""
    faults: dict[int, list[str]] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        match = re.fullmatch(r"([a-z_]+)@(\d+)", item)
        if not match or match.group(1) not in FAULT_KINDS or int(match.group(2)) < 1:
            raise ValueError(f"monitor.inject_fault: {item!r} is not KIND@STEP with KIND one of "
                             f"{', '.join(FAULT_KINDS)} and STEP >= 1")
        faults.setdefault(int(match.group(2)), []).append(match.group(1))
    return faults


class DivergenceError(RunStopped):
    """The monitor asked for more rollbacks than `max_rollbacks`: the run cannot be trusted to recover."""


# ==================================================================================================== signals
def parameter_group(name: str) -> str:
    """`backbone.layers.3.mixer.in_proj.weight` -> `layer.3`; lm_head, embeddings, norm_f, mtp on their own."""
    parts = name.split(".")
    if parts[0] == "backbone":
        return f"layer.{parts[2]}" if parts[1] == "layers" else parts[1]
    return parts[0]


def group_norms_ref(named_grads: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Per-group L2 norm of the gradients: the plain loop that defines `WgradNorms`'s fused computation."""
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
    index = torch.tensor([groups.index(parameter_group(name)) for name, _ in named_grads])
    norms = torch.stack(torch._foreach_norm([grad for _, grad in named_grads])).double()
    values = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, index, norms.pow(2)).sqrt()
    return dict(zip(groups, values.tolist()))


class WgradNorms(Hook):
    """`wgrad_norm/<group>` every step: the norms before clipping (clip_grad_norm_ scaled every gradient by the
    same factor min(1, clip / (grad_norm + 1e-6)), which is undone here)."""

    def after_backward(self, trainer, metrics):
        named = [(name, p.grad) for name, p in trainer.model.named_parameters() if p.grad is not None]
        clip, total = trainer.config.grad_clip, metrics.get("grad_norm", float("nan"))
        scale = min(1.0, clip / (total + 1e-6)) if clip > 0 and math.isfinite(total) else 1.0
        for group, value in group_norms(named).items():
            metrics[f"wgrad_norm/{group}"] = value / scale
        return True


def sampled(step: int, every: int) -> bool:
    """Sampled signals are measured on step 1 (a baseline) and every `every`-th step (steps count from 1)."""
    return step == 1 or step % every == 0


class ResidualRMS(Hook):
    """`residual_rms/<i>`: RMS of block i's output on sampled steps, from forward hooks; averaged over the step's
    micro-batches. Evaluation forwards (model.eval()) are not counted."""

    def __init__(self, every: int):
        self.every = every
        self.trainer = None
        self.handles = []
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}

    def on_train_start(self, trainer):
        self.trainer = trainer
        for index, layer in enumerate(trainer.model.backbone.layers):
            self.handles.append(layer.register_forward_hook(self._record(index)))

    def _record(self, index: int):
        def hook(module, inputs, output):
            if module.training and sampled(self.trainer.step + 1, self.every):
                mean_square = output.detach().float().pow(2).mean()
                self.sums[index] = self.sums.get(index, 0.0) + mean_square
                self.counts[index] = self.counts.get(index, 0) + 1
        return hook

    def after_backward(self, trainer, metrics):
        for index in sorted(self.sums):
            metrics[f"residual_rms/{index}"] = math.sqrt(float(self.sums[index]) / self.counts[index])
        self.sums, self.counts = {}, {}
        return True

    def on_train_end(self, trainer):
        for handle in self.handles:
            handle.remove()
        self.handles = []


class RouterBiasSpread(Hook):
    """`router_bias_spread/<i>`: max - min of MoE layer i's aux-loss-free routing bias after the step."""

    def on_step_end(self, trainer, metrics):
        for layer, bias in zip(trainer.moe_layer_ids, trainer.model.router_biases()):
            metrics[f"router_bias_spread/{layer}"] = float(bias.max() - bias.min())


class UpdateRatio(Hook):
    """`update_ratio` (all parameters) and `update_ratio/lm_head` on every `every`-th step: the weights are copied
    before the optimizer step and compared after it. Not reported for a step whose update was dropped."""

    def __init__(self, every: int):
        self.every = every
        self.before: list[tuple[str, torch.Tensor, torch.Tensor]] | None = None

    def after_backward(self, trainer, metrics):
        self.before = None
        if metrics["step"] % self.every == 0:
            self.before = [(name, p, p.detach().clone()) for name, p in trainer.model.named_parameters()
                           if p.grad is not None]
        return True

    @torch.no_grad()
    def on_step_end(self, trainer, metrics):
        if self.before is None:
            return
        before, self.before = self.before, None
        if metrics.get("skipped") or "rollback" in metrics:
            return
        names = [name for name, _, _ in before]
        deltas = torch.stack(torch._foreach_norm(torch._foreach_sub([p for _, p, _ in before],
                                                                    [old for _, _, old in before]))).double()
        weights = torch.stack(torch._foreach_norm([old for _, _, old in before])).double()
        metrics["update_ratio"] = float(deltas.pow(2).sum().sqrt() / weights.pow(2).sum().sqrt().clamp_min(1e-30))
        head = torch.tensor([parameter_group(name) == "lm_head" for name in names])
        if head.any():
            metrics["update_ratio/lm_head"] = float(deltas[head].pow(2).sum().sqrt()
                                                    / weights[head].pow(2).sum().sqrt().clamp_min(1e-30))


def quantized_modules(model: torch.nn.Module) -> dict[str, object]:
    """Every emulated 4- or 8-bit GEMM of the model (the precision policy's NVFP4 and MXFP8 modules; its BF16
    ones flush next to nothing): name -> QuantLinear or the RoutedExperts' quantized grouped matmul (named
    `<experts>.grouped_mm`)."""
    from hybridtron.numerics.linear import QuantizedGroupedMM, QuantLinear

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and module.recipe.format != "bf16":
            found[name] = module
        grouped = getattr(module, "grouped_mm", None)
        if isinstance(grouped, QuantizedGroupedMM) and grouped.recipe.format != "bf16":
            found[f"{name}.grouped_mm"] = grouped
    return found


class Underflow(Hook):
    """`underflow/<module>` on sampled steps: the share of non-zero fprop operand values (input and weight) that
    the module's quantization flushed to zero during that step's training forwards. Reads the numerics'
    UnderflowStats, switched on by a forward pre-hook only for training forwards of sampled steps; a model without
    quantized modules reports nothing."""

    def __init__(self, every: int):
        self.every = every
        self.modules: dict[str, object] = {}
        self.handle = None

    def on_train_start(self, trainer):
        self.modules = quantized_modules(trainer.model)
        if self.modules:
            self.handle = trainer.model.register_forward_pre_hook(
                lambda model, args: self._enable(model.training and sampled(trainer.step + 1, self.every)))

    def _enable(self, enabled: bool) -> None:
        for module in self.modules.values():
            module.stats.enabled = enabled

    def after_backward(self, trainer, metrics):
        if self.modules and sampled(metrics["step"], self.every):
            for name, module in self.modules.items():
                metrics[f"underflow/{name}"] = module.stats.zero_fraction
                module.stats.reset()
        return True

    def on_train_end(self, trainer):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


# ================================================================================================== detectors
@dataclass
class Finding:
    detector: str
    message: str
    key: str
    value: float
    threshold: float


class Rolling:
    """The last `size` finite values of a signal."""

    def __init__(self, size: int):
        self.values: collections.deque[float] = collections.deque(maxlen=size)

    def add(self, value) -> None:
        if value is not None and math.isfinite(value):
            self.values.append(float(value))

    def __len__(self) -> int:
        return len(self.values)

    def mean_std(self) -> tuple[float, float]:
        array = np.asarray(self.values)
        return float(array.mean()), float(array.std())

    def median(self) -> float:
        return float(np.median(np.asarray(self.values)))


class Detector:
    """Judges one step's metrics against the history of accepted steps. `check` reads, `observe` commits."""

    name = ""

    def __init__(self, config: MonitorConfig):
        self.config = config

    def check(self, metrics: dict) -> Finding | None:
        raise NotImplementedError

    def observe(self, metrics: dict) -> None: ...

    def state_dict(self) -> dict:
        """The Rolling histories by attribute name (detectors with other state override this)."""
        return {key: list(value.values) for key, value in vars(self).items() if isinstance(value, Rolling)}

    def load_state_dict(self, state: dict) -> None:
        for key, values in state.items():
            rolling = getattr(self, key)
            rolling.values.clear()
            rolling.values.extend(values)


def _loss_keys(metrics: dict) -> list[str]:
    return [k for k in metrics if k in ("loss", "lm_loss") or k.startswith("mtp_loss_")]


class NonFinite(Detector):
    name = "nonfinite"

    def check(self, metrics):
        keys = _loss_keys(metrics) + [k for k in metrics if k == "grad_norm" or k.startswith("wgrad_norm/")]
        bad = [k for k in keys if isinstance(metrics[k], float) and not math.isfinite(metrics[k])]
        if bad:
            return Finding(self.name, f"non-finite {', '.join(bad[:6])}{' ...' if len(bad) > 6 else ''}",
                           bad[0], metrics[bad[0]], float("inf"))
        return None


class LossSpike(Detector):
    name = "loss_spike"

    def __init__(self, config):
        super().__init__(config)
        self.history = Rolling(config.window)

    def check(self, metrics):
        value = metrics.get("lm_loss")
        if value is None or len(self.history) < self.config.min_history:
            return None
        mean, std = self.history.mean_std()
        threshold = max(mean + self.config.loss_spike_sigma * std, mean * (1 + self.config.loss_spike_min_rel))
        if value > threshold:
            return Finding(self.name, f"lm_loss {value:.4g} > {threshold:.4g} (mean {mean:.4g} + "
                           f"{self.config.loss_spike_sigma:g} sigma {std:.3g})", "lm_loss", value, threshold)
        return None

    def observe(self, metrics):
        self.history.add(metrics.get("lm_loss"))


class WgradGrowth(Detector):
    name = "wgrad_growth"
    keys = ("grad_norm", "wgrad_norm/lm_head")

    def __init__(self, config):
        super().__init__(config)
        self.histories = {key: Rolling(config.window) for key in self.keys}

    def check(self, metrics):
        for key, history in self.histories.items():
            value = metrics.get(key)
            if value is None or len(history) < self.config.min_history:
                continue
            threshold = self.config.wgrad_growth_factor * history.median()
            if value > threshold:
                return Finding(self.name, f"{key} {value:.4g} > {self.config.wgrad_growth_factor:g} x rolling "
                               f"median {history.median():.4g}", key, value, threshold)
        return None

    def observe(self, metrics):
        for key, history in self.histories.items():
            history.add(metrics.get(key))

    def state_dict(self):
        return {"histories": {key: list(h.values) for key, h in self.histories.items()}}

    def load_state_dict(self, state):
        for key, values in state["histories"].items():
            self.histories[key].values.clear()
            self.histories[key].values.extend(values)


class MtpLeads(Detector):
    """An MTP depth's loss degrading while the main loss is not (see the module docstring): a spike of the per-step
    gap mtp_loss_d - lm_loss, or a rise of the smoothed mtp_loss_d above its own running minimum."""

    name = "mtp_leads"

    def __init__(self, config):
        super().__init__(config)
        self.gaps: dict[str, Rolling] = {}
        self.main = Rolling(config.window)
        self.ema: dict[str, float] = {}  # smoothed lm_loss and mtp_loss_<d>
        self.ema_min: dict[str, float] = {}
        self.seen = 0

    def _smoothed(self, key: str, value: float) -> float:
        beta = self.config.mtp_lead_ema
        return beta * self.ema[key] + (1 - beta) * value

    def check(self, metrics):
        cfg, lm = self.config, metrics.get("lm_loss")
        if (lm is None or metrics["step"] <= cfg.mtp_lead_after or self.seen < cfg.min_history
                or "lm_loss" not in self.ema_min):
            return None
        main_mean, main_std = self.main.mean_std()
        main_spiking = lm > main_mean + cfg.mtp_lead_sigma * main_std
        main_rise = self._smoothed("lm_loss", lm) / self.ema_min["lm_loss"] - 1
        for key in sorted(k for k in metrics if k.startswith("mtp_loss_") and k in self.ema_min):
            gap = metrics[key] - lm
            mean, std = self.gaps[key].mean_std()
            threshold = mean + cfg.mtp_lead_sigma * std
            if gap > threshold and not main_spiking:
                return Finding(self.name, f"{key} - lm_loss = {gap:.4g} > {threshold:.4g} (mean {mean:.4g} + "
                               f"{cfg.mtp_lead_sigma:g} sigma) while lm_loss is not spiking", key, gap, threshold)
            rise = self._smoothed(key, metrics[key]) / self.ema_min[key] - 1
            if rise > cfg.mtp_lead_rise and main_rise < rise / 2:
                return Finding(self.name, f"smoothed {key} {rise:.1%} above its minimum, lm_loss {main_rise:.1%}",
                               key, rise, cfg.mtp_lead_rise)
        return None

    def observe(self, metrics):
        lm = metrics.get("lm_loss")
        values = {k: v for k, v in metrics.items() if k.startswith("mtp_loss_") or k == "lm_loss"}
        if lm is None or not all(math.isfinite(v) for v in values.values()):
            return
        self.main.add(lm)
        for key, value in values.items():
            if key != "lm_loss":
                self.gaps.setdefault(key, Rolling(self.config.window)).add(value - lm)
            self.ema[key] = self._smoothed(key, value) if key in self.ema else value
            # the minimum counts once the first, fastest-learning steps are past
            if self.seen >= self.config.min_history:
                self.ema_min[key] = min(self.ema_min.get(key, math.inf), self.ema[key])
        self.seen += 1

    def state_dict(self):
        return {"main": list(self.main.values), "gaps": {k: list(v.values) for k, v in self.gaps.items()},
                "ema": dict(self.ema), "ema_min": dict(self.ema_min), "seen": self.seen}

    def load_state_dict(self, state):
        self.main.values.clear()
        self.main.values.extend(state["main"])
        self.gaps = {}
        for key, values in state["gaps"].items():
            self.gaps[key] = Rolling(self.config.window)
            self.gaps[key].values.extend(values)
        self.ema, self.ema_min, self.seen = dict(state["ema"]), dict(state["ema_min"]), state["seen"]


class MaxVio(Detector):
    """MaxVio per MoE layer (ExpertLoad's `maxvio/<i>`, the report's max/mean definition) above a share of E/K."""

    name = "maxvio"

    def __init__(self, config, bound: float):
        super().__init__(config)
        self.bound = bound

    def check(self, metrics):
        if metrics["step"] <= self.config.min_history:  # the router biases have not had time to balance yet
            return None
        threshold = self.config.maxvio_share * self.bound
        for key in sorted(k for k in metrics if k.startswith("maxvio/")):
            if metrics[key] > threshold:
                return Finding(self.name, f"{key} {metrics[key]:.3g} > {self.config.maxvio_share:g} x bound "
                               f"{self.bound:.4g}", key, metrics[key], threshold)
        return None


class ResidualSpread(Detector):
    name = "residual_spread"

    def check(self, metrics):
        values = [v for k, v in metrics.items() if k.startswith("residual_rms/") and v > 0 and math.isfinite(v)]
        if len(values) < 2:
            return None
        orders = math.log10(max(values) / min(values))
        if orders > self.config.residual_spread_orders:
            return Finding(self.name, f"residual RMS spans {orders:.2f} orders of magnitude across layers "
                           f"(min {min(values):.3g}, max {max(values):.3g})", "residual_rms", orders,
                           self.config.residual_spread_orders)
        return None


# ================================================================================================== responses
class EventLog:
    """events.jsonl (append-only) and the same events on stderr."""

    def __init__(self, run_dir: Path, stream=sys.stderr):
        self.path, self.stream = run_dir / EVENTS_FILE, stream
        self.newline_first = False  # a progress bar owns the current terminal line

    def write(self, step: int, detector: str, action: str, message: str, **extra) -> dict:
        event = {"time": round(time.time(), 3), "step": step, "detector": detector, "action": action,
                 "message": message, **extra}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(json.dumps(event, default=_json_default) + "\n")
        lead = "\n" if self.newline_first else ""
        self.stream.write(f"{lead}[monitor] step {step}: {detector} -> {action}: {message}\n")
        self.stream.flush()
        return event


def _json_default(value):
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _clean(value):
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)


class StabilityMonitor(Hook):
    """Runs the detectors on each step's signals and chooses the response; `Recovery`, the last hook of the
    run, carries out rollbacks and marks checkpoints GOOD. Place it after the signal hooks and ExpertLoad, and
    before MetricsLogger and Checkpointing (see `monitor_hooks`)."""

    def __init__(self, config: MonitorConfig, run_dir: Path, maxvio_bound: float, stream=sys.stderr):
        self.config = config
        self.events = EventLog(run_dir, stream)
        self.run_dir = run_dir
        self.detectors = [NonFinite(config), LossSpike(config), WgradGrowth(config), MtpLeads(config),
                          ResidualSpread(config), MaxVio(config, maxvio_bound)]
        self.last_fired: dict[str, int] = {}  # detector -> step it last fired (a warn episode ends after `window`
        #                                       quiet steps)
        self.consecutive_skips = 0
        self.pending: dict | None = None  # the rollback or anneal Recovery carries out at the end of this step
        # the run's history: kept across rollbacks, restored on resume
        self.history = {"rollbacks": 0, "lr_scale": 1.0, "grad_accum_dtype": None, "anneals": 0}
        self._keep_history = False

    # ------------------------------------------------------------------------------------------ the step
    def on_train_start(self, trainer):
        self.events.newline_first = trainer.hooks.find(ProgressBar) is not None
        self.apply_history(trainer)

    def after_backward(self, trainer, metrics):
        self.pending = None
        pre = [d for d in self.detectors if d.name not in POST_UPDATE_DETECTORS]
        action = self._respond(trainer, metrics, pre, can_skip=True)
        if action == "apply":
            self.consecutive_skips = 0
            for detector in pre:
                detector.observe(metrics)
        return action == "apply"

    def on_step_end(self, trainer, metrics):
        if self.pending is None:
            self._respond(trainer, metrics, [d for d in self.detectors if d.name in POST_UPDATE_DETECTORS],
                          can_skip=False)

    def _respond(self, trainer, metrics, detectors, can_skip: bool) -> str:
        """Judge, log, and decide: 'apply' (the update stands), 'skip', or a pending 'rollback' / 'anneal'.
        `can_skip`: the update is still to come (after_backward), so dropping it is possible."""
        step = metrics["step"]
        findings = []
        for detector in detectors:
            finding = detector.check(metrics)
            if finding is not None:
                findings.append(finding)
                if detector.name == "nonfinite":
                    break  # NaN/Inf makes every other comparison meaningless
        chosen = "warn"
        for finding in findings:
            response = self.config.response(finding.detector)
            last = self.last_fired.get(finding.detector)
            if response != "warn" or last is None or step - last > self.config.window:
                self._event(metrics, finding.detector, response, finding.message, key=finding.key,
                            value=_clean(finding.value), threshold=_clean(finding.threshold))
            self.last_fired[finding.detector] = step
            chosen = max(chosen, response, key=SEVERITY.get)
        if chosen == "skip":
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.config.escalate_after:
                chosen = "rollback"
                self._event(metrics, "monitor", "rollback", f"{self.consecutive_skips} consecutive skipped steps")
        if chosen in ("rollback", "anneal"):
            target = trainer.checkpoints.latest(good_only=True)
            if target is None:
                fallback = "skip" if can_skip else "warn"
                self._event(metrics, "monitor", fallback, f"no GOOD checkpoint to {chosen} to"
                            + ("; dropping the update" if can_skip else ""))
                chosen = fallback
            else:
                if self.history["rollbacks"] >= self.config.max_rollbacks:
                    self._event(metrics, "monitor", "give_up", f"{chosen} requested after "
                                f"{self.history['rollbacks']} rollbacks (monitor.max_rollbacks)")
                    raise DivergenceError(f"step {step}: still unstable after {self.history['rollbacks']} "
                                          f"rollbacks; see {self.events.path}")
                self.pending = {"action": chosen, "target": target}
                metrics["rollback"] = step_of(target)
                return chosen
        if chosen == "skip":
            metrics["skipped"] = True
            return "skip"
        return "apply"

    def _event(self, metrics, detector, action, message, **extra):
        self.events.write(metrics["step"], detector, action, message, **extra)
        metrics.setdefault("events", []).append(f"{detector}:{action}")

    # --------------------------------------------------------------------------------------- run history
    def apply_history(self, trainer) -> None:
        """Re-apply what earlier rollbacks changed: the LR scale and the gradient-accumulation dtype."""
        trainer.schedule.peak_lr = trainer.config.lr * self.history["lr_scale"]
        if self.history["grad_accum_dtype"] is not None:
            trainer.config = dataclasses.replace(trainer.config, grad_accum_dtype=self.history["grad_accum_dtype"])
            set_output_accumulation(trainer.model, self.history["grad_accum_dtype"])

    @contextlib.contextmanager
    def keeping_history(self):
        """Load a checkpoint without forgetting the run's history (what rollbacks have done)."""
        self._keep_history = True
        try:
            yield
        finally:
            self._keep_history = False

    def state_dict(self):
        return {"detectors": {d.name: d.state_dict() for d in self.detectors}, "last_fired": dict(self.last_fired),
                "consecutive_skips": self.consecutive_skips, "history": dict(self.history)}

    def load_state_dict(self, state):
        for detector in self.detectors:
            detector.load_state_dict(state["detectors"][detector.name])
        self.last_fired, self.consecutive_skips = dict(state["last_fired"]), state["consecutive_skips"]
        if not self._keep_history:
            self.history = dict(state["history"])


def set_output_accumulation(model: torch.nn.Module, dtype: str) -> None:
    """Switch the output layer's Megatron-style main_grad (numerics.grad_accum.MainGradLinear) to `dtype`; between
    optimizer steps, when the buffer is empty."""
    from hybridtron.numerics.grad_accum import MainGradLinear

    for module in model.modules():
        if isinstance(module, MainGradLinear) and module.accum_dtype != dtype:
            module.set_accum_dtype(dtype)


class Recovery(Hook):
    """The last hook of a run: carries out the rollback or anneal the monitor decided on this step, and marks
    checkpoints GOOD once `good_after` steps past them went by without one."""

    def __init__(self, monitor: StabilityMonitor):
        self.monitor = monitor

    def on_train_start(self, trainer):
        if trainer.checkpoints.list():
            self.monitor.events.write(trainer.step, "monitor", "resume", f"resumed at step {trainer.step}")
        else:
            trainer.save_checkpoint(blocking=True)
            trainer.checkpoints.mark_good(0)
            self.monitor.events.write(0, "checkpoint", "mark_good", "step 0 (the initialization) is the first "
                                      "rollback target")

    def on_step_end(self, trainer, metrics):
        pending, self.monitor.pending = self.monitor.pending, None
        if pending is not None:
            self.roll_back(trainer, metrics, pending)
        self.mark_good(trainer)

    def mark_good(self, trainer) -> None:
        for path in trainer.checkpoints.list():
            step = step_of(path)
            if not (path / GOOD).exists() and step + self.monitor.config.good_after <= trainer.step:
                try:
                    trainer.checkpoints.mark_good(step)
                except FileNotFoundError:  # pruned by the checkpoint writer thread meanwhile
                    continue
                self.monitor.events.write(trainer.step, "checkpoint", "mark_good", f"step {step}: "
                                          f"{trainer.step - step} steps past it without a rollback")

    def roll_back(self, trainer, metrics, pending) -> None:
        monitor, config, history = self.monitor, self.monitor.config, self.monitor.history
        bad_step, target = metrics["step"], pending["target"]
        checkpoints = trainer.checkpoints
        checkpoints.wait()
        position = copy.deepcopy(trainer.loader.state_dict())  # just past the batches that caused the trouble
        with monitor.keeping_history():
            trainer.load_checkpoint(target)
        trainer.loader.load_state_dict(position)
        target_step = trainer.step
        history["rollbacks"] += 1
        discarded = [path.name for path in checkpoints.list() if step_of(path) > target_step]
        for name in discarded:
            shutil.rmtree(checkpoints.directory / name)
        moved = self.move_abandoned_lines(target_step, history["rollbacks"])

        changes = []
        if config.rollback_lr_scale != 1.0:
            history["lr_scale"] *= config.rollback_lr_scale
            changes.append(f"LR x{history['lr_scale']:g}")
        if config.rollback_fp32_grad_accum and trainer.config.grad_accum_dtype == "bf16":
            history["grad_accum_dtype"] = "fp32"
            changes.append("grad_accum_dtype bf16 -> fp32")
        if pending["action"] == "anneal":
            schedule = trainer.schedule
            decay = config.anneal_steps or max(schedule.total_steps - schedule.decay_start, 1)
            new_total = min(target_step + decay, schedule.total_steps)
            schedule.anneal_now(target_step, new_total)
            history["anneals"] += 1
            changes.append(f"decay starts now, run ends at step {new_total}")
        monitor.apply_history(trainer)
        monitor.events.write(
            bad_step, "monitor", "rolled_back" if pending["action"] == "rollback" else "annealed",
            f"step {bad_step} -> {target.name}; skipped the data of steps {target_step + 1}-{bad_step}"
            + (f"; {', '.join(changes)}" if changes else ""),
            target_step=target_step, rollback=history["rollbacks"], discarded_checkpoints=discarded,
            moved_metric_lines=moved, lr_scale=history["lr_scale"], grad_accum_dtype=trainer.config.grad_accum_dtype,
            total_steps=trainer.schedule.total_steps)

    def move_abandoned_lines(self, target_step: int, rollback: int) -> int:
        """Move metrics.jsonl lines past `target_step` to metrics.rolled_back.jsonl (side file first: a crash in
        between duplicates lines there rather than losing them)."""
        path = self.monitor.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0
        kept, moved = [], []
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if record.get("step", 0) > target_step:
                moved.append(json.dumps({**record, "rolled_back": rollback}))
            else:
                kept.append(line)
        if moved:
            with (self.monitor.run_dir / ROLLED_BACK_FILE).open("a") as handle:
                handle.write("".join(line + "\n" for line in moved))
            staging = path.with_name(path.name + ".tmp")
            staging.write_text("".join(line + "\n" for line in kept))
            os.replace(staging, path)
        return len(moved)


# ============================================================================================= fault injection
class _CorruptingLoader:
    """Wraps the training loader: the batches of a `corrupt_batch` step become garbage with a huge loss: random
    input tokens, every label the last vocabulary id (one no data ever had as a target, so the model's probability
    for it keeps falling). Random labels alone cost only about log(vocab), within the noise of a small batch."""

    def __init__(self, loader, injector: "FaultInjector"):
        self.loader, self.injector = loader, injector

    def __next__(self):
        input_ids, labels = next(self.loader)
        if self.injector.due("corrupt_batch", self.injector.trainer.step + 1):
            generator = torch.Generator().manual_seed(1234)
            vocab = self.injector.trainer.model.config.vocab_size
            input_ids = torch.randint(0, vocab, input_ids.shape, generator=generator)
            labels = torch.full_like(labels, vocab - 1)
        return input_ids, labels

    def __iter__(self):
        return self

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)


class FaultInjector(Hook):
    """Test-only faults (`monitor.inject_fault`, see the module docstring); each fires once per run."""

    def __init__(self, config: MonitorConfig):
        self.config = config
        self.faults = parse_faults(config.inject_fault)
        self.fired: set[str] = set()
        self.trainer = None
        self.handle = None

    def due(self, kind: str, step: int) -> bool:
        return kind in self.faults.get(step, []) and f"{kind}@{step}" not in self.fired

    def _fire(self, kind: str, step: int) -> None:
        self.fired.add(f"{kind}@{step}")
        monitor = self.trainer.hooks.find(StabilityMonitor)
        if monitor is not None:
            monitor.events.write(step, "inject", kind, "fault injected (monitor.inject_fault)")

    def on_train_start(self, trainer):
        self.trainer = trainer
        if not isinstance(trainer.loader, _CorruptingLoader):
            trainer.loader = _CorruptingLoader(trainer.loader, self)
        # the final norm's weight: every token's gradient passes through it, whatever lm_head has become
        self.handle = trainer.model.backbone.norm_f.weight.register_hook(self._poison)

    def _poison(self, grad):
        step = self.trainer.step + 1
        if not self.due("nan_grad", step):
            return grad
        self._fire("nan_grad", step)
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    def after_backward(self, trainer, metrics):
        step = metrics["step"]
        if self.due("corrupt_batch", step):
            self._fire("corrupt_batch", step)  # after every micro-batch of the step was corrupted
        if self.due("lr_spike", step):
            self._fire("lr_spike", step)
            for group in trainer.optimizer.param_groups:
                group["lr"] *= self.config.inject_lr_factor
        return True

    @torch.no_grad()
    def on_step_end(self, trainer, metrics):
        step = metrics["step"]
        if self.due("router_bias", step) and "rollback" not in metrics:
            self._fire("router_bias", step)
            trainer.model.router_biases()[0][0] += self.config.inject_router_bias

    def on_train_end(self, trainer):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def state_dict(self):
        return {"fired": sorted(self.fired)}

    def load_state_dict(self, state):
        self.fired |= set(state["fired"])  # a rollback must not re-arm a fault that already fired


# ===================================================================================================== wiring
def monitor_hooks(config: MonitorConfig, run_dir: Path, model_config, stream=sys.stderr
                  ) -> tuple[list[Hook], list[Hook]]:
    """`(before, last)`: the hooks to place after ExpertLoad and Validation but before MetricsLogger and
    Checkpointing (fault injector, signals, StabilityMonitor), and the one to place last (Recovery)."""
    if not config.enabled:
        return [], []
    monitor = StabilityMonitor(config, Path(run_dir), model_config.n_routed_experts /
                               model_config.num_experts_per_tok, stream)
    before = [FaultInjector(config)] if config.inject_fault else []
    before += [WgradNorms(), ResidualRMS(config.residual_every), RouterBiasSpread(),
               UpdateRatio(config.update_ratio_every), Underflow(config.underflow_every), monitor]
    return before, [Recovery(monitor)]
