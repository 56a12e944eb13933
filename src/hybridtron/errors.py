"""Errors that end a command on purpose, as opposed to bugs: the CLI prints their message, not a traceback."""

from __future__ import annotations

import signal
from pathlib import Path


class RunStopped(RuntimeError):
    """A run stopped itself because continuing could not be trusted (e.g. the stability monitor gave up).

    Its state on disk is intact (the last GOOD checkpoint, metrics, events); `hybridtron` exits with code 3.
    """

    exit_code = 3


class RunInterrupted(RunStopped):
    """A signal (Ctrl-C's SIGINT, or SIGTERM from a scheduler or torchrun) stopped the run after a finished step,
    whose checkpoint it wrote (`checkpoint`; None for a run that writes none). The exit code is the shell's for a
    process ended by that signal: 130 for SIGINT, 143 for SIGTERM."""

    def __init__(self, signal_number: int, step: int, checkpoint: Path | None):
        self.signal_number, self.step, self.checkpoint = signal_number, step, checkpoint
        self.resume_command: str | None = None  # how to continue: the command that ran it fills it in
        self.exit_code = 128 + signal_number
        where = f"; checkpoint {checkpoint}" if checkpoint is not None else ""
        super().__init__(f"{signal.Signals(signal_number).name} received: stopped after step {step}{where}")
