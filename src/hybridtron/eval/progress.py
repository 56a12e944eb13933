"""The progress line of a long evaluation (`eval tasks`, `loss`, `ruler`, `harness`): what is done of the total, the
time so far and an estimate of the time left, on stderr, as training's progress bar reports them (its
`format_duration`).

    progress = Progress("ruler", 44, "samples", work=44 * 2048)
    progress.advance(2, work=2 * 2048, note="niah_single_1 at 2K")
    # ruler 2/44 samples (5%, niah_single_1 at 2K), 14s elapsed, ETA 4m54s

Items are what the line counts (samples, windows, completions, requests); `work` weighs them for the estimate where
they cost unequally (a 2K sample costs about twice a 1K one). On a terminal the line is redrawn in place; into a
file or a pipe it is written at most every `every` seconds, and always at the start and the end, so that a log
stays short and a long step still shows it is alive.
"""

from __future__ import annotations

import sys
import time

from hybridtron.train.hooks import format_duration

EVERY_SECONDS = 5.0  # a piped line at most this often


class Progress:
    """`label done/total unit (percent, note), elapsed, ETA`; `enabled` False (a --quiet) writes nothing."""

    def __init__(self, label: str, total: int, unit: str, *, work: float | None = None, stream=None,
                 every: float = EVERY_SECONDS, enabled: bool = True):
        self.label, self.total, self.unit = label, total, unit
        self.work = float(total if work is None else work)
        self.stream = sys.stderr if stream is None else stream  # the stderr of the moment, which may be redirected
        self.every, self.enabled = every, enabled
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.done, self.work_done, self.started = 0, 0.0, time.perf_counter()
        self.written_at, self.width = self.started, 0
        self.write(f"{self.label} 0/{self.total} {self.unit}")

    def advance(self, items: int = 1, *, work: float | None = None, note: str = "") -> None:
        """`items` more done, weighing `work` (default: `items`) in the estimate."""
        self.done += items
        self.work_done += items if work is None else work
        now = time.perf_counter()
        finished = self.done >= self.total
        if not finished and not self.interactive and now - self.written_at < self.every:
            return
        elapsed = now - self.started
        eta = elapsed / self.work_done * max(self.work - self.work_done, 0.0) if self.work_done > 0 else None
        share = f"{self.done / max(self.total, 1):.0%}" + (f", {note}" if note else "")
        self.write(f"{self.label} {self.done}/{self.total} {self.unit} ({share}), {format_duration(elapsed)} "
                   f"elapsed" + (f", ETA {format_duration(eta)}" if eta is not None and not finished else ""),
                   end=finished)

    def write(self, text: str, end: bool = False) -> None:
        if not self.enabled:
            return
        self.written_at = time.perf_counter()
        if self.interactive:  # one line redrawn; spaces cover a longer line before it
            self.stream.write(f"\r{text.ljust(self.width)}" + ("\n" if end else ""))
            self.width = 0 if end else len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
