"""Serve a checkpoint with an OpenAI-compatible HTTP API: /v1/models, /v1/completions, /v1/chat/completions.

`hybridtron serve --model DIR [--host 127.0.0.1 --port 8000 --no-speculative --draft-length K]`

The server speaks OpenAI's wire format (the official `openai` client works against it): JSON responses with usage
counts and finish_reason "stop" / "length"; `stream: true` sends server-sent events, one `data: {chunk}` per text
delta and `data: [DONE]` at the end. Every client mistake gets OpenAI's error shape,
`{"error": {"message", "type": "invalid_request_error", "param", "code"}}`, with status 400 (404 for an unknown
model or route), and the server keeps serving.

The model sits behind `Engine`, a small protocol: tokenizer, chat template, and a token stream. The server owns
everything that is about text: the stop strings and stop tokens, max_tokens and the context budget, incremental
detokenisation that never emits half a UTF-8 character or the beginning of a stop string. Generations run one at a
time on a worker thread (the engine holds one cache) and pass their text to the event loop through a queue, so the
loop keeps answering other requests while the model computes; a client that disconnects mid-stream stops its
generation at the next token.

FastAPI and uvicorn are imported only when a server is built (`pip install 'hybridtron[serve]'`).
"""

# No `from __future__ import annotations`: FastAPI reads the route functions' annotations (Request) at runtime.
import asyncio
import json
import logging
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Protocol, Sequence

from hybridtron.infer.text import TextStream
from hybridtron.infer.sampling import ParamError, SamplingParams

log = logging.getLogger("hybridtron.serve")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
MAX_STOP_STRINGS = 4  # as OpenAI
CHAT_ROLES = ("system", "developer", "user", "assistant")


class Engine(Protocol):
    """What the server needs from a model. `hybridtron.infer.engine.load_engine` builds the real one.

    stream(prompt_ids, params) yields generated token ids one at a time (a speculative engine yields each token it
    accepted, in order), sampling with `params` (temperature, top_k, top_p, seed). It stops by itself at the end of
    sequence token (not yielded) or when the context is full. The server closes the generator as soon as it has
    enough (max_tokens, a stop string or stop token, a client gone), so the engine frees its cache in a `finally`.
    The server never runs two streams at once, but may call encode / decode / chat_template from another thread
    while a stream runs.
    """

    model_name: str
    max_context: int  # prompt + generated tokens
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat_template(self, messages: list[dict[str, str]]) -> str: ...

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]: ...


# ------------------------------------------------------------------------------------------ text generation
@dataclass(frozen=True)
class TextEvent:
    """A piece of generated text; the last event of a generation carries the finish_reason (and maybe text)."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None


def generate_text(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> Iterator[TextEvent]:
    """Run the engine's token stream and turn it into text deltas, applying max_tokens, the context budget, stop
    token ids and stop strings (neither of which appears in the text; `TextStream` does the detokenisation). One
    event per token received (its text is empty while held back), then a last one with the rest of the text and
    the finish_reason: "length" when max_tokens or the context ran out, "stop" otherwise."""
    budget = min(params.max_tokens, engine.max_context - len(prompt_ids))
    text = TextStream(engine.decode, prompt_ids, params.stop, params.stop_token_ids)
    count = 0  # tokens received, a stop token included (that is what the engine computed)
    finish, last = "length", ""
    if budget > 0:
        stream = engine.stream(list(prompt_ids), params)
        try:
            finish = "stop"  # a stop token or string, or the engine ended the sequence itself; unless the budget ends
            for token in stream:
                count += 1
                delta, stopped = text.push(token)
                if stopped or count >= budget:
                    finish, last = ("stop" if stopped else "length"), delta
                    break
                # One event per token, empty while text is held back, so a consumer can stop between any two.
                yield TextEvent(delta, count)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
    yield TextEvent(last + text.finish(), count, finish)


# ------------------------------------------------------------------------------------------ request parsing
class APIError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


_TYPE_CHECKS = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


class _Body:
    """Typed access to a JSON request body; each mistake becomes a 400 that names the parameter."""

    def __init__(self, body, allowed: set[str]):
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object, got {_json_type(body)}")
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
        self.body = body

    def get(self, name: str, *types: str, default=None, required: bool = False):
        if name not in self.body or self.body[name] is None:
            if required:
                raise APIError(400, f"you must provide a {name} parameter", param=name)
            return default
        value = self.body[name]
        if not any(_TYPE_CHECKS[t](value) for t in types):
            raise APIError(400, f"{name}: expected {' or '.join(types)}, got {_json_type(value)} ({value!r:.60})",
                           param=name)
        return value

    def unsupported(self, name: str, *types: str, allowed: tuple = (None,), note: str = ""):
        """A parameter clients send with its neutral value; anything else is refused, not silently ignored."""
        value = self.get(name, *types)
        if value not in allowed:
            raise APIError(400, f"{name}={value!r} is not supported by this server{note}", param=name)


COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop",
                 "stop_token_ids", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}


@dataclass(frozen=True)
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


def _common(body: _Body, engine: Engine) -> dict[str, Any]:
    model = body.get("model", "string", required=True)
    if model != engine.model_name:
        raise APIError(404, f"The model '{model}' does not exist (this server has '{engine.model_name}')",
                       param="model", code="model_not_found")
    if body.get("n", "integer", default=1) != 1:
        raise APIError(400, "n: this server returns one choice per request; n must be 1", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        body.unsupported(name, "number", allowed=(None, 0), note=" (no penalties; use 0)")
    if body.get("logit_bias", "object"):
        raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")
    body.get("user", "string")
    stream = body.get("stream", "boolean", default=False)
    options = body.get("stream_options", "object")
    include_usage = False
    if options is not None:
        if not stream:
            raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")
        unknown = sorted(set(options) - {"include_usage"})
        if unknown:
            raise APIError(400, f"stream_options.{unknown[0]} is not supported", param="stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise APIError(400, "stream_options.include_usage: expected boolean", param="stream_options")
    stop = body.get("stop", "string", "array", default=())
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    return dict(
        stream=stream, include_usage=include_usage,
        sampling=dict(temperature=body.get("temperature", "number", default=1.0),
                      top_p=body.get("top_p", "number", default=1.0), top_k=body.get("top_k", "integer", default=0),
                      seed=body.get("seed", "integer"), stop=stop,
                      stop_token_ids=body.get("stop_token_ids", "array", default=())),
    )


def _sampling_params(sampling: dict[str, Any], max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, **sampling)
    except ParamError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def _check_context(engine: Engine, prompt_ids: list[int], max_tokens: int | None, prompt_param: str) -> int:
    """max_tokens, defaulted to the rest of the context; a prompt must leave room for one generated token."""
    if not prompt_ids:
        raise APIError(400, f"{prompt_param}: the prompt is empty", param=prompt_param)
    if max_tokens is not None and max_tokens < 0:
        raise APIError(400, f"max_tokens must be >= 0, got {max_tokens}", param="max_tokens")
    room = engine.max_context - len(prompt_ids)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = len(prompt_ids) + (max_tokens or 0)
        raise APIError(400, f"This model's maximum context length is {engine.max_context} tokens. However, you "
                            f"requested {asked} tokens ({len(prompt_ids)} in the prompt, {max_tokens or 0} in the "
                            f"completion). Please reduce the length of the prompt or of max_tokens.",
                       param=prompt_param if room < 1 else "max_tokens", code="context_length_exceeded")
    return room if max_tokens is None else max_tokens


def _encode(engine: Engine, text: str, param: str) -> list[int]:
    try:
        return list(engine.encode(text))
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None


def parse_completion_request(raw, engine: Engine) -> ParsedRequest:
    body = _Body(raw, COMPLETION_FIELDS)
    common = _common(body, engine)
    body.unsupported("echo", "boolean", allowed=(None, False))
    body.unsupported("best_of", "integer", allowed=(None, 1))
    body.unsupported("suffix", "string")
    body.unsupported("logprobs", "integer", allowed=(None, 0), note=" (no log-probabilities)")
    prompt = body.get("prompt", "string", "array", required=True)
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        elif prompt and not all(_TYPE_CHECKS["integer"](t) for t in prompt):
            raise APIError(400, "prompt: expected a string, a list of token ids, or a batch of one of them "
                                "(this server takes one prompt per request)", param="prompt")
    if isinstance(prompt, str):
        prompt_ids = _encode(engine, prompt, "prompt")
    else:
        if not all(_TYPE_CHECKS["integer"](t) and 0 <= t < engine.vocab_size for t in prompt):
            raise APIError(400, f"prompt: token ids must be integers in [0, {engine.vocab_size})", param="prompt")
        prompt_ids = list(prompt)
    max_tokens = body.get("max_tokens", "integer", default=DEFAULT_COMPLETION_MAX_TOKENS)
    max_tokens = _check_context(engine, prompt_ids, max_tokens, "prompt")
    return ParsedRequest(prompt_ids, _sampling_params(common["sampling"], max_tokens), common["stream"],
                         common["include_usage"])


def _message_text(message, index: int) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise APIError(400, f"{where}: expected an object with role and content", param=where)
    unknown = sorted(set(message) - {"role", "content", "name"})
    if unknown:
        field = f"{where}.{unknown[0]}"
        raise APIError(400, f"{field} is not supported (text messages only)", param=field)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise APIError(400, f"{where}.role: expected one of {', '.join(CHAT_ROLES)}, got {role!r}",
                       param=f"{where}.role")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise APIError(400, f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                           param=f"{where}.content")
        content = "".join(p["text"] for p in content)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise APIError(400, f"{where}.content: expected a string or a list of text parts, got {_json_type(content)}",
                       param=f"{where}.content")
    return {"role": role, "content": content}


def parse_chat_request(raw, engine: Engine) -> ParsedRequest:
    body = _Body(raw, CHAT_FIELDS)
    common = _common(body, engine)
    body.unsupported("logprobs", "boolean", allowed=(None, False), note=" (no log-probabilities)")
    body.unsupported("top_logprobs", "integer", allowed=(None, 0))
    messages = body.get("messages", "array", required=True)
    if not messages:
        raise APIError(400, "messages: at least one message is required", param="messages")
    messages = [_message_text(m, i) for i, m in enumerate(messages)]
    try:
        prompt = engine.chat_template(messages)
    except ValueError as exc:
        raise APIError(400, f"messages: {exc}", param="messages") from None
    prompt_ids = _encode(engine, prompt, "messages")
    max_tokens = body.get("max_completion_tokens", "integer")
    if max_tokens is None:
        max_tokens = body.get("max_tokens", "integer")
    max_tokens = _check_context(engine, prompt_ids, max_tokens, "messages")
    return ParsedRequest(prompt_ids, _sampling_params(common["sampling"], max_tokens), common["stream"],
                         common["include_usage"])


# ------------------------------------------------------------------------------------------ generation runner
_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class GenerationRunner:
    """Runs generations on one worker thread, in arrival order, and streams their events to the event loop."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridtron-generate")

    async def events(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TextEvent]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the event loop has closed: nobody is listening any more
                cancelled.set()

        def work() -> None:
            try:
                if cancelled.is_set():  # the client left while the request waited for the worker
                    return
                events = generate_text(self.engine, prompt_ids, params)
                try:
                    for event in events:
                        put(event)
                        if cancelled.is_set():
                            break
                finally:
                    events.close()
            except Exception as exc:  # the engine failed: report it to this request, keep serving
                log.exception("generation failed")
                put(_Failure(exc))
            finally:
                put(_END)

        loop.run_in_executor(self.executor, work)
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, _Failure):
                    raise APIError(500, f"the model failed while generating: {item.exc}", type="server_error")
                yield item
        finally:
            cancelled.set()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


# ------------------------------------------------------------------------------------------ the app
def _require_serving_dependencies():
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"hybridtron serve needs FastAPI and uvicorn ({exc.name} is missing): "
                          f"pip install 'hybridtron[serve]'") from None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(payload) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def create_app(engine: Engine):
    """The FastAPI application serving `engine`."""
    _require_serving_dependencies()
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    runner = GenerationRunner(engine)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        yield
        runner.shutdown()

    app = FastAPI(title="hybridtron", summary="OpenAI-compatible API of a hybridtron model", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        message = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code in (404, 405) \
            else str(exc.detail)
        return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    def model_card() -> dict[str, Any]:
        return {"id": engine.model_name, "object": "model", "created": created, "owned_by": "hybridtron",
                "max_model_len": engine.max_context}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
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

    def response_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def respond(parsed: ParsedRequest, chat: bool):
        """Run one generation; a JSON response, or an event stream of chunks."""
        rid = response_id("chatcmpl" if chat else "cmpl")
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": engine.model_name}
        prompt_tokens = len(parsed.prompt_ids)

        def choice(text: str, finish_reason, stream: bool) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = "delta" if stream else "message"
            content = {"content": text} if stream else {"role": "assistant", "content": text}
            return {"index": 0, body: content if (text or not stream) else {}, "logprobs": None,
                    "finish_reason": finish_reason}

        if not parsed.stream:
            pieces, last = [], None
            async for event in runner.events(parsed.prompt_ids, parsed.params):
                pieces.append(event.text)
                last = event
            return {**head, "choices": [choice("".join(pieces), last.finish_reason, False)],
                    "usage": _usage(prompt_tokens, last.completion_tokens)}

        chunk_head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        async def chunks():
            if chat:  # OpenAI opens a chat stream with the assistant's role
                yield _sse({**chunk_head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]})
            try:
                async for event in runner.events(parsed.prompt_ids, parsed.params):
                    if event.text:
                        yield _sse({**chunk_head, "choices": [choice(event.text, None, True)]})
                    if event.finish_reason is not None:
                        yield _sse({**chunk_head, "choices": [choice("", event.finish_reason, True)]})
                        if parsed.include_usage:
                            yield _sse({**chunk_head, "choices": [],
                                        "usage": _usage(prompt_tokens, event.completion_tokens)})
            except APIError as exc:  # the status line has gone out; report the failure in the stream
                yield _sse(exc.body())
            yield _sse("[DONE]")

        return StreamingResponse(chunks(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        raw = await read_json(request)
        return await respond(await run_in_threadpool(parse_completion_request, raw, engine), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        raw = await read_json(request)
        return await respond(await run_in_threadpool(parse_chat_request, raw, engine), chat=True)

    return app


# ------------------------------------------------------------------------------------------ command line
def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory (Hugging Face layout)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--no-speculative", action="store_true",
                        help="decode one token per forward instead of drafting with the MTP block")
    parser.add_argument("--draft-length", type=int, default=3, help="tokens the MTP block drafts per step")
    parser.add_argument("--compile", action="store_true",
                        help="plain decoding with the one-token step compiled by torch.compile (implies "
                             "--no-speculative; the first request of each batch and cache size waits for a compile)")


def run(args) -> int:
    if args.draft_length < 1:
        raise ValueError(f"--draft-length must be >= 1, got {args.draft_length}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if not Path(args.model).is_dir():
        raise FileNotFoundError(f"{args.model}: no such checkpoint directory")
    try:
        _require_serving_dependencies()
    except ImportError as exc:
        print(f"hybridtron serve: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from hybridtron.infer.engine import load_engine

    engine = load_engine(args.model, speculative=not (args.no_speculative or args.compile),
                         draft_length=args.draft_length, compile=args.compile)
    app = create_app(engine)
    print(f"hybridtron serve: {engine.model_name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
