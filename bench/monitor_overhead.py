"""Cost of the stability monitor: training step time with and without its hooks, at the default intervals.

One model, one synthetic loader, blocks of `--block` steps alternating between the variants (the order flips each
round, so a slow spell of a shared machine hits both): `off` (ExpertLoad and the metrics logger only), `on` (plus
every monitor hook at the default MonitorConfig: per-layer weight-gradient norms and router bias spread every
step, residual RMS and update ratio every 10th step, the detectors, Recovery's GOOD marks) and `every-step` (the
sampled signals on every step: the worst case). Each block's first step (optimizer state allocation, the
step-0 checkpoint) is dropped; the mean of the rest includes the sampled steps in their real proportion. Two clocks: wall time, and this process's CPU time (user + system, all
threads), which a busy shared machine disturbs far less; the overhead is reported on both.

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
from hybridtron.train.monitor import MonitorConfig, monitor_hooks


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
    """Wall and CPU seconds between consecutive step ends."""

    def __init__(self):
        self.times: list[tuple[float, float]] = []

    def on_train_start(self, trainer):
        self.last = (time.perf_counter(), time.process_time())

    def on_step_end(self, trainer, metrics):
        now = (time.perf_counter(), time.process_time())
        self.times.append((now[0] - self.last[0], now[1] - self.last[1]))
        self.last = now


VARIANTS = {
    "off": None,
    "on": MonitorConfig(),
    "every-step": MonitorConfig(residual_every=1, update_ratio_every=1, underflow_every=1),
}


def run_block(model, loader, train: TrainConfig, monitor: MonitorConfig | None, directory: Path
              ) -> list[tuple[float, float]]:
    timer = StepTimer()
    logger = H.MetricsLogger(directory)
    watch, recovery = monitor_hooks(monitor, directory, model.config, stream=io.StringIO()) if monitor else ([], [])
    hooks = [H.ExpertLoad(train.maxvio_window), *watch, logger, timer, *recovery]
    trainer = Trainer(model, loader, train, hooks, CheckpointManager(directory / "checkpoints", keep=1))
    trainer.train()
    trainer.checkpoints.close()
    return timer.times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--block", type=int, default=20, help="steps per block (2 sampling periods by default)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = HybridLM(preset(args.preset))
    loader = RandomLoader(model.config.vocab_size, args.batch_size, args.seq_len)
    train = TrainConfig(steps=args.block, warmup_steps=5)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            order = list(VARIANTS) if round_index % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                directory = Path(scratch) / f"{name}-{round_index}"
                times[name] += run_block(model, loader, train, VARIANTS[name], directory)

    print(f"{args.preset}, batch {args.batch_size} x {args.seq_len}, {args.threads} threads, "
          f"{args.rounds} rounds x {args.block - 1} timed steps per variant")
    print(f"{'variant':<12}{'wall ms':>10}{'overhead':>10}{'CPU ms':>10}{'overhead':>10}")
    base_wall, base_cpu = (statistics.mean(t[i] for t in times["off"]) for i in (0, 1))
    for name, values in times.items():
        wall, cpu = (statistics.mean(t[i] for t in values) for i in (0, 1))
        print(f"{name:<12}{1000 * wall:>10.1f}{100 * (wall / base_wall - 1):>9.1f}%"
              f"{1000 * cpu:>10.1f}{100 * (cpu / base_cpu - 1):>9.1f}%")


if __name__ == "__main__":
    main()
