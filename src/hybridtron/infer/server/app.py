"""The FastAPI application: routes, streaming, log-probabilities, authentication, timeouts and metrics over an
`Engine` (see `hybridtron.infer.server` for the API it speaks)."""

# No `from __future__ import annotations`: FastAPI reads the route functions' annotations (Request) at runtime.
import asyncio
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridtron.data.tools import ContentStream, ParsedOutput, parse_tool_calls
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.scheduler import EngineError, EngineStats, QueueFull, RequestHandle, TokenEvent
from hybridtron.infer.server.settings import DEFAULT_REQUEST_TIMEOUT_S
from hybridtron.infer.server.metrics import CountResponses, Metrics
from hybridtron.infer.server.protocol import APIError, GenerationRequest, chat_request, completion_request
from hybridtron.infer.text import SequenceText, TextStream

log = logging.getLogger("hybridtron.serve")


class Engine(Protocol):
    """What the server needs from a model: `hybridtron.infer.engine.HybridEngine` (its serving API).

    `submit_samples` queues the n samples of one prompt (they share its prefill; sample j is drawn with the noise of
    (seed, first_sample + j)) and returns their handles (`hybridtron.infer.scheduler.RequestHandle`: `events()`,
    `cancel()`, `done`); it raises `QueueFull` when the engine's bounded queue lacks room for them. The engine applies
    max_tokens, the context and the end tokens; its last event says why a sequence ended ("stop": an end or stop
    token, included in the events). Stop strings are the server's (`hybridtron.infer.text.SequenceText`): it
    cancels a handle whose text hit one. encode / decode / chat_template are called from worker threads while the
    loop runs. Optional: `token_bytes(token_id) -> bytes | None`, a token's bytes for log-probabilities (else they
    come from the engine's byte-level `tokenizer`, or from decoding the token alone)."""

    model_name: str
    max_context: int  # prompt + generated tokens
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat_template(self, messages: list[dict[str, Any]]) -> str: ...

    def submit_samples(self, prompt_ids: Sequence[int], params: SamplingParams, n: int, *, first_sample: int = 0,
                       logprobs: int | None = None, request_id: str | None = None) -> list[RequestHandle]: ...

    def prompt_logprobs(self, prompt_ids: Sequence[int], top_n: int = 0) -> list[tuple[float, dict[int, float]]]: ...

    def stats(self) -> EngineStats: ...

    def start(self) -> None: ...

    def shutdown(self, cancel: bool = False, timeout: float | None = None) -> None: ...


# ------------------------------------------------------------------------------------------ token strings
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte in a byte-level BPE vocab."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


class Vocabulary:
    """Each token's bytes and display string for log-probabilities (OpenAI's `token`, `bytes`).

    A byte-level BPE token may hold part of a UTF-8 character, so its bytes come from the vocabulary (the byte-level
    alphabet), not from decoding it alone; its string is then `bytes:\\xNN...`, as OpenAI writes such tokens."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.cache: dict[int, tuple[str, bytes]] = {}
        self.token_bytes = getattr(engine, "token_bytes", None) or self._byte_level(engine)

    def _byte_level(self, engine: Engine):
        """Bytes from a byte-level BPE vocabulary (the engine's tokenizer, hybridtron's or any GPT-2-style one);
        None for another kind of tokenizer, whose tokens are then their decoded text."""
        backend = getattr(getattr(engine, "tokenizer", None), "backend", None)
        if backend is None or type(backend.decoder).__name__ != "ByteLevel":
            return None
        special = set(backend.get_added_tokens_decoder())
        byte_of = {char: byte for byte, char in _bytes_to_unicode().items()}

        def token_bytes(token_id: int) -> bytes | None:
            piece = backend.id_to_token(token_id) or ""
            if token_id in special or not all(c in byte_of for c in piece):
                return None
            return bytes(byte_of[c] for c in piece)

        return token_bytes

    def entry(self, token_id: int) -> tuple[str, bytes]:
        if token_id not in self.cache:
            raw = self.token_bytes(token_id) if self.token_bytes is not None else None
            if raw is None:  # a special token, or not a byte-level vocabulary: its text
                raw = self.engine.decode([token_id]).encode("utf-8")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self.cache[token_id] = (text, raw)
        return self.cache[token_id]

    def text(self, token_id: int) -> str:
        return self.entry(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return list(self.entry(token_id)[1])


# ------------------------------------------------------------------------------------------ one request
@dataclass
class Delta:
    """What one engine event adds to a choice: text, the log-probs of the tokens it shows, maybe the end."""

    index: int
    text: str
    logprobs: list[tuple[int, float, dict[int, float] | None, int]]  # (token, logprob, top, text offset)
    finish_reason: str | None
    completion_tokens: int  # tokens the engine generated for this choice so far (a stop token included)


@dataclass
class Choice:
    index: int
    handle: RequestHandle
    text: SequenceText
    prefix: str  # the prompt's text when echoing, else ""
    prefix_logprobs: list  # the prompt's tokens' entries when echoing with logprobs (as `Delta.logprobs`)
    completion_tokens: int = 0

    async def deltas(self, want_logprobs: bool) -> AsyncIterator[Delta]:
        try:
            async for event in self.handle.events():
                yield self.push(event, want_logprobs)
                if self.text.finish_reason is not None:
                    return
        finally:
            if not self.handle.done:
                self.handle.cancel()  # a stop string, a client gone, a timeout: free the slot

    def push(self, event: TokenEvent, want_logprobs: bool) -> Delta:
        if event.token_id is not None:
            self.completion_tokens += 1
        offset = len(self.prefix) + len(self.text.text)
        step = self.text.push(event.token_id, event.finish_reason)
        entries = [(event.token_id, event.logprob, event.top_logprobs, offset)] \
            if want_logprobs and step.shown and event.logprob is not None else []
        return Delta(self.index, step.text, entries, step.finish_reason, self.completion_tokens)


class Generation:
    """The choices of one request (n per prompt), running in the engine's loop, and their merged deltas."""

    def __init__(self, engine: Engine, request: GenerationRequest, request_id: str,
                 prompt_logprobs: dict[int, list] | None = None):
        self.request = request
        self.choices: list[Choice] = []
        try:
            for i, (prompt, params) in enumerate(zip(request.prompts, request.params)):
                prefix = engine.decode(prompt) if request.echo else ""
                handles = engine.submit_samples(prompt, params, request.n, first_sample=i * request.n,
                                                logprobs=request.logprobs, request_id=f"{request_id}-{i}")
                for j, handle in enumerate(handles):
                    self.choices.append(Choice(i * request.n + j, handle,
                                               SequenceText(engine.decode, prompt, params.stop), prefix,
                                               (prompt_logprobs or {}).get(i, [])))
        except QueueFull as exc:
            self.cancel()
            raise APIError(503, f"the server is busy: {exc}", type="server_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except RuntimeError as exc:  # the engine is shutting down
            self.cancel()
            raise APIError(503, f"the server is shutting down: {exc}", type="server_error",
                           code="shutting_down") from None

    def cancel(self) -> None:
        for choice in self.choices:
            choice.handle.cancel()

    async def deltas(self, timeout: float | None) -> AsyncIterator[Delta]:
        """Every choice's deltas as they come (each choice in order); APIError 504 after `timeout` seconds (the
        requests are cancelled), 500 if the engine failed."""
        want = self.request.logprobs is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        sources = [choice.deltas(want) for choice in self.choices]
        merged = sources[0] if len(sources) == 1 else _merge(sources)
        try:
            while True:
                try:
                    if deadline is None:
                        delta = await anext(merged)
                    else:
                        delta = await asyncio.wait_for(anext(merged), deadline - time.monotonic())
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise APIError(504, f"the request did not finish within the server's request timeout of "
                                        f"{timeout:g} s (hybridtron serve --request-timeout); it was cancelled",
                                   type="server_error", code="timeout") from None
                except EngineError as exc:
                    log.error("%s", exc)  # the engine goes on serving the other requests
                    raise APIError(500, f"the model failed while generating: {exc.__cause__ or exc}",
                                   type="server_error") from None
                yield delta
        finally:
            await merged.aclose()
            self.cancel()


async def _merge(sources: list[AsyncIterator[Delta]]) -> AsyncIterator[Delta]:
    """Interleave async iterators in arrival order; the first failure is raised."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def run(source):
        try:
            async for item in source:
                queue.put_nowait(item)
        except Exception as exc:  # noqa: BLE001 (re-raised in the consumer)
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.create_task(run(source)) for source in sources]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def prompt_entries(engine: Engine, prompt: list[int], top_n: int) -> list:
    """The prompt's tokens as log-prob entries (`Delta.logprobs`) for `echo`: the first has no log-prob, as in
    OpenAI's API; offsets from an incremental decode of the prompt."""
    scored = engine.prompt_logprobs(prompt, top_n)
    stream, entries = TextStream(engine.decode), []
    for t, token in enumerate(prompt):
        offset = len(stream.text)
        stream.push(token)
        logprob, top = (None, None) if t == 0 else scored[t - 1]
        entries.append((token, logprob, top, offset))
    return entries


# ------------------------------------------------------------------------------------------ response shapes
def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(payload) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


class Shapes:
    """OpenAI's JSON shapes of choices and log-probabilities, for completions and chat."""

    def __init__(self, vocabulary: Vocabulary, chat: bool):
        self.vocabulary, self.chat = vocabulary, chat

    def logprobs(self, entries, top_n: int | None):
        if top_n is None:
            return None
        text = self.vocabulary.text
        if self.chat:
            def item(token, logprob):
                return {"token": text(token), "logprob": logprob, "bytes": self.vocabulary.bytes(token)}

            return {"content": [{**item(token, logprob),
                                 "top_logprobs": [item(t, lp) for t, lp in (top or {}).items()]}
                                for token, logprob, top, _ in entries]}
        return {"tokens": [text(t) for t, _, _, _ in entries],
                "token_logprobs": [lp for _, lp, _, _ in entries],
                "top_logprobs": [self._by_text(top) if top_n and top is not None else None
                                 for _, _, top, _ in entries],
                "text_offset": [offset for _, _, _, offset in entries]}

    def _by_text(self, top: dict[int, float]) -> dict[str, float]:
        """{token text: log-prob}, most likely first; where two tokens read the same, the more likely one's."""
        out: dict[str, float] = {}
        for token, logprob in sorted(top.items(), key=lambda item: -item[1]):
            out.setdefault(self.vocabulary.text(token), logprob)
        return out

    def choice(self, index: int, text: str, entries, top_n, finish_reason,
               parsed: ParsedOutput | None = None) -> dict[str, Any]:
        """`parsed`: the text read for tool calls (chat with tools); where calls parsed, the message carries them
        and the finish reason is "tool_calls"."""
        logprobs = self.logprobs(entries, top_n)
        if self.chat:
            message = {"role": "assistant", "content": text}
            if parsed is not None and parsed.calls:
                message = {"role": "assistant", "content": parsed.content, "tool_calls": tool_calls_json(parsed)}
                finish_reason = "tool_calls"
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str | None, entries, top_n, finish_reason) -> dict[str, Any]:
        logprobs = self.logprobs(entries, top_n) if entries else None
        if self.chat:
            return {"index": index, "delta": {} if text is None else {"content": text}, "logprobs": logprobs,
                    "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}


def tool_calls_json(parsed: ParsedOutput) -> list[dict[str, Any]]:
    """OpenAI's `tool_calls` of a message: each call with a fresh id and its arguments as a JSON string."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name, "arguments": call.arguments_json()}} for call in parsed.calls]


class StreamedToolCalls:
    """One streamed choice of a chat with tools: its content goes out as it comes until a `<tool_call>` opens; the
    calls are held to the end of the turn and then sent (one chunk, each call whole: id, name and arguments) if
    every one parses, else the held text goes out as content, so a stream says what the whole response says."""

    def __init__(self, prefill: str):
        self.content = ContentStream(prefill)

    def push(self, text: str) -> str:
        return self.content.push(text)

    def finish(self, finish_reason: str) -> tuple[dict[str, Any] | None, str]:
        """(the closing delta or None, the finish reason)."""
        parsed = parse_tool_calls(self.content.text)
        if parsed.calls:
            calls = [{"index": i, **call} for i, call in enumerate(tool_calls_json(parsed))]
            return {"tool_calls": calls}, "tool_calls"
        held = self.content.held()
        return ({"content": held} if held else None), finish_reason


# ------------------------------------------------------------------------------------------ the app
def create_app(engine: Engine, *, api_key: str | None = None,
               request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S):
    """The FastAPI application serving `engine`; `api_key`: required as a bearer token on /v1/ routes;
    `request_timeout`: seconds before a request is cancelled (None: no limit). Its lifespan starts the engine's loop
    and stops it at shutdown, after uvicorn has let the in-flight requests finish (or cancelled them after its
    graceful timeout, `uvicorn.run(timeout_graceful_shutdown=...)`): by then nobody waits for what is left."""
    vocabulary = Vocabulary(engine)
    metrics = Metrics()
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            await run_in_threadpool(engine.shutdown, True)

    app = FastAPI(title="hybridtron", summary="OpenAI-compatible API of a hybridtron model", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.add_middleware(CountResponses, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        message = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code in (404, 405) \
            else str(exc.detail)
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "Incorrect API key provided" if header else
                           "You didn't provide an API key: send it as 'Authorization: Bearer KEY'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    protected = [Depends(authorize)]

    def model_card() -> dict[str, Any]:
        return {"id": engine.model_name, "object": "model", "created": created, "owned_by": "hybridtron",
                "max_model_len": engine.max_context}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus_metrics():
        return PlainTextResponse(metrics.render(engine.stats()), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=protected)
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=protected)
    async def retrieve_model(model_id: str):
        if model_id != engine.model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        return model_card()

    async def read_json(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"We could not parse the JSON body of your request ({exc}).") from None

    def account(generation: Generation, started: float, first_token: float | None) -> None:
        metrics.prompt_tokens += sum(len(p) for p in generation.request.prompts)
        metrics.completion_tokens += sum(c.completion_tokens for c in generation.choices)
        for choice in generation.choices:
            metrics.requests_finished[choice.text.finish_reason or "cancelled"] += 1
        metrics.request_seconds += time.perf_counter() - started
        metrics.requests_timed += 1
        if first_token is not None:
            metrics.first_token_seconds += first_token - started
            metrics.first_tokens += 1

    async def respond(request: Request, parsed: GenerationRequest, started: float):
        chat = parsed.chat
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": engine.model_name}
        shapes = Shapes(vocabulary, chat)
        top_n = parsed.logprobs
        prompt_tokens = sum(len(p) for p in parsed.prompts)
        scored = None
        if parsed.echo and parsed.logprobs is not None:  # scoring a text: one forward over each prompt
            scored = {i: await run_in_threadpool(prompt_entries, engine, prompt, parsed.logprobs)
                      for i, prompt in enumerate(parsed.prompts)}
        generation = Generation(engine, parsed, rid, scored)

        if not parsed.stream:
            texts = {c.index: [c.prefix] for c in generation.choices}
            entries = {c.index: list(c.prefix_logprobs) for c in generation.choices}
            finish: dict[int, str] = {}
            first_token = None

            async def collect():
                nonlocal first_token
                async for delta in generation.deltas(request_timeout):
                    first_token = first_token or time.perf_counter()
                    texts[delta.index].append(delta.text)
                    entries[delta.index].extend(delta.logprobs)
                    if delta.finish_reason is not None:
                        finish[delta.index] = delta.finish_reason

            await _unless_disconnected(request, collect(), generation)
            account(generation, started, first_token)
            choices = []
            for c in generation.choices:
                text = parsed.prefill + "".join(texts[c.index])
                calls = parse_tool_calls(text) if parsed.parse_tool_calls else None
                choices.append(shapes.choice(c.index, text, entries[c.index], top_n, finish[c.index], calls))
            return {**head, "choices": choices,
                    "usage": _usage(prompt_tokens, sum(c.completion_tokens for c in generation.choices))}

        chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(choice: dict[str, Any]) -> str:
            return _sse({**chunk_head, "choices": [choice]})

        tool_streams = {c.index: StreamedToolCalls(parsed.prefill) for c in generation.choices} \
            if parsed.parse_tool_calls else {}

        async def chunks():
            first_token = None
            try:
                for choice in generation.choices:
                    if chat:  # OpenAI opens each choice of a chat stream with the assistant's role
                        yield _sse({**chunk_head, "choices": [{"index": choice.index, "delta": {
                            "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
                    if choice.prefix:
                        yield chunk(shapes.chunk_choice(choice.index, choice.prefix, choice.prefix_logprobs, top_n,
                                                        None))
                async for delta in generation.deltas(request_timeout):
                    first_token = first_token or time.perf_counter()
                    tools = tool_streams.get(delta.index)
                    text = tools.push(delta.text) if tools is not None else delta.text
                    if text or delta.logprobs:
                        yield chunk(shapes.chunk_choice(delta.index, text, delta.logprobs, top_n, None))
                    if delta.finish_reason is not None:
                        finish_reason = delta.finish_reason
                        if tools is not None:
                            closing, finish_reason = tools.finish(finish_reason)
                            if closing is not None:
                                yield chunk({"index": delta.index, "delta": closing, "logprobs": None,
                                             "finish_reason": None})
                        yield chunk(shapes.chunk_choice(delta.index, None, [], top_n, finish_reason))
                if parsed.include_usage:
                    completion_tokens = sum(c.completion_tokens for c in generation.choices)
                    yield _sse({**chunk_head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
            except APIError as exc:  # the status line has gone out; report the failure in the stream
                if exc.code == "timeout":
                    metrics.timeouts += 1
                yield _sse(exc.body())
            finally:
                generation.cancel()
                account(generation, started, first_token)
            yield _sse("[DONE]")

        return StreamingResponse(chunks(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def serve(request: Request, parse):
        started = time.perf_counter()
        raw = await read_json(request)
        parsed = await run_in_threadpool(parse, raw, engine)
        try:
            return await respond(request, parsed, started)
        except APIError as exc:
            if exc.code == "timeout":
                metrics.timeouts += 1
            elif exc.code == "queue_full":
                metrics.rejected_queue_full += 1
            raise

    @app.post("/v1/completions", dependencies=protected)
    async def completions(request: Request):
        return await serve(request, completion_request)

    @app.post("/v1/chat/completions", dependencies=protected)
    async def chat_completions(request: Request):
        return await serve(request, chat_request)

    return app


async def _unless_disconnected(request: Request, work, generation: Generation) -> None:
    """Run `work`; if the client disconnects first, cancel the generation (its slots free at the next step)."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            generation.cancel()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise APIError(499, "the client closed the connection", type="client_error")
        await task  # its result, or its APIError
    finally:
        watcher.cancel()
