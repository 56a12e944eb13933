"""SFT conversations that carry `tools`: the declarations are rendered into the system turn as at inference (and are
never trained), conversations with and without tools tokenize side by side in their order, a conversation without
tools keeps its hash (so existing data split and resume as before), and a bad declaration names its line."""

from __future__ import annotations

import hashlib
import json

import pytest

from hybridtron.data.chat import tokenize_chat
from hybridtron.data.sft import conversations_from, tokenize_conversations
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.data.tools import function_tool
from hybridtron.model.lm import IGNORE_INDEX

TOOL = function_tool("echo", "Echo the text.", {"type": "object", "properties": {"text": {"type": "string"}}})
CALL = '<tool_call>\n{"name": "echo", "arguments": {"text": "hi"}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "Say hi through the tool."}, {"role": "assistant", "content": CALL},
            {"role": "tool", "content": "hi"}, {"role": "assistant", "content": "It said hi."}]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train([json.dumps(TOOL), CALL, "Say hi through the tool. It said hi."] * 20, vocab_size=512)


def test_tools_are_rendered_in_order_and_never_trained(tokenizer):
    records = [{"messages": MESSAGES, "tools": [TOOL]}, {"messages": MESSAGES}, {"messages": MESSAGES[:2],
                                                                                 "tools": [TOOL]}]
    store = tokenize_conversations(conversations_from(records), tokenizer, seq_len=4096)
    for i, record in enumerate(records):
        chat = tokenize_chat(tokenizer, record["messages"], tools=record.get("tools"))
        ids = store.ids[store.offsets[i]:store.offsets[i + 1]]
        assert ids.tolist() == chat.ids.tolist()
        assert ("# Tools" in tokenizer.decode(ids.tolist())) == ("tools" in record)
        labels = store.labels[store.offsets[i]:store.offsets[i + 1]]
        assert labels[:-1][labels[:-1] != IGNORE_INDEX].tolist() == chat.ids[1:][chat.trained()[1:]].tolist()
    # the same messages with tools are another conversation; without, the hash is that of the messages alone
    assert store.keys[0] != store.keys[1]
    assert store.keys[1] == hashlib.sha256(json.dumps(MESSAGES, sort_keys=True).encode()).hexdigest()


def test_a_bad_declaration_names_its_line(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": MESSAGES, "tools": [{"name": "echo"}]}) + "\n")
    with pytest.raises(ValueError, match=r"chats.jsonl line 1: tools\[0\]: expected \{'type': 'function'"):
        conversations_from(path)
