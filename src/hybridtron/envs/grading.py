"""Grading in child processes with a hard wall-clock limit per item.

A verifier can hang or blow up on a pathological completion, and `signal.alarm` only works on the main thread
(a rollout worker thread gets no alarm at all). So each item is graded by a persistent child process
(`python -I -S SCRIPT --serve MEMORY_MB`, one JSON line in, one line out): an item that takes longer than
`timeout_s` kills its child, scores 0, is counted in `stats.timeouts` and logged; a fresh child takes over
the rest of the batch. Children persist between calls, so an item costs two pipe writes, not a process start.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

log = logging.getLogger(__name__)


@dataclass
class GradingStats:
    graded: int = 0
    timeouts: int = 0   # items killed at the wall-clock limit (scored 0)
    errors: int = 0     # items the grader raised on or died during (scored 0)


class _Worker:
    def __init__(self, script: Path, memory_mb: int):
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", str(script), "--serve", str(memory_mb)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env={}, start_new_session=True, bufsize=0)
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buffer = b""

    def send(self, line: bytes) -> None:
        self.proc.stdin.write(line)

    def read_reply(self) -> bytes | None:
        """A complete reply line if one has arrived; b"" at end of file (the child died)."""
        try:
            chunk = os.read(self.fd, 4096)
        except BlockingIOError:
            return None
        if not chunk:
            return b""
        self.buffer += chunk
        if b"\n" not in self.buffer:
            return None
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self.proc.wait()


def _kill_all(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.kill()
    workers.clear()


class GraderPool:
    """`workers` persistent grading children; `grade(pairs)` returns one score per (completion, key) pair."""

    def __init__(self, script: Path, *, workers: int = 1, timeout_s: float = 1.0, memory_mb: int = 1024):
        if workers < 1:
            raise ValueError(f"GraderPool: workers must be >= 1, got {workers}")
        if not timeout_s > 0:
            raise ValueError(f"GraderPool: timeout_s must be > 0, got {timeout_s}")
        self.script, self.size, self.timeout_s, self.memory_mb = Path(script), workers, timeout_s, memory_mb
        self.stats = GradingStats()
        self._workers: list[_Worker] = []
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)

    def grade(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        with self._lock:
            if os.getpid() != self._owner:  # a forked copy must not share its parent's children
                self._workers.clear()
                self._owner = os.getpid()
            return self._grade(pairs)

    def _spawn(self) -> _Worker:
        worker = _Worker(self.script, self.memory_mb)
        self._workers.append(worker)
        return worker

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)

    def _grade(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        scores = [0.0] * len(pairs)
        queue = deque(range(len(pairs)))
        while len(self._workers) < min(self.size, len(pairs)):
            self._spawn()
        idle = list(self._workers)
        busy: dict[_Worker, tuple[int, float]] = {}
        selector = selectors.DefaultSelector()
        try:
            while queue or busy:
                while queue and idle:
                    worker, i = idle.pop(), queue.popleft()
                    try:
                        worker.send((json.dumps(pairs[i]) + "\n").encode())
                    except OSError:  # the child died between items: this one scores 0, a new child goes on
                        self.stats.graded += 1
                        self.stats.errors += 1
                        log.warning("grading item %d failed: the grader had died", i)
                        self._retire(worker)
                        idle.append(self._spawn())
                        continue
                    busy[worker] = (i, time.monotonic() + self.timeout_s)
                    selector.register(worker.fd, selectors.EVENT_READ, worker)
                if not busy:
                    continue
                wait = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
                for key, _ in selector.select(timeout=wait):
                    worker = key.data
                    reply = worker.read_reply()
                    if reply is None:
                        continue
                    i, _ = busy.pop(worker)
                    selector.unregister(worker.fd)
                    self.stats.graded += 1
                    if reply in (b"1", b"0"):
                        scores[i] = float(reply == b"1")
                        idle.append(worker)
                        continue
                    self.stats.errors += 1
                    log.warning("grading item %d failed: %s", i,
                                reply[2:].decode(errors="replace") if reply else "the grader died")
                    if reply:
                        idle.append(worker)
                    else:
                        self._retire(worker)
                        idle.append(self._spawn())
                now = time.monotonic()
                for worker, (i, deadline) in list(busy.items()):
                    if now >= deadline:
                        del busy[worker]
                        selector.unregister(worker.fd)
                        self.stats.graded += 1
                        self.stats.timeouts += 1
                        log.warning("grading item %d exceeded %.2f s: scored 0 (%d timeouts so far)", i,
                                    self.timeout_s, self.stats.timeouts)
                        self._retire(worker)
                        idle.append(self._spawn())
        finally:
            selector.close()
        return scores

    def close(self) -> None:
        with self._lock:
            _kill_all(self._workers)

    def __enter__(self) -> "GraderPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
