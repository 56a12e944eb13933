"""Writing files so that a crash or a concurrent reader never sees half of one."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


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
