"""Serve a checkpoint with an OpenAI-compatible HTTP API (vLLM's OpenAI server is the anchor): `hybridtron serve`.

    hybridtron serve --model DIR [--host 127.0.0.1 --port 8000 --served-model-name NAME --api-key KEY ...]

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models[/{id}]`, `GET /health`, and
`GET /metrics` (Prometheus text: responses by route and status, tokens, latency and time to first token, queue
length, batch occupancy, tokens/s, speculative acceptance length).

What a request may ask (OpenAI's fields, and vLLM's `top_k` and `stop_token_ids`): `n` samples per prompt, a list
of prompts (completions), `logprobs` (completions: an integer k, OpenAI's `tokens` / `token_logprobs` /
`top_logprobs` / `text_offset`; chat: `logprobs: true` and `top_logprobs: k`, OpenAI's `content` list with `bytes`),
`echo` (with `logprobs`, the prompt's tokens are scored too, from one forward: `HybridEngine.prompt_logprobs`),
`seed`, `stop`, `max_tokens` (a prompt plus max_tokens beyond the context is a 400 that states the limit),
`stream` with `stream_options.include_usage`, `tools` and `tool_choice` (chat: see below). Log-probabilities of
generated tokens are those of the distribution each was drawn from (`hybridtron.infer.scheduler.TokenEvent`). The
`n` samples of a prompt share its prefill, and a seeded request is reproducible: choice i * n + j is
`HybridEngine.generate(prompts, params, n)[i][j]`.

Every request runs on the engine's continuous-batching loop (`hybridtron.infer.scheduler`): it joins the running
batch between two steps and leaves it when it finishes, so concurrent requests share each forward. The chat
template is the one the trainers use (`hybridtron.data.chat`). Text, stop strings and the end of a sequence's text
follow `hybridtron.infer.text.SequenceText`, as in `hybridtron generate`.

Tools (chat): `tools` are rendered by the chat template into the system turn, as Qwen3's template does, and the
model's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` regions are parsed back as vLLM's Hermes parser
parses them (`hybridtron.data.tools`): `message.tool_calls` with the text before the first call as `content`, and
`finish_reason` "tool_calls"; a call that does not parse is returned as text (finish_reason "stop", or "length"
when cut). Streamed, the content goes out as it comes until a `<tool_call>` opens, and the calls are sent whole at
the end of the turn, one `tool_calls` delta each (so that a stream says what the whole response says).
`tool_choice`: "auto" (the default with tools), "none" (tools rendered, nothing parsed), "required" and a named
function, enforced by a guided prefix written into the assistant's turn (`<tool_call>` and, for a named function,
`{"name": NAME, "arguments": `); the arguments themselves are not constrained.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a malformed request, naming
the field (pydantic models with `extra="forbid"`, `protocol.py`), 401 without the `--api-key`, 404 for an unknown
model or route, 503 (with Retry-After) when the engine's bounded queue (`--max-queue`) is full, 504 when a request
runs past `--request-timeout` (it is cancelled), 500 if the model fails (the server keeps serving). A client that
disconnects, streaming or not, frees its slot at the next step. Shutdown (SIGINT / SIGTERM) stops accepting
connections, lets in-flight requests finish for `--shutdown-timeout` seconds, cancels the rest and stops the loop.
The port is bound before the model loads (a port in use is an error at once); `--port 0` takes a free one, which
the start line prints. An empty `--api-key` (what an unset shell variable expands to) is an error, never a server
that silently requires no key.

Layout: `command.py` is the command; `protocol.py` the request models and their errors; `app.py` the FastAPI
application (`create_app(engine)`, re-exported here); `metrics.py` the counters behind `/metrics` and their
Prometheus text; `settings.py` the defaults the command and the application share. FastAPI and uvicorn (the
`serve` extra: `pip install 'hybridtron[serve]'`) are imported only when a server is built.
"""

from __future__ import annotations


def require_serving_dependencies() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"hybridtron serve needs FastAPI and uvicorn ({exc.name} is missing): "
                          f"pip install 'hybridtron[serve]'") from None


def create_app(engine, **options):
    """The FastAPI application serving `engine` (`hybridtron.infer.server.app.create_app`)."""
    require_serving_dependencies()
    from hybridtron.infer.server.app import create_app as build  # FastAPI: the optional `serve` extra

    return build(engine, **options)
