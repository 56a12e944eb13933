"""The OpenAI-compatible server over real loopback HTTP, with the official `openai` client and a fake engine."""

import itertools
import json
import random
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from hybridtron.infer.text import TextStream
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.server import create_app, generate_text

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

REPLY = "Héllo wörld, 🙂 says the fake model. "  # 1-, 2- and 4-byte UTF-8 characters
MODEL = "hybridtron-fake"


class FakeEngine:
    """Bytes as tokens (id = byte + 3; 0-2 are special). Replies REPLY over and over, deterministically.

    Prompt words steer it: "short" ends the sequence after one REPLY (end of sequence), "slow" sleeps 50 ms per
    token, "boom" raises after three tokens.
    """

    model_name = MODEL
    max_context = 128
    vocab_size = 259

    def __init__(self):
        self.started = 0
        self.closed = 0

    def encode(self, text):
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids):
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", errors="replace")

    def chat_template(self, messages):
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"

    def stream(self, prompt_ids, params):
        prompt = self.decode(prompt_ids)
        reply = self.encode(REPLY)
        self.started += 1
        try:
            for i in itertools.count():
                if "boom" in prompt and i == 3:
                    raise RuntimeError("boom")
                if ("short" in prompt and i == len(reply)) or len(prompt_ids) + i >= self.max_context:
                    return
                if "slow" in prompt:
                    time.sleep(0.05)
                yield reply[i % len(reply)]
        finally:
            self.closed += 1


def expected_text(n_tokens: int) -> str:
    engine = FakeEngine()
    return engine.decode((engine.encode(REPLY) * 4)[:n_tokens])


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uvicorn_server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="critical"))
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not uvicorn_server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield engine, f"http://127.0.0.1:{port}"
    uvicorn_server.should_exit = True
    thread.join(10)
    sock.close()


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


# ------------------------------------------------------------------------------------------ generate_text
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


def run_text(engine, prompt, **params):
    events = list(generate_text(engine, engine.encode(prompt), SamplingParams(**params)))
    assert all(e.finish_reason is None for e in events[:-1]) and events[-1].finish_reason is not None
    return events


def test_generate_text_holds_back_stop_prefixes_and_partial_characters():
    engine = FakeEngine()
    events = run_text(engine, "x", max_tokens=100, stop=("wör",))
    assert "".join(e.text for e in events) == "Héllo " and events[-1].finish_reason == "stop"
    assert not any("\ufffd" in e.text or "w" in e.text for e in events)
    assert sum(bool(e.text) for e in events) > 3  # text really streamed as it came, not at the end
    assert engine.started == engine.closed == 1  # the engine's stream was closed at the stop string

    events = run_text(engine, "x", max_tokens=100, stop=("🙂",))
    assert "".join(e.text for e in events) == "Héllo wörld, "
    events = run_text(engine, "x", max_tokens=len(REPLY.encode()) + 2)
    assert "".join(e.text for e in events) == REPLY + "H\ufffd" and not any("\ufffd" in e.text for e in events[:-1])


def test_generate_text_budgets_and_stop_tokens():
    engine = FakeEngine()
    events = run_text(engine, "x", max_tokens=0)
    assert events == [events[-1]] and events[-1].text == "" and events[-1].finish_reason == "length"
    assert engine.started == 0
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
    assert engine.started == engine.closed == 4


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
    assert ended.usage.completion_tokens == len(REPLY.encode())
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
    ("two prompts", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", None),
    ("token id out of range", "/v1/completions", {"model": MODEL, "prompt": [1, 300]}, 400, "prompt", None),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ("n = 2", "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400, "n", None),
    ("logprobs", "/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 5}, 400, "logprobs", None),
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
    ("tools", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []},
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


# ------------------------------------------------------------------------------------------ the command
def test_serve_command_wires_the_engine(monkeypatch, tmp_path, capsys):
    """`hybridtron serve` builds the engine with load_engine(dir, speculative, draft_length, compile), runs uvicorn."""
    import sys
    import types

    from hybridtron.cli import main

    calls = {}
    fake_engine_module = types.ModuleType("hybridtron.infer.engine")

    def load_engine(model_dir, speculative, draft_length, compile):
        calls["load"] = (model_dir, speculative, draft_length, compile)
        return FakeEngine()

    fake_engine_module.load_engine = load_engine
    monkeypatch.setitem(sys.modules, "hybridtron.infer.engine", fake_engine_module)
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, **kw: calls.setdefault("run", (app, host, port)))
    assert main(["serve", "--model", str(tmp_path), "--port", "9123", "--no-speculative", "--draft-length", "5"]) == 0
    assert calls["load"] == (str(tmp_path), False, 5, False)
    app, host, port = calls["run"]
    assert (host, port) == ("127.0.0.1", 9123) and app.state.engine.model_name == MODEL
    assert main(["serve", "--model", str(tmp_path)]) == 0 and calls["load"] == (str(tmp_path), True, 3, False)
    assert main(["serve", "--model", str(tmp_path), "--compile"]) == 0
    assert calls["load"] == (str(tmp_path), False, 3, True), "--compile decodes plainly"

    assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path), "--draft-length", "0"]) == 2
    assert "--draft-length" in capsys.readouterr().err


def test_missing_fastapi_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "fastapi", None)  # makes `import fastapi` fail
    with pytest.raises(ImportError, match=r"pip install 'hybridtron\[serve\]'"):
        create_app(FakeEngine())
