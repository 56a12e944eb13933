"""The OpenAI-compatible server over real loopback HTTP, with the official `openai` client and a fake engine whose
text is known in advance (UTF-8 edge cases, failures, slow streams). The real engine is served in
test_server_engine.py."""

import asyncio
import contextlib
import json
import math
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.scheduler import EngineError, EngineStats, QueueFull, TokenEvent
from hybridtron.infer.server import command as server_command
from hybridtron.infer.server import create_app
from hybridtron.infer.server.metrics import MetricFamilies
from hybridtron.infer.text import SequenceText, TextStream

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

REPLY = "Héllo wörld, 🙂 says the fake model. "  # 1-, 2- and 4-byte UTF-8 characters
MODEL = "hybridtron-fake"
END = 2  # the fake's end-of-sequence token


class FakeHandle:
    """The engine's request handle (`hybridtron.infer.scheduler.RequestHandle`): events as an async iterator, with
    the engine's semantics (max_tokens and the context end with "length", an end or stop token with "stop", that
    token included), cancel() ends it with "cancelled" at the next token."""

    def __init__(self, engine, prompt_ids, params):
        self.engine, self.prompt_ids, self.params = engine, list(prompt_ids), params
        self.done = self.cancel_requested = False

    def cancel(self):
        self.cancel_requested = True

    def tokens(self):
        prompt, reply = self.engine.decode(self.prompt_ids), self.engine.encode(REPLY)
        for i in range(self.params.max_tokens):
            if "boom" in prompt and i == 3:
                raise EngineError("boom")
            if len(self.prompt_ids) + i >= self.engine.max_context:
                return
            if "short" in prompt and i == len(reply):
                yield END, "stop"
                return
            token = reply[i % len(reply)]
            last = i + 1 == self.params.max_tokens or len(self.prompt_ids) + i + 1 >= self.engine.max_context
            yield token, "stop" if token in self.params.stop_token_ids else ("length" if last else None)
            if token in self.params.stop_token_ids:
                return

    async def events(self):
        self.engine.started += 1
        try:
            if self.params.max_tokens == 0:
                yield TokenEvent(None, None, None, "length")
                return
            for token, finish in self.tokens():
                await asyncio.sleep(0.05 if "slow" in self.engine.decode(self.prompt_ids) else 0)
                if self.cancel_requested:
                    yield TokenEvent(None, None, None, "cancelled")
                    return
                yield TokenEvent(token, -0.5, None, finish)
                if finish is not None:
                    return
        finally:
            self.done = True
            self.engine.closed += 1


class FakeEngine:
    """Bytes as tokens (id = byte + 3; 0-2 are special). Replies REPLY over and over, deterministically.

    Prompt words steer it: "short" ends the sequence after one REPLY (an end token), "slow" sleeps 50 ms per
    token, "boom" fails after three tokens. `queue_full` makes submit refuse.
    """

    model_name = MODEL
    max_context = 128
    vocab_size = 259

    def __init__(self):
        self.started = 0
        self.closed = 0
        self.queue_full = False
        self.running = False

    def encode(self, text):
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")

    def token_bytes(self, token):
        return bytes([token - 3]) if token >= 3 else b""

    def chat_template(self, messages):
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def submit_samples(self, prompt_ids, params, n, *, first_sample=0, logprobs=None, request_id=None):
        if self.queue_full:
            raise QueueFull("the engine's queue is full (0 requests waiting, max_queue 0); retry later")
        return [FakeHandle(self, prompt_ids, params) for _ in range(n)]

    def prompt_logprobs(self, prompt_ids, top_n=0):
        return [(-1.0, {}) for _ in prompt_ids[1:]]

    def stats(self):
        return EngineStats(requests_served=self.closed, requests_running=self.started - self.closed, queue_length=0,
                           slots=1, slots_used=0, batch_occupancy=0.0, tokens_per_second=0.0,
                           mean_acceptance_length=None, draft_length=0, speculative=False, cache_bytes=0,
                           slot_bytes=0, prompt_tokens=0, generated_tokens=0)

    def start(self):
        self.running = True

    def shutdown(self, cancel=False, timeout=None):
        self.running = False


def expected_text(n_tokens: int) -> str:
    engine = FakeEngine()
    return engine.decode((engine.encode(REPLY) * 4)[:n_tokens])


@contextlib.contextmanager
def serving(app, stop=None, **config):
    """`app` served by uvicorn on a free loopback port, in a thread; yields the base URL. `stop`, a list, receives
    a function that starts the server's shutdown (what SIGTERM does). `config`: uvicorn.Config options."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uvicorn_server = uvicorn.Server(uvicorn.Config(app, log_level="critical", **config))
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not uvicorn_server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    if stop is not None:
        stop.append(lambda: setattr(uvicorn_server, "should_exit", True))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uvicorn_server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    with serving(create_app(engine)) as base:
        yield engine, base


@pytest.fixture(scope="module")
def client(server):
    _, base = server
    http_client = openai.DefaultHttpxClient(trust_env=False)  # loopback: never through a proxy
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=20, http_client=http_client)


_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(base, path, body=None, method="POST"):
    """(status, headers, raw bytes) of one plain HTTP request."""
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with _opener.open(request, timeout=20) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def assert_served(client):
    """A good request after an error: the server is still fine."""
    response = client.completions.create(model=MODEL, prompt="again", max_tokens=5)
    assert response.choices[0].text == expected_text(5)


# ------------------------------------------------------------------------------------------ the text layer
def test_text_stream_equals_full_decode():
    """Leading-space pieces (SentencePiece style) and multi-byte characters split over byte tokens both come out
    as the full decode would, while each step decodes only a short window (the server's detokenisation)."""
    pieces = ["▁Hello", "▁world", "!", "▁é", "t", "é", "▁🙂", "s"]

    def sentencepiece_decode(ids):
        return "".join(pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")

    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(len(pieces)) for _ in range(rng.randrange(1, 30))]
        stream, deltas = TextStream(sentencepiece_decode), []
        for n, token in enumerate(ids, 1):
            deltas.append(stream.push(token)[0])
            assert stream.text == sentencepiece_decode(ids[:n])
        assert "".join(deltas) + stream.finish() == sentencepiece_decode(ids)

    engine, decoded_tokens = FakeEngine(), []

    def counting_decode(ids):
        decoded_tokens.append(len(ids))
        return engine.decode(ids)

    ids = engine.encode(REPLY * 20)
    stream, deltas = TextStream(counting_decode), []
    for n, token in enumerate(ids, 1):
        deltas.append(stream.push(token)[0])
        assert "\ufffd" not in stream.text and engine.decode(ids[:n]).startswith(stream.text)
    assert "".join(deltas) + stream.finish() == REPLY * 20
    assert sum(decoded_tokens) < 8 * len(ids)  # windows of a few tokens, not the whole list each step


class TextEvent:
    def __init__(self, text, completion_tokens, finish_reason):
        self.text, self.completion_tokens, self.finish_reason = text, completion_tokens, finish_reason


def run_text(engine, prompt, **params):
    """The server's text layer over one request: `SequenceText` fed the handle's events, as the server does, up to
    the end of the text (a stop string ends it before the engine does: the handle is cancelled)."""
    params = SamplingParams(**params)
    handle, = engine.submit_samples(engine.encode(prompt), params, 1)
    text = SequenceText(engine.decode, handle.prompt_ids, params.stop)

    async def collect():
        events, count, stream = [], 0, handle.events()
        async for event in stream:
            count += event.token_id is not None
            step = text.push(event.token_id, event.finish_reason)
            events.append(TextEvent(step.text, count, step.finish_reason))
            if step.finish_reason is not None:
                break
        await stream.aclose()
        return events

    events = asyncio.run(collect())
    assert all(e.finish_reason is None for e in events[:-1]) and events[-1].finish_reason is not None
    return events


def test_sequence_text_holds_back_stop_prefixes_and_partial_characters():
    engine = FakeEngine()
    events = run_text(engine, "x", max_tokens=100, stop=("wör",))
    assert "".join(e.text for e in events) == "Héllo " and events[-1].finish_reason == "stop"
    assert not any("\ufffd" in e.text or "w" in e.text for e in events)
    assert sum(bool(e.text) for e in events) > 3  # text really streamed as it came, not at the end
    assert engine.started == engine.closed == 1  # the request was closed at the stop string

    events = run_text(engine, "x", max_tokens=100, stop=("🙂",))
    assert "".join(e.text for e in events) == "Héllo wörld, "
    events = run_text(engine, "x", max_tokens=len(REPLY.encode()) + 2)
    assert "".join(e.text for e in events) == REPLY + "H\ufffd" and not any("\ufffd" in e.text for e in events[:-1])


def test_sequence_text_ends_where_the_engine_does_and_hides_stop_tokens():
    engine = FakeEngine()
    events = run_text(engine, "x", max_tokens=0)
    assert events == [events[-1]] and events[-1].text == "" and events[-1].finish_reason == "length"
    assert events[-1].completion_tokens == 0
    events = run_text(engine, "x", max_tokens=7)
    assert "".join(e.text for e in events) == expected_text(7) and events[-1].completion_tokens == 7
    comma = engine.encode(",")[0]
    events = run_text(engine, "x", max_tokens=100, stop_token_ids=(comma,))
    assert "".join(e.text for e in events) == "Héllo wörld" and events[-1].finish_reason == "stop"
    assert events[-1].completion_tokens == len("Héllo wörld,".encode())
    events = run_text(engine, "x" * 120, max_tokens=100)  # 8 tokens of context left
    assert events[-1].completion_tokens == 8 and events[-1].finish_reason == "length"
    events = run_text(engine, "short", max_tokens=100)  # the engine ends the sequence itself
    assert "".join(e.text for e in events) == REPLY and events[-1].finish_reason == "stop"
    assert engine.started == engine.closed == 5


# ------------------------------------------------------------------------------------------ over HTTP
def test_models(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "hybridtron"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.code == "model_not_found"
    status, _, body = http(server[1], "/health", method="GET")
    assert status == 200 and json.loads(body) == {"status": "ok"}


def test_completion(client):
    response = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=9)
    assert response.object == "text_completion" and response.model == MODEL
    assert response.choices[0].text == expected_text(9) and response.choices[0].finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (6, 9, 15)
    stopped = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=50, stop=["wörld"])
    assert stopped.choices[0].text == "Héllo " and stopped.choices[0].finish_reason == "stop"
    ended = client.completions.create(model=MODEL, prompt="short", max_tokens=100)
    assert ended.choices[0].text == REPLY and ended.choices[0].finish_reason == "stop"
    assert ended.usage.completion_tokens == len(REPLY.encode()) + 1  # the end token counts (as vLLM counts it)
    nothing = client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert (nothing.choices[0].text, nothing.choices[0].finish_reason, nothing.usage.completion_tokens) == \
        ("", "length", 0)
    token_prompt = client.completions.create(model=MODEL, prompt=[3 + ord("s")] * 4, max_tokens=3)
    assert token_prompt.usage.prompt_tokens == 4 and token_prompt.choices[0].text == "Hé"


def test_chat_completion(client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12)
    choice = response.choices[0]
    assert response.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == expected_text(12) and choice.finish_reason == "length"
    prompt = FakeEngine().chat_template(messages)
    assert response.usage.prompt_tokens == len(prompt.encode()) and response.usage.completion_tokens == 12
    # no max_tokens: the reply may fill the context; text content parts are accepted
    ended = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "short"}]}])
    assert ended.choices[0].message.content == REPLY and ended.choices[0].finish_reason == "stop"


def test_streaming_completion(client):
    plain = client.completions.create(model=MODEL, prompt="stream me", max_tokens=30, stop=["says"])
    chunks = list(client.completions.create(model=MODEL, prompt="stream me", max_tokens=30, stop=["says"],
                                            stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == plain.choices[0].text == "Héllo wörld, 🙂 " and len(texts) > 5
    assert not any("\ufffd" in t for t in texts)
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishing[-1] == "stop" and set(finishing[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_streaming_chat(client):
    messages = [{"role": "user", "content": "hello"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == expected_text(20) and chunks[-1].choices[0].finish_reason == "length"
    assert len({c.id for c in chunks}) == 1


def test_stream_wire_format(server):
    status, headers, body = http(server[1], "/v1/completions",
                                 {"model": MODEL, "prompt": "wire", "max_tokens": 4, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = body.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert "".join(p["choices"][0]["text"] for p in payloads) == expected_text(4)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


LONG = "x" * 200
BAD_REQUESTS = [
    # (name, path, body, status, param, code)
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    ("unknown chat model", "/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "a"}]},
     404, "model", "model_not_found"),
    ("negative max_tokens", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400,
     "max_tokens", None),
    ("malformed JSON", "/v1/completions", b'{"model": "hybridtron-fake", "prompt": ', 400, None, None),
    ("not UTF-8", "/v1/completions", b'\xff\xfe{}', 400, None, None),
    ("body not an object", "/v1/completions", b"[1, 2]", 400, None, None),
    ("oversized prompt", "/v1/completions", {"model": MODEL, "prompt": LONG}, 400, "prompt",
     "context_length_exceeded"),
    ("prompt fills the context", "/v1/completions", {"model": MODEL, "prompt": "x" * 128, "max_tokens": 0}, 400,
     "prompt", "context_length_exceeded"),
    ("oversized chat", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]},
     400, "messages", "context_length_exceeded"),
    ("prompt + max_tokens too long", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1000}, 400,
     "max_tokens", "context_length_exceeded"),
    ("max_tokens a string", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400,
     "max_tokens", None),
    ("max_tokens a float", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2.5}, 400,
     "max_tokens", None),
    ("temperature a string", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400,
     "temperature", None),
    ("negative temperature", "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400,
     "temperature", None),
    ("top_p zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("stream a string", "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream", None),
    ("model a number", "/v1/completions", {"model": 3, "prompt": "hi"}, 400, "model", None),
    ("prompt a number", "/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt", None),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt", None),
    ("prompts of two kinds", "/v1/completions", {"model": MODEL, "prompt": ["a", [5, 6], 7]}, 400, "prompt", None),
    ("empty prompt list", "/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt", None),
    ("token id out of range", "/v1/completions", {"model": MODEL, "prompt": [1, 300]}, 400, "prompt", None),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("n = 0", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n", None),
    ("n a string", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                            "n": "2"}, 400, "n", None),
    ("too many choices", "/v1/completions", {"model": MODEL, "prompt": ["a"] * 10, "n": 20}, 400, "n", None),
    ("logprobs 21", "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    ("logprobs true on completions", "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": True}, 400,
     "logprobs", None),
    ("best_of above n", "/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of", None),
    ("a penalty", "/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 0.5}, 400,
     "presence_penalty", None),
    ("seed a string", "/v1/completions", {"model": MODEL, "prompt": "hi", "seed": "7"}, 400, "seed", None),
    ("one prompt of a batch too long", "/v1/completions", {"model": MODEL, "prompt": ["a", LONG]}, 400, "prompt",
     "context_length_exceeded"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, 400, "top_logprobs", None),
    ("top_logprobs 21", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                                 "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
    ("unknown message field", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "a", "colour": "red"}]}, 400, "messages[0].colour",
     None),
    ("message not an object", "/v1/chat/completions", {"model": MODEL, "messages": ["hi"]}, 400, "messages[0]", None),
    ("unknown argument", "/v1/completions", {"model": MODEL, "prompt": "hi", "foo": 1}, 400, "foo", None),
    ("five stop strings", "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": list("abcde")}, 400, "stop",
     None),
    ("empty stop string", "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [""]}, 400, "stop", None),
    ("stream_options without stream", "/v1/completions",
     {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ("messages a string", "/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, "messages", None),
    ("no messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("unknown role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", None),
    ("content a number", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
     400, "messages[0].content", None),
    ("image content", "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400,
     "messages[0].content", None),
    ("tools not declarations", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval"}]},
     400, "tools", None),
]


@pytest.mark.parametrize("name,path,body,status,param,code", BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, client, name, path, body, status, param, code):
    got_status, headers, raw = http(server[1], path, body)
    assert got_status == status, raw
    assert headers["content-type"] == "application/json"
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    assert_served(client)


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-5)
    assert info.value.status_code == 400 and info.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}])
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], stream=True)
    assert_served(client)


def test_unknown_route_and_method(server, client):
    for method, path, status in (("POST", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
        got, headers, raw = http(server[1], path, {} if method == "POST" else None, method=method)
        error = json.loads(raw)["error"]
        assert got == status and error["type"] == "invalid_request_error" and path in error["message"]
    assert_served(client)


def test_engine_failure_is_reported_and_the_server_keeps_serving(server, client):
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL, prompt="boom", max_tokens=10)
    assert "boom" in info.value.message
    status, _, raw = http(server[1], "/v1/completions",
                          {"model": MODEL, "prompt": "boom", "max_tokens": 10, "stream": True})
    events = raw.decode().split("\n\n")
    assert status == 200 and events[-2] == "data: [DONE]"
    assert json.loads(events[-3][len("data: "):])["error"]["type"] == "server_error"
    assert_served(client)


def test_event_loop_answers_while_a_generation_runs(server, client):
    """A 1 s streaming generation is under way; listing the models still answers at once."""
    first_chunk, done = threading.Event(), threading.Event()

    def slow_stream():
        for _ in client.completions.create(model=MODEL, prompt="slow", max_tokens=20, stream=True):
            first_chunk.set()
        done.set()

    worker = threading.Thread(target=slow_stream)
    worker.start()
    assert first_chunk.wait(10)
    start = time.monotonic()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert time.monotonic() - start < 0.5 and not done.is_set()
    worker.join(10)
    assert done.is_set()


def test_client_disconnect_stops_the_generation(server, client):
    """A client that leaves mid-stream frees the engine at the next token; the next request is served at once."""
    engine = server[0]
    started = engine.started
    stream = client.completions.create(model=MODEL, prompt="slow", max_tokens=100, stream=True)  # 5 s in full
    received = [chunk for chunk, _ in zip(stream, range(3))]
    assert len(received) == 3
    stream.close()
    start = time.monotonic()
    assert_served(client)
    assert time.monotonic() - start < 2.0
    assert engine.started == started + 2 and engine.closed == engine.started


def test_n_prompt_batches_echo_and_logprob_shapes(server):
    base = server[1]
    status, _, raw = http(base, "/v1/completions", {"model": MODEL, "prompt": ["ab", [3 + ord("c")]], "n": 2,
                                                    "max_tokens": 3, "echo": True})
    body = json.loads(raw)
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["ab" + expected_text(3)] * 2 + ["c" + expected_text(3)] * 2
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}

    status, _, raw = http(base, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": 0})
    logprobs = json.loads(raw)["choices"][0]["logprobs"]
    # "é" is two byte tokens: neither is text on its own (OpenAI writes them as bytes), and both start at offset 1
    assert logprobs == {"tokens": ["H", "bytes:\\xc3", "bytes:\\xa9"], "token_logprobs": [-0.5] * 3,
                        "top_logprobs": [None] * 3, "text_offset": [0, 1, 1]}

    # echo with logprobs scores the prompt too: its first token has none, as in OpenAI's API
    status, _, raw = http(base, "/v1/completions", {"model": MODEL, "prompt": "ab", "max_tokens": 1, "logprobs": 0,
                                                    "echo": True})
    choice = json.loads(raw)["choices"][0]
    assert choice["text"] == "abH" and choice["logprobs"] == {
        "tokens": ["a", "b", "H"], "token_logprobs": [None, -1.0, -0.5], "top_logprobs": [None] * 3,
        "text_offset": [0, 1, 2]}

    status, _, raw = http(base, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 1, "logprobs": True})
    choice = json.loads(raw)["choices"][0]
    assert choice["logprobs"] == {"content": [{"token": "H", "logprob": -0.5, "bytes": [72], "top_logprobs": []}]}
    status, _, raw = http(base, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 1})
    assert json.loads(raw)["choices"][0]["logprobs"] is None


def test_queue_full_is_503_with_retry_after(server, client):
    engine, base = server
    engine.queue_full = True
    try:
        status, headers, raw = http(base, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 3})
    finally:
        engine.queue_full = False
    error = json.loads(raw)["error"]
    assert status == 503 and headers["retry-after"] == "1"
    assert (error["type"], error["code"]) == ("server_error", "queue_full") and "queue is full" in error["message"]
    assert_served(client)


def test_request_timeout_cancels_and_reports(server):
    engine = FakeEngine()
    with serving(create_app(engine, request_timeout=0.3)) as base:
        start = time.monotonic()
        status, _, raw = http(base, "/v1/completions", {"model": MODEL, "prompt": "slow", "max_tokens": 40})
        assert status == 504 and time.monotonic() - start < 1.5
        error = json.loads(raw)["error"]
        assert error["code"] == "timeout" and "request timeout of 0.3 s" in error["message"]
        status, _, raw = http(base, "/v1/completions",
                              {"model": MODEL, "prompt": "slow", "max_tokens": 40, "stream": True})
        events = raw.decode().split("\n\n")
        assert status == 200 and events[-2] == "data: [DONE]"
        assert json.loads(events[-3][len("data: "):])["error"]["code"] == "timeout"
        assert engine.started == engine.closed == 2  # both cancelled in the engine
        status, _, raw = http(base, "/metrics", method="GET")
        assert re.search(r"^hybridtron_request_timeouts_total 2$", raw.decode(), re.M)


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="count me", max_tokens=4)
    http(server[1], "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1})
    status, headers, raw = http(server[1], "/metrics", method="GET")
    text = raw.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    for code in (200, 400):
        assert re.search(rf'^hybridtron_http_responses_total\{{route="/v1/completions",status="{code}"\}} [1-9]', text,
                         re.M), code
    for name in ("engine_queue_length", "engine_batch_occupancy", "engine_tokens_per_second",
                 "engine_mean_acceptance_length", "generation_tokens_total", "time_to_first_token_seconds_count"):
        assert re.search(rf"^hybridtron_{name}(\{{[^}}]*\}})? \S+$", text, re.M), name


# Every family /metrics exposes, and its type (counters by the name the parser gives them, without `_total`).
METRIC_FAMILIES = {
    "http_responses": "counter", "requests_finished": "counter", "prompt_tokens": "counter",
    "generation_tokens": "counter", "request_seconds": "summary", "time_to_first_token_seconds": "summary",
    "request_timeouts": "counter", "queue_full": "counter", "engine_requests_served": "counter",
    "engine_requests_running": "gauge", "engine_queue_length": "gauge", "engine_slots": "gauge",
    "engine_slots_used": "gauge", "engine_batch_occupancy": "gauge", "engine_tokens_per_second": "gauge",
    "engine_mean_acceptance_length": "gauge", "engine_draft_length": "gauge", "engine_cache_bytes": "gauge",
    "engine_prompt_tokens": "counter", "engine_generated_tokens": "counter",
}


def test_metrics_follow_the_prometheus_text_format(server, client):
    """/metrics read by prometheus_client's parser: every family typed as it should be (a sample whose name does not
    fit its family's type comes back as an untyped family of its own), with a help text; a summary is exactly its
    `_sum` and `_count`; counters' samples end in `_total`; the values are the server's."""
    parser = pytest.importorskip("prometheus_client.parser")
    client.completions.create(model=MODEL, prompt="count me", max_tokens=4)
    status, _, raw = http(server[1], "/metrics", method="GET")
    assert status == 200
    families = {family.name.removeprefix("hybridtron_"): family
                for family in parser.text_string_to_metric_families(raw.decode())}
    assert {name: family.type for name, family in families.items()} == METRIC_FAMILIES
    for name, family in families.items():
        assert family.documentation, name
        if family.type == "summary":
            assert sorted(sample.name for sample in family.samples) == [f"{family.name}_count", f"{family.name}_sum"]
        elif family.type == "counter":
            assert family.samples and all(sample.name == family.name + "_total" for sample in family.samples), name
        else:
            assert [sample.name for sample in family.samples] == [family.name], name
    values = {sample.name.removeprefix("hybridtron_"): sample.value
              for family in families.values() for sample in family.samples if not sample.labels}
    assert values["request_seconds_count"] >= 1 and values["request_seconds_sum"] > 0
    assert values["time_to_first_token_seconds_count"] >= 1
    assert 0 < values["time_to_first_token_seconds_sum"] <= values["request_seconds_sum"]
    assert values["generation_tokens_total"] >= 4
    assert math.isnan(values["engine_mean_acceptance_length"])  # the fake engine never drafts
    completions = {sample.labels["status"]: sample.value for sample in families["http_responses"].samples
                   if sample.labels["route"] == "/v1/completions"}
    assert completions["200"] >= 1


def test_metric_text_escapes_label_values_and_help():
    """Backslashes, quotes and newlines in a label value or a help text survive the round trip through the parser;
    NaN and infinities are spelt as the format wants."""
    parser = pytest.importorskip("prometheus_client.parser")
    families = MetricFamilies()
    tricky = 'a "quoted" \\path\nand a new line'
    families.add("odd_total", "counter", "help with \\ and\na new line", [({"label": tricky}, 3)])
    families.add("values", "gauge", "special values", [({"which": "nan"}, math.nan), ({"which": "inf"}, math.inf),
                                                       ({"which": "-inf"}, -math.inf), ({"which": "half"}, 0.5)])
    parsed = {family.name: family for family in parser.text_string_to_metric_families(families.text())}
    odd = parsed["hybridtron_odd"]
    assert odd.documentation == "help with \\ and\na new line" and odd.samples[0].labels == {"label": tricky}
    values = {sample.labels["which"]: sample.value for sample in parsed["hybridtron_values"].samples}
    assert math.isnan(values["nan"]) and values["inf"] == math.inf and values["-inf"] == -math.inf
    assert values["half"] == 0.5


def test_client_gone_before_a_plain_response_frees_the_engine(server, client):
    """A non-streaming client that gives up: its generation is cancelled, not run to the end."""
    engine, base = server
    started = engine.started
    request = urllib.request.Request(base + "/v1/completions", method="POST", headers={
        "Content-Type": "application/json"}, data=json.dumps({"model": MODEL, "prompt": "slow",
                                                              "max_tokens": 100}).encode())
    with pytest.raises(OSError):  # a 5 s generation; the client waits 0.3 s
        _opener.open(request, timeout=0.3)
    deadline = time.monotonic() + 3
    while engine.closed < started + 1:
        assert time.monotonic() < deadline, "the generation ran on after its client left"
        time.sleep(0.05)
    assert_served(client)


def test_shutdown_cancels_what_outlives_the_graceful_timeout():
    """A 5 s stream in flight, shutdown with a 0.3 s graceful timeout: the stream is cut, its request cancelled in
    the engine, and the engine's loop stopped."""
    engine, stop, received = FakeEngine(), [], []
    with serving(create_app(engine), stop=stop, timeout_graceful_shutdown=0.3) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=20,
                               http_client=openai.DefaultHttpxClient(trust_env=False))

        def stream():
            with contextlib.suppress(openai.APIError):
                for chunk in client.completions.create(model=MODEL, prompt="slow", max_tokens=100, stream=True):
                    received.append(chunk)

        thread = threading.Thread(target=stream)
        thread.start()
        deadline = time.monotonic() + 10
        while not received:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start = time.monotonic()
        stop[0]()
        thread.join(10)
        assert not thread.is_alive() and time.monotonic() - start < 3
    assert 0 < len(received) < 50 and received[-1].choices[0].finish_reason is None  # cut, not finished
    assert engine.started == engine.closed and not engine.running


# ------------------------------------------------------------------------------------------ the command
@pytest.fixture
def serve_command(monkeypatch, tmp_path):
    """`hybridtron serve` with a fake engine and a uvicorn server that returns at once: `calls["load"]` holds
    load_engine's (model_dir, options), `calls["run"]` the server's (config, bound address, app). `tmp_path` looks
    like a checkpoint (a config.json) that declares hybridtron's chat template."""
    from hybridtron.data.chat import CHAT_TEMPLATE

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    calls = {}

    def load_engine(model_dir, **options):
        calls["load"] = (model_dir, options)
        return FakeEngine()

    def run(server, sockets):
        calls["run"] = (server.config, sockets[0].getsockname(), server.config.app)
        server.started = True

    monkeypatch.setattr(server_command, "load_engine", load_engine)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.delenv("HYBRIDTRON_API_KEY", raising=False)
    yield calls
    FakeEngine.model_name = MODEL  # the fake's class attribute may have been shadowed on an instance


def test_serve_command_wires_the_engine(serve_command, tmp_path, capsys):
    """`hybridtron serve` builds the engine with load_engine(dir, speculative, draft_length, compile, max_queue, ...),
    names it --served-model-name, and serves on the port it bound, with the graceful shutdown timeout."""
    from hybridtron.cli import main

    calls = serve_command
    assert main(["serve", "--model", str(tmp_path), "--port", "0", "--no-speculative", "--draft-length", "5",
                 "--max-slots", "8", "--max-queue", "4", "--served-model-name", "mine"]) == 0
    assert calls["load"] == (str(tmp_path), dict(speculative=False, draft_length=5, compile=False, max_queue=4,
                                                 max_slots=8))
    config, (host, port), app = calls.pop("run")
    assert host == "127.0.0.1" and port != 0 and (config.host, config.port) == (host, port)
    assert app.state.engine.model_name == "mine" and config.timeout_graceful_shutdown == 30.0
    assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 0
    assert calls["load"] == (str(tmp_path), dict(speculative=True, draft_length=None, compile=False, max_queue=256))
    FakeEngine.model_name = MODEL  # the fake's class attribute was shadowed on one instance only
    assert calls["run"][2].state.engine.model_name == MODEL

    capsys.readouterr()
    calls.clear()
    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert f"--model {tmp_path / 'missing'}: no such directory" in capsys.readouterr().err
    assert calls == {}  # refused before the model loaded
    for bad in (["--draft-length", "0"], ["--max-queue", "-1"], ["--request-timeout", "-1"], ["--port", "70000"]):
        assert main(["serve", "--model", str(tmp_path), *bad]) == 2
        assert bad[0] in capsys.readouterr().err


def test_serve_says_when_the_checkpoint_has_no_chat_template(serve_command, tmp_path, capsys):
    """A checkpoint that declares no chat template (a base model): the start line is followed by one line saying so,
    what /v1/chat/completions renders instead, and that /v1/completions takes plain text; a chat model gets none."""
    from hybridtron.cli import main

    assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 0
    assert "chat template" not in capsys.readouterr().err
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 0
    start, note = capsys.readouterr().err.strip().splitlines()
    assert "/v1 (no API key" in start
    assert f"{tmp_path} declares no chat template" in note and "hybridtron's ChatML format" in note
    assert "send plain text to /v1/completions" in note


def test_serve_says_when_the_checkpoint_is_a_pretraining_runs_export(serve_command, tmp_path, capsys):
    """hybridtron writes its chat template into every export, a base model's too: a run directory whose
    run_config.json trains on a text mixture (pretraining's [data] section) is named a base model at start, by its
    run directory or its hf/; an SFT run's export (its data a file or an environment) gets no note."""
    from hybridtron.cli import main

    run = tmp_path / "run"
    (run / "hf").mkdir(parents=True)
    for name in ("config.json", "tokenizer_config.json"):
        (run / "hf" / name).write_text((tmp_path / name).read_text())
    (run / "run_config.json").write_text(json.dumps({"model": {}, "data": {"seq_len": 256}}))
    for model in (run, run / "hf"):
        assert main(["serve", "--model", str(model), "--port", "0"]) == 0
        _, note = capsys.readouterr().err.strip().splitlines()
        assert "export of a pretraining run" in note and "never fine-tuned for chat" in note
        assert "send plain text to /v1/completions" in note
    (run / "run_config.json").write_text(json.dumps({"model": {}, "data": "env:math", "sft": {}}))
    assert main(["serve", "--model", str(run), "--port", "0"]) == 0
    assert "pretraining" not in capsys.readouterr().err


def test_serve_port_0_prints_the_port_it_bound(serve_command, tmp_path, capsys):
    """`--port 0`: the start line names the free port the system picked (not ":0"), the one the server runs on."""
    from hybridtron.cli import main

    assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 0
    _, (_, port), _ = serve_command["run"]
    start_line = capsys.readouterr().err
    assert port != 0 and f"on http://127.0.0.1:{port}/v1" in start_line and ":0/" not in start_line


def test_serve_refuses_a_port_in_use(serve_command, tmp_path, capsys):
    """A port another process listens on: one line naming --port, before the model loads."""
    from hybridtron.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(tmp_path), "--port", str(port)]) == 2
    error = capsys.readouterr().err
    assert f"--port {port}: cannot listen there" in error and len(error.strip().splitlines()) == 1
    assert "load" not in serve_command


def test_serve_refuses_an_empty_api_key(serve_command, tmp_path, capsys, monkeypatch):
    """`--api-key "$KEY"` with KEY unset passes an empty key: the server does not start (a server without
    authentication while the user believes one is required); nor with an empty $HYBRIDTRON_API_KEY. A key, or
    none at all, is said in the start line."""
    from hybridtron.cli import main

    for key in ("", "  "):
        assert main(["serve", "--model", str(tmp_path), "--port", "0", "--api-key", key]) == 2
        error = capsys.readouterr().err
        assert "--api-key is empty (an unset shell variable?)" in error and len(error.strip().splitlines()) == 1
    assert "load" not in serve_command and "run" not in serve_command
    monkeypatch.setenv("HYBRIDTRON_API_KEY", "")
    assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 2
    assert "$HYBRIDTRON_API_KEY is empty" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path), "--port", "0", "--api-key", "secret"]) == 0
    assert "(clients must send the API key)" in capsys.readouterr().err
    monkeypatch.delenv("HYBRIDTRON_API_KEY")
    assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 0
    assert "(no API key: every client is served)" in capsys.readouterr().err


def test_missing_fastapi_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "fastapi", None)  # makes `import fastapi` fail
    with pytest.raises(ImportError, match=r"pip install 'hybridtron\[serve\]'"):
        create_app(FakeEngine())
