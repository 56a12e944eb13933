"""Checks of the `hybridtron eval` options that run before anything loads: an evaluation can run for minutes, so
what would fail at its end (an output path that cannot be written) or deep inside a library (a device torch does not
know) is refused first, in one line naming the option and its value. Light: no lm_eval, no model."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def check_device(device: str, option: str = "--device") -> torch.device:
    """The torch device of `device`: cpu, cuda or cuda:N; ValueError naming `option` otherwise."""
    if not DEVICE.fullmatch(str(device)):
        raise ValueError(f"{option} {device!r}: expected cpu, cuda or cuda:N")
    return torch.device(device)


def check_output_path(path: str | Path, option: str, *, directory: bool | None) -> Path:
    """`path` as an output that the evaluation will be able to write: a directory (`directory` True), a file (False)
    or either (None). What exists must be of that kind. A file goes into a directory that exists (a mistyped one is
    not created); a directory, with any missing parents, under its nearest existing ancestor. Either way that
    directory must be writable. ValueError naming `option` otherwise."""
    path = Path(path)
    if path.exists():
        if directory is True and not path.is_dir():
            raise ValueError(f"{option} {path}: a file, not a directory")
        if directory is False and path.is_dir():
            raise ValueError(f"{option} {path}: a directory; expected a file name")
        if not path.is_dir() and not os.access(path, os.W_OK):
            raise ValueError(f"{option} {path}: not writable")
        target = path if path.is_dir() else path.parent
    elif directory is False:
        target = path.parent
        if not target.is_dir():
            raise ValueError(f"{option} {path}: no directory {target} to write it in")
    else:
        target = next(parent for parent in path.parents if parent.exists())
        if not target.is_dir():
            raise ValueError(f"{option} {path}: {target} is a file, so nothing can be written under it")
    if not os.access(target, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: {target} is not writable")
    return path
