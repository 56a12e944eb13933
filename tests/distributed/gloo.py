"""Spawned gloo worlds for the tests that check one collective computation against one process: each rank's
worker checks its own numbers and reports what differs (a line per difference) instead of raising, so that every
rank finishes its collectives and the test fails with every rank's report."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, check, world: int, port: int, errors) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        for line in check(rank):
            errors.put(f"rank {rank}: {line}")
    except Exception as exc:  # reported to the test, which fails with it
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()


def differences(check, world: int) -> list[str]:
    """Every rank's report: `check(rank)` (a module-level function, which spawn pickles by name) runs in a gloo world
    of `world` processes and yields a line for each difference it finds."""
    errors = mp.get_context("spawn").Queue()
    mp.start_processes(_run, args=(check, world, free_port(), errors), nprocs=world, start_method="spawn")
    reported = []
    while not errors.empty():
        reported.append(errors.get())
    return reported
