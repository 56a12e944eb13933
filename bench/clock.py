"""The clock a benchmark reads (`--clock`): elapsed time, or this process's own CPU time on a busy machine.

CPU time is not inflated by other processes taking turns on the cores, so side-by-side ratios stay steady on a
shared machine; it is meaningful with `--threads 1` only (idle OpenMP workers spin and count), and other jobs
still slow a process down through the caches and memory bandwidth they share.
"""

from __future__ import annotations

import argparse
import time

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
