"""Hooks observe the training loop; they never change what a step does. Each has a `state_dict` so that a resumed
run restores it.

Call points (all optional): `on_train_start(trainer)`, `on_initial_evaluation(trainer, values)` (a fresh run's
step-0 evaluations), `on_step_end(trainer, stats, decision)` with the finished
`StepStats` and the monitor's `Decision` (read-only), `on_rollback(trainer, bad_step, target_step, rollback)` after
the trainer restored a checkpoint, `on_train_end(trainer)`. Every hook sees the same finished step, so their order
does not matter.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hybridtron.files import METRICS_FILE, ROLLED_BACK_FILE

if TYPE_CHECKING:  # a hook module stays light: `hybridtron branch --help` imports it to subclass Hook
    from hybridtron.train.monitor.recovery import Decision
    from hybridtron.train.stats import StepStats


class Hook:
    def on_train_start(self, trainer) -> None: ...

    def on_initial_evaluation(self, trainer, values: dict[str, float]) -> None: ...

    def on_step_end(self, trainer, stats: StepStats, decision: Decision) -> None: ...

    def on_rollback(self, trainer, bad_step: int, target_step: int, rollback: int) -> None: ...

    def on_train_end(self, trainer) -> None: ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


def step_line(stats: StepStats, decision: Decision) -> dict:
    """The metrics.jsonl line of a step: its record and what the monitor decided."""
    line = stats.record()
    if decision.action == "skip":
        line["skipped"] = True
    elif decision.rolls_back:
        line["rollback"] = int(decision.target.name.removeprefix("step_"))
    return line


class MetricsLogger(Hook):
    """One JSON line per step in `metrics.jsonl` (step 0 carries the initial evaluation); TensorBoard event files
    beside it when the `tensorboard` package is installed (`tensorboard/`)."""

    def __init__(self, run_dir: Path, every: int = 1):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.every = every
        self.tensorboard = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional (the dev extra has it)
            SummaryWriter = None
        if SummaryWriter is not None:
            self.tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))

    def on_train_start(self, trainer):
        """On resume, drop lines past the checkpoint: the resumed run writes those steps again, identically."""
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= trainer.step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, line: dict) -> None:
        # floats exactly (json writes the shortest repr that reads back bit for bit); NaN/Inf as strings
        clean = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in line.items()}
        with self.path.open("a") as handle:
            handle.write(json.dumps(clean) + "\n")
        if self.tensorboard is not None:
            for key, value in line.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self.tensorboard.add_scalar(key, value, line["step"])

    def on_initial_evaluation(self, trainer, values):
        self.write({"step": 0, **values})

    def on_step_end(self, trainer, stats, decision):
        if stats.step % self.every == 0 or stats.events or stats.evaluation:
            self.write(step_line(stats, decision))

    def on_rollback(self, trainer, bad_step, target_step, rollback):
        """Move the lines of the abandoned steps (past `target_step`) to metrics.rolled_back.jsonl, side file first:
        a crash in between duplicates lines there rather than losing them."""
        if not self.path.exists():
            return
        kept, moved = [], []
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            if record.get("step", 0) > target_step:
                moved.append(json.dumps({**record, "rolled_back": rollback}))
            else:
                kept.append(line)
        if moved:
            with (self.run_dir / ROLLED_BACK_FILE).open("a") as handle:
                handle.write("".join(line + "\n" for line in moved))
            staging = self.path.with_name(self.path.name + ".tmp")
            staging.write_text("".join(line + "\n" for line in kept))
            os.replace(staging, self.path)

    def on_train_end(self, trainer):
        if self.tensorboard is not None:
            self.tensorboard.close()


def format_duration(seconds: float) -> str:
    """`12s`, `4m05s`, `2h03m`: whole units, so a duration never reads `35m60s`."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressBar(Hook):
    """The step, the objective's headline metric (pretraining: `ce`, the next-token cross entropy, as the
    validation loss is), the validation value, the step's ranges (RL: `ratio 0.91-1.12`), tokens/s and the ETA. On
    a terminal: one line redrawn in place; into a file or a pipe: a plain line every `log_every` steps and at the
    end, so logs stay readable."""

    def __init__(self, stream=None, width: int = 28, log_every: int = 10):
        stream = sys.stderr if stream is None else stream  # the stderr of the moment, which may be redirected
        self.stream, self.width, self.log_every = stream, width, log_every
        self.interactive = hasattr(stream, "isatty") and stream.isatty()
        self.started = None
        self.start_step = 0
        self.last_val = None

    def on_train_start(self, trainer):
        self.started, self.start_step = time.perf_counter(), trainer.step

    def on_step_end(self, trainer, stats, decision):
        total = trainer.schedule.total_steps
        done = trainer.step - self.start_step
        elapsed = time.perf_counter() - self.started
        eta = elapsed / max(done, 1) * (total - trainer.step)
        key, label = trainer.objective.headline
        self.last_val = stats.evaluation.get("val_loss", self.last_val)
        val = f" val {label} {self.last_val:.3f}" if self.last_val is not None else ""
        ranges = "".join(f" {name} {low:.2f}-{high:.2f}" for name, (low, high) in stats.ranges.items())
        text = (f"{trainer.step}/{total} {label} {stats.losses.get(key, math.nan):.3f}{val}{ranges} "
                f"{stats.tokens / max(stats.seconds, 1e-9):.0f} tok/s ETA {format_duration(eta)}")
        if self.interactive:
            filled = int(self.width * trainer.step / max(total, 1))
            self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {text}")
            if trainer.step == total:
                self.stream.write("\n")
        elif trainer.step % self.log_every == 0 or trainer.step == total:
            self.stream.write(f"step {text}\n")
        self.stream.flush()
