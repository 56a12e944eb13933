"""The monitor's decision on each step, and its bookkeeping: the event log and which checkpoints are GOOD.

`StabilityMonitor.judge` measures the signals, runs the detectors and returns a typed `Decision`; the trainer
carries it out in its own code (`Trainer.roll_back`). The monitor never touches the trainer's optimizer, schedule,
loader or config.

    apply     the update stands
    skip      drop the step's update; `escalate_after` consecutive skips turn into a rollback
    rollback  restore the newest GOOD checkpoint, continue reading the data after the window that caused the
              trouble; scale the LR by rollback_lr_scale (compounding) and switch the output layer's gradient
              accumulation from bf16 to fp32 (rollback_fp32_grad_accum)
    anneal    a rollback that also starts the schedule's decay at once and ends the run `anneal_steps` later, as
              the report did at 15T after its second divergence

A rollback with no GOOD checkpoint to go to becomes a skip. More than `max_rollbacks` rollbacks stop the run
(`DivergenceError`).

Checkpoints: the trainer writes a step-0 checkpoint of a fresh run, which is GOOD at once (the initialization has
no past to be wrong about); any other is marked GOOD once `good_after` steps past it ran without a rollback.

The monitor's state has two parts: the trajectory (detector histories, consecutive skips), which a rollback
restores from the checkpoint like the rest of the trainer, and the run's history (rollbacks and anneals done),
which a rollback keeps and a resume restores.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridtron.checkpoint.dcp import GOOD, step_of
from hybridtron.errors import RunStopped
from hybridtron.files import ABANDONED_EVENTS_FILE, EVENTS_FILE
from hybridtron.train.monitor.config import SEVERITY, MonitorConfig
from hybridtron.train.monitor.detectors import (
    Finding, LossSpike, MaxVio, MtpLeads, NonFinite, ResidualSpread, WgradGrowth,
)
from hybridtron.train.monitor.signals import ResidualRMS, RouterBiasSpread, Underflow, UpdateRatio
from hybridtron.train.stats import StepStats

APPLY, SKIP, ROLLBACK, ANNEAL = "apply", "skip", "rollback", "anneal"
RUN_EVENT = "run"  # the `detector` of the events the run itself records (the trainer, the run scaffold)


class DivergenceError(RunStopped):
    """The monitor asked for more rollbacks than `max_rollbacks`: the run cannot be trusted to recover."""


@dataclass(frozen=True)
class Decision:
    """What the trainer does with a step."""

    action: str = APPLY  # apply | skip | rollback | anneal
    target: Path | None = None  # rollback / anneal: the GOOD checkpoint to restore
    lr_scale: float = 1.0  # rollback / anneal: multiply the LR by this from now on
    grad_accum_dtype: str | None = None  # rollback / anneal: switch the output layer's gradient accumulation
    anneal_steps: int = 0  # anneal: decay length; 0 = the planned decay length
    rollback: int = 0  # rollback / anneal: how many rollbacks the run has done, this one included

    @property
    def applies(self) -> bool:
        return self.action == APPLY

    @property
    def rolls_back(self) -> bool:
        return self.action in (ROLLBACK, ANNEAL)


class EventLog:
    """events.jsonl (append-only) and the same events on stderr."""

    def __init__(self, run_dir: Path, stream=None):
        self.path = Path(run_dir) / EVENTS_FILE
        self.stream = stream if stream is not None else sys.stderr  # looked up now: stderr may be redirected
        self.newline_first = False  # a progress bar owns the current terminal line

    def write(self, step: int, detector: str, action: str, message: str, **extra) -> dict:
        event = {"time": round(time.time(), 3), "step": step, "detector": detector, "action": action,
                 "message": message, **{k: _clean(v) for k, v in extra.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as handle:
            handle.write(json.dumps(event, default=str) + "\n")
        lead = "\n" if self.newline_first else ""
        if detector == RUN_EVENT:  # the run's own events: resumed, interrupted, configuration changed
            self.stream.write(f"{lead}[run] step {step}: {action}: {message}\n")
        else:
            self.stream.write(f"{lead}[monitor] step {step}: {detector} -> {action}: {message}\n")
        self.stream.flush()
        return event

    def abandon_after(self, step: int) -> None:
        """A resume from the checkpoint of `step`: the events of the later steps (written before a kill, for steps
        the resumed run computes again) move to events.abandoned.jsonl, so that no event is counted twice. The side
        file is written first: a crash in between duplicates lines there rather than losing them."""
        if not self.path.exists():
            return
        kept, abandoned = [], []
        for line in self.path.read_text().splitlines():
            if line.strip():
                (abandoned if json.loads(line).get("step", 0) > step else kept).append(line)
        if abandoned:
            with self.path.with_name(ABANDONED_EVENTS_FILE).open("a") as handle:
                handle.write("".join(line + "\n" for line in abandoned))
            staging = self.path.with_name(self.path.name + ".tmp")
            staging.write_text("".join(line + "\n" for line in kept))
            os.replace(staging, self.path)


def _clean(value):
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)


class StabilityMonitor:
    """Signals -> detectors -> a `Decision` per step (see the module docstring)."""

    def __init__(self, config: MonitorConfig, run_dir: Path, maxvio_bound: float, stream=None):
        self.config = config
        self.events = EventLog(run_dir, stream)
        self.signals = [ResidualRMS(config.residual_every), Underflow(config.underflow_every),
                        UpdateRatio(config.update_ratio_every), RouterBiasSpread()]
        self.detectors = [NonFinite(config), LossSpike(config), WgradGrowth(config), MtpLeads(config),
                          ResidualSpread(config), MaxVio(config, maxvio_bound)]
        self.last_fired: dict[str, int] = {}  # detector -> step it last fired (a warn episode ends after `window`
        #                                       quiet steps)
        self.consecutive_skips = 0
        self.history = {"rollbacks": 0, "anneals": 0}  # the run's: kept across rollbacks, restored on resume

    # ------------------------------------------------------------------------------------------ the step
    def attach(self, trainer) -> None:
        for signal in self.signals:
            signal.attach(trainer)

    def detach(self) -> None:
        for signal in self.signals:
            signal.detach()

    def begin_step(self, trainer, step: int) -> None:
        for signal in self.signals:
            signal.begin_step(trainer, step)

    def judge(self, trainer, stats: StepStats) -> Decision:
        """Measure the pre-update signals into `stats`, run every detector, and decide."""
        for signal in self.signals:
            stats.signals.update(signal.measure(trainer, stats))
        findings = []
        for detector in self.detectors:
            finding = detector.check(stats)
            if finding is not None:
                findings.append(finding)
                if detector.name == "nonfinite":
                    break  # NaN/Inf makes every other comparison meaningless
        decision = self._respond(trainer, stats, findings)
        if decision.applies:
            self.consecutive_skips = 0
            for detector in self.detectors:
                detector.observe(stats)
        return decision

    def after_update(self, trainer, stats: StepStats, decision: Decision) -> None:
        for signal in self.signals:
            stats.signals.update(signal.after_update(trainer, stats, decision.applies))

    def _respond(self, trainer, stats: StepStats, findings: list[Finding]) -> Decision:
        step = stats.step
        chosen = "warn"
        for finding in findings:
            response = self.config.response(finding.detector)
            last = self.last_fired.get(finding.detector)
            if response != "warn" or last is None or step - last > self.config.window:
                self._event(stats, finding.detector, response, finding.message, key=finding.key,
                            value=finding.value, threshold=finding.threshold)
            self.last_fired[finding.detector] = step
            chosen = max(chosen, response, key=SEVERITY.get)
        if chosen == SKIP:
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.config.escalate_after:
                chosen = ROLLBACK
                self._event(stats, "monitor", ROLLBACK, f"{self.consecutive_skips} consecutive skipped steps")
        if chosen in (ROLLBACK, ANNEAL):
            target = trainer.checkpoints.latest(good_only=True)
            if target is None:
                self._event(stats, "monitor", SKIP, f"no GOOD checkpoint to {chosen} to; dropping the update")
                return Decision(SKIP)
            if self.history["rollbacks"] >= self.config.max_rollbacks:
                self._event(stats, "monitor", "give_up", f"{chosen} requested after {self.history['rollbacks']} "
                            f"rollbacks (monitor.max_rollbacks)")
                raise DivergenceError(f"step {step}: still unstable after {self.history['rollbacks']} rollbacks; "
                                      f"see {self.events.path}")
            self.history["rollbacks"] += 1
            self.history["anneals"] += chosen == ANNEAL
            switch = self.config.rollback_fp32_grad_accum and trainer.config.grad_accum_dtype == "bf16"
            return Decision(chosen, target=target, lr_scale=self.config.rollback_lr_scale,
                            grad_accum_dtype="fp32" if switch else None, anneal_steps=self.config.anneal_steps,
                            rollback=self.history["rollbacks"])
        return Decision(SKIP) if chosen == SKIP else Decision(APPLY)

    def _event(self, stats: StepStats, detector: str, action: str, message: str, **extra) -> None:
        self.events.write(stats.step, detector, action, message, **extra)
        stats.events.append(f"{detector}:{action}")

    # ------------------------------------------------------------------------------------------ checkpoints
    def mark_good(self, checkpoints, step: int) -> None:
        """Mark GOOD every checkpoint that `good_after` steps have now run past without a rollback."""
        for path in checkpoints.list():
            saved_at = step_of(path)
            if not (path / GOOD).exists() and (saved_at == 0 or saved_at + self.config.good_after <= step):
                try:
                    checkpoints.mark_good(saved_at)
                except FileNotFoundError:  # pruned by the checkpoint writer thread meanwhile
                    continue
                reason = "the initialization is the first rollback target" if saved_at == 0 else \
                    f"{step - saved_at} steps past it without a rollback"
                self.events.write(step, "checkpoint", "mark_good", f"step {saved_at}: {reason}")

    # ------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"detectors": {d.name: d.state_dict() for d in self.detectors}, "last_fired": dict(self.last_fired),
                "consecutive_skips": self.consecutive_skips, "history": dict(self.history)}

    def load_state_dict(self, state: dict, *, keep_history: bool = False) -> None:
        """`keep_history`: a rollback restores the trajectory but not what the run has been through."""
        for detector in self.detectors:
            detector.load_state_dict(state["detectors"][detector.name])
        self.last_fired, self.consecutive_skips = dict(state["last_fired"]), state["consecutive_skips"]
        if not keep_history:
            self.history = dict(state["history"])


@dataclass
class NoMonitor:
    """`monitor.enabled = false`: every update applies; nothing is measured or marked."""

    config: MonitorConfig = field(default_factory=lambda: MonitorConfig(enabled=False))
    events: EventLog | None = None

    def attach(self, trainer) -> None: ...

    def detach(self) -> None: ...

    def begin_step(self, trainer, step: int) -> None: ...

    def judge(self, trainer, stats: StepStats) -> Decision:
        return Decision(APPLY)

    def after_update(self, trainer, stats: StepStats, decision: Decision) -> None: ...

    def mark_good(self, checkpoints, step: int) -> None: ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict, *, keep_history: bool = False) -> None: ...
