"""The server over loopback HTTP with the REAL `HybridEngine` (a tiny checkpoint this module writes) and the official
`openai` client: what it returns is what the engine generates (greedy text, log-probs), in OpenAI's shapes; a
bounded load test with cancellations leaves no slot behind; shutdown finishes what is in flight."""

import contextlib
import json
import random
import re
import socket
import threading
import time
import urllib.request

import pytest
import torch

from hybridtron.checkpoint import save_pretrained
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.infer.engine import HybridEngine, load_engine
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.server import create_app
from hybridtron.model.lm import HybridLM

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

TEXT = "def generate(model, prompt):\n    return model(prompt)\n" * 40 + "Ça va très bien, merci 🙂 !\n" * 20
GREEDY = dict(temperature=0)


@contextlib.contextmanager
def serving(app):
    """`app` served by uvicorn on a free loopback port, in a thread: yields (uvicorn server, base URL)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield server, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(20)
        assert not thread.is_alive(), "the server did not stop"
        sock.close()


def openai_client(base, **options):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30,
                         http_client=openai.DefaultHttpxClient(trust_env=False), **options)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train([TEXT], 600)


@pytest.fixture(scope="module")
def model(small_config):
    torch.manual_seed(0)
    return HybridLM(small_config(vocab_size=640, max_position_embeddings=256, initializer_range=0.05)).eval()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, model, tokenizer):
    directory = tmp_path_factory.mktemp("served") / "tiny"
    save_pretrained(model, directory)
    tokenizer.save(directory)
    return load_engine(directory, max_slots=8, max_queue=64)


@pytest.fixture(scope="module")
def served(engine):
    with serving(create_app(engine)) as (_, base):
        yield engine, base, openai_client(base)


def reference(engine, prompt_ids, max_tokens, **params):
    """What the engine generates for a prompt, offline (`HybridEngine.generate`): (shown text, shown tokens,
    their log-probs, all tokens)."""
    completion = engine.generate([prompt_ids], SamplingParams(max_tokens=max_tokens, **params))[0][0]
    tokens = completion.token_ids
    shown = tokens[:-1] if completion.finish_reason == "stop" else tokens  # the end token shows no text
    return engine.decode(shown), shown, completion.logprobs[:len(shown)].tolist(), tokens


def test_completions_are_the_engines_output(served):
    engine, _, client = served
    prompt = engine.encode("def generate(model")
    text, shown, _, tokens = reference(engine, prompt, 20, **GREEDY)
    response = client.completions.create(model=engine.model_name, prompt="def generate(model", max_tokens=20,
                                         temperature=0)
    assert response.choices[0].text == text
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt), len(tokens))

    # n, a batch of prompts (string and token ids), echo: choice i * n + j is sample j of prompt i
    other = engine.encode("    return")
    other_text = reference(engine, other, 20, **GREEDY)[0]
    batch = client.completions.create(model=engine.model_name, prompt=["def generate(model", other], n=2,
                                      max_tokens=20, temperature=0, echo=True)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == ["def generate(model" + text] * 2 + ["    return" + other_text] * 2
    assert batch.usage.prompt_tokens == len(prompt) + len(other)


def test_logprobs_are_the_engines_in_openais_shapes(served, model):
    engine, _, client = served
    prompt = engine.encode("def generate(model")
    text, shown, logprobs, _ = reference(engine, prompt, 16, **GREEDY)
    response = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=16, temperature=0,
                                         logprobs=3)
    got = response.choices[0].logprobs
    assert len(got.tokens) == len(got.token_logprobs) == len(got.top_logprobs) == len(got.text_offset) == len(shown)
    assert got.token_logprobs == pytest.approx(logprobs, abs=1e-5)
    for token_logprob, top in zip(got.token_logprobs, got.top_logprobs):
        # greedy: the token is the most likely one (the dict is keyed by token text, where two tokens may read the
        # same: ids past the tokenizer's vocabulary all read "")
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(token_logprob, abs=1e-6)
    assert got.text_offset[0] == 0 and got.text_offset == sorted(got.text_offset)

    # echo + logprobs scores the prompt (one forward over it), then goes on with the generated tokens
    scored = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=16, temperature=0,
                                       logprobs=2, echo=True).choices[0]
    assert scored.text == engine.decode(prompt) + text
    assert scored.logprobs.token_logprobs[0] is None and scored.logprobs.top_logprobs[0] is None
    with torch.no_grad():
        forward = torch.log_softmax(model(torch.tensor([prompt]), mtp=False).logits[0, :-1], dim=-1)
    expected = forward.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    assert scored.logprobs.token_logprobs[1:len(prompt)] == pytest.approx(expected, abs=1e-5)
    assert scored.logprobs.token_logprobs[len(prompt):] == pytest.approx(logprobs, abs=1e-5)
    assert scored.logprobs.text_offset[len(prompt)] == len(engine.decode(prompt))

    chat = client.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": "Ça va ?"}],
                                          max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    choice = chat.choices[0]
    content = choice.logprobs.content
    assert content and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    # every shown token's bytes, put together, are the reply's text
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", errors="replace") == choice.message.content


def test_streaming_equals_non_streaming(served):
    engine, _, client = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def generate"}]
    plain = client.chat.completions.create(model=engine.model_name, messages=messages, max_tokens=24, temperature=0,
                                           logprobs=True)
    chunks = list(client.chat.completions.create(model=engine.model_name, messages=messages, max_tokens=24,
                                                 temperature=0, logprobs=True, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    streamed_logprobs = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
                         for t in c.choices[0].logprobs.content]
    assert streamed_logprobs == pytest.approx([t.logprob for t in plain.choices[0].logprobs.content], abs=1e-5)
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason

    completion = list(client.completions.create(model=engine.model_name, prompt="def generate(", max_tokens=12,
                                                temperature=0, n=2, stream=True))
    texts = ["".join(c.choices[0].text for c in completion if c.choices[0].index == i) for i in (0, 1)]
    assert texts[0] == texts[1] == reference(engine, engine.encode("def generate("), 12, **GREEDY)[0]


def test_n_samples_share_a_prefill_and_a_seed_reproduces_them(served):
    engine, _, client = served
    request = dict(model=engine.model_name, messages=[{"role": "user", "content": "Hello"}], max_tokens=16,
                   temperature=1.0, n=3, seed=5)
    prefilled = engine.stats().prompt_tokens
    first = client.chat.completions.create(**request)
    assert engine.stats().prompt_tokens - prefilled == first.usage.prompt_tokens  # the 3 samples share one prefill
    second = client.chat.completions.create(**request)
    replies = [c.message.content for c in first.choices]
    assert replies == [c.message.content for c in second.choices]
    assert len(set(replies)) > 1
    # the choices of a seeded request are the offline API's samples
    prompt = engine.encode(engine.chat_template(request["messages"]))
    offline = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=16, seed=5), n=3)[0]
    assert first.usage.completion_tokens == sum(len(o.token_ids) for o in offline)
    assert replies == [engine.decode(o.token_ids[:-1] if o.finish_reason == "stop" else o.token_ids)
                       for o in offline]
    assert client.chat.completions.create(**{**request, "seed": 6}).choices[0].message.content != replies[0]


def test_stop_strings_and_the_context_limit(served):
    engine, _, client = served
    text = reference(engine, engine.encode("def generate(model"), 24, **GREEDY)[0]
    stop = text[5:8]
    assert stop and stop not in text[:5 + len(stop) - 1]
    response = client.completions.create(model=engine.model_name, prompt="def generate(model", max_tokens=24,
                                         temperature=0, stop=[stop])
    assert response.choices[0].text == text[:text.index(stop)] and response.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=engine.model_name, prompt="def", max_tokens=1000)
    assert info.value.code == "context_length_exceeded" and "maximum context length is 256" in info.value.message


def test_queue_full_is_a_503_and_the_server_goes_on(served):
    engine, base, client = served
    engine.scheduler.max_queue = 0  # every request finds the queue full
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=engine.model_name, prompt="def", max_tokens=4)
        assert info.value.status_code == 503 and info.value.code == "queue_full"
        assert info.value.response.headers["retry-after"] == "1"
    finally:
        engine.scheduler.max_queue = 64
    assert client.completions.create(model=engine.model_name, prompt="def", max_tokens=4).choices[0].text is not None


def metric(base, name):
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(base + "/metrics", timeout=10) as response:
        text = response.read().decode()
    values = re.findall(rf"^hybridtron_{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert values, f"{name} missing from /metrics"
    return sum(float(v) for v in values)


def test_load_every_request_answered_and_no_slot_leaks(served):
    """64 requests from 16 concurrent clients: mixed prompt and completion lengths, chat and completions, n 1-2,
    streaming and not; a quarter are streams the client drops after two chunks, a few are malformed. Each is
    answered (200 or a clean 400), and afterwards the engine is idle: no slot, queue entry or staged prompt left."""
    engine, base, client = served
    served_before = metric(base, "engine_requests_served_total")
    rng = random.Random(0)
    outcomes, lock = [], threading.Lock()

    def one(index):
        kind = index % 8
        max_tokens = rng.randint(1, 24)
        prompt = [rng.randrange(20, 600) for _ in range(rng.randint(1, 60))]
        if kind in (0, 1):  # a stream dropped mid-way
            stream = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=64, stream=True)
            received = [chunk for chunk, _ in zip(stream, range(2))]
            stream.close()
            return "dropped" if received else "empty"
        if kind == 2:  # malformed
            try:
                client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=-1)
            except openai.BadRequestError as exc:
                return "refused" if exc.param == "max_tokens" else "wrong error"
            return "accepted a bad request"
        if kind == 3:
            reply = client.chat.completions.create(model=engine.model_name, max_tokens=max_tokens, n=2,
                                                   messages=[{"role": "user", "content": engine.decode(prompt)}])
            return "ok" if len(reply.choices) == 2 else "wrong choices"
        if kind == 4:
            chunks = list(client.chat.completions.create(model=engine.model_name, max_tokens=max_tokens, stream=True,
                                                         messages=[{"role": "user", "content": "hi"}]))
            return "ok" if chunks[-1].choices[0].finish_reason in ("stop", "length") else "unfinished"
        response = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0, logprobs=1 if kind == 5 else None)
        finish = response.choices[0].finish_reason
        return "ok" if finish == "stop" or response.usage.completion_tokens == max_tokens else "wrong length"

    def worker(indices):
        for index in indices:
            try:
                outcome = one(index)
            except Exception as exc:  # noqa: BLE001 (reported below)
                outcome = f"{type(exc).__name__}: {exc}"
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=worker, args=(range(i, 64, 16),)) for i in range(16)]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert time.monotonic() - start < 60
    assert len(outcomes) == 64 and set(outcomes) <= {"ok", "dropped", "refused"}, outcomes

    deadline = time.monotonic() + 10
    while (stats := engine.stats()).requests_running or stats.queue_length or stats.slots_used:
        assert time.monotonic() < deadline, f"slots leaked: {stats}"
        time.sleep(0.05)
    assert not engine.scheduler.running and engine.scheduler.staged is None and not engine.scheduler.batch.sequences
    # 16 dropped streams, 8 chats of n=2, 40 more: every submitted sequence finished (a dropped one as cancelled)
    assert metric(base, "engine_requests_served_total") - served_before == 16 + 16 + 8 + 24
    assert metric(base, "engine_batch_occupancy") == 0 and metric(base, "engine_queue_length") == 0
    assert metric(base, "engine_tokens_per_second") >= 0 and metric(base, "generation_tokens_total") > 0
    assert client.completions.create(model=engine.model_name, prompt="def", max_tokens=3).usage.completion_tokens


def test_graceful_shutdown_finishes_in_flight_requests(model, tokenizer):
    engine = HybridEngine.from_model(model, tokenizer, model_name="tiny", max_slots=2)
    expected_tokens = len(reference(engine, engine.encode("def"), 60, **GREEDY)[3])
    received, finished = [], threading.Event()
    with serving(create_app(engine)) as (server, base):
        client = openai_client(base)

        def stream():
            for chunk in client.completions.create(model="tiny", prompt="def", max_tokens=60, stream=True,
                                                   temperature=0,
                                                   stream_options={"include_usage": True}):
                received.append(chunk)
            finished.set()

        thread = threading.Thread(target=stream)
        thread.start()
        deadline = time.monotonic() + 10
        while not received:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.should_exit = True  # what SIGTERM does
        assert finished.wait(20), "the in-flight stream was cut"
        thread.join(5)
    assert received[-1].usage.completion_tokens == expected_tokens
    assert [c.choices[0].finish_reason for c in received if c.choices][-1] in ("stop", "length")
    assert not engine.scheduler.threaded and not engine.scheduler.has_work()
    with pytest.raises(openai.APIConnectionError):
        client.completions.create(model="tiny", prompt="def", max_tokens=2)


def test_api_key(model, tokenizer):
    keyed = HybridEngine.from_model(model, tokenizer, model_name="tiny", max_slots=1)
    with serving(create_app(keyed, api_key="s3cret")) as (_, base):
        with pytest.raises(openai.AuthenticationError) as info:
            openai_client(base).models.list()
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0, timeout=30,
                             http_client=openai.DefaultHttpxClient(trust_env=False))
        assert good.completions.create(model="tiny", prompt="def", max_tokens=2).usage.completion_tokens
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(base + "/health", timeout=10) as response:  # health and metrics need no key
            assert json.loads(response.read()) == {"status": "ok"}
