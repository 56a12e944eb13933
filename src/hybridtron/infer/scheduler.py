"""Continuous batching: the engine's loop, which admits requests into the running batch between steps and retires
finished ones.

A request (`submit`) waits in a bounded queue (`max_queue`; `QueueFull` beyond it) until a slot of the batch
(`hybridtron.infer.decoder.DecodeBatch`) is free, first come first served. Each iteration of the loop (`step`):

1. Cancellations: a cancelled request leaves the queue, or its sequence finishes ("cancelled") and frees its slot.
2. Prefill, under a token budget: the decode step about to run feeds `rows x (1 + draft length)` tokens, and the
   prompt chunks of waiting requests fill what is left of `max_step_tokens` (at least one chunk per iteration, so
   admission never starves). A request's prompt is fed chunk by chunk into the staging row; when it is all in, the
   request joins the batch (its samples share the prefill: `n` > 1 in `generate`) and its first token is sampled.
3. One decode step of every running sequence (plain, or speculative: `hybridtron.infer.speculative`).
4. Retirement: finished sequences free their slots (`DecodeBatch.retire_finished`); their last event goes out.

Every request's tokens reach its `RequestHandle` as `TokenEvent`s, from the loop's thread: a blocking iterator, an
asyncio iterator (`handle.events()`), or `handle.result()` for the whole `Completion`. The loop runs in a
background thread (`start`, `shutdown`) or in the caller's thread (`run_until`, what `HybridEngine.generate` does
when no thread runs); it is the same loop. The batch is touched by one thread at a time (`step_lock`, which weight
updates take too); submissions, cancellations and statistics only take the queue's lock.

A request's greedy output is the same alone or batched: its prefill's chunks do not depend on the batch, its rows
compute the same functions whatever the other rows hold, and its sampled tokens depend on its own noise key only
(`hybridtron.infer.sampling`). The one caveat is floating point: a matrix product over 8 rows may round
differently from one over 1 row, which can flip a near-tie.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator, Sequence

import torch

from hybridtron.infer.decoder import CANCELLED, DecodeBatch, SequenceState

DEFAULT_MAX_QUEUE = 256
DEFAULT_MAX_STEP_TOKENS = 512
MAX_TOP_LOGPROBS = 20  # as vLLM's default max_logprobs
STATS_WINDOW_S = 10.0


class QueueFull(RuntimeError):
    """The engine's waiting queue holds `max_queue` requests; the caller may retry later (HTTP 503)."""


class EngineError(RuntimeError):
    """The engine failed while running a request (the request is lost; the engine keeps serving)."""


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of a request, or its end.

    token_id: the token (an end or stop token that finished the sequence included); None only in a request's last
      event when it ended without a token (cancelled, or max_tokens 0).
    logprob: log p(token) under the distribution it was drawn from (the request's filtered distribution; greedy:
      log_softmax of the raw logits), when the request asked for log-probs, else None.
    top_logprobs: the `logprobs` most likely tokens of that same distribution {token: log-prob}, when asked (> 0).
    finish_reason: None, except in a request's last event: "stop" (an end or stop token), "length" (max_tokens or
      the context) or "cancelled".
    """

    token_id: int | None
    logprob: float | None
    top_logprobs: dict[int, float] | None
    finish_reason: str | None


@dataclass
class Completion:
    """One sampled continuation of a prompt.

    token_ids: the generated tokens; an end or stop token that ended the sequence is included (finish_reason
      "stop"); with a stop string the tokens end with the one that completed it.
    logprobs: float32 [len(token_ids)] (None when not asked): log p(token_ids[i]) under the distribution it was
      drawn from, the model's next-token distribution after temperature, top-k and top-p, renormalized (what
      `sampling.probs_from_logits` gives). With speculative decoding it is still the model's (the target's)
      distribution at that position, never the drafter's. Under greedy decoding (temperature 0), where the draw is
      deterministic, it is log_softmax of the unscaled, unfiltered logits.
    finish_reason: "stop" (an end token, a stop token or a stop string), "length" (max_tokens, or the context), or
      "cancelled".
    expert_ids: None unless asked; else {router name of each backbone MoE layer, as `HybridLM.routers()` names it:
      LongTensor [len(prompt_ids) + len(token_ids) - 1, k]} (len(prompt_ids) rows when nothing was generated).
      Row t holds the experts that router chose for the token at position t of prompt_ids + token_ids, in the
      forward that read it as input: the prefill for the prompt's positions, the decode step (or the verification
      forward) for generated tokens. The last generated token is never read (nothing is generated after it), so
      it has no row: replay them with `model(input_ids=(prompt_ids + token_ids)[:-1], labels=(prompt_ids +
      token_ids)[1:], expert_ids={name: ids[None]})`, the layout of a next-token loss.
    top_logprobs: None unless asked; else per generated token {token: log-prob} of the most likely tokens of the
      same distribution as `logprobs`.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor | None
    finish_reason: str
    expert_ids: dict[str, torch.Tensor] | None = None
    top_logprobs: list[dict[int, float]] | None = None


def completion_of(seq: SequenceState, keep: int | None = None, finish_reason: str | None = None) -> Completion:
    """The Completion of a sequence, its tokens cut to the first `keep` (a stop string) when given."""
    count = len(seq.tokens) if keep is None else keep
    tokens = seq.tokens[:count]
    return Completion(
        prompt_ids=list(seq.prompt), token_ids=list(tokens),
        logprobs=torch.tensor(seq.logprobs[:count], dtype=torch.float32) if seq.keep_logprobs else None,
        finish_reason=finish_reason or seq.finish_reason,
        expert_ids=_cut_routing(seq, count) if seq.routing is not None else None,
        top_logprobs=list(seq.top_logprobs[:count]) if seq.top_n else None)


def _cut_routing(seq: SequenceState, count: int) -> dict[str, torch.Tensor]:
    read = len(seq.prompt) + max(count - 1, 0)
    return {name: ids[:read] for name, ids in seq.expert_ids().items()}


class RequestHandle:
    """A submitted request: its events as they come, its cancellation and its result (see the module docstring).

    Iterating (blocking) or `async for event in handle.events()` yields the events from the first; every iterator
    starts at the beginning. The last event carries the finish_reason. Both raise `EngineError` if the engine failed
    while running the request. Without a background thread, waiting (iterating, `result`) runs the loop in the
    waiting thread."""

    def __init__(self, request_id: str, seq: SequenceState, scheduler: "Scheduler"):
        self.request_id = request_id
        self.sequence = seq
        self._scheduler = scheduler
        self._events: list[TokenEvent] = []
        self._condition = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._error: BaseException | None = None
        self.cancel_requested = False

    @property
    def prompt_ids(self) -> list[int]:
        return self.sequence.prompt

    @property
    def done(self) -> bool:
        return self._error is not None or bool(self._events and self._events[-1].finish_reason is not None)

    @property
    def finish_reason(self) -> str | None:
        return self._events[-1].finish_reason if self.done and self._error is None else None

    def cancel(self) -> None:
        """Stop generating: the request's slot is freed at the next step; its last event is "cancelled" (unless it
        finished first). Safe from any thread, and more than once."""
        if not self.done and not self.cancel_requested:
            self.cancel_requested = True
            self._scheduler.cancel(self)

    def _wait(self, ready: Callable[[], bool], timeout: float | None = None) -> bool:
        if not self._scheduler.threaded:  # nobody else runs the loop: run it here
            self._scheduler.run_until(ready)
            if ready():
                return True
        with self._condition:
            return self._condition.wait_for(ready, timeout)

    def result(self, timeout: float | None = None) -> Completion:
        """The whole completion, once the request finishes; TimeoutError after `timeout` seconds (with a background
        thread; without one the loop runs here until the request is done)."""
        if not self._wait(lambda: self.done, timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self._error is not None:
            raise EngineError(f"request {self.request_id} failed: {self._error}") from self._error
        return completion_of(self.sequence, finish_reason=self.finish_reason)

    def __iter__(self) -> Iterator[TokenEvent]:
        read = 0
        while True:
            self._wait(lambda: read < len(self._events) or self._error is not None)
            with self._condition:
                if read >= len(self._events):
                    raise EngineError(f"request {self.request_id} failed: {self._error}") from self._error
                event = self._events[read]
            read += 1
            yield event
            if event.finish_reason is not None:
                return

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The events for an asyncio consumer (e.g. a FastAPI handler): awaits without blocking the event loop."""
        loop = asyncio.get_running_loop()
        read = 0
        while True:
            with self._condition:
                if read < len(self._events):
                    event, wait = self._events[read], None
                elif self._error is not None:
                    raise EngineError(f"request {self.request_id} failed: {self._error}") from self._error
                else:
                    event, wait = None, loop.create_future()
                    self._waiters.append((loop, wait))
            if wait is not None:
                await wait
                continue
            read += 1
            yield event
            if event.finish_reason is not None:
                return

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self.events()

    # ------------------------------------------------------------------------------------ the loop's side
    def _push(self, events: Sequence[TokenEvent]) -> None:
        with self._condition:
            self._events.extend(events)
            self._condition.notify_all()
            waiters, self._waiters = self._waiters, []
        _wake(waiters)

    def _fail(self, error: BaseException) -> None:
        with self._condition:
            self._error = error
            self._condition.notify_all()
            waiters, self._waiters = self._waiters, []
        _wake(waiters)


def _wake(waiters) -> None:
    for loop, future in waiters:
        try:
            loop.call_soon_threadsafe(_resolve, future)
        except RuntimeError:  # that event loop has closed: nobody is waiting any more
            pass


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


@dataclass(frozen=True)
class EngineStats:
    """What the engine is doing (`HybridEngine.stats()`); rates over the last `STATS_WINDOW_S` seconds."""

    requests_served: int  # finished, for any reason
    requests_running: int  # decoding in a slot, or being prefilled
    queue_length: int  # waiting for a slot
    slots: int  # sequences that can decode at once
    slots_used: int
    batch_occupancy: float  # slots_used / slots
    tokens_per_second: float  # generated tokens
    mean_acceptance_length: float | None  # tokens per verification step (None: no speculative step in the window)
    draft_length: int  # of the last step; 0: plain decoding
    speculative: bool
    cache_bytes: int  # allocated now
    slot_bytes: int
    prompt_tokens: int  # totals since the engine started
    generated_tokens: int


@dataclass(eq=False)
class Request:
    handle: RequestHandle
    seq: SequenceState
    reported: int = 0  # tokens already sent as events


@dataclass(eq=False)
class Group:
    """Requests that share one prefill (the samples of one prompt)."""

    requests: list[Request]
    prefill_started: bool = False

    @property
    def prompt(self) -> list[int]:
        return self.requests[0].seq.prompt


@dataclass
class _Window:
    """(time, generated tokens, verification row-steps, tokens they emitted, last draft length) per iteration."""

    samples: collections.deque = field(default_factory=collections.deque)

    def add(self, now: float, tokens: int, verify_steps: int, verify_tokens: int) -> None:
        self.samples.append((now, tokens, verify_steps, verify_tokens))
        while self.samples and self.samples[0][0] < now - STATS_WINDOW_S:
            self.samples.popleft()


class Scheduler:
    """The loop (see the module docstring) over `batch`."""

    def __init__(self, batch: DecodeBatch, *, max_queue: int = DEFAULT_MAX_QUEUE,
                 max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        if not isinstance(max_step_tokens, int) or max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be an integer >= 1, got {max_step_tokens!r}")
        self.batch = batch
        self.max_queue = max_queue
        self.max_step_tokens = max_step_tokens
        self.lock = threading.Lock()  # the queue, the cancellations, the counters
        self.wake = threading.Condition(self.lock)  # the loop waits on it for work
        self.progress = threading.Condition(self.lock)  # notified after every iteration
        self.step_lock = threading.RLock()  # the batch: one iteration (or a weight update) at a time
        self.waiting: collections.deque[Group] = collections.deque()
        self.cancelled: list[RequestHandle] = []
        self.staged: Group | None = None  # the group whose prompt is in the staging row
        self.running: dict[int, Request] = {}  # id(seq) -> request, for the sequences in the batch
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.accepting = True
        self.served = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.window = _Window()
        self.last_draft_length = 0
        self.iterations = 0

    # ---------------------------------------------------------------------------------------- submitting
    def submit(self, sequences: Sequence[SequenceState], request_ids: Sequence[str | None],
               bypass_queue: bool = False) -> list[RequestHandle]:
        """Queue sequences that share one prompt (one prefill) as requests; returns their handles. QueueFull when
        the queue is full (unless `bypass_queue`: the offline batch API waits for slots instead)."""
        requests = [Request(RequestHandle(rid or uuid.uuid4().hex, seq, self), seq)
                    for seq, rid in zip(sequences, request_ids)]
        with self.lock:
            if not self.accepting:
                raise RuntimeError("the engine is shutting down and takes no new requests")
            queued = sum(len(g.requests) for g in self.waiting)
            if not bypass_queue and queued + len(requests) > self.max_queue:
                raise QueueFull(f"the engine's queue is full ({queued} requests waiting, max_queue "
                                f"{self.max_queue}); retry later")
            self.waiting.append(Group(requests))
            self.wake.notify_all()
        return [r.handle for r in requests]

    def cancel(self, handle: RequestHandle) -> None:
        with self.lock:
            self.cancelled.append(handle)
            self.wake.notify_all()

    def has_work(self) -> bool:
        return bool(self.waiting or self.cancelled or self.staged is not None or self.batch.sequences)

    # ------------------------------------------------------------------------------------------ the loop
    def step(self) -> None:
        """One iteration of the loop (see the module docstring)."""
        with self.step_lock, torch.inference_mode():
            try:
                generated = self._iteration()
            except Exception as exc:  # the batch is in an unknown state: its requests fail, the engine goes on
                self._fail_in_flight(exc)
                raise
        with self.lock:
            self.iterations += 1
            self.generated_tokens += generated
            self.progress.notify_all()

    def _iteration(self) -> int:
        batch = self.batch
        self._apply_cancellations()
        verify_before = (batch.stats.steps, batch.stats.accepted) if hasattr(batch, "stats") else (0, 0)
        generated = 0
        # 2. prefill what the budget leaves after this step's decode tokens
        budget = self.max_step_tokens - len(batch.sequences) * self._tokens_per_row()
        fed_chunk = False
        while True:
            if self.staged is None and not self._stage_next():
                break
            chunk = batch.next_chunk()
            if chunk:
                if fed_chunk and chunk > budget:
                    break
                batch.prefill_next_chunk()
                self.prompt_tokens += chunk
                budget -= chunk
                fed_chunk = True
                if batch.next_chunk():
                    continue
            generated += self._join_staged()
            if self.staged is not None:  # waiting for free slots
                break
        # 3. decode
        if batch.sequences:
            sequences = list(batch.sequences)
            emitted = batch.step()
            self.last_draft_length = getattr(batch, "last_draft_length", 0)
            for seq, tokens in zip(sequences, emitted):
                generated += len(tokens)
                self._publish(self.running[id(seq)])
        # 4. retire
        for seq in batch.retire_finished():
            self._finish(self.running.pop(id(seq)))
        steps, accepted = (batch.stats.steps, batch.stats.accepted) if hasattr(batch, "stats") else (0, 0)
        with self.lock:
            row_steps = steps - verify_before[0]
            self.window.add(time.perf_counter(), generated, row_steps, row_steps + accepted - verify_before[1])
        return generated

    def _tokens_per_row(self) -> int:
        controller = getattr(self.batch, "controller", None)
        if controller is None or not self.batch.sequences:
            return 1
        return 1 + controller.current.get(controller.bucket(len(self.batch.sequences)), 0)

    def _stage_next(self) -> bool:
        """Put the next waiting group's prompt in the staging row; False when nothing waits."""
        with self.lock:
            if not self.waiting:
                return False
            group = self.waiting.popleft()
        self.staged = group
        self.batch.stage(group.requests[0].seq)
        return True

    def _join_staged(self) -> int:
        """Join as many of the staged group's requests as there are free slots; returns the tokens they emitted."""
        group, batch = self.staged, self.batch
        count = min(batch.free_slots, len(group.requests))
        if count == 0:
            return 0
        joining, group.requests = group.requests[:count], group.requests[count:]
        generated = 0
        for request, tokens in zip(joining, batch.join([r.seq for r in joining])):
            self.running[id(request.seq)] = request
            generated += len(tokens)
            self._publish(request)
        if not group.requests:
            self.staged = None
            batch.unstage()
        return generated

    def _publish(self, request: Request, final: bool = False) -> None:
        """Send a request's new tokens as events. A finished request's go out once its slot is free (`final`, from
        `_finish`), so that whoever sees its last event sees the engine without it."""
        seq = request.seq
        start, end = request.reported, len(seq.tokens)
        if start == end or (seq.finished and not final):
            return
        events = [TokenEvent(seq.tokens[i], seq.logprobs[i] if seq.keep_logprobs else None,
                             seq.top_logprobs[i] if seq.top_n else None,
                             seq.finish_reason if i == end - 1 else None) for i in range(start, end)]
        request.reported = end
        request.handle._push(events)

    def _finish(self, request: Request) -> None:
        """A retired request: its last tokens, or a last event without one."""
        with self.lock:
            self.served += 1
        self._publish(request, final=True)
        if not request.handle.done:
            request.handle._push([TokenEvent(None, None, None, request.seq.finish_reason)])

    def _apply_cancellations(self) -> None:
        """Cancelled requests leave the queue or the staging row, or finish and free their slots."""
        with self.lock:
            cancelled, self.cancelled = set(self.cancelled), []
            if not cancelled:
                return
            dropped = [r for g in self.waiting for r in g.requests if r.handle in cancelled]
            for group in list(self.waiting):
                group.requests = [r for r in group.requests if r.handle not in cancelled]
                if not group.requests:
                    self.waiting.remove(group)
        if self.staged is not None:
            dropped += [r for r in self.staged.requests if r.handle in cancelled]
            self.staged.requests = [r for r in self.staged.requests if r.handle not in cancelled]
            if not self.staged.requests:
                self.staged = None
                self.batch.unstage()
        for request in dropped:
            request.seq.finish_reason = CANCELLED
            self._finish(request)
        for request in self.running.values():
            if request.handle in cancelled and not request.seq.finished:
                request.seq.finish_reason = CANCELLED
        for seq in self.batch.retire_finished():
            self._finish(self.running.pop(id(seq)))

    def _fail_in_flight(self, error: BaseException) -> None:
        """After a failed iteration: fail the requests in the batch and the staged ones, empty the batch."""
        failed = list(self.running.values()) + (self.staged.requests if self.staged is not None else [])
        for request in failed:
            request.handle._fail(error)
        self.running.clear()
        self.staged = None
        self.batch.unstage()
        for seq in self.batch.sequences:
            seq.finish_reason = seq.finish_reason or CANCELLED
        self.batch.retire_finished()
        with self.lock:
            self.served += len(failed)

    # --------------------------------------------------------------------------------- running the loop
    def run_until(self, done: Callable[[], bool]) -> None:
        """Run iterations in the calling thread until `done()` (or nothing is left to do)."""
        while not done() and self.has_work():
            self.step()

    def start(self) -> None:
        """Run the loop in a background thread (no-op when it runs)."""
        with self.lock:
            if self.thread is not None and self.thread.is_alive():
                return
            self.stopping, self.accepting = False, True
            self.thread = threading.Thread(target=self._run, name="hybridtron-engine", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while True:
            with self.lock:
                self.wake.wait_for(lambda: self.stopping or self.has_work())
                if self.stopping and not self.has_work():
                    return
            try:
                self.step()
            except Exception:  # reported to the requests it failed (`step`); keep serving the others
                pass

    @property
    def threaded(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def shutdown(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Take no new requests; finish the ones in flight (or cancel them: `cancel`, or those left after `timeout`
        seconds); stop the loop's thread."""
        with self.lock:
            self.accepting = False
        if cancel:
            self.cancel_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.threaded:
            with self.lock:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self.progress.wait_for(lambda: not self.has_work(), left):
                    self.cancelled.extend(self._in_flight())
                    self.wake.notify_all()
                    self.progress.wait_for(lambda: not self.has_work())
                self.stopping = True
                self.wake.notify_all()
            self.thread.join()
            self.thread = None
        else:
            self.run_until(lambda: deadline is not None and time.monotonic() >= deadline)
            self.cancel_all()
            self.run_until(lambda: False)

    def _in_flight(self) -> list[RequestHandle]:
        handles = [r.handle for g in self.waiting for r in g.requests] + [r.handle for r in self.running.values()]
        if self.staged is not None:
            handles += [r.handle for r in self.staged.requests]
        return handles

    def cancel_all(self) -> None:
        with self.lock:
            self.cancelled.extend(self._in_flight())
            self.wake.notify_all()

    # ------------------------------------------------------------------------------------------- statistics
    def stats(self) -> EngineStats:
        batch = self.batch
        with self.lock:
            samples = list(self.window.samples)
            queued = sum(len(g.requests) for g in self.waiting)
            staged = len(self.staged.requests) if self.staged is not None else 0
            served, prompt_tokens, generated = self.served, self.prompt_tokens, self.generated_tokens
        running = len(batch.sequences)
        span = samples[-1][0] - samples[0][0] if len(samples) > 1 else 0.0
        tokens = sum(s[1] for s in samples[1:])
        verify_steps, verify_tokens = sum(s[2] for s in samples), sum(s[3] for s in samples)
        return EngineStats(
            requests_served=served, requests_running=running + staged, queue_length=queued, slots=batch.slots,
            slots_used=running, batch_occupancy=running / batch.slots,
            tokens_per_second=tokens / span if span > 0 else 0.0,
            mean_acceptance_length=verify_tokens / verify_steps if verify_steps else None,
            draft_length=self.last_draft_length, speculative=hasattr(batch, "controller"),
            cache_bytes=batch.memory_bytes(), slot_bytes=batch.slot_bytes(), prompt_tokens=prompt_tokens,
            generated_tokens=generated)
