"""Training checkpoints: torch.distributed.checkpoint for the tensors, asynchronous and atomic.

Layout of a run's `checkpoints/` directory:

    step_000100/              one complete checkpoint
        .metadata, __0_0.distcp   model + optimizer tensors (DCP; sharded across ranks when distributed)
        trainer_rank0.pt      everything else of rank 0: step, schedule, loader position, RNG states, hook states
        COMPLETE              written last, inside the temporary directory
        GOOD                  added later, once the stability monitor has watched enough steps past it
    step_000200.tmp-XXXX/     a save in progress (or one a crash interrupted; ignored and cleaned up)

A save copies the state in the caller's thread (the only time the training loop blocks), then writes it in a
background thread into a temporary directory that is renamed into place when the write is complete. A crash at any
point leaves every earlier checkpoint intact and the half-written one invisible.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

CHECKPOINT_NAME = re.compile(r"^step_(\d{6,})$")
COMPLETE, GOOD = "COMPLETE", "GOOD"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _copy(obj):
    """A deep copy of every tensor, so training can go on while the copy is written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy(v) for v in obj)
    return obj


class CheckpointManager:
    def __init__(self, directory: str | Path, keep: int = 3):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: Future | None = None
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------------------------- save
    def save(self, step: int, tensors: dict, trainer_state: dict, *, blocking: bool = False) -> Future:
        """`tensors`: model and optimizer state dicts (DCP); `trainer_state`: picklable rest of this rank."""
        self.wait()  # one save in flight at a time; an older one must finish before a newer one starts
        snapshot = (_copy(tensors), _copy(trainer_state))
        self._pending = self._executor.submit(self._write, step, *snapshot)
        if blocking:
            self.wait()
        return self._pending

    def _write(self, step: int, tensors: dict, trainer_state: dict) -> Path:
        final = self.directory / f"step_{step:06d}"
        staging = self.directory / f"step_{step:06d}.tmp-{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        with warnings.catch_warnings():  # DCP warns that it runs single-process; that is intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(tensors, checkpoint_id=str(staging))
        torch.save(trainer_state, staging / f"trainer_rank{_rank()}.pt")
        (staging / COMPLETE).write_text(str(step))
        with self._lock:
            if final.exists():  # a re-run of the same step (after a rollback) replaces the old copy
                shutil.rmtree(final)
            os.replace(staging, final)
            self._prune()
        return final

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()  # re-raises a failed write here, in the training thread
            self._pending = None

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)

    def _prune(self) -> None:
        """Keep the last `keep` checkpoints, and always the newest one marked GOOD (the rollback target)."""
        complete = self.list()
        good = [p for p in complete if (p / GOOD).exists()]
        protected = set(complete[-self.keep:]) | set(good[-1:])
        for path in complete:
            if path not in protected:
                shutil.rmtree(path, ignore_errors=True)

    # ----------------------------------------------------------------------------------------------- find
    def list(self) -> list[Path]:
        """Complete checkpoints, oldest first. Half-written (`.tmp-*`) ones are not listed."""
        found = []
        for path in self.directory.iterdir():
            match = CHECKPOINT_NAME.match(path.name)
            if match and (path / COMPLETE).exists():
                found.append((int(match.group(1)), path))
        return [p for _, p in sorted(found)]

    def latest(self, good_only: bool = False, at_or_before: int | None = None) -> Path | None:
        candidates = [p for p in self.list() if (not good_only or (p / GOOD).exists())
                      and (at_or_before is None or step_of(p) <= at_or_before)]
        return candidates[-1] if candidates else None

    def mark_good(self, step: int) -> None:
        path = self.directory / f"step_{step:06d}"
        with self._lock:  # the writer thread may be pruning
            if (path / COMPLETE).exists():
                (path / GOOD).write_text(str(step))

    def remove_incomplete(self) -> None:
        for path in self.directory.glob("step_*.tmp-*"):
            shutil.rmtree(path, ignore_errors=True)

    # ----------------------------------------------------------------------------------------------- load
    @staticmethod
    def load(path: Path, tensors: dict) -> dict:
        """Load tensors in place into `tensors` (same structure as saved); return this rank's trainer state."""
        if not (path / COMPLETE).exists():
            raise ValueError(f"{path}: not a complete checkpoint (no {COMPLETE} marker)")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, checkpoint_id=str(path))
        return torch.load(path / f"trainer_rank{_rank()}.pt", weights_only=False)


def step_of(path: Path) -> int:
    match = CHECKPOINT_NAME.match(path.name)
    if not match:
        raise ValueError(f"{path}: not a checkpoint directory name (expected step_NNNNNN)")
    return int(match.group(1))
