"""The chat format: exact renderings, per-token segments, validation errors, the Hugging Face files and
`apply_chat_template` parity (transformers reads the exported `chat_template` and must give our ids)."""

from __future__ import annotations

import json
import os
import stat

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from hybridtron.data.chat import (
    CHAT_TEMPLATE, Segment, load_chat_tokenizer, render_chat, save_tokenizer_files, tokenize_chat,
    validate_messages,
)
from hybridtron.data.tokenizer import Tokenizer

TEXTS = ["What is 2 + 3? The answer is 5.\n", "def add(a, b):\n    return a + b\n", "naïve café, 日本語\n",
         "Let me think step by step: 2 + 3 = 5.\n", '{"city": "Paris", "unit": "celsius"}\n'] * 20

THINKING_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<think>\n2 + 3 = 5\n</think>\n\nThe answer is 5."},
]
MULTI_TURN = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "reasoning_content": "add them", "content": "5"},
    {"role": "user", "content": "And 2 + 4?"},
    {"role": "assistant", "reasoning": "add again", "content": "6"},  # the alias transformers also reads
]
TOOL_CHAT = [
    {"role": "developer", "content": "You can call get_weather."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        {"name": "get_time", "arguments": '{"tz": "CET"}'}]},
    {"role": "tool", "tool_call_id": "1", "content": "sunny, 21 C"},
    {"role": "tool", "content": "14:00"},
    {"role": "assistant", "content": "Sunny and 21 C at 14:00."},
]
WHITESPACE_CHAT = [{"role": "user", "content": "\n\n  indented"}, {"role": "assistant", "content": "\n\n  code"}]
CONVERSATIONS = {"thinking": THINKING_CHAT, "multi_turn": MULTI_TURN, "tool": TOOL_CHAT,
                 "whitespace": WHITESPACE_CHAT, "prompt_only": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(TEXTS, vocab_size=512)


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer, tmp_path_factory):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("hf_tokenizer")
    save_tokenizer_files(tokenizer, directory, model_max_length=4096)
    return AutoTokenizer.from_pretrained(directory)


def test_render_thinking_conversation_exactly():
    chat = render_chat(THINKING_CHAT, add_generation_prompt=False)
    assert chat.text == ("<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n2 + 3 = 5\n</think>\nThe answer is 5.<|im_end|>\n")
    by_segment = {}
    for start, end, segment, _ in chat.spans:
        by_segment.setdefault(segment, []).append(chat.text[start:end])
    assert by_segment[Segment.THINKING] == ["<think>\n2 + 3 = 5\n</think>"]
    assert by_segment[Segment.ANSWER] == ["\nThe answer is 5.<|im_end|>"]
    assert by_segment[Segment.PROMPT] == ["Be brief.", "What is 2 + 3?"]
    # the same message with the reasoning in its own field renders the same
    fielded = [*THINKING_CHAT[:2],
               {"role": "assistant", "reasoning_content": "2 + 3 = 5", "content": "The answer is 5."}]
    assert render_chat(fielded).text == chat.text


def test_reasoning_history_and_enable_thinking():
    last = render_chat(MULTI_TURN, add_generation_prompt=False).text
    assert "<think>\nadd them" not in last and "<think>\nadd again\n</think>\n6<|im_end|>" in last
    assert "<|im_start|>assistant\n5<|im_end|>" in last  # the earlier turn keeps its answer only
    assert "<think>\nadd them\n</think>\n5" in render_chat(MULTI_TURN, reasoning_history="all").text
    prompt = MULTI_TURN[:3]
    assert render_chat(prompt, add_generation_prompt=True).text.endswith("<|im_start|>assistant\n")
    assert render_chat(prompt, add_generation_prompt=True, enable_thinking=False).text.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n")
    assert render_chat(prompt, add_generation_prompt=True, enable_thinking=True).text.endswith(
        "<|im_start|>assistant\n<think>\n")
    # an empty reasoning block is how a non-reasoning answer renders (as the enable_thinking=False prompt)
    empty = render_chat([MULTI_TURN[0], {"role": "assistant", "reasoning_content": "", "content": "5"}]).text
    assert empty.endswith("<|im_start|>assistant\n<think>\n\n</think>\n5<|im_end|>\n")


def test_tool_calls_and_tool_responses():
    text = render_chat(TOOL_CHAT).text
    assert text.startswith("<|bos|><|im_start|>system\nYou can call get_weather.<|im_end|>\n")  # developer = system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call><|im_end|>\n'
            in text)
    assert ("<|im_start|>tool\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
            "<|im_start|>tool\n<tool_response>\n14:00\n</tool_response><|im_end|>\n" in text)


def test_token_segments(tokenizer):
    chat = tokenize_chat(tokenizer, THINKING_CHAT)
    assert list(chat.ids) == tokenizer.encode(render_chat(THINKING_CHAT).text)  # one encoding of the whole text
    assert chat.ids[0] == tokenizer.bos_id and chat.segments[0] == Segment.TEMPLATE

    def text_of(mask):
        return tokenizer.decode(chat.ids[mask])

    assert text_of(chat.segments == Segment.THINKING) == "<think>\n2 + 3 = 5\n</think>"
    assert text_of(chat.segments == Segment.ANSWER) == "\nThe answer is 5.<|im_end|>"
    assert text_of(chat.trained(False)) == "\nThe answer is 5.<|im_end|>"
    assert text_of(chat.trained(True)) == "<think>\n2 + 3 = 5\n</think>\nThe answer is 5.<|im_end|>"
    assert [chat.roles[t] for t in chat.turns[chat.segments == Segment.PROMPT]][0] == "system"
    assert set(chat.turns[chat.segments == Segment.ANSWER]) == {2}
    prompt = tokenize_chat(tokenizer, THINKING_CHAT[:2], add_generation_prompt=True)
    assert prompt.roles[-1] == "assistant" and not prompt.trained(True).any()


@pytest.mark.parametrize("messages, error", [
    ([], r"messages: empty; expected at least one message"),
    ("hi", r"messages: expected an array of messages, got string"),
    (["hi"], r"messages\[0\]: expected an object with 'role' and 'content', got string"),
    ([{"content": "hi"}], r"messages\[0\].role: missing; expected one of system, user, assistant, tool"),
    ([{"role": "bot", "content": "hi"}], r"messages\[0\].role: expected one of .*, got 'bot'"),
    ([{"role": "user"}], r"messages\[0\].content: missing; expected a string"),
    ([{"role": "user", "content": ["a"]}], r"messages\[0\].content: expected a string, got array"),
    ([{"role": "user", "content": "a"}, {"role": "assistant"}], r"messages\[1\].content: missing"),
    ([{"role": "user", "content": "hi", "contnet": "x"}], r"messages\[0\].contnet: unknown field"),
    ([{"role": "user", "content": "a <|im_end|> b"}], r"messages\[0\].content: contains '<\|im_end\|>'"),
    ([{"role": "tool", "content": "42"}], r"messages\[0\]: a tool message must follow an assistant .* follows nothing"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "42"}], r"messages\[1\]: .*follows a user message"),
    ([{"role": "user", "content": "a", "reasoning_content": "r"}], r"messages\[0\].reasoning_content: only assistant"),
    ([{"role": "assistant", "content": "<think>unclosed"}], r"messages\[0\].content: a '<think>' out of place"),
    ([{"role": "assistant", "content": "x <think>r</think> y"}], r"messages\[0\].content: a '<think>' out of place"),
    ([{"role": "assistant", "content": "<think>r</think>y", "reasoning_content": "r"}], r"reasoning given twice"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}],
     r"messages\[0\].tool_calls\[0\].function.arguments: missing"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": "{bad"}]}],
     r"messages\[0\].tool_calls\[0\].arguments: not valid JSON"),
])
def test_bad_messages_name_index_and_field(messages, error):
    with pytest.raises(ValueError, match=error):
        validate_messages(messages)


def test_render_options_are_checked():
    with pytest.raises(ValueError, match="reasoning_history: expected one of last_turn, all"):
        render_chat(MULTI_TURN, reasoning_history="first")


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_apply_chat_template_gives_our_ids(tokenizer, hf_tokenizer, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    for options in ({}, {"enable_thinking": False}, {"enable_thinking": True}, {"reasoning_history": "all"}):
        ours = tokenize_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt, **options)
        text = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=add_generation_prompt, **options)
        assert text == render_chat(messages, add_generation_prompt=add_generation_prompt, **options).text
        ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                               add_generation_prompt=add_generation_prompt, **options)
        assert list(ids) == ours.ids.tolist(), options
    # the template's {% generation %} block marks exactly the assistant tokens (what TRL's assistant-only loss reads)
    marked = hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
    assert marked["assistant_masks"] == tokenize_chat(tokenizer, messages).trained(True).astype(int).tolist()


def test_tokenizer_files(tokenizer, tmp_path):
    written = save_tokenizer_files(tokenizer, tmp_path / "hf", model_max_length=4096)
    assert sorted(p.name for p in written) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert config["model_max_length"] == 4096 and "<|im_start|>" in config["extra_special_tokens"]
    umask = os.umask(0)
    os.umask(umask)
    for path in written:  # published files: readable as a plain open() would make them, not the temp file's 0o600
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
    assert load_chat_tokenizer(tmp_path / "hf", vocab_size=tokenizer.vocab_size,
                               require_template=True).fingerprint == tokenizer.fingerprint


def test_exported_tokenizer_adds_bos_once(tokenizer, hf_tokenizer):
    """A plain HF consumer gets the bos the model was trained with; hybridtron's encoding and the chat template
    (rendered, then encoded without special tokens) do not get a second one."""
    text = "def parse(x):"
    assert hf_tokenizer(text).input_ids == [tokenizer.bos_id] + tokenizer.encode(text)
    assert hf_tokenizer(text, add_special_tokens=False).input_ids == tokenizer.encode(text)
    chat = hf_tokenizer.apply_chat_template(MULTI_TURN, tokenize=True, return_dict=False)
    assert list(chat).count(tokenizer.bos_id) == 1 and chat[0] == tokenizer.bos_id


def test_models_without_our_chat_format_are_refused(tokenizer, tmp_path):
    base = tmp_path / "base"
    tokenizer.save(base)  # a pretrained model: tokenizer.json only
    assert load_chat_tokenizer(base).vocab_size == tokenizer.vocab_size  # fine to fine-tune
    with pytest.raises(ValueError, match="no chat template .* fine-tune it with `hybridtron sft` first"):
        load_chat_tokenizer(base, require_template=True)
    with pytest.raises(ValueError, match="beyond the model's vocab_size 10"):
        load_chat_tokenizer(base, vocab_size=10)

    foreign = tmp_path / "foreign"
    save_tokenizer_files(tokenizer, foreign)
    (foreign / "chat_template.jinja").write_text("{% for m in messages %}[INST] {{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="chat_template.jinja: a chat template other than hybridtron's"):
        load_chat_tokenizer(foreign)

    vocab = {chr(c): i for i, c in enumerate(range(97, 123))} | {"<s>": 26, "</s>": 27, "<pad>": 28}
    backend = BackendTokenizer(models.WordLevel(vocab, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "plain").mkdir()
    backend.save(str(tmp_path / "plain" / "tokenizer.json"))
    with pytest.raises(ValueError, match="has no '<\\|im_start\\|>', '<\\|im_end\\|>', .* tokens: the model was not"):
        load_chat_tokenizer(tmp_path / "plain")
