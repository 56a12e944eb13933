"""The progress line of long evaluations (hybridtron.eval.progress): done/total, elapsed and an estimate weighed by
work; throttled into a pipe, redrawn in place on a terminal, silent when disabled."""

from __future__ import annotations

import io

import pytest

from hybridtron.eval import progress as progress_module
from hybridtron.eval.progress import Progress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", clock)
    return clock


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_piped_line_at_most_every_few_seconds_with_an_estimate_weighed_by_work(clock):
    stream = io.StringIO()
    line = Progress("eval ruler", 4, "samples", work=1 + 1 + 2 + 2, stream=stream, every=5.0)
    clock.now += 10
    line.advance(1, work=1, note="vt at 1K")  # 10 s for 1 unit of work: 5 left, 50 s
    clock.now += 2
    line.advance(1, work=1)  # within 5 s of the last line: not written
    clock.now += 40
    line.advance(1, work=2)  # 52 s for 4 units: 2 left, 26 s
    clock.now += 20
    line.advance(1, work=2)  # the end: always written, no estimate
    assert stream.getvalue().splitlines() == [
        "eval ruler 0/4 samples",
        "eval ruler 1/4 samples (25%, vt at 1K), 10s elapsed, ETA 50s",
        "eval ruler 3/4 samples (75%), 52s elapsed, ETA 26s",
        "eval ruler 4/4 samples (100%), 1m12s elapsed",
    ]


def test_a_terminal_line_is_redrawn_in_place(clock):
    stream = Terminal()
    line = Progress("eval loss", 3, "windows", work=3 * 64, stream=stream)
    for _ in range(3):
        clock.now += 1
        line.advance(work=64)
    text = stream.getvalue()
    assert text.startswith("\reval loss 0/3 windows") and text.count("\r") == 4 and text.endswith("\n")
    assert "\reval loss 2/3 windows (67%), 2s elapsed, ETA 1s" in text and "3/3 windows (100%)" in text


def test_disabled_it_writes_nothing(clock):
    stream = io.StringIO()
    line = Progress("eval tasks math", 2, "completions", stream=stream, enabled=False)
    line.advance(2)
    assert stream.getvalue() == ""
