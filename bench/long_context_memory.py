"""Peak memory of a tiny training step against the row length, with and without activation checkpointing
(`train.recompute`), in one process.

    python bench/long_context_memory.py [--lengths 1k,2k,4k,8k,16k,32k] [--recompute none,selective,full]
                                        [--threads 2] [--steps 2] [--clock wall] [--grad-accum-dtype fp32]
                                        [--json PATH] [--plot PATH]

The `tiny` preset (its `max_position_embeddings` raised to the length), one row of batch 1, fp32, trained as
`hybridtron pretrain` trains it in one process: `assemble_trainer` (the precision converters, `parallelize` with
`train.recompute`), `PretrainObjective` (lm_head applied inside the loss, a block of rows at a time, for the main
head and the MTP depths) and the `Trainer`'s step (forward, backward, clipping, AdamW), on synthetic token rows
(memory does not depend on the tokens). Each (length, recompute) configuration runs `--steps` steps in a process of
its own (this script with `--worker`), one after another, so each peak is that configuration's alone:

    peak  the growth of the process's peak resident memory (`ru_maxrss`) from before the model is built to after
          the last step: what the OS had to give the step, allocator overheads included (torch's CPU allocator
          keeps no count of its own; tracemalloc does not see its allocations). The first step's peak is lower
          (AdamW's moments do not exist yet, and glibc has not yet fragmented its heap); after two steps the peak
          is within 10% of that after four (measured at 1K and 8K tokens).
    time  the median of the steps after the first (which also pays for first-touch page faults), on `--clock`.

A configuration the machine cannot hold is skipped, not crashed into: before it starts, when its predicted peak
(the larger of the preflight estimate, `hybridtron.train.preflight.training_memory`, which `hybridtron pretrain`
checks, and the same mode's last measured peak scaled by the length) exceeds MemAvailable; and while it runs, the
worker's data limit (RLIMIT_DATA, set to what was available) turns an allocation past it into an error instead of
a call to the OOM killer, which on a shared machine might pick another process. `--grad-accum-dtype bf16` converts
lm_head to a `MainGradLinear`, which the fused loss cannot apply, so the loss reads the whole [tokens, vocab] logits
(as under `train.precision` nvfp4 or mxfp8): the cost of that path at length.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridtron.config import tiny
from hybridtron.data.batch import TokenBatch
from hybridtron.model.lm import HybridLM
from hybridtron.train.config import TrainConfig
from hybridtron.train.hooks import Hook
from hybridtron.train.monitor.config import MonitorConfig
from hybridtron.train.objectives import BatchSource, PretrainObjective
from hybridtron.train.preflight import available_memory, training_memory
from hybridtron.train.run import assemble_trainer

import clock
from clock import cpu_model

MODES = ("none", "selective", "full")
DEFAULT_LENGTHS = "1k,2k,4k,8k,16k,32k"
HEADROOM = 1 << 30  # left to the rest of the machine (other jobs, this script) when a worker's limit is set
GiB = 2 ** 30


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def parse_length(text: str) -> int:
    """'32k' -> 32768, '1000' -> 1000."""
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def length_label(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


class SyntheticRows(BatchSource):
    """One row of random token ids per step, its labels the next tokens, as pretraining's loader hands them over."""

    def __init__(self, vocab: int, length: int):
        self.vocab, self.length, self.position = vocab, length, 0

    def next_step(self):
        generator = torch.Generator().manual_seed(self.position)
        self.position += 1
        ids = torch.randint(3, self.vocab, (1, self.length), generator=generator)
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = -100  # the row's last token has no next token
        return [TokenBatch(ids, labels)]  # no document mask: pretraining's default (data.document_mask)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class StepClock(Hook):
    """Each step's time on the selected clock (`--clock`), from the end of the previous one (or the start)."""

    def __init__(self, read_clock):
        self.read_clock, self.seconds = read_clock, []

    def on_train_start(self, trainer):
        self.last = self.read_clock()

    def on_step_end(self, trainer, stats, decision):
        now = self.read_clock()
        self.seconds.append(now - self.last)
        self.last = now


def train_config(args, recompute: str) -> TrainConfig:
    return TrainConfig(steps=args.steps, warmup_steps=0, recompute=recompute, threads=args.threads,
                       grad_accum_dtype=args.grad_accum_dtype)


def worker(args, length: int, recompute: str) -> dict:
    """One configuration's steps in this process: its peak growth and step times."""
    torch.set_num_threads(args.threads)
    before = peak_rss_bytes()  # torch and hybridtron loaded, nothing built
    torch.manual_seed(0)
    config = tiny().replace(max_position_embeddings=length)
    with tempfile.TemporaryDirectory() as out:  # the trainer's metrics.jsonl, not read
        trainer = assemble_trainer(HybridLM(config), PretrainObjective(), SyntheticRows(config.vocab_size, length),
                                   [], train=train_config(args, recompute), monitor_config=MonitorConfig(enabled=False),
                                   out=Path(out), checkpoints=None, quiet=True)
        step_clock = StepClock(clock.CLOCKS[args.clock])
        trainer.hooks.append(step_clock)
        trainer.train()
        seconds = step_clock.seconds
    return {"length": length, "recompute": recompute, "peak_bytes": peak_rss_bytes() - before,
            "peak_rss_before_bytes": before, "step_seconds": seconds,
            "time_s": statistics.median(seconds[1:] if len(seconds) > 1 else seconds)}


def run_worker(args, length: int, recompute: str, limit: int) -> dict:
    """A configuration in its own process, its memory capped at `limit` bytes: its record, or why it has none."""
    command = [sys.executable, __file__, "--worker", str(length), recompute, "--limit", str(limit),
               "--threads", str(args.threads), "--steps", str(args.steps), "--clock", args.clock,
               "--grad-accum-dtype", args.grad_accum_dtype]
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    if "can't allocate memory" in done.stderr or "MemoryError" in done.stderr:
        return {"skipped": f"ran out of memory at its {limit / GiB:.1f} GiB limit (what was available)"}
    sys.exit(f"{length_label(length)} tokens, recompute {recompute} failed:\n{done.stderr[-3000:]}")


def predicted_peak(estimate: int, length: int, recompute: str, measured: list[dict]) -> int:
    """Bytes the configuration is expected to need: the preflight `estimate`, or the same mode's last measured peak
    scaled by the length, whichever is larger (the estimate counts activations, not the allocator's overheads)."""
    shorter = [r for r in measured if r["recompute"] == recompute and "peak_bytes" in r]
    scaled = shorter[-1]["peak_bytes"] * length / shorter[-1]["length"] if shorter else 0
    return max(estimate, int(scaled))


def table_row(result: dict, none: dict | None) -> str:
    """A configuration's line of the table; `none`: the same length without recompute, if it was measured."""
    start = f"| {length_label(result['length'])} | {result['recompute']} |"
    estimate = f"{result['estimate_bytes'] / GiB:.2f}"
    if "skipped" in result:
        return f"{start} skipped: {result['skipped']} | | {estimate} | | |"

    def over_none(key):
        return f"{result[key] / none[key]:.2f}" if none else "-"

    return (f"{start} {result['peak_bytes'] / GiB:.2f} | {over_none('peak_bytes')} | {estimate} | "
            f"{result['time_s']:.1f} | {over_none('time_s')} |")


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib  # optional: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for recompute in MODES:
        points = [(r["length"], r["peak_bytes"] / GiB) for r in results
                  if r["recompute"] == recompute and "peak_bytes" in r]
        if points:
            axes.plot(*zip(*points), marker="o", label=f"recompute {recompute}")
    lengths = sorted({r["length"] for r in results})
    axes.set_xscale("log", base=2)
    axes.set_xticks(lengths, [length_label(n) for n in lengths])
    axes.set_xlabel("tokens per row (batch 1)")
    axes.set_ylabel("peak memory of a training step (GiB)")
    axes.set_title(title, fontsize=10)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help=f"tokens per row (default {DEFAULT_LENGTHS})")
    parser.add_argument("--recompute", default=",".join(MODES), help="train.recompute modes (default: all three)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="training steps per configuration (default 2)")
    parser.add_argument("--grad-accum-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="train.grad_accum_dtype; bf16 converts lm_head, so the loss reads the whole logits")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="draw peak memory against length here (a PNG; needs matplotlib)")
    parser.add_argument("--worker", nargs=2, metavar=("LENGTH", "RECOMPUTE"), help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=int, help=argparse.SUPPRESS)  # the worker's data limit, in bytes
    clock.add_clock_argument(parser)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.worker:
        resource.setrlimit(resource.RLIMIT_DATA, (args.limit, args.limit))
        print(json.dumps(worker(args, int(args.worker[0]), args.worker[1])))
        return
    lengths = [parse_length(n) for n in args.lengths.split(",")]
    modes = [m.strip() for m in args.recompute.split(",")]
    if unknown := sorted(set(modes) - set(MODES)):
        parser.error(f"--recompute: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")

    config = tiny()
    parameters = HybridLM(config).num_parameters(include_mtp=True)
    header = (f"tiny ({parameters / 1e6:.1f}M parameters with MTP, vocab {config.vocab_size}, "
              f"{config.mtp_num_depths} MTP depth(s)), batch 1, fp32, grad_accum_dtype {args.grad_accum_dtype}, "
              f"{args.steps} steps per configuration, {args.threads} thread(s), {args.clock} clock")
    print(header)
    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores; {(available_memory(torch.device('cpu')) or 0) / GiB:.1f} "
          f"GiB available; torch {torch.__version__}; Python {platform.python_version()}\n")
    print("| tokens | recompute | peak (GiB) | peak / none | preflight estimate (GiB) | step (s) | step / none |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    results = []
    for length in lengths:
        for recompute in modes:  # the modes of a length side by side: they see the same machine load
            available = (available_memory(torch.device("cpu")) or 0) - HEADROOM
            estimate = training_memory(tiny().replace(max_position_embeddings=length), length,
                                       train=train_config(args, recompute)).total_bytes
            needed = predicted_peak(estimate, length, recompute, results)
            if needed > available:
                result = {"skipped": f"needs about {needed / GiB:.1f} GiB, {available / GiB:.1f} GiB available"}
            else:
                result = run_worker(args, length, recompute, available)
            result.update(length=length, recompute=recompute, estimate_bytes=estimate)
            results.append(result)
            none = next((r for r in results if r["length"] == length and r["recompute"] == "none"
                         and "peak_bytes" in r), None)
            print(table_row(result, none), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": header, "cpu": cpu_model(), "torch": torch.__version__,
                                               "date": time.strftime("%Y-%m-%d"), "results": results}, indent=1))
    if args.plot:
        plot(results, Path(args.plot), f"tiny training step, batch 1, fp32, {args.threads} thread(s)")


if __name__ == "__main__":
    main()
