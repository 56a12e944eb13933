"""Tool calling through the OpenAI API, with the official `openai` client against the server over loopback: tools
rendered into the prompt by the chat template, `tool_calls` parsed from the model's text as vLLM's Hermes parser
parses them (content before the calls, nothing after), streamed as tool_calls deltas, a call that does not parse
returned as text, and tool_choice "required" / a named function enforced by a guided prefix."""

import json

import pytest
import torch
from test_server import END, MODEL, FakeEngine, FakeHandle, serving
from test_server_engine import openai_client
from test_server_engine import serving as engine_serving

from hybridtron.data.chat import render_chat
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.data.tools import function_tool
from hybridtron.infer.engine import HybridEngine
from hybridtron.infer.server import create_app
from hybridtron.model.lm import HybridLM

openai = pytest.importorskip("openai")

WEATHER = function_tool("get_weather", "The weather in a city.",
                        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
CLOCK = function_tool("get_time", "The time in a zone.", {"type": "object", "properties": {"tz": {"type": "string"}}})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
SCRIPTS = {  # the last user message -> what the fake model writes
    "weather?": "Let me check.\n" + CALL,
    "both?": CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>\ntrailing',
    "broken?": '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
    "plain?": "Just text, no call.",
    "required?": '{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>',  # after the prefix
    "named?": '{"city": "Bern"}}\n</tool_call>',  # after the prefix naming get_weather
}


class ScriptedHandle(FakeHandle):
    def tokens(self):
        prompt = self.engine.decode(self.prompt_ids)
        question = prompt.rsplit("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0]
        for token in self.engine.encode(SCRIPTS[question]):
            yield token, None
        yield END, "stop"


class ToolEngine(FakeEngine):
    """The fake engine of test_server.py with the real chat template and a scripted reply per question."""

    max_context = 4096

    def __init__(self):
        super().__init__()
        self.prompts = []

    def chat_template(self, messages, tools=None):
        return render_chat(messages, tools=tools, add_generation_prompt=True).text

    def submit_samples(self, prompt_ids, params, n, *, first_sample=0, logprobs=None, request_id=None):
        self.prompts.append(self.decode(prompt_ids))
        return [ScriptedHandle(self, prompt_ids, params) for _ in range(n)]


@pytest.fixture(scope="module")
def served():
    engine = ToolEngine()
    with serving(create_app(engine)) as base:
        http_client = openai.DefaultHttpxClient(trust_env=False)
        yield engine, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=20,
                                    http_client=http_client)


def ask(client, question, **options):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                          tools=[WEATHER, CLOCK], **options)


def streamed(client, question, **options):
    """(content, tool calls by index as {id, name, arguments}, finish reason) accumulated from the stream."""
    content, calls, finish = "", {}, None
    for chunk in ask(client, question, stream=True, **options):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            entry["name"] += (call.function.name or "") if call.function else ""
            entry["arguments"] += (call.function.arguments or "") if call.function else ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_tools_reach_the_prompt_and_calls_come_back(served):
    engine, client = served
    response = ask(client, "weather?")
    assert json.dumps(WEATHER, ensure_ascii=False) in engine.prompts[-1]  # declared by the chat template
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"  # the text before the call, as vLLM's parser keeps it
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Zürich"}


def test_several_calls_and_text_after_them(served):
    _, client = served
    choice = ask(client, "both?").choices[0]
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"]
    assert choice.message.content is None  # nothing before the first call; "trailing" is dropped, as in vLLM
    assert len({c.id for c in choice.message.tool_calls}) == 2


def test_a_call_that_does_not_parse_is_text(served):
    _, client = served
    for question in ("broken?", "plain?"):
        choice = ask(client, question).choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert choice.message.content == SCRIPTS[question]
        content, calls, finish = streamed(client, question)
        assert (content, calls, finish) == (SCRIPTS[question], {}, "stop")


def test_streamed_tool_calls(served):
    _, client = served
    content, calls, finish = streamed(client, "both?")
    assert content == "" and finish == "tool_calls"
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[1]["arguments"]) == {"tz": "CET"} and all(c["id"] for c in calls.values())
    content, calls, _ = streamed(client, "weather?")
    assert content == "Let me check.\n" and json.loads(calls[0]["arguments"]) == {"city": "Zürich"}


def test_tool_choice_none_returns_the_text(served):
    _, client = served
    choice = ask(client, "weather?", tool_choice="none").choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == SCRIPTS["weather?"]


def test_required_and_named_tool_choice_prefill_the_call(served):
    engine, client = served
    choice = ask(client, "required?", tool_choice="required").choices[0]
    assert engine.prompts[-1].endswith("<|im_start|>assistant\n<tool_call>\n")
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = ask(client, "named?", tool_choice=named).choices[0]
    assert engine.prompts[-1].endswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Bern"}
    _, calls, finish = streamed(client, "named?", tool_choice=named)
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather"


def test_a_tool_conversation_continues(served):
    engine, client = served
    first = ask(client, "weather?").choices[0].message
    messages = [{"role": "user", "content": "weather?"}, first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny"},
                {"role": "user", "content": "plain?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert reply.choices[0].message.content == SCRIPTS["plain?"]
    assert "<tool_response>\nsunny\n</tool_response>" in engine.prompts[-1] and CALL in engine.prompts[-1]


@pytest.mark.parametrize("options, message", [
    ({"tool_choice": "required", "tools": None}, "tool_choice: 'required' needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "function 'nope' is not among"),
    ({"tool_choice": "sometimes"}, "tool_choice: expected one of none, auto, required"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, r"tools\[0\]\.function\.name"),
    ({"tools": [{"type": "retrieval"}]}, r"tools\[0\]: expected"),
])
def test_bad_tool_requests_are_400(served, options, message):
    _, client = served
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER], **options}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(openai.BadRequestError, match=message) as raised:
        client.chat.completions.create(**body)
    assert raised.value.body["param"] in ("tools", "tool_choice")


# ------------------------------------------------------------------------------------------ the real engine
@pytest.fixture(scope="module")
def engine(small_config):
    """A tiny random model with room for the tools' system turn (about 500 tokens of a 512-token vocabulary)."""
    torch.manual_seed(0)
    model = HybridLM(small_config(vocab_size=512, max_position_embeddings=1024, initializer_range=0.05)).eval()
    tokenizer = Tokenizer.train([json.dumps(WEATHER) + "\nweather?\n"] * 20, vocab_size=512)
    return HybridEngine(model, tokenizer, model_name="tiny", speculative=False, max_slots=2)


def test_real_engine_with_tools_never_fails(engine):
    """hybridtron's engine renders the tools with its chat template; its (random) model's text after the
    "required" prefix does not parse, so it comes back as text, the prefix included, streamed or not."""
    with engine_serving(create_app(engine)) as (_, base):
        client = openai_client(base)
        request = dict(model=engine.model_name, messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER],
                       tool_choice="required", max_tokens=8, temperature=0)
        choice = client.chat.completions.create(**request).choices[0]
        assert choice.message.content.startswith("<tool_call>\n") and not choice.message.tool_calls
        assert choice.finish_reason in ("stop", "length")
        content = "".join(chunk.choices[0].delta.content or "" for chunk in
                          client.chat.completions.create(**request, stream=True) if chunk.choices)
        assert content == choice.message.content
    assert json.dumps(WEATHER) in engine.chat_template([{"role": "user", "content": "x"}], tools=[WEATHER])
