"""Stability monitoring: the signals the Ultra report watched, detectors on them, and automatic responses.

Ultra's pretraining diverged twice (the Nemotron 3 Ultra report; docs/experiments/divergence1.md reproduces the
first in miniature). What showed it: the loss together with the weight-gradient L2 norm; the MTP-2 loss spiking
first; expert imbalance (the first MoE layer's MaxVio 4.8 -> about 12, bound 23.27); residual norms spreading four
orders of magnitude across layers. What fixed it: a rollback with FP32 gradient reduction; a rollback with immediate
LR annealing and a cut budget. Every run is watched for those signals:

    config.py     MonitorConfig, the `[monitor]` section: sampling, thresholds, the response of each detector
    signals.py    residual RMS per layer, NVFP4 underflow, update-to-weight ratio, router-bias spread (the losses,
                  gradient norms per group and MaxVio per router come with every step: train/stats.py, balance.py)
    detectors.py  nonfinite, loss_spike, wgrad_growth, mtp_leads, maxvio, residual_spread
    recovery.py   StabilityMonitor.judge -> Decision (apply / skip / rollback / anneal), which the trainer carries
                  out; the event log (events.jsonl); GOOD checkpoints
    faults.py     fault injection for drills and tests (`monitor.inject_fault`)

Bookkeeping, all in the run directory: events.jsonl gets one line per event or action (detections, skips,
rollbacks, GOOD marks, resumes), each also printed on stderr; metrics.jsonl keeps one line per step of the
trajectory that counts, and the lines of steps a rollback abandoned move to metrics.rolled_back.jsonl with
`"rolled_back": <rollback number>`; the bad step's own line carries `"rollback": <target step>`, a skipped step's
`"skipped": true`.
"""

from __future__ import annotations

from pathlib import Path

from hybridtron.files import EVENTS_FILE, ROLLED_BACK_FILE
from hybridtron.train.balance import max_violation_bound
from hybridtron.train.monitor.config import DETECTORS, FAULT_KINDS, RESPONSES, MonitorConfig, parse_faults
from hybridtron.train.monitor.detectors import (
    Detector, Finding, LossSpike, MaxVio, MtpLeads, NonFinite, ResidualSpread, Rolling, WgradGrowth,
)
from hybridtron.train.monitor.faults import FaultInjector
from hybridtron.train.monitor.recovery import (
    ANNEAL, APPLY, ROLLBACK, RUN_EVENT, SKIP, Decision, DivergenceError, EventLog, NoMonitor, StabilityMonitor,
)

__all__ = [
    "ANNEAL", "APPLY", "DETECTORS", "EVENTS_FILE", "FAULT_KINDS", "RESPONSES", "ROLLBACK", "ROLLED_BACK_FILE",
    "RUN_EVENT", "SKIP",
    "Decision", "Detector", "DivergenceError", "EventLog", "FaultInjector", "Finding", "LossSpike", "MaxVio",
    "MonitorConfig", "MtpLeads", "NoMonitor", "NonFinite", "ResidualSpread", "Rolling", "StabilityMonitor",
    "WgradGrowth", "build_monitor", "parse_faults",
]


def build_monitor(config: MonitorConfig, run_dir: Path, model_config, stream=None
                  ) -> tuple[StabilityMonitor | NoMonitor, FaultInjector | None]:
    """The run's monitor (a `NoMonitor` when `monitor.enabled` is false) and its fault injector (None unless
    `monitor.inject_fault` names faults)."""
    if not config.enabled:  # nothing watched; the run's own events (resume, interruption) are still recorded
        return NoMonitor(events=EventLog(Path(run_dir), stream)), None
    bound = max_violation_bound(model_config.n_routed_experts, model_config.num_experts_per_tok)
    monitor = StabilityMonitor(config, Path(run_dir), bound, stream)
    faults = FaultInjector(config, monitor.events) if config.inject_fault else None
    return monitor, faults
