"""Training checkpoints: torch.distributed.checkpoint for the tensors, asynchronous and atomic.

Layout of a run's `checkpoints/` directory:

    step_000100/              one complete checkpoint
        .metadata, __R_0.distcp   model + optimizer tensors (DCP; each rank writes its shards when distributed)
        trainer_rank0.pt      everything else, as global rank 0 holds it: step, schedule, loader position (global,
                              so the same at every world size), RNG states, hook states
        COMPLETE              written last, inside the temporary directory
        GOOD                  added later, once the stability monitor has watched enough steps past it
    step_000200.tmp-XXXX/     a save in progress (or one a crash interrupted; ignored and cleaned up)

A save copies the state in the caller's thread (the only time the training loop blocks), then writes it in a
background thread into a temporary directory that is renamed into place when the write is complete. A crash at any
point leaves every earlier checkpoint intact and the half-written one invisible.

Distributed (torch.distributed initialized): every rank writes its own shards with `dcp.async_save` over a
separate gloo group (the training collectives keep the default group to themselves); global rank 0 then writes
the trainer state and COMPLETE and renames the directory, once DCP reports every rank's write finished. The
tensors are saved as DTensors under their single-process names, so `load` reshards them to whatever layout and
world size the resuming run has; only rank 0 touches the directory tree (prune, GOOD marks, cleanup).
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


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _copy(obj):
    """A deep copy of every tensor, so training can go on while the copy is written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy(v) for v in obj)
    return obj


class _Staged:
    """DCP's async stager for a state that `CheckpointManager.save` has already copied: nothing more to do (the
    default stager would copy it again, and cannot copy the DTensor views over local shards of
    hybridtron.distributed.state)."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def close(self) -> None: ...


class CheckpointManager:
    def __init__(self, directory: str | Path, keep: int = 3):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: Future | None = None
        self._lock = threading.Lock()
        self._group = None  # the gloo group of distributed saves, made at the first one (all ranks save together)

    # ----------------------------------------------------------------------------------------------- save
    def save(self, step: int, tensors: dict, trainer_state: dict, *, blocking: bool = False) -> Future:
        """`tensors`: model and optimizer state dicts (DCP); `trainer_state`: picklable rest of this rank."""
        self.wait()  # one save in flight at a time; an older one must finish before a newer one starts
        snapshot = (_copy(tensors), _copy(trainer_state))
        if _distributed():
            self._pending = self._save_distributed(step, *snapshot)
        else:
            self._pending = self._executor.submit(self._write, step, *snapshot)
        if blocking:
            self.wait()
        return self._pending

    def _save_distributed(self, step: int, tensors: dict, trainer_state: dict) -> Future:
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        staging = self.directory / f"step_{step:06d}.tmp-dist"
        if _rank() == 0:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir()
        dist.barrier(group=self._group)  # the directory exists before any rank writes into it
        written = dcp.async_save(tensors, checkpoint_id=str(staging), process_group=self._group,
                                 async_stager=_Staged())
        return self._executor.submit(self._finish_distributed, step, staging, written, trainer_state)

    def _finish_distributed(self, step: int, staging: Path, written: Future, trainer_state: dict) -> Path:
        written.result()  # on rank 0 this returns once DCP has gathered every rank's write result
        final = self.directory / f"step_{step:06d}"
        if _rank() == 0:
            torch.save(trainer_state, staging / "trainer_rank0.pt")
            self._commit(step, staging, final)
        return final

    def _write(self, step: int, tensors: dict, trainer_state: dict) -> Path:
        final = self.directory / f"step_{step:06d}"
        staging = self.directory / f"step_{step:06d}.tmp-{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
        with warnings.catch_warnings():  # DCP warns that it runs single-process; that is intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(tensors, checkpoint_id=str(staging))
        torch.save(trainer_state, staging / "trainer_rank0.pt")
        self._commit(step, staging, final)
        return final

    def _commit(self, step: int, staging: Path, final: Path) -> None:
        (staging / COMPLETE).write_text(str(step))
        with self._lock:
            if final.exists():  # a re-run of the same step (after a rollback) replaces the old copy
                shutil.rmtree(final)
            os.replace(staging, final)
            self._prune()

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
        if _rank() != 0:
            return
        path = self.directory / f"step_{step:06d}"
        with self._lock:  # the writer thread may be pruning
            if (path / COMPLETE).exists():
                (path / GOOD).write_text(str(step))

    def remove_after(self, step: int) -> list[str]:
        """Delete the checkpoints newer than `step` (after a rollback they belong to the abandoned trajectory, and
        `--resume` would pick them); returns their names."""
        newer = [path for path in self.list() if step_of(path) > step]
        if _rank() == 0:
            for path in newer:
                shutil.rmtree(path)
        return [path.name for path in newer]

    def remove_incomplete(self) -> None:
        if _rank() != 0:
            return
        for path in self.directory.glob("step_*.tmp-*"):
            shutil.rmtree(path, ignore_errors=True)

    # ----------------------------------------------------------------------------------------------- load
    @staticmethod
    def load(path: Path, tensors: dict) -> dict:
        """Load tensors in place into `tensors` (same structure as saved, any sharding: DCP reshards); return the
        trainer state (global rank 0's at save time, whatever the world size then and now)."""
        if not (path / COMPLETE).exists():
            raise ValueError(f"{path}: not a complete checkpoint (no {COMPLETE} marker)")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, checkpoint_id=str(path))
        return torch.load(path / "trainer_rank0.pt", weights_only=False)


def saved_keys(path: Path) -> set[str]:
    """The flattened keys of the tensors a checkpoint holds ("optimizer.state.<parameter>.exp_avg", ...)."""
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def step_of(path: Path) -> int:
    match = CHECKPOINT_NAME.match(path.name)
    if not match:
        raise ValueError(f"{path}: not a checkpoint directory name (expected step_NNNNNN)")
    return int(match.group(1))
