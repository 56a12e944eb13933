"""Tools in the chat format: the system turn that declares them equals transformers' `apply_chat_template(...,
tools=...)` on the exported tokenizer, token for token; checkpoints exported before tools are still read as ours."""

from __future__ import annotations

import hashlib
import json

import pytest

from hybridtron.data.chat import (
    CHAT_TEMPLATE, EARLIER_CHAT_TEMPLATES, load_chat_tokenizer, render_chat, save_tokenizer_files, tokenize_chat,
)
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.data.tools import function_tool

TOOLS = [function_tool("python", "Run Python; prints come back.",
                       {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}),
         function_tool("get_weather", "Weather in a city (°C).",
                       {"type": "object", "properties": {"city": {"type": "string"}}})]
WITH_SYSTEM = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "What is 2 ** 70?"},
    {"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "python", "arguments": '{"code": "print(2**70)"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "1180591620717411303424"},
    {"role": "assistant", "content": "1180591620717411303424"},
]
WITHOUT_SYSTEM = [{"role": "user", "content": "Weather in Zürich?"}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    tokenizer = Tokenizer.train(["def f(x):\n    return x\n", "What is 2 ** 70? {\"code\": 1}\n"] * 20, vocab_size=512)
    directory = tmp_path_factory.mktemp("hf")
    save_tokenizer_files(tokenizer, directory)
    return tokenizer, AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("messages", [WITH_SYSTEM, WITHOUT_SYSTEM], ids=["system", "no_system"])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_tools_render_as_transformers_does(tokenizers, messages, add_generation_prompt):
    tokenizer, hf = tokenizers
    ours = render_chat(messages, tools=TOOLS, add_generation_prompt=add_generation_prompt).text
    assert ours == hf.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                          add_generation_prompt=add_generation_prompt)
    ids = hf.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=False,
                                 add_generation_prompt=add_generation_prompt)
    assert list(ids) == tokenize_chat(tokenizer, messages, tools=TOOLS,
                                      add_generation_prompt=add_generation_prompt).ids.tolist()


def test_tools_system_turn_layout():
    text = render_chat(WITH_SYSTEM[:2], tools=TOOLS).text
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|bos|><|im_start|>system\nUse the tools.\n\n# Tools\n")
    declared = system.split("<tools>\n", 1)[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in declared] == TOOLS  # one declaration a line, as given
    assert text.count("Use the tools.") == 1  # the system message is not rendered twice
    assert render_chat(WITH_SYSTEM[:2], tools=[]).text == render_chat(WITH_SYSTEM[:2]).text
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.name: expected 1-64"):
        render_chat(WITHOUT_SYSTEM, tools=[function_tool("bad name", "", {})])


def test_templates_exported_before_tools_are_still_ours(tmp_path):
    """v1 (no tools) is the template every checkpoint exported before tools carries, byte for byte."""
    (v1,) = EARLIER_CHAT_TEMPLATES
    assert hashlib.sha256(v1.encode()).hexdigest() == "1df083a2ec971a1a3fa48fc528d6b628e0b9d6de2e790cc300dd3bc01ab13fa0"
    assert v1 != CHAT_TEMPLATE
    tokenizer = Tokenizer.train(["hello world\n"] * 20, vocab_size=512)
    save_tokenizer_files(tokenizer, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": v1}))
    assert load_chat_tokenizer(tmp_path, require_template=True).fingerprint == tokenizer.fingerprint
