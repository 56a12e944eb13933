"""The clock a benchmark reads (`--clock`): elapsed time, or this process's own CPU time on a busy machine; and
`cpu_line`, the machine it ran on as BENCHMARKS.md records it.

CPU time is not inflated by other processes taking turns on the cores, so side-by-side ratios stay steady on a
shared machine; it is meaningful with `--threads 1` only (idle OpenMP workers spin and count), and other jobs
still slow a process down through the caches and memory bandwidth they share.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_selected = CLOCKS["wall"]


def add_clock_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time (default); cpu: this process's CPU time, for a busy machine "
                             "(with --threads 1)")


def select(name: str) -> None:
    """Make `timed` read clock `name` ("wall" or "cpu")."""
    global _selected
    _selected = CLOCKS[name]


def timed(fn) -> float:
    """Seconds that `fn()` takes on the selected clock."""
    start = _selected()
    fn()
    return _selected() - start


def cpu_model() -> str:
    """The CPU's model name and the vector-ISA flags torch's CPU kernels dispatch on, from /proc/cpuinfo."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.is_file() else []
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                 platform.processor() or "unknown")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    isa = " ".join(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
    return f"{model} ({isa or 'no AVX flags'})"


def cpu_line() -> str:
    """"CPU: model (flags); N cores; load average": what a benchmark prints beside its numbers (BENCHMARKS.md records
    the CPU of every figure; on a shared machine the load too)."""
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"CPU: {cpu_model()}; {os.cpu_count()} cores; load average {load}"
