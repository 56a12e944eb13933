"""Writing files so that a crash or a concurrent reader never sees half of one; the names of a run directory's files
(hybridtron.train.run describes the directory)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

RUN_CONFIG = "run_config.json"  # the resolved configuration, which `--config` and `--resume` read back
METRICS_FILE = "metrics.jsonl"  # one line per step
ROLLED_BACK_FILE = "metrics.rolled_back.jsonl"  # the lines of steps a rollback abandoned
EVENTS_FILE = "events.jsonl"  # the monitor's detections and actions, interruptions, resumes, configuration changes
ABANDONED_EVENTS_FILE = "events.abandoned.jsonl"  # events of steps a resume re-runs (after a kill, before its save)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write via a temporary file and rename, so a crash never leaves a half-written file and a reader (another
    process: a torchrun rank reading the run config its peer rewrites) sees the old file or the new one, never a
    truncated one. The file gets the permissions of a plain `open(path, "w")` (0o666 less the umask), not the
    temporary file's private 0o600."""
    path = Path(path)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp", encoding="utf-8") as f:
        f.write(text)
    os.chmod(f.name, 0o666 & ~_umask())
    os.replace(f.name, path)


def _umask() -> int:
    try:  # Linux reports it without changing it (os.umask would, for a moment, for every thread)
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def atomic_write_json(path: str | os.PathLike, data) -> None:
    """`data` as indented JSON, written by `atomic_write_text` (a run's config: other ranks may be reading it)."""
    atomic_write_text(path, json.dumps(data, indent=2))
