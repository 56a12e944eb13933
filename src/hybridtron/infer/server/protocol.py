"""OpenAI's request bodies as pydantic models, their mistakes as OpenAI's errors, and their translation into engine
requests (token ids and `SamplingParams`).

Each model forbids unknown fields (`extra="forbid"`) and coerces nothing (`strict`: "10" is not an integer, 2.5 is
not an integer, 1 is not a boolean); `null` means absent, as the OpenAI API treats it. The first validation error
becomes a 400 in OpenAI's shape that names the parameter (`messages[0].content`) and says what was expected and what
came (`error_from_validation`). Parameters that OpenAI clients send with their neutral value and this server cannot
honour (penalties, `logit_bias`, `suffix`, `best_of` > n) are accepted at that value and refused otherwise, never
silently ignored. The context budget is checked here too: a prompt plus `max_tokens` beyond the model's context is
an error that states the limit (`context_length_exceeded`), never a silent cut. Chat's `tools` are checked as the
chat template renders them (`hybridtron.data.tools.check_tools`) and `tool_choice` against them; "required" and a
named function become a prefix of the assistant's turn (`tool_prefill`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hybridtron.data.chat import MESSAGE_FIELDS, ROLE_ALIASES, ROLES
from hybridtron.data.tokenizer import TOOL_CALL_START
from hybridtron.data.tools import check_tools
from hybridtron.infer.sampling import ParamError, SamplingParams
from hybridtron.infer.scheduler import MAX_TOP_LOGPROBS

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_CHOICES = 128  # n x prompts of one request
CHAT_ROLES = (*ROLES, *ROLE_ALIASES)


class APIError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def json_type(value) -> str:
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


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid", "{message}", {"message": message})  # no template: messages hold braces


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------ the models
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Strict):
    include_usage: bool = False


class _Request(_Strict):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extension
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = ()
    stop_token_ids: list[int] = ()  # vLLM's extension
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
            raise _invalid(f"stop: expected a string or an array of strings, got {json_type(value)}")
        if len(stops) > MAX_STOP_STRINGS:
            raise _invalid(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if not all(stops):
            raise _invalid("stop: a stop string must not be empty")
        return tuple(stops)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value, info):
        if value != 0:
            raise _invalid(f"{info.field_name}={value!r} is not supported by this server (no penalties; use 0)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise _invalid("logit_bias is not supported by this server")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("stream_options", "stream_options: only allowed when stream is true")
        return self


class CompletionRequest(_Request):
    prompt: Any
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value):
        """A string, a list of token ids, or a list of either (a batch of prompts)."""
        def one(item) -> bool:
            return isinstance(item, str) or (isinstance(item, list) and bool(item) and all(map(_is_int, item)))

        if one(value):
            return [value]
        if isinstance(value, list) and value and all(map(one, value)):
            return value
        raise _invalid(f"prompt: expected a string, an array of token ids, or an array of strings or of token-id "
                       f"arrays (a batch), got {json_type(value)} ({value!r:.60})")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise _invalid("suffix is not supported by this server (no fill-in-the-middle)")
        return value

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise PydanticCustomError("best_of", "best_of={best_of} is not supported by this server; it must equal "
                                                 "n ({n}) or be left out", {"best_of": self.best_of, "n": self.n})
        return self


class ChatMessage(_Strict):
    """A message as the chat format reads it (`hybridtron.data.chat.MESSAGE_FIELDS`); the chat format checks the
    rest (reserved tokens, tool messages after an assistant's call)."""

    model_config = ConfigDict(extra="allow", strict=True)  # the chat format's own fields, checked below
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: Any = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data):
        if isinstance(data, dict):
            unknown = [key for key in data if key not in MESSAGE_FIELDS]
            if unknown:
                raise PydanticCustomError("extra_forbidden", "{field}: unknown field; a message has {fields}",
                                          {"field": unknown[0], "fields": ", ".join(MESSAGE_FIELDS)})
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value):
        """A string, or content parts of which only text ones ({"type": "text", "text": ...}) are supported."""
        if isinstance(value, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in value):
                raise _invalid("only text parts ({'type': 'text', 'text': ...}) are supported")
            return "".join(p["text"] for p in value)
        if not isinstance(value, str):
            raise _invalid(f"expected a string or an array of text parts, got {json_type(value)}")
        return value

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


TOOL_CHOICES = ("none", "auto", "required")


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, value):
        try:
            return check_tools(value, "tools")
        except ValueError as exc:
            raise _invalid(str(exc)) from None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value):
        """"none", "auto", "required", or {"type": "function", "function": {"name": NAME}} (kept as NAME)."""
        if value in TOOL_CHOICES:
            return value
        function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
        if isinstance(function, dict) and isinstance(function.get("name"), str) and len(value) == 2:
            return {"name": function["name"]}
        raise _invalid(f"tool_choice: expected one of {', '.join(TOOL_CHOICES)} or {{'type': 'function', "
                       f"'function': {{'name': NAME}}}}, got {value!r:.80}")

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "top_logprobs: only allowed when logprobs is true")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise PydanticCustomError("tool_choice", "{message}", {
                "message": f"tool_choice: {self.tool_choice!r} needs tools; declare them in tools"})
        if isinstance(self.tool_choice, dict):
            declared = [tool["function"]["name"] for tool in self.tools]
            if self.tool_choice["name"] not in declared:
                raise PydanticCustomError("tool_choice", "{message}", {
                    "message": f"tool_choice: function {self.tool_choice['name']!r} is not among the tools declared "
                               f"({', '.join(declared)})"})
        return self

    def tool_prefill(self) -> str:
        """The start of the assistant's turn that enforces `tool_choice` (see `tool_prefill`)."""
        return tool_prefill(self.tool_choice)


def tool_prefill(tool_choice) -> str:
    """"required" and a named function are enforced by writing the start of the call into the assistant's turn (a
    guided prefix): `<tool_call>` then a newline for "required" (the model picks the function), and for a named
    function also `{"name": NAME, "arguments": ` (the model writes the arguments). The arguments themselves are not
    constrained (no grammar-guided decoding): a call that does not parse comes back as text."""
    if tool_choice == "required":
        return TOOL_CALL_START + "\n"
    if isinstance(tool_choice, dict):
        return TOOL_CALL_START + '\n{"name": ' + json.dumps(tool_choice["name"]) + ', "arguments": '
    return ""


# ------------------------------------------------------------------------------------------ errors
_PARAM_OF_ERROR_TYPE = {"stream_options": "stream_options", "best_of": "best_of", "top_logprobs": "top_logprobs",
                        "tool_choice": "tool_choice"}


def _param(loc: tuple) -> str | None:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or None


def error_from_validation(exc: ValidationError, model: type[BaseModel]) -> APIError:
    """The first mistake of a request body as a 400 naming its parameter."""
    error = exc.errors(include_url=False)[0]
    loc, kind, value = tuple(error["loc"]), error["type"], error.get("input")
    param = _param(loc) or _PARAM_OF_ERROR_TYPE.get(kind)
    if kind == "model_type" and not loc:
        return APIError(400, f"the request body must be a JSON object, got {json_type(value)}")
    if kind == "extra_forbidden":
        if len(loc) == 1:
            return APIError(400, f"Unrecognized request argument supplied: {loc[0]}", param=param)
        field = f"{param}.{error['ctx']['field']}" if "ctx" in error and "field" in error["ctx"] else param
        return APIError(400, f"{field} is not supported: {error['msg'].split(': ', 1)[-1]}", param=field)
    if kind == "missing":
        if len(loc) == 1:
            return APIError(400, f"you must provide a {loc[0]} parameter", param=param)
        return APIError(400, f"{param}: missing", param=param)
    if kind in ("invalid", *_PARAM_OF_ERROR_TYPE):
        message = error["msg"]
        return APIError(400, message if message.startswith(param or "") else f"{param}: {message}", param=param)
    if kind == "literal_error":
        return APIError(400, f"{param}: expected one of {', '.join(CHAT_ROLES)}, got {value!r:.60}", param=param)
    got = f"got {json_type(value)}" + ("" if isinstance(value, (dict, list)) else f" ({value!r:.60})")
    return APIError(400, f"{param}: {error['msg'][0].lower()}{error['msg'][1:]}, {got}", param=param)


def validate(model: type[BaseModel], raw) -> BaseModel:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise error_from_validation(exc, model) from None


# ------------------------------------------------------------------------------------------ engine requests
@dataclass(frozen=True)
class GenerationRequest:
    """A validated request, as the engine takes it: one `SamplingParams` per prompt (max_tokens resolved against the
    context), `n` samples of each. `logprobs`: None (none), 0 (the sampled tokens'), k (and the k most likely)."""

    chat: bool
    prompts: list[list[int]]
    params: list[SamplingParams]
    n: int
    logprobs: int | None
    echo: bool
    stream: bool
    include_usage: bool
    parse_tool_calls: bool = False  # tools declared and tool_choice not "none": tool_calls parsed from the text
    prefill: str = ""  # the start of the assistant's turn written into the prompt (`tool_prefill`), part of its text


def _check_model(request: _Request, model_name: str) -> None:
    if request.model != model_name:
        raise APIError(404, f"The model '{request.model}' does not exist (this server has '{model_name}')",
                       param="model", code="model_not_found")


def _check_context(max_context: int, prompt_ids: list[int], max_tokens: int | None, prompt_param: str) -> int:
    """max_tokens, defaulted to the rest of the context; a prompt must leave room for one generated token."""
    if not prompt_ids:
        raise APIError(400, f"{prompt_param}: the prompt is empty", param=prompt_param)
    if max_tokens is not None and max_tokens < 0:
        raise APIError(400, f"max_tokens must be >= 0, got {max_tokens}", param="max_tokens")
    room = max_context - len(prompt_ids)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = len(prompt_ids) + (max_tokens or 0)
        raise APIError(400, f"This model's maximum context length is {max_context} tokens. However, you requested "
                            f"{asked} tokens ({len(prompt_ids)} in the prompt, {max_tokens or 0} in the completion). "
                            f"Please reduce the length of the prompt or of max_tokens.",
                       param=prompt_param if room < 1 else "max_tokens", code="context_length_exceeded")
    return room if max_tokens is None else max_tokens


def _sampling_params(request: _Request, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p,
                              top_k=request.top_k, seed=request.seed, stop=request.stop,
                              stop_token_ids=tuple(request.stop_token_ids))
    except ParamError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def _encode(engine, text: str, param: str) -> list[int]:
    try:
        return list(engine.encode(text))
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None


def _choices_fit(count: int) -> None:
    if count > MAX_CHOICES:
        raise APIError(400, f"n: n x prompts is {count}; at most {MAX_CHOICES} choices per request", param="n")


def completion_request(raw, engine) -> GenerationRequest:
    """A /v1/completions body (see the module docstring); APIError for any mistake."""
    request = validate(CompletionRequest, raw)
    _check_model(request, engine.model_name)
    _choices_fit(len(request.prompt) * request.n)
    prompts, params = [], []
    for index, prompt in enumerate(request.prompt):
        param = "prompt" if len(request.prompt) == 1 else f"prompt[{index}]"
        if isinstance(prompt, str):
            ids = _encode(engine, prompt, param)
        else:
            if not all(0 <= t < engine.vocab_size for t in prompt):
                raise APIError(400, f"{param}: token ids must be integers in [0, {engine.vocab_size})", param="prompt")
            ids = list(prompt)
        max_tokens = request.max_tokens if request.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        max_tokens = _check_context(engine.max_context, ids, max_tokens, "prompt")
        prompts.append(ids)
        params.append(_sampling_params(request, max_tokens))
    return GenerationRequest(False, prompts, params, request.n, request.logprobs, request.echo, request.stream,
                             bool(request.stream_options and request.stream_options.include_usage))


_MESSAGE_FIELD = re.compile(r"^(messages\[\d+\](?:\.\w+)?)")


def chat_request(raw, engine) -> GenerationRequest:
    """A /v1/chat/completions body (see the module docstring); APIError for any mistake."""
    request = validate(ChatRequest, raw)
    _check_model(request, engine.model_name)
    _choices_fit(request.n)
    messages = [m.as_dict() for m in request.messages]
    try:
        # tools rendered whatever tool_choice says, "none" included (as vLLM does by default)
        prompt = engine.chat_template(messages, tools=request.tools) if request.tools else \
            engine.chat_template(messages)
    except ValueError as exc:  # the chat format names the message and field: "messages[1].content: ..."
        match = _MESSAGE_FIELD.match(str(exc))
        raise APIError(400, str(exc) if match else f"messages: {exc}",
                       param=match.group(1) if match else "messages") from None
    prefill = request.tool_prefill()
    ids = _encode(engine, prompt + prefill, "messages")
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    max_tokens = _check_context(engine.max_context, ids, max_tokens, "messages")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return GenerationRequest(True, [ids], [_sampling_params(request, max_tokens)], request.n, logprobs, False,
                             request.stream, bool(request.stream_options and request.stream_options.include_usage),
                             parse_tool_calls=bool(request.tools) and request.tool_choice != "none", prefill=prefill)
