"""The chat format: one definition shared by the server (/v1/chat/completions), the trainers (SFT, GRPO) and the
Hugging Face export (`tokenizer_config.json`'s `chat_template`).

Layout: ChatML with Qwen3-style `<think>` reasoning and Hermes/Qwen3 JSON tool calls, after one `<|bos|>` that
opens every conversation as it opened every pretraining document:

    <|im_start|>system\\n{content}<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n{answer}<|im_end|>\\n
    <|im_start|>assistant\\n{answer}\\n<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call><|im_end|>\\n
    <|im_start|>tool\\n<tool_response>\\n{content}\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n                                  <- the generation prompt

With `tools` (OpenAI-style declarations, `render_chat(..., tools=)`), the conversation opens with a system turn that
declares them as Qwen3's template does: the system message's content (if any) and a blank line, then `# Tools`, the
declarations between `<tools>` and `</tools>` one JSON object a line, and how to call them (`TOOLS_HEADER`,
`TOOLS_FOOTER`). The template that carries this is v2; v1 (before tools) is still read as ours
(`EARLIER_CHAT_TEMPLATES`), since it renders every conversation without tools as v2 does.

Messages are OpenAI-style dicts: `role` (system, user, assistant, tool; `developer` is read as system) and
`content` (a string). An assistant message may carry its reasoning in `reasoning_content` (or `reasoning` /
`thinking`, the aliases transformers accepts) or inline, as content that opens with `<think>...</think>`; and
`tool_calls`, `[{"function": {"name": str, "arguments": object or JSON string}}]` (the `function` wrapper may
be left out). `name` and `tool_call_id` are accepted and not rendered (ChatML has no place for them); any other
field is an error, so a misspelt field never vanishes silently. Whitespace: reasoning is stripped of the
newlines around it and the answer of the newlines before it, so `<think>` blocks always read the same.

Reasoning in history (`reasoning_history`): "last_turn" (the default, as Qwen3's template and Nemotron 3
Super's `truncate_history_thinking` default) keeps `<think>` only in the assistant messages after the last user
message (the turn being answered, with its tool calls); earlier assistant turns show their answers alone, which
is what the model sees when it serves a multi-turn chat. "all" keeps every turn's reasoning. `enable_thinking`
shapes the generation prompt: None leaves the choice to the model, False appends an empty
`<think>\\n\\n</think>\\n` (answer directly, as a non-reasoning SFT example renders with `reasoning_content: ""`),
True appends `<think>\\n` (reason first).

`render_chat` builds the text and labels each character span with a `Segment` and its message;
`tokenize_chat` encodes the whole text at once (so its ids are exactly `tokenizer.encode(text)`, which is what
transformers' `apply_chat_template` computes from `CHAT_TEMPLATE`) and gives each token the segment of its
first character. Segment changes inside the text fall at special tokens (`<think>`, `</think>`,
`<|im_end|>`), where BPE never merges, except at the `\\n` that ends a role header: a token that joins that
`\\n` to an answer opening with whitespace counts as template.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from hybridtron.data.tokenizer import (
    BOS, IM_END, IM_START, SPECIAL_TOKENS, THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START,
    TOOL_RESPONSE_END, TOOL_RESPONSE_START, Tokenizer,
)
from hybridtron.data.tools import check_tools
from hybridtron.files import atomic_write_text

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system message
# `enable_thinking` of `render_chat` by the name a configuration or a command line gives it
THINKING_SWITCH = {"auto": None, "on": True, "off": False}
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")  # the names transformers reads reasoning under
IGNORED_FIELDS = ("name", "tool_call_id")  # accepted, not rendered
MESSAGE_FIELDS = ("role", "content", *REASONING_FIELDS, "tool_calls", *IGNORED_FIELDS)
REASONING_HISTORY = ("last_turn", "all")
# Markup a message may not contain: it would end or open a turn (or a conversation) in the middle of content.
RESERVED_TOKENS = (IM_START, IM_END, BOS)
# How the system turn declares tools (Qwen3's and Hermes' wording); each declaration goes on a line of its own between.
TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")
# Tokens the template itself needs in the vocabulary.
CHAT_TOKENS = (BOS, IM_START, IM_END, THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START,
               TOOL_RESPONSE_END)


class Segment(enum.IntEnum):
    """What a span of a rendered conversation is; SFT trains on ANSWER (and THINKING with train_on_thinking)."""

    TEMPLATE = 0  # bos, <|im_start|>, role headers, newlines, a non-assistant <|im_end|>, the generation prompt
    PROMPT = 1  # the content of a system, user or tool message
    ANSWER = 2  # an assistant's answer and tool calls, and the <|im_end|> that closes its turn (learn to stop)
    THINKING = 3  # an assistant's <think> ... </think>, both tags included


@dataclass(frozen=True)
class Message:
    """A validated message: reasoning split from the answer, tool calls rendered to their JSON text."""

    role: str
    content: str
    reasoning: str | None = None  # None: no reasoning block; "": an empty one
    tool_calls: tuple[str, ...] = ()  # each `{"name": ..., "arguments": ...}` as rendered


@dataclass(frozen=True)
class RenderedChat:
    """A conversation's text and its spans: `(start, end, segment, message index)`, contiguous from 0."""

    text: str
    spans: tuple[tuple[int, int, Segment, int], ...]
    roles: tuple[str, ...]  # per message index (the generation prompt, if any, is one more "assistant")


@dataclass(frozen=True)
class ChatTokens:
    """A tokenized conversation: per token its id, its `Segment` and the index of its message in `roles`."""

    ids: np.ndarray  # [N] int64
    segments: np.ndarray  # [N] uint8, Segment values
    turns: np.ndarray  # [N] int32, index into roles (bos counts as the first message's)
    roles: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.ids)

    def trained(self, train_on_thinking: bool = False) -> np.ndarray:
        """[N] bool: the tokens an SFT loss predicts (assistant answers, and reasoning if asked)."""
        mask = self.segments == Segment.ANSWER
        return mask | (self.segments == Segment.THINKING) if train_on_thinking else mask


# ------------------------------------------------------------------------------------------------ validation
def _type_name(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), type(value).__name__)


def _check_text(value, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected a string, got {_type_name(value)}")
    for token in RESERVED_TOKENS:
        if token in value:
            raise ValueError(f"{where}: contains {token!r}, which the chat format reserves for its own markup")
    return value


def _tool_call_text(call, where: str) -> str:
    if not isinstance(call, dict):
        raise ValueError(f"{where}: expected an object with 'function' (or 'name' and 'arguments'), "
                         f"got {_type_name(call)}")
    if "function" in call:
        where, call = f"{where}.function", call["function"]
        if not isinstance(call, dict):
            raise ValueError(f"{where}: expected an object with 'name' and 'arguments', got {_type_name(call)}")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name: expected a non-empty string, got {name!r}")
    _check_text(name, f"{where}.name")
    if "arguments" not in call:
        raise ValueError(f"{where}.arguments: missing; expected an object or a JSON string")
    arguments = call["arguments"]
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}.arguments: not valid JSON ({exc})") from None
        _check_text(arguments, f"{where}.arguments")
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)  # what the template's `tojson` writes
        _check_text(arguments, f"{where}.arguments")
    else:
        raise ValueError(f"{where}.arguments: expected an object or a JSON string, got {_type_name(arguments)}")
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ' + arguments + "}"


def _split_inline_reasoning(content: str, where: str) -> tuple[str | None, str]:
    """`<think>r</think>answer` -> (r, answer); content without tags -> (None, content)."""
    if content.startswith(THINK_START) and THINK_END in content:
        reasoning, answer = content[len(THINK_START):].split(THINK_END, 1)
    else:
        reasoning, answer = None, content
    for tag in (THINK_START, THINK_END):
        if tag in (reasoning or "") or tag in answer:
            raise ValueError(f"{where}: a {tag!r} out of place; reasoning goes first, as "
                             f"'{THINK_START}...{THINK_END}' then the answer (or in 'reasoning_content')")
    return reasoning, answer


def validate_messages(messages, where: str = "messages") -> list[Message]:
    """Check a conversation and return its `Message`s; a mistake raises ValueError naming index and field."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{where}: expected an array of messages, got {_type_name(messages)}")
    if not messages:
        raise ValueError(f"{where}: empty; expected at least one message")
    checked: list[Message] = []
    for index, message in enumerate(messages):
        at = f"{where}[{index}]"
        if not isinstance(message, dict):
            raise ValueError(f"{at}: expected an object with 'role' and 'content', got {_type_name(message)}")
        unknown = [key for key in message if key not in MESSAGE_FIELDS]
        if unknown:
            raise ValueError(f"{at}.{unknown[0]}: unknown field; a message has {', '.join(MESSAGE_FIELDS)}")
        present = {key: value for key, value in message.items() if value is not None}  # None = absent (OpenAI)
        role = present.get("role")
        if role is None:
            raise ValueError(f"{at}.role: missing; expected one of {', '.join(ROLES)}")
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise ValueError(f"{at}.role: expected one of {', '.join(ROLES)}, got {role!r}")
        reasoning_keys = [key for key in REASONING_FIELDS if key in present]
        if role != "assistant":
            for key in [*reasoning_keys, *(["tool_calls"] if "tool_calls" in present else [])]:
                raise ValueError(f"{at}.{key}: only assistant messages carry {key}")
            if "content" not in present:
                raise ValueError(f"{at}.content: missing; expected a string")
            content = _check_text(present["content"], f"{at}.content")
            if role == "tool" and (not checked or checked[-1].role not in ("assistant", "tool")):
                follows = f"a {checked[-1].role} message" if checked else "nothing"
                raise ValueError(f"{at}: a tool message must follow an assistant message (or another tool "
                                 f"message); it follows {follows}")
            checked.append(Message(role, content))
            continue
        # assistant
        calls = present.get("tool_calls", [])
        if not isinstance(calls, list):
            raise ValueError(f"{at}.tool_calls: expected an array, got {_type_name(calls)}")
        tool_calls = tuple(_tool_call_text(call, f"{at}.tool_calls[{i}]") for i, call in enumerate(calls))
        if "content" not in present and not (tool_calls or reasoning_keys):
            raise ValueError(f"{at}.content: missing; expected a string (it may be left out only beside "
                             f"tool_calls or reasoning_content)")
        content = _check_text(present.get("content", ""), f"{at}.content")
        reasoning, content = _split_inline_reasoning(content, f"{at}.content")
        if reasoning_keys:
            key = reasoning_keys[0]
            if reasoning is not None:
                raise ValueError(f"{at}: reasoning given twice, in {key!r} and inline in content")
            if any(present[other] != present[key] for other in reasoning_keys):
                raise ValueError(f"{at}: {' and '.join(map(repr, reasoning_keys))} differ; give the reasoning once")
            reasoning = _check_text(present[key], f"{at}.{key}")
            for tag in (THINK_START, THINK_END):
                if tag in reasoning:
                    raise ValueError(f"{at}.{key}: contains {tag!r}; give the reasoning without the tags")
        if reasoning is not None:
            content = content.lstrip("\n")
        checked.append(Message(role, content, reasoning, tool_calls))
    return checked


# ------------------------------------------------------------------------------------------------- rendering
def tools_text(tools) -> str:
    """The tool declarations as the system turn carries them (Qwen3's and Hermes' wording, one JSON object a line)."""
    declared = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in check_tools(tools))
    return _check_text(TOOLS_HEADER + declared + TOOLS_FOOTER, "tools")


def render_chat(messages, *, add_generation_prompt: bool = False, enable_thinking: bool | None = None,
                reasoning_history: str = "last_turn", bos_token: str = BOS, tools=None) -> RenderedChat:
    """The conversation's text in the chat format, with its labelled spans (see the module docstring). `tools`:
    OpenAI-style declarations (`hybridtron.data.tools.check_tools`), rendered in the system turn after the system
    message's content, as Qwen3's template renders them."""
    if reasoning_history not in REASONING_HISTORY:
        raise ValueError(f"reasoning_history: expected one of {', '.join(REASONING_HISTORY)}, "
                         f"got {reasoning_history!r}")
    if enable_thinking not in (None, True, False):
        raise ValueError(f"enable_thinking: expected true, false or null, got {enable_thinking!r}")
    checked = validate_messages(messages)
    last_user = max((i for i, m in enumerate(checked) if m.role == "user"), default=-1)
    pieces: list[tuple[str, Segment, int]] = [(bos_token, Segment.TEMPLATE, 0)]
    skip = -1  # the system message the tools' turn already holds
    if tools:  # its spans count as the first message's, as bos does
        pieces.append((f"{IM_START}system\n", Segment.TEMPLATE, 0))
        if checked[0].role == "system":  # its content opens the system turn that declares the tools
            pieces.append((checked[0].content + "\n\n", Segment.PROMPT, 0))
            skip = 0
        pieces += [(tools_text(tools), Segment.PROMPT, 0), (f"{IM_END}\n", Segment.TEMPLATE, 0)]
    for index, message in enumerate(checked):
        def add(text: str, segment: Segment) -> None:
            pieces.append((text, segment, index))

        if index == skip:
            continue
        add(f"{IM_START}{message.role}\n", Segment.TEMPLATE)
        if message.role == "assistant":
            body = message.content
            if message.reasoning is not None and (reasoning_history == "all" or index > last_user):
                add(f"{THINK_START}\n{message.reasoning.strip(chr(10))}\n{THINK_END}", Segment.THINKING)
                body = "\n" + body
            for call in message.tool_calls:
                body += ("\n" if body else "") + f"{TOOL_CALL_START}\n{call}\n{TOOL_CALL_END}"
            add(body + IM_END, Segment.ANSWER)
            add("\n", Segment.TEMPLATE)
        elif message.role == "tool":
            add(TOOL_RESPONSE_START, Segment.TEMPLATE)
            add(f"\n{message.content}\n", Segment.PROMPT)
            add(f"{TOOL_RESPONSE_END}{IM_END}\n", Segment.TEMPLATE)
        else:
            add(message.content, Segment.PROMPT)
            add(f"{IM_END}\n", Segment.TEMPLATE)
    roles = tuple(m.role for m in checked)
    if add_generation_prompt:
        prompt = f"{IM_START}assistant\n"
        if enable_thinking is False:
            prompt += f"{THINK_START}\n\n{THINK_END}\n"
        elif enable_thinking is True:
            prompt += f"{THINK_START}\n"
        pieces.append((prompt, Segment.TEMPLATE, len(checked)))
        roles += ("assistant",)
    spans, start = [], 0
    for text, segment, index in pieces:
        if text:
            spans.append((start, start + len(text), segment, index))
            start += len(text)
    return RenderedChat("".join(text for text, _, _ in pieces), tuple(spans), roles)


def tool_turn_text(tool_contents: Sequence[str], *, enable_thinking: bool | None = None) -> str:
    """The text that follows an assistant turn's `<|im_end|>` when its calls were answered: the `tool` messages, then
    the next generation prompt; exactly what `render_chat` writes there in the whole conversation (the turn loop of
    multi-turn rollouts appends it to the tokens the model sampled)."""
    chat = render_chat([{"role": "user", "content": "-"}, {"role": "assistant", "content": "-"},
                        *({"role": "tool", "content": content} for content in tool_contents)],
                       add_generation_prompt=True, enable_thinking=enable_thinking, bos_token="")
    end = next(end for _, end, segment, index in chat.spans if index == 1 and segment == Segment.ANSWER)
    return chat.text[end:]


def tokenize_chat(tokenizer: Tokenizer, messages, **options) -> ChatTokens:
    """`render_chat(messages, **options)` encoded with `tokenizer`, each token labelled."""
    return tokenize_chats(tokenizer, [messages], **options)[0]


def tokenize_chats(tokenizer: Tokenizer, conversations: Sequence, **options) -> list[ChatTokens]:
    """Many conversations at once (the encoding runs in parallel in Rust)."""
    rendered = [render_chat(messages, bos_token=token_text(tokenizer, tokenizer.bos_id), **options)
                for messages in conversations]
    encodings = tokenizer.backend.encode_batch([r.text for r in rendered], add_special_tokens=False)
    out = []
    for chat, encoding in zip(rendered, encodings):
        span_starts = np.array([span[0] for span in chat.spans])
        token_starts = np.array([offset[0] for offset in encoding.offsets], dtype=np.int64)
        which = np.searchsorted(span_starts, token_starts, side="right") - 1
        out.append(ChatTokens(
            ids=np.asarray(encoding.ids, dtype=np.int64),
            segments=np.array([span[2] for span in chat.spans], dtype=np.uint8)[which],
            turns=np.array([span[3] for span in chat.spans], dtype=np.int32)[which],
            roles=chat.roles,
        ))
    return out


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    text = tokenizer.backend.id_to_token(token_id)
    assert text is not None, token_id
    return text


# ------------------------------------------------------------------------------------------- the Jinja twin
# Equal to `render_chat` on every valid conversation (tests/data/test_chat.py renders both through transformers).
# It validates nothing beyond the role: bad input is rejected by `validate_messages` on our side.
_HEADER = "{#- hybridtron chat format v%d (hybridtron/data/chat.py): ChatML with <think> reasoning and tool calls -#}\n"
# the system turn that declares the tools, and the loop's skip of the system message it already holds
_TOOLS_BLOCK = """\
{%- if tools -%}
  {{- '<|im_start|>system\\n' -}}
  {%- if messages[0].role in ['system', 'developer'] -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}
  {{- TOOLS_HEADER_LITERAL -}}
  {%- for tool in tools -%}{{- '\\n' + tool | tojson -}}{%- endfor -%}
  {{- TOOLS_FOOTER_LITERAL + '<|im_end|>\\n' -}}
{%- endif -%}
"""
_SKIP_SYSTEM = """\
  {%- if tools and loop.first and role == 'system' -%}{%- continue -%}{%- endif -%}
"""
_TEMPLATE_BODY = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
  {%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- set keep_all_reasoning = reasoning_history is defined and reasoning_history == 'all' -%}
{{- bos_token -}}
TOOLS_BLOCK{%- for message in messages -%}
  {%- set role = 'system' if message.role == 'developer' else message.role -%}
  {%- if role not in ['system', 'user', 'assistant', 'tool'] -%}
    {{- raise_exception('unknown role ' ~ role) -}}
  {%- endif -%}
SKIP_SYSTEM  {{- '<|im_start|>' + role + '\\n' -}}
  {%- if role == 'assistant' -%}
    {%- set content = message.content if message.content is string else '' -%}
    {%- set reasoning = none -%}
    {%- if message.reasoning_content is string -%}
      {%- set reasoning = message.reasoning_content -%}
    {%- elif content.startswith('<think>') and '</think>' in content -%}
      {%- set reasoning = content[7:].split('</think>', 1)[0] -%}
      {%- set content = content.split('</think>', 1)[1] -%}
    {%- endif -%}
    {%- generation -%}
    {%- set ns.body = content -%}
    {%- if reasoning is not none -%}
      {%- set ns.body = content.lstrip('\\n') -%}
      {%- if keep_all_reasoning or loop.index0 > ns.last_user -%}
        {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>' -}}
        {%- set ns.body = '\\n' + ns.body -%}
      {%- endif -%}
    {%- endif -%}
    {%- for call in message.tool_calls or [] -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {%- set arguments = fn.arguments if fn.arguments is string else fn.arguments | tojson -%}
      {%- set ns.body = ns.body + ('\\n' if ns.body else '') + '<tool_call>\\n{"name": ' + fn.name | tojson
          + ', "arguments": ' + arguments + '}\\n</tool_call>' -%}
    {%- endfor -%}
    {{- ns.body + '<|im_end|>' -}}
    {%- endgeneration -%}
    {{- '\\n' -}}
  {%- elif role == 'tool' -%}
    {{- '<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' -}}
  {%- else -%}
    {{- message.content + '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}
    {{- '<think>\\n\\n</think>\\n' -}}
  {%- elif enable_thinking is defined and enable_thinking is true -%}
    {{- '<think>\\n' -}}
  {%- endif -%}
{%- endif -%}
"""
CHAT_TEMPLATE = (_HEADER % 2 + _TEMPLATE_BODY.replace("TOOLS_BLOCK", _TOOLS_BLOCK).replace("SKIP_SYSTEM", _SKIP_SYSTEM)
                 .replace("TOOLS_HEADER_LITERAL", json.dumps(TOOLS_HEADER))
                 .replace("TOOLS_FOOTER_LITERAL", json.dumps(TOOLS_FOOTER)))
# The templates of earlier versions, still read as ours (a checkpoint exported before tools renders every
# conversation without tools as v2 does): v1 had no tools.
EARLIER_CHAT_TEMPLATES = (_HEADER % 1 + _TEMPLATE_BODY.replace("TOOLS_BLOCK", "").replace("SKIP_SYSTEM", ""),)


# ---------------------------------------------------------------------------------------- Hugging Face files
def save_tokenizer_files(tokenizer: Tokenizer, directory: str | os.PathLike, *,
                         model_max_length: int | None = None) -> list[Path]:
    """Write `tokenizer.json`, `tokenizer_config.json` (with `CHAT_TEMPLATE`) and `special_tokens_map.json`
    into `directory`, so that `transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(...)`
    gives `tokenize_chat`'s ids. Returns the files written."""
    directory = Path(directory)
    names = {key: token_text(tokenizer, getattr(tokenizer, f"{key}_id")) for key in ("bos", "eos", "pad")}
    # A plain consumer (`AutoTokenizer.from_pretrained(dir)(text)`, lm-eval's HF backend, vLLM's completions) adds
    # what the post-processor adds: bos, which opened every document the model was trained on (scored without it,
    # log-likelihoods move by up to 0.9 nats). hybridtron's own encoding never applies it (add_special_tokens=False);
    # the chat template writes bos itself, and transformers and vLLM encode a rendered chat without special tokens.
    backend = BackendTokenizer.from_str(tokenizer.backend.to_str())
    bos = names["bos"]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A:0", pair=f"{bos} $A:0 {bos} $B:1", special_tokens=[(bos, tokenizer.bos_id)])
    tokenizer_file = Tokenizer(backend).save(directory)
    extra = [token for token in SPECIAL_TOKENS if token_text(tokenizer, tokenizer.token_id(token))
             not in names.values()]
    special_tokens = {f"{key}_token": name for key, name in names.items()}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens,
        "extra_special_tokens": extra,
        "add_bos_token": True,  # tokenizer.json's post-processor adds it (above)
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    written = [tokenizer_file]
    for name, content in (("tokenizer_config.json", config),
                          ("special_tokens_map.json", {**special_tokens, "additional_special_tokens": extra})):
        atomic_write_text(directory / name, json.dumps(content, indent=2, ensure_ascii=False) + "\n")
        written.append(directory / name)
    return written


def load_chat_tokenizer(directory: str | os.PathLike, *, vocab_size: int | None = None,
                        require_template: bool = False) -> Tokenizer:
    """The tokenizer of a model directory, checked for chat: raises ValueError when its vocabulary lacks the chat
    tokens (or has them past the model's `vocab_size`), when it declares a chat template other than ours, or,
    with `require_template`, when it declares none (a base model that was never fine-tuned for chat)."""
    directory = Path(directory)
    tokenizer = Tokenizer.load(directory)
    appended = [token for token in CHAT_TOKENS if token in tokenizer.appended_special_tokens]
    if appended:
        raise ValueError(f"{directory}/tokenizer.json has no {', '.join(map(repr, appended))} token"
                         f"{'s' if len(appended) > 1 else ''}: the model was not trained with hybridtron's chat "
                         f"format and cannot be fine-tuned or served in it")
    if vocab_size is not None:
        beyond = [token for token in CHAT_TOKENS if tokenizer.token_id(token) >= vocab_size]
        if beyond:
            raise ValueError(f"{directory}: token {beyond[0]!r} has id {tokenizer.token_id(beyond[0])}, beyond the "
                             f"model's vocab_size {vocab_size}; the tokenizer and the model do not match")
    template, source = declared_chat_template(directory)
    if template is None:
        if require_template:
            raise ValueError(f"{directory}: no chat template (no chat_template in tokenizer_config.json or "
                             f"chat_template.jinja); this is a base model: fine-tune it with `hybridtron sft` "
                             f"first, whose export writes the template")
    elif template != CHAT_TEMPLATE and template not in EARLIER_CHAT_TEMPLATES:
        raise ValueError(f"{source}: a chat template other than hybridtron's (it starts "
                         f"{template[:60]!r}); hybridtron renders conversations only in its own format "
                         f"(hybridtron.data.chat), so this model's chats would be read in the wrong layout")
    return tokenizer


def declared_chat_template(directory: str | os.PathLike) -> tuple[str | None, Path | None]:
    """The chat template a model directory declares, and the file it is in: `chat_template.jinja` (what
    transformers 5 writes) or `tokenizer_config.json`'s `chat_template`; (None, None) if neither."""
    directory = Path(directory)
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), jinja
    config_file = directory / "tokenizer_config.json"
    if not config_file.is_file():
        return None, None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_file}: not valid JSON ({exc})") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{config_file}: chat_template must be a string, got {_type_name(template)}")
    return template, (config_file if template is not None else None)
