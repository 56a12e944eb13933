"""The `[monitor]` section: which signals are sampled how often, detector thresholds, and each detector's response.

Responses: warn (an event), skip (drop the step's update), rollback (restore the newest GOOD checkpoint and skip the
data window that caused the trouble), anneal (a rollback that also starts the LR decay at once). See
`hybridtron.train.monitor` for what each detector watches.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar

RESPONSES = ("warn", "skip", "rollback", "anneal")
SEVERITY = {name: rank for rank, name in enumerate(RESPONSES)}
DETECTORS = ("nonfinite", "loss_spike", "wgrad_growth", "mtp_leads", "maxvio", "residual_spread")
# MaxVio measures what the router biases have done over a window of steps; dropping one step's update undoes none
# of it.
NOT_SKIPPABLE = {"maxvio": "the imbalance comes from the router biases of earlier steps"}
FAULT_KINDS = ("lr_spike", "corrupt_batch", "nan_grad", "router_bias")


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """The `[monitor]` section: signals, detector thresholds and the response of each detector."""

    enabled: bool = True  # watch the run at all (false: no signals, detectors, responses or faults)
    # signals (sampled ones every N steps; per-layer weight-gradient norms and router bias spread every step)
    residual_every: int = 10  # residual-stream RMS per layer
    update_ratio_every: int = 10  # update-to-weight ratio (copies the weights once per sampled step)
    underflow_every: int = 10  # quantization flush-to-zero share (counts every quantized operand that step)
    # detectors
    window: int = 50  # steps of rolling history each detector compares against
    min_history: int = 20  # steps of history before a detector may fire
    loss_spike_sigma: float = 6.0  # loss_spike: lm_loss above mean + this many sigma of the window ...
    loss_spike_min_rel: float = 0.05  # ... and at least this share above the mean
    wgrad_growth_factor: float = 10.0  # wgrad_growth: grad_norm or wgrad_norm/lm_head over this x rolling median
    mtp_lead_sigma: float = 6.0  # mtp_leads: the gap mtp_loss_d - lm_loss above mean + this many sigma
    mtp_lead_rise: float = 0.05  # smoothed MTP loss this share above its minimum (the main loss not following)
    mtp_lead_ema: float = 0.95  # EMA decay per step (about a 20-step memory)
    mtp_lead_after: int = 100  # steps before mtp_leads judges: early on the MTP depths learn more slowly than the
    #                            main head, so their gap grows by itself
    maxvio_share: float = 0.5  # of the bound E/K
    residual_spread_orders: float = 3.0  # residual_spread: log10(max / min residual RMS over layers) above this
    # responses: warn | skip | rollback | anneal
    on_nonfinite: str = "skip"  # the response of each detector: warn, skip, rollback or anneal
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
    inject_lr_factor: float = 1000.0  # lr_spike: the LR multiplier of the faulted step
    inject_router_bias: float = 1.0  # router_bias: added to the first router's bias of expert 0
    expect_divergence: bool = False  # a drill meant to end with its validation loss far above its start (the run
    #   then exits 0; otherwise such an ending is reported and the command exits with status 4)

    RESUMABLE: ClassVar = "all"  # thresholds and responses may change on resume (hybridtron.train.config)

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
            if response == "skip" and detector in NOT_SKIPPABLE:
                raise ValueError(f"monitor.on_{detector} = 'skip' would not help: {NOT_SKIPPABLE[detector]}; use "
                                 f"warn, rollback or anneal")
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
