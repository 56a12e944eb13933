"""The engine's loop and serving API: continuous batching (admission, retirement, slot reuse, chunked prefill under a
budget), batched == alone, per-request seeds, the bounded queue, cancellation, shutdown, events (blocking and
asyncio), failures, and the adaptive draft length."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from hybridtron.data.tokenizer import Tokenizer
from hybridtron.infer.engine import EngineError, HybridEngine, QueueFull, generate_tokens
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.speculative import DraftLengthController
from hybridtron.model.lm import HybridLM
from test_speculative import chain_model

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(["def serve(engine, request):\n    return engine.submit(request)\n" * 40], 600)


@pytest.fixture
def model(small_config):
    torch.manual_seed(0)
    return HybridLM(small_config(vocab_size=640, initializer_range=0.05)).eval()


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 600, (n,), generator=g).tolist() for n in lengths]


def alone(engine, prompt, params):
    """The tokens of one request with nothing else in the engine."""
    return engine.submit(prompt, params).result(timeout=60).token_ids


def wait_idle(engine, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.requests_running == 0 and stats.queue_length == 0:
            return stats
        time.sleep(0.01)
    raise AssertionError(f"the engine did not go idle: {engine.stats()}")


def assert_idle(engine):
    """No slot, queue entry or staged prompt left."""
    scheduler = engine.scheduler
    assert not scheduler.running and not scheduler.waiting and scheduler.staged is None
    assert not scheduler.batch.sequences and scheduler.batch.staged is None
    stats = engine.stats()
    assert stats.slots_used == 0 and stats.requests_running == 0 and stats.queue_length == 0


# ----------------------------------------------------------------------------------------- batched == alone
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_greedy_output_is_the_same_batched_and_alone(model, tokenizer, speculative):
    """Eight requests of different prompt lengths and budgets, submitted at once to a running engine with three
    slots and a small step budget (so prompts are prefilled in chunks between decode steps): each one's tokens are
    what it gets alone, and what a fixed-batch decoder gives."""
    engine = HybridEngine.from_model(model, tokenizer, speculative=speculative, max_slots=3, prefill_chunk=4,
                                     max_step_tokens=8)
    prompts = prompts_of([3, 17, 6, 1, 9, 12, 5, 2])
    budgets = [12, 5, 9, 12, 3, 7, 12, 1]
    expected = [alone(engine, p, SamplingParams(temperature=0, max_tokens=m)) for p, m in zip(prompts, budgets)]
    engine.start()
    try:
        handles = [engine.submit(p, SamplingParams(temperature=0, max_tokens=m)) for p, m in zip(prompts, budgets)]
        assert [h.result(timeout=60).token_ids for h in handles] == expected
        stops = engine.end_token_ids
        for prompt, tokens, budget in zip(prompts, expected, budgets):
            plain = generate_tokens(model, [prompt], SamplingParams(temperature=0, max_tokens=budget,
                                                                    stop_token_ids=stops))[0]
            assert tokens == plain
        assert_idle(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_a_seeded_request_samples_the_same_tokens_whatever_else_runs(model, tokenizer, speculative):
    """Per-request noise: a seeded request's sampled tokens alone, beside other sampled requests (joining at other
    times), with and without drafting, and through `generate`, are the same; another seed changes them."""
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, max_tokens=12, seed=7)
    engine = HybridEngine.from_model(model, tokenizer, speculative=speculative, max_slots=4)
    prompt = prompts_of([7])[0]
    reference = alone(engine, prompt, params)
    plain = HybridEngine.from_model(model, tokenizer, speculative=False)
    assert alone(plain, prompt, params) == reference  # drafting does not change a sampled request's tokens
    assert engine.generate([prompt], params)[0][0].token_ids == reference
    others = [engine.submit(p, SamplingParams(temperature=1.0, max_tokens=10)) for p in prompts_of([4, 11], 1)]
    engine.scheduler.step()  # the others are running when the seeded one joins
    handle = engine.submit(prompt, params)
    late = engine.submit(prompts_of([3], 2)[0], SamplingParams(temperature=1.0, max_tokens=10))
    engine.scheduler.run_until(lambda: handle.done and late.done and all(o.done for o in others))
    assert handle.result().token_ids == reference
    assert alone(engine, prompt, SamplingParams(temperature=0.9, top_k=40, top_p=0.95, max_tokens=12,
                                                seed=8)) != reference


# ------------------------------------------------------------------------------------ admission and slots
def test_requests_arriving_at_different_times_join_and_leave_the_running_batch(model, tokenizer):
    """Two slots; requests of different lengths submitted while others run: they wait for a slot (queue length),
    join as slots free up (batch occupancy), finish in the order their budgets allow, and the slots are reused: the
    cache never grows past two rows and is back to idle afterwards, cancelled requests included."""
    engine = HybridEngine.from_model(model, tokenizer, speculative=False, max_slots=2)
    scheduler = engine.scheduler
    first = engine.submit(prompts_of([5])[0], SamplingParams(temperature=0, max_tokens=20))
    short = engine.submit(prompts_of([3])[0], SamplingParams(temperature=0, max_tokens=3))
    scheduler.step()  # both join (a first token each) and decode one token
    assert engine.stats().slots_used == 2 and engine.stats().batch_occupancy == 1.0
    assert len(short.sequence.tokens) == 2
    waiting = [engine.submit(p, SamplingParams(temperature=0, max_tokens=4)) for p in prompts_of([4, 6, 2], 3)]
    cancelled = engine.submit(prompts_of([8])[0], GREEDY)
    assert engine.stats().queue_length == 4
    cancelled.cancel()
    scheduler.step()  # `short` finishes; the first waiting prompt is prefilled meanwhile, waiting for a slot
    assert short.done and short.finish_reason == "length" and len(short.result().token_ids) == 3
    assert cancelled.done and cancelled.finish_reason == "cancelled" and cancelled.result().token_ids == []
    stats = engine.stats()
    assert stats.slots_used == 1 and stats.queue_length == 2 and stats.requests_running == 2
    scheduler.step()  # ... and takes the freed slot
    assert engine.stats().slots_used == 2 and scheduler.batch.sequences[1] is waiting[0].sequence
    bytes_in_use = engine.stats().cache_bytes
    scheduler.run_until(lambda: all(h.done for h in [first, *waiting]))
    assert [len(h.result().token_ids) for h in waiting] == [4, 4, 4] and len(first.result().token_ids) == 20
    assert waiting[2].sequence.prompt == prompts_of([4, 6, 2], 3)[2]
    assert scheduler.batch.cache.batch_size == 2 and engine.stats().cache_bytes == bytes_in_use
    assert engine.stats().requests_served == 6
    assert_idle(engine)


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(model, tokenizer):
    """A 40-token prompt with 8-token chunks and a budget of 10 tokens per step: while it is prefilled the running
    request still gets one token per step, and the prompt's chunks do not depend on the budget (same tokens)."""
    engine = HybridEngine.from_model(model, tokenizer, speculative=False, max_slots=2, prefill_chunk=8,
                                     max_step_tokens=10)
    scheduler = engine.scheduler
    running = engine.submit(prompts_of([4])[0], SamplingParams(temperature=0, max_tokens=30))
    scheduler.step()
    long_prompt = prompts_of([40], 5)[0]
    long = engine.submit(long_prompt, GREEDY)
    tokens_before = len(running.sequence.tokens)
    steps = 0
    while not long.sequence.tokens:
        scheduler.step()
        steps += 1
    assert steps == 5  # one 8-token chunk per step (the decode step takes 1 of the 10)
    assert len(running.sequence.tokens) == tokens_before + steps
    scheduler.run_until(lambda: running.done and long.done)
    unchunked = HybridEngine.from_model(model, tokenizer, speculative=False, prefill_chunk=64)
    assert long.result().token_ids == alone(unchunked, long_prompt, GREEDY)


def test_samples_beyond_the_free_slots_share_the_prefill_and_wait(model, tokenizer, monkeypatch):
    """generate with n = 5 on 2 slots: one prefill, the samples join two at a time, all five complete."""
    from hybridtron.infer.decoder import DecodeBatch

    engine = HybridEngine.from_model(model, tokenizer, speculative=False, max_slots=2)
    staged = []
    stage = DecodeBatch.stage
    monkeypatch.setattr(DecodeBatch, "stage", lambda self, seq: staged.append(seq.prompt) or stage(self, seq))
    prompt = prompts_of([6])[0]
    samples = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=6, seed=1), n=5)[0]
    assert staged == [prompt] and len(samples) == 5 and len({tuple(s.token_ids) for s in samples}) > 1
    assert_idle(engine)


def test_engines_that_each_take_a_slice_of_the_prompts_sample_what_one_call_samples(model, tokenizer):
    """`first_prompt` (split rollouts under torchrun): prompts 1.. generated apart, with logprobs, are the whole
    call's samples of them, and the first slice is the whole call's first."""
    engine = HybridEngine.from_model(model, tokenizer, max_slots=4)
    prompts = prompts_of([5, 7, 4])
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3)
    whole = engine.generate(prompts, params, n=2)
    parts = engine.generate(prompts[:1], params, n=2) + engine.generate(prompts[1:], params, n=2, first_prompt=1)
    for got, want in zip(parts, whole):
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(a.logprobs, b.logprobs)
    shifted = engine.generate(prompts[1:], params, n=2)  # without the offset, other noise keys
    assert [c.token_ids for c in shifted[0]] != [c.token_ids for c in whole[1]]
    assert_idle(engine)


# ------------------------------------------------------------------------------------------ the API
def test_queue_full_and_bad_requests(model, tokenizer):
    engine = HybridEngine.from_model(model, tokenizer, speculative=False, max_queue=2)
    engine.submit([5, 6], GREEDY)
    engine.submit([5, 7], GREEDY)
    with pytest.raises(QueueFull, match="max_queue 2"):
        engine.submit([5, 8], GREEDY)
    engine.generate([[5, 9]], SamplingParams(temperature=0, max_tokens=2))  # the batch API waits instead
    for kwargs, message in (({"prompt_ids": []}, "empty"), ({"prompt_ids": [5, 700]}, "outside the vocabulary"),
                            ({"params": "greedy"}, "SamplingParams"), ({"logprobs": 21}, "logprobs"),
                            ({"logprobs": True}, "logprobs"), ({"request_id": 3}, "request_id")):
        arguments = {"prompt_ids": [5], "params": GREEDY, **kwargs}
        with pytest.raises(ValueError, match=message):
            engine.submit(arguments.pop("prompt_ids"), arguments.pop("params"), **arguments)


def test_events_logprobs_and_async_iteration(model, tokenizer):
    """Events carry each token, its log-prob and top log-probs (the sampled distribution's, so the sampled token's
    log-prob is among them or below them), the finish_reason on the last; `result` agrees; `events()` works from
    asyncio while the loop runs in its thread."""
    engine = HybridEngine.from_model(model, tokenizer, speculative=True, draft_length=2)
    engine.start()
    try:
        handle = engine.submit(prompts_of([5])[0], SamplingParams(temperature=0.8, top_k=30, max_tokens=8, seed=2),
                               logprobs=3, request_id="r-1")
        events = list(handle)
        assert handle.request_id == "r-1" and [e.finish_reason for e in events][-1] == "length"
        assert all(e.finish_reason is None for e in events[:-1]) and len(events) == 8
        completion = handle.result()
        assert [e.token_id for e in events] == completion.token_ids
        torch.testing.assert_close(torch.tensor([e.logprob for e in events]), completion.logprobs)
        for event in events:
            assert len(event.top_logprobs) == 3 and event.logprob <= max(event.top_logprobs.values()) + 1e-6
            assert event.token_id not in event.top_logprobs or \
                abs(event.top_logprobs[event.token_id] - event.logprob) < 1e-6
        assert completion.top_logprobs == [e.top_logprobs for e in events]

        async def consume():
            handle = engine.submit(prompts_of([4])[0], SamplingParams(temperature=0, max_tokens=6))
            return [event async for event in handle.events()], handle

        async_events, async_handle = asyncio.run(consume())
        assert [e.token_id for e in async_events] == async_handle.result().token_ids
        assert async_events[-1].finish_reason == "length" and async_events[0].logprob is None
    finally:
        engine.shutdown()


def test_cancel_mid_stream_frees_the_slot(model, tokenizer):
    engine = HybridEngine.from_model(model, tokenizer, speculative=True, max_slots=1)
    engine.start()
    try:
        handle = engine.submit(prompts_of([5])[0], SamplingParams(temperature=0, max_tokens=200))
        events = iter(handle)
        first = [next(events) for _ in range(3)]
        handle.cancel()
        rest = list(events)
        assert all(e.token_id is not None for e in first)
        assert rest[-1].finish_reason == "cancelled" and rest[-1].token_id is None
        assert handle.finish_reason == "cancelled" and len(handle.result().token_ids) < 200
        wait_idle(engine)
        assert_idle(engine)
        handle.cancel()  # a finished request: nothing happens
        assert alone(engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))  # the slot serves again
    finally:
        engine.shutdown()


def test_shutdown_finishes_or_cancels_what_is_in_flight(small_config, tokenizer):
    # a context far longer than the fixture's 256 tokens: on a loaded machine the scheduler's thread decoded a whole
    # 256-token context between a submit and the shutdown that was to cancel it
    torch.manual_seed(0)
    model = HybridLM(small_config(vocab_size=640, initializer_range=0.05, max_position_embeddings=1 << 16)).eval()
    engine = HybridEngine.from_model(model, tokenizer, speculative=False, max_slots=2)
    engine.start()
    graceful = [engine.submit(p, SamplingParams(temperature=0, max_tokens=6)) for p in prompts_of([3, 5, 4])]
    engine.shutdown()
    assert [h.finish_reason for h in graceful] == ["length"] * 3 and not engine.scheduler.threaded
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.submit([5], GREEDY)
    engine.start()
    long = [engine.submit(p, SamplingParams(temperature=0, max_tokens=10_000)) for p in prompts_of([3, 5, 4])]
    engine.shutdown(cancel=True)
    assert [h.finish_reason for h in long] == ["cancelled"] * 3
    engine.start()
    long = [engine.submit(p, SamplingParams(temperature=0, max_tokens=10_000)) for p in prompts_of([3, 5, 4])]
    started = time.monotonic()
    engine.shutdown(timeout=0.2)
    assert time.monotonic() - started < 30 and [h.finish_reason for h in long] == ["cancelled"] * 3
    assert_idle(engine)


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(model, tokenizer, monkeypatch):
    engine = HybridEngine.from_model(model, tokenizer, speculative=False)
    engine.start()
    try:
        batch = engine.scheduler.batch
        step = batch.step
        monkeypatch.setattr(batch, "step", lambda: (_ for _ in ()).throw(RuntimeError("kernel exploded")))
        handle = engine.submit([5, 6, 7], GREEDY)
        with pytest.raises(EngineError, match="kernel exploded"):
            handle.result(timeout=30)
        with pytest.raises(EngineError):
            list(handle)
        monkeypatch.setattr(batch, "step", step)
        assert len(alone(engine, [5, 6, 7], SamplingParams(temperature=0, max_tokens=3))) == 3
        assert_idle(engine)
    finally:
        engine.shutdown()


def test_weights_are_handed_over_between_steps_of_a_running_loop(model, tokenizer):
    """`load_weights` while requests run waits for the step in progress; later tokens come from the new weights."""
    engine = HybridEngine.from_model(model, tokenizer, speculative=False)
    engine.start()
    try:
        handles = [engine.submit(p, SamplingParams(temperature=1.0, max_tokens=50)) for p in prompts_of([3, 4])]
        updated = HybridLM(model.config).eval()
        engine.update_weights(updated)
        for name, value in updated.state_dict().items():
            assert torch.equal(engine.model.state_dict()[name], value)
        for handle in handles:
            handle.result(timeout=60)
    finally:
        engine.shutdown()


def test_stats_report_throughput_and_acceptance(model, tokenizer):
    engine = HybridEngine.from_model(model, tokenizer, speculative=True, draft_length=3, max_slots=4)
    engine.generate(prompts_of([5, 6]), SamplingParams(temperature=0, max_tokens=16), n=2)
    stats = engine.stats()
    assert stats.speculative and stats.slots == 4 and stats.requests_served == 4
    assert stats.tokens_per_second > 0 and stats.generated_tokens == 64 and stats.prompt_tokens == 11
    assert stats.mean_acceptance_length >= 1.0 and stats.draft_length in (0, 1, 2, 3)
    assert stats.slot_bytes > 0 and stats.cache_bytes >= stats.slot_bytes
    assert engine.last_stats.steps > 0


# --------------------------------------------------------------------------------------- the draft length
def test_drafting_turns_off_when_drafts_are_never_accepted(small_config, tokenizer):
    """A random MTP block on a model whose tokens it cannot predict: after its first tries the controller stops
    drafting (mostly plain steps), probes now and then, and the output is still plain greedy's."""
    model = HybridLM(small_config(vocab_size=640, initializer_range=0.05)).eval()
    engine = HybridEngine.from_model(model, tokenizer, speculative=True, max_slots=1)
    prompt = prompts_of([5])[0]
    params = SamplingParams(temperature=0, max_tokens=120)
    tokens = engine.generate([prompt], params)[0][0].token_ids
    controller = engine.scheduler.batch.controller
    assert controller.off.get(1) and controller.accepted[1] / controller.reached[1] < 0.2  # the measured rate
    assert engine.last_stats.steps < 20  # verification steps among ~120 tokens: the first tries and the probes
    assert tokens == generate_tokens(model, [prompt], SamplingParams(temperature=0, max_tokens=120,
                                                                     stop_token_ids=engine.end_token_ids))[0]


def test_the_draft_length_grows_on_a_model_whose_drafts_are_accepted(small_config, tokenizer):
    """Drafts that are (almost) always right: the controller drafts several tokens per step, beyond k = 1."""
    model = chain_model(small_config(vocab_size=640, initializer_range=0.1), mtp_noise=0.0)
    engine = HybridEngine.from_model(model, tokenizer, speculative=True, max_slots=1)
    engine.generate(prompts_of([5]), SamplingParams(temperature=0, max_tokens=100))
    controller = engine.scheduler.batch.controller
    assert not controller.off.get(1) and controller.current[1] >= 3
    assert engine.last_stats.mean_acceptance_length > 3


def test_the_controller_picks_the_k_with_the_most_tokens_per_second():
    """Unit test with a cost model: a step costs 1 + 0.25 k; depth j is accepted with probability p_j. The controller
    settles on the k that maximises expected tokens / cost, turns drafting off when nothing beats plain, and backs
    off its probes."""
    def simulate(acceptance, steps=400):
        controller = DraftLengthController(max_draft_length=6)
        g = torch.Generator().manual_seed(0)
        for _ in range(steps):
            k = controller.draft_length(1)
            accepted = 0
            while accepted < k and torch.rand(1, generator=g) < acceptance[accepted]:
                accepted += 1
            controller.record(1, k, 1.0 + 0.25 * k, [accepted] if k else [])
        return controller

    def best(acceptance):
        def rate(k):
            total, chain = 1.0, 1.0
            for p in acceptance[:k]:
                chain *= p
                total += chain
            return total / (1 + 0.25 * k)
        return max(range(7), key=rate)

    for acceptance in ([0.95] * 6, [0.9, 0.8, 0.05, 0.05, 0.05, 0.05], [0.6, 0.3, 0.1, 0, 0, 0]):
        controller = simulate(acceptance)
        assert controller.current[1] == best(acceptance), acceptance
    never = simulate([0.0] * 6)
    assert never.off[1] and never.probe_every[1] >= 64  # probes got rarer


def test_a_depth_rejected_in_the_first_steps_is_tried_again():
    """A deep backbone's costs (a verification 1.4 plain steps, a draft 0.06) and drafts accepted at 0.9 per depth,
    except that the first two steps that reach draft 2 happen to reject it: the controller still grows k to the
    best within a 100-token reply, not stuck at k = 1, which never reaches depth 2 to measure it again."""
    controller = DraftLengthController(max_draft_length=6)
    g = torch.Generator().manual_seed(0)
    early_rejections, ks = 2, []
    for _ in range(60):
        k = controller.draft_length(1)
        ks.append(k)
        accepted = 0
        if k >= 2 and early_rejections:
            early_rejections -= 1
            accepted = 1
        else:
            while accepted < k and torch.rand(1, generator=g) < 0.9:
                accepted += 1
        controller.record(1, k, 1.0 if k == 0 else 1.4 + 0.06 * k, [accepted] if k else [])
    assert early_rejections == 0 and controller.current[1] == 6, ks
