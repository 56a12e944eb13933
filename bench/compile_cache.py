"""The shared compile cache, cold against warm: how long a compiled `hybridtron pretrain` takes from its start to its
first training step with an empty `train.compile_cache` and again with the directory the first run filled.

    python bench/compile_cache.py [--presets tiny,bench22m] [--worlds 1,2] [--threads 1]

For each preset and world size (1: one process; 2: `torchrun --nproc-per-node 2` on the CPU, gloo), three runs of
the same one-step pretraining, one after another: eager (`train.compile=false`, for reference), cold
(`train.compile=true` with a new, empty cache directory) and warm (the same again with the directory the cold run
filled: every rank of it loads what the cold run's ranks compiled). Start to first step is the wall time from the
launch to the moment metrics.jsonl gets its step-1 line (the step-0 validation, whose no-grad graphs compile too,
comes before it); CPU is the whole run's CPU seconds over every process (compile workers included), which other jobs
on a shared machine inflate less than the wall time. The table gives cold / warm of both, and the cache entries each
compiled run left (FX graphs + AOTAutograd graphs: the warm run adds none when it loaded everything).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POLL_S = 0.05  # how often the launcher looks for the first step's metrics line


def cpu_seconds_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # every finished descendant, its own children included
    return usage.ru_utime + usage.ru_stime


def first_step_logged(metrics: Path) -> bool:
    if not metrics.is_file():
        return False
    return any('"loss"' in line for line in metrics.read_text().splitlines())


def launch(preset: str, world: int, threads: int, out: Path, compile_cache: Path | None) -> tuple[float, float]:
    """(seconds from the launch to the first step's metrics line, CPU seconds of the whole run) of a one-step
    pretraining (compiled when `compile_cache` is given)."""
    command = [sys.executable, "-m", "hybridtron"] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), "-m",
        "hybridtron"]
    command += ["pretrain", "--preset", preset, "--out", str(out), "--steps", "1", "--quiet",
                "--set", f"train.threads={threads}", "--set", "train.warmup_steps=0"]
    if compile_cache is not None:
        command += ["--set", "train.compile=true", "--set", f"train.compile_cache={compile_cache}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the run's train.compile_cache alone says where the cache is
    cpu_before = cpu_seconds_of_children()
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first_step = None
    while process.poll() is None:
        if first_step is None and first_step_logged(out / "metrics.jsonl"):
            first_step = time.perf_counter() - start
        time.sleep(POLL_S)
    stderr = process.stderr.read()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({process.returncode}):\n{stderr[-3000:]}")
    if first_step is None:  # the step and the end of the run fell between two polls
        first_step = time.perf_counter() - start
    return first_step, cpu_seconds_of_children() - cpu_before


def cache_entries(directory: Path) -> int:
    """Entries of the FX graph and AOTAutograd caches in `directory`."""
    return sum(1 for name in ("fxgraph", "aotautograd") for path in (directory / name).rglob("*") if path.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,bench22m")
    parser.add_argument("--worlds", default="1,2", help="processes per run: 1, and 2 for torchrun (default: 1,2)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process (default: 1)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="compile-cache-bench-") as scratch:
        scratch = Path(scratch)
        for preset in args.presets.split(","):
            for world in (int(w) for w in args.worlds.split(",")):
                name = f"{preset}-w{world}"
                cache = scratch / f"{name}-cache"
                eager = launch(preset, world, args.threads, scratch / f"{name}-eager", None)
                cold = launch(preset, world, args.threads, scratch / f"{name}-cold", cache)
                cold_entries = cache_entries(cache)
                warm = launch(preset, world, args.threads, scratch / f"{name}-warm", cache)
                rows.append((preset, world, eager, cold, warm, cold_entries, cache_entries(cache) - cold_entries))
                print(json.dumps({"preset": preset, "world": world, "eager": eager, "cold": cold, "warm": warm,
                                  "entries": [rows[-1][5], rows[-1][6]]}), file=sys.stderr, flush=True)
    print("| preset | processes | eager: first step (s) | cold: first step (s) | warm: first step (s) "
          "| cold / warm | CPU s cold / warm (ratio) | cache entries: cold + warm |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for preset, world, eager, cold, warm, cold_entries, warm_entries in rows:
        print(f"| {preset} | {world} | {eager[0]:.1f} | {cold[0]:.1f} | {warm[0]:.1f} | {cold[0] / warm[0]:.2f}x "
              f"| {cold[1]:.0f} / {warm[1]:.0f} ({cold[1] / warm[1]:.2f}x) | {cold_entries} + {warm_entries} |")


if __name__ == "__main__":
    main()
