"""Tool calls in the chat format: the tool declarations a conversation carries, and the calls parsed back out of a
model's text, Hermes/Qwen3-style (what `hybridtron.data.chat` renders and what vLLM's `hermes` tool parser reads):

    <tool_call>
    {"name": "python", "arguments": {"code": "print(2 ** 64)"}}
    </tool_call>

`parse_tool_calls` follows vLLM's `Hermes2ProToolParser.extract_tool_calls` (vllm 0.32,
vllm/tool_parsers/hermes_tool_parser.py): every `<tool_call>...</tool_call>` region (and a last one left open at the
end of the text) is one JSON object with `name` and `arguments`; the content is the text before the first
`<tool_call>` (None where empty), and text after the calls is dropped; if any region fails to parse, there are no
calls and the whole text is the content. Beyond vLLM, a region must hold an object whose `name` is a non-empty string
and whose `arguments` is an object (vLLM accepts whatever JSON holds a "name"), since a caller runs these calls.
`ContentStream` is the streaming half: the content that may be sent before the calls, holding back a suffix that
could open a `<tool_call>` tag (vLLM's `_extract_content`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from hybridtron.data.tokenizer import TOOL_CALL_END, TOOL_CALL_START

TOOL_CALL_REGEX = re.compile(re.escape(TOOL_CALL_START) + "(.*?)" + re.escape(TOOL_CALL_END) + "|"
                             + re.escape(TOOL_CALL_START) + "(.*)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]

    def arguments_json(self) -> str:
        """The arguments as OpenAI's API carries them (a JSON string; vLLM's `json.dumps(..., ensure_ascii=False)`)."""
        return json.dumps(self.arguments, ensure_ascii=False)

    def as_message_call(self) -> dict[str, Any]:
        """The call as an assistant message's `tool_calls` entry (what `hybridtron.data.chat` renders back)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedOutput:
    """A model's text split into content and calls. `calls` is empty when no `<tool_call>` was written;
    `malformed` is the reason a written call did not parse (then `calls` is empty and `content` the whole text)."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()
    malformed: str | None = None


def _one_call(body: str) -> ToolCall:
    value = json.loads(body)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object with name and arguments, got {type(value).__name__}")
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        raise ValueError(f"'name' must be a non-empty string, got {name!r:.60}")
    if not isinstance(arguments, dict):
        raise ValueError(f"'arguments' must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> ParsedOutput:
    """The calls in a model's text, as vLLM's Hermes parser reads them (see the module docstring)."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return ParsedOutput(text)
    calls = []
    for closed, open_ in TOOL_CALL_REGEX.findall(text):
        try:
            calls.append(_one_call(closed or open_))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            return ParsedOutput(text, (), f"call {len(calls)}: {exc}")
    return ParsedOutput(text[:start] or None, tuple(calls))


def partial_tag_overlap(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag` (a tag that may still be
    arriving)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ContentStream:
    """The content of a streamed output that can be sent now: everything before the first `<tool_call>`, less a
    suffix that may be the start of one; what comes from the tag on is held for `parse_tool_calls` at the end."""

    def __init__(self, text: str = ""):
        self.text, self.sent = text, 0

    def push(self, delta: str) -> str:
        self.text += delta
        start = self.text.find(TOOL_CALL_START)
        sendable = start if start >= 0 else len(self.text) - partial_tag_overlap(self.text, TOOL_CALL_START)
        out, self.sent = self.text[self.sent:sendable], max(self.sent, sendable)
        return out

    def held(self) -> str:
        """The text not sent yet (from the first `<tool_call>` on, or a partial tag)."""
        return self.text[self.sent:]


def check_tools(tools, where: str = "tools") -> list[dict[str, Any]]:
    """Tool declarations as the chat template renders them: OpenAI's `{"type": "function", "function": {"name",
    "description", "parameters"}}` objects (rendered as given, one JSON object a line, as Qwen3's template does).
    ValueError names the index and field of a bad one."""
    if not isinstance(tools, (list, tuple)):
        raise ValueError(f"{where}: expected an array of tool declarations, got {type(tools).__name__}")
    names = set()
    for index, tool in enumerate(tools):
        at = f"{where}[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f"{at}: expected {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}, "
                             f"got {str(tool)[:80]}")
        name = tool["function"].get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ValueError(f"{at}.function.name: expected 1-64 letters, digits, '_' or '-', got {name!r:.60}")
        if name in names:
            raise ValueError(f"{at}.function.name: {name!r} is declared twice")
        names.add(name)
        parameters = tool["function"].get("parameters", {})
        if not isinstance(parameters, dict):
            raise ValueError(f"{at}.function.parameters: expected a JSON schema object, got "
                             f"{type(parameters).__name__}")
        try:
            json.dumps(tool)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{at}: not JSON ({exc})") from None
    return list(tools)


def function_tool(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-style tool declaration."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
