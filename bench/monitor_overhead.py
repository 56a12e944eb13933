"""Cost of the stability monitor at its default intervals, as a share of the training step.

Two measurements on one model and one synthetic loader:

1. In-step share (the number to trust on a shared machine): the monitor's calls in the loop (`begin_step`, `judge`,
   `after_update`, `mark_good`) are timed inside the steps they run in, together with the residual-RMS forward
   hooks, and divided by those steps' own time. Load swings hit numerator and denominator alike.
2. A/B: blocks of `--block` steps alternating between `off` (no monitor: the balance and the metrics logger only)
   and `on` (the stability monitor, default MonitorConfig), the order flipping each round. The difference of two step
   times is only as good as the machine is quiet: the spread of the blocks is printed beside it.

`every-step` repeats both with the sampled signals (residual RMS, update ratio) on every step: the worst case.
Each block's first step (optimizer state allocation, the step-0 checkpoint) is dropped.

    python bench/monitor_overhead.py                          # tiny preset, batch 8 x 256 (the quickstart's)
    python bench/monitor_overhead.py --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hybridtron.checkpoint.dcp import CheckpointManager
from hybridtron.config import preset
from hybridtron.model.lm import HybridLM
from hybridtron.train import hooks as H
from hybridtron.train.config import TrainConfig
from hybridtron.train.loop import Trainer
from hybridtron.train.monitor import MonitorConfig, StabilityMonitor, build_monitor
from hybridtron.train.monitor.signals import ResidualRMS
from hybridtron.train.objectives import LoaderBatches, PretrainObjective


class RandomLoader:
    def __init__(self, vocab: int, batch: int, seq: int):
        self.vocab, self.batch, self.seq, self.position = vocab, batch, seq, 0

    def __next__(self):
        self.position += 1
        ids = torch.randint(0, self.vocab, (self.batch, self.seq + 1),
                            generator=torch.Generator().manual_seed(self.position))
        return ids[:, :-1], ids[:, 1:]

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class StepTimer(H.Hook):
    """Wall seconds of each step (between consecutive step ends) and of the monitor's work inside it."""

    def __init__(self):
        self.steps: list[float] = []
        self.monitor: list[float] = []
        self.spent = 0.0

    def on_train_start(self, trainer):
        self.last = time.perf_counter()

    def on_step_end(self, trainer, stats, decision):
        now = time.perf_counter()
        self.steps.append(now - self.last)
        self.monitor.append(self.spent)
        self.last, self.spent = now, 0.0

    def timed(self, function):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - started
        return wrapper


def instrument(monitor: StabilityMonitor, timer: StepTimer) -> None:
    """Time the monitor's calls in the loop and the residual-RMS forward hooks (registered at train start)."""
    for name in ("begin_step", "judge", "after_update", "mark_good"):
        setattr(monitor, name, timer.timed(getattr(monitor, name)))
    for signal in monitor.signals:
        if isinstance(signal, ResidualRMS):
            record = signal._record  # a bench may reach inside: the forward hooks are the monitor's work too
            signal._record = lambda index, record=record: timer.timed(record(index))


VARIANTS = {
    "off": None,
    "on": MonitorConfig(),
    "every-step": MonitorConfig(residual_every=1, update_ratio_every=1, underflow_every=1),
}


def run_block(model, loader, train: TrainConfig, monitor: MonitorConfig | None, directory: Path) -> StepTimer:
    timer = StepTimer()
    watcher = None
    if monitor is not None:
        watcher, _ = build_monitor(monitor, directory, model.config, stream=io.StringIO())
        instrument(watcher, timer)
    trainer = Trainer(model, PretrainObjective(), LoaderBatches(loader, 1), train,
                      CheckpointManager(directory / "checkpoints", keep=1), hooks=[H.MetricsLogger(directory), timer],
                      monitor=watcher)
    trainer.train()
    trainer.checkpoints.close()
    timer.steps, timer.monitor = timer.steps[1:], timer.monitor[1:]
    return timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--block", type=int, default=21, help="steps per block (2 sampling periods + 1 dropped)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = HybridLM(preset(args.preset))
    loader = RandomLoader(model.config.vocab_size, args.batch_size, args.seq_len)
    train = TrainConfig(steps=args.block, warmup_steps=5)
    timers: dict[str, list[StepTimer]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            order = list(VARIANTS) if round_index % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                directory = Path(scratch) / f"{name}-{round_index}"
                timers[name].append(run_block(model, loader, train, VARIANTS[name], directory))

    print(f"{args.preset}, batch {args.batch_size} x {args.seq_len}, {args.threads} threads, "
          f"{args.rounds} rounds x {args.block - 1} timed steps per variant")
    print(f"{'variant':<12}{'step ms':>9}{'block means ms':>26}{'monitor ms/step':>17}{'in-step share':>15}")
    for name, runs in timers.items():
        steps = [t for run in runs for t in run.steps]
        spent = [t for run in runs for t in run.monitor]
        blocks = ", ".join(f"{1000 * statistics.mean(run.steps):.0f}" for run in runs)
        print(f"{name:<12}{1000 * statistics.mean(steps):>9.0f}{blocks:>26}{1000 * statistics.mean(spent):>17.1f}"
              f"{100 * sum(spent) / sum(steps):>14.2f}%")
    off, on = (statistics.mean(t for run in timers[n] for t in run.steps) for n in ("off", "on"))
    print(f"A/B: on vs off {100 * (on / off - 1):+.1f}% (noise: see the spread of the block means)")


if __name__ == "__main__":
    main()
