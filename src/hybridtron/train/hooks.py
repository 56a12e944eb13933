"""Hooks around the training loop. Each one has a `state_dict` so that a resumed run restores it.

Call points: `on_train_start(trainer)`, `after_backward(trainer, metrics) -> bool` (False drops this step's
update: the stability monitor's `skip`), `on_step_end(trainer, metrics)`, `on_train_end(trainer)`.
`metrics` is the step's dict; hooks may add to it (validation loss, MaxVio) before the logger writes it.
"""

from __future__ import annotations

import collections
import json
import math
import sys
import time
from pathlib import Path

import torch

from hybridtron.train.balance import max_violation


class Hook:
    def on_train_start(self, trainer) -> None: ...

    def after_backward(self, trainer, metrics: dict) -> bool:
        return True

    def on_step_end(self, trainer, metrics: dict) -> None: ...

    def on_train_end(self, trainer) -> None: ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


class Hooks:
    """The hooks of a run, called in order; their state dicts are keyed by class name."""

    def __init__(self, hooks: list[Hook]):
        self.hooks = hooks

    def on_train_start(self, trainer):
        for hook in self.hooks:
            hook.on_train_start(trainer)

    def after_backward(self, trainer, metrics) -> bool:
        return all([hook.after_backward(trainer, metrics) for hook in self.hooks])  # every hook sees the step

    def on_step_end(self, trainer, metrics):
        for hook in self.hooks:
            hook.on_step_end(trainer, metrics)

    def on_train_end(self, trainer):
        for hook in self.hooks:
            hook.on_train_end(trainer)

    def state_dict(self) -> dict:
        return {type(hook).__name__: hook.state_dict() for hook in self.hooks}

    def load_state_dict(self, state: dict) -> None:
        for hook in self.hooks:
            if type(hook).__name__ in state:
                hook.load_state_dict(state[type(hook).__name__])

    def find(self, cls):
        return next((hook for hook in self.hooks if isinstance(hook, cls)), None)


class ExpertLoad(Hook):
    """MaxVio per MoE layer over the last `window` steps (the report measured over 20 iterations)."""

    def __init__(self, window: int):
        self.window = collections.deque(maxlen=window)

    def on_step_end(self, trainer, metrics):
        counts = metrics.pop("expert_counts", None)
        if counts is None:
            return
        self.window.append(counts)
        for layer, value in zip(trainer.moe_layer_ids, max_violation(torch.stack(list(self.window)).sum(0))):
            metrics[f"maxvio/{layer}"] = round(float(value), 4)

    def state_dict(self):
        return {"window": list(self.window)}

    def load_state_dict(self, state):
        self.window.clear()
        self.window.extend(state["window"])


class Validation(Hook):
    """Held-out loss (the backbone's next-token CE) at step 0, every `every` steps, and at the end."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], every: int):
        self.batches, self.every = batches, every
        self.history: list[tuple[int, float]] = []

    @torch.no_grad()
    def evaluate(self, trainer) -> float:
        model = trainer.model
        was_training = model.training
        model.eval()
        total = 0.0
        for input_ids, labels in self.batches:
            with trainer.autocast():
                total += float(model(input_ids, labels, mtp=False).lm_loss)
        model.train(was_training)
        return total / len(self.batches)

    def on_train_start(self, trainer):
        if trainer.step == 0 and not self.history:
            self.initial = self.evaluate(trainer)
            self.history.append((0, self.initial))
            trainer.log({"step": 0, "val_loss": self.initial})

    def on_step_end(self, trainer, metrics):
        if trainer.step % self.every == 0 or trainer.step == trainer.schedule.total_steps:
            metrics["val_loss"] = self.evaluate(trainer)
            self.history.append((trainer.step, metrics["val_loss"]))

    def state_dict(self):
        return {"history": list(self.history)}

    def load_state_dict(self, state):
        self.history = [tuple(x) for x in state["history"]]


class MetricsLogger(Hook):
    """One JSON line per step in `metrics.jsonl`; TensorBoard event files too when tensorboard is installed."""

    def __init__(self, run_dir: Path, every: int = 1):
        self.path = run_dir / "metrics.jsonl"
        self.every = every
        self.tensorboard = None
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            pass

    def on_train_start(self, trainer):
        """On resume, drop lines past the checkpoint: the resumed run writes those steps again, identically."""
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= trainer.step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, metrics: dict) -> None:
        # floats exactly (json writes the shortest repr that reads back bit for bit); NaN/Inf as strings
        clean = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        with self.path.open("a") as handle:
            handle.write(json.dumps(clean) + "\n")
        if self.tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tensorboard.add_scalar(key, value, metrics["step"])

    def on_step_end(self, trainer, metrics):
        if trainer.step % self.every == 0 or "val_loss" in metrics or metrics.get("events"):
            self.write(metrics)

    def on_train_end(self, trainer):
        if self.tensorboard is not None:
            self.tensorboard.close()


class ProgressBar(Hook):
    """A one-line progress bar on stderr: step, loss, validation loss, tokens/s and ETA."""

    def __init__(self, stream=sys.stderr, width: int = 28):
        self.stream, self.width = stream, width
        self.started = None
        self.start_step = 0
        self.last_val = None

    def on_train_start(self, trainer):
        self.started, self.start_step = time.perf_counter(), trainer.step

    def on_step_end(self, trainer, metrics):
        total = trainer.schedule.total_steps
        done = trainer.step - self.start_step
        elapsed = time.perf_counter() - self.started
        eta = elapsed / max(done, 1) * (total - trainer.step)
        self.last_val = metrics.get("val_loss", self.last_val)
        filled = int(self.width * trainer.step / max(total, 1))
        val = f" val {self.last_val:.3f}" if self.last_val is not None else ""
        line = (f"\r[{'#' * filled}{'.' * (self.width - filled)}] {trainer.step}/{total} loss {metrics['loss']:.3f}"
                f"{val} {metrics.get('tokens_per_s', 0):.0f} tok/s ETA {eta // 60:.0f}m{eta % 60:02.0f}s")
        self.stream.write(line)
        if trainer.step == total:
            self.stream.write("\n")
        self.stream.flush()


class Checkpointing(Hook):
    """An asynchronous checkpoint every `every` steps and a blocking one at the end; none of a step the stability
    monitor is about to roll back (`"rollback"` in its metrics)."""

    def __init__(self, every: int):
        self.every = every

    def on_step_end(self, trainer, metrics):
        if (trainer.step % self.every == 0 and trainer.step < trainer.schedule.total_steps
                and "rollback" not in metrics):
            trainer.save_checkpoint()

    def on_train_end(self, trainer):
        trainer.save_checkpoint(blocking=True)
        trainer.checkpoints.close()
