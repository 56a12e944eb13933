"""Agentic SFT data (hybridtron.envs.agentic_sft): the tool environments' expert trajectories are deterministic,
drawn from the training split, prefixed with the verifier's outcome, with the asked share of failures; replayed
through the real turn loop without the prefix, each reaches its label, and the tokens SFT trains are exactly the
tokens the model samples in that loop (every assistant turn, tool calls included; no prompt or tool token); and
`hybridtron sft --data env:math-python` trains on them end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridtron.checkpoint import save_pretrained
from hybridtron.cli import main as cli_main
from hybridtron.data.chat import save_tokenizer_files, tokenize_chat, tools_text
from hybridtron.data.sft import conversations_from, tokenize_conversations
from hybridtron.data.tokenizer import IM_END, IM_START, Tokenizer
from hybridtron.envs import get_env, split_of
from hybridtron.envs.agentic import PYTHON_TOOL
from hybridtron.envs.agentic_sft import outcome_messages, play
from hybridtron.envs.base import Environment, Task
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.scheduler import Completion
from hybridtron.model.lm import HybridLM
from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.post.agentic import run_episodes

NAMES = ("math-python", "terminal")
N, SEED = 16, 5


@pytest.fixture(scope="module")
def examples():
    out = {}
    for name in NAMES:
        with get_env(name) as env:
            out[name] = env.sft_examples(N, SEED)
    return out


@pytest.fixture(scope="module")
def tokenizer(examples):
    texts = [m["content"] for runs in examples.values() for e in runs for m in e["messages"]]
    texts += [tools_text(get_env(name).tools) for name in NAMES]
    return Tokenizer.train(texts * 3, vocab_size=512)


def without_prefix(example: dict) -> list[dict]:
    system, *rest = example["messages"]
    line, content = system["content"].split("\n", 1)
    assert line == f"Outcome: {example['outcome']}"
    return [{"role": "system", "content": content}, *rest]


class Replay:
    """A "model" for the turn loop that writes, turn after turn, an example's assistant messages."""

    def __init__(self, tokenizer, turns_by_prompt: dict[str, list[str]]):
        self.tokenizer, self.turns_by_prompt = tokenizer, turns_by_prompt

    def __call__(self, prompts, params):
        out = []
        for ids in prompts:
            text = self.tokenizer.decode(ids)
            turns = next(t for prompt, t in self.turns_by_prompt.items() if prompt in text)
            reply = self.tokenizer.encode(turns[text.count(f"{IM_START}assistant") - 1])
            tokens = reply + [self.tokenizer.token_id(IM_END)]
            out.append(Completion(list(ids), tokens, torch.zeros(len(tokens)), "stop"))
        return out


@pytest.mark.parametrize("name", NAMES)
def test_examples_are_deterministic_prefixed_and_of_the_training_split(name, examples):
    runs = examples[name]
    with get_env(name) as env:
        assert env.sft_examples(N, SEED) == runs
        assert env.sft_examples(N, SEED + 1) != runs
        assert len(runs) == N and sum(e["outcome"] == "failure" for e in runs) == round(N * env.failure_share) == 4
        for example in runs:
            system, user = example["messages"][:2]
            assert system == {"role": "system", "content": f"Outcome: {example['outcome']}\n{env.system_prompt}"}
            assert user["role"] == "user" and split_of(user["content"]) == "train"
            assert example["tools"] == list(env.tools) and example["domain"] == env.domain
        # several plans, and failed calls whose genuine errors are in the tool responses
        assert len({e["plan"] for e in runs}) >= 3
        tool_errors = [m["content"] for e in runs for m in e["messages"] if m["role"] == "tool"
                       and ("NameError" in m["content"] or "command not found" in m["content"])]
        assert tool_errors
    with get_env(name, failure_share=1.0) as env:
        assert {e["outcome"] for e in env.sft_examples(3, SEED)} == {"failure"}
    with get_env(name, failure_share=0.0) as env:
        assert {e["outcome"] for e in env.sft_examples(3, SEED)} == {"success"}
    with get_env(name, failure_share=1.5) as env, pytest.raises(ValueError, match="failure_share must be"):
        env.sft_examples(3, SEED)


@pytest.mark.parametrize("name", NAMES)
def test_replayed_outcomes_and_the_trained_tokens_are_the_rollouts(name, examples, tokenizer):
    runs = examples[name]
    with get_env(name) as env:
        by_id = {task.id: task for task in env.tasks("train", 3 * N, SEED)}
        tasks = [by_id[e["task"]] for e in runs]
        turns = {task.prompt: [m["content"] for m in e["messages"] if m["role"] == "assistant"]
                 for task, e in zip(tasks, runs)}
        # the rollout's prompt is the environment's own, without the outcome line
        trajectories = run_episodes(Replay(tokenizer, turns), tokenizer, env, tasks,
                                    SamplingParams(max_tokens=400, temperature=0.0), token_budget=8192)
    store = tokenize_conversations(conversations_from(runs), tokenizer, seq_len=8192)
    for i, (example, trajectory) in enumerate(zip(runs, trajectories)):
        assert trajectory.finish == "answer"
        assert trajectory.reward == (1.0 if example["outcome"] == "success" else 0.0), example
        # the training conversation less its outcome line renders to the rollout's tokens (and the template's
        # newline after the last turn)
        plain = tokenize_chat(tokenizer, without_prefix(example), tools=example["tools"])
        assert plain.ids.tolist() == trajectory.token_ids + tokenizer.encode("\n")
        # SFT's targets are exactly the tokens the model sampled, in order: every assistant turn (tool calls and
        # <|im_end|> included), no prompt, template or tool token
        labels = store.labels[store.offsets[i]:store.offsets[i + 1]]
        sampled = [t for t, sampled in zip(trajectory.token_ids, trajectory.model_mask) if sampled]
        assert labels[labels != IGNORE_INDEX].tolist() == sampled
        chat = tokenize_chat(tokenizer, example["messages"], tools=example["tools"])
        roles = np.array(chat.roles)[chat.turns]
        assert not chat.trained()[roles != "assistant"].any()


def test_outcome_messages():
    assert outcome_messages([{"role": "user", "content": "hi"}], "failure") == [
        {"role": "system", "content": "Outcome: failure"}, {"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="outcome must be one of success, failure, got 'ok'"):
        outcome_messages([], "ok")


def test_a_tool_environment_without_an_expert_and_an_endless_plan_are_refused():
    class Tools(Environment):
        tools = (PYTHON_TOOL,)

        def generate(self, rng):
            return Task(prompt=f"task {rng.random()}")

        def reward(self, task, completion):
            return 0.0

    with pytest.raises(ValueError, match="multi-turn .*agentic_sft.expert_examples"):
        Tools().sft_examples(1)
    with get_env("math-python", levels=(1,)) as env:
        (task,) = env.tasks("train", 1)
        with pytest.raises(ValueError, match="still calls tools after 4 turns"):
            play(env, task, lambda outputs: task.reference)


def test_sft_on_env_math_python_end_to_end(tmp_path, tokenizer, small_config):
    base = tmp_path / "base"
    torch.manual_seed(0)
    save_pretrained(HybridLM(small_config(vocab_size=512, max_position_embeddings=1024)), base)
    save_tokenizer_files(tokenizer, base, model_max_length=1024)
    sets = ["sft.env_examples=12", "sft.env_levels=1,2", "sft.seq_len=1024", "sft.batch_size=2", "sft.val_batches=1",
            "sft.val_fraction=0.1", "train.val_every=2", "train.checkpoint_every=2", "train.warmup_steps=1",
            "train.decay_fraction=0", "train.threads=1"]
    out = tmp_path / "run"
    assert cli_main(["sft", "--model", str(base), "--data", "env:math-python", "--out", str(out), "--steps", "2",
                     *[arg for s in sets for arg in ("--set", s)], "--quiet"]) == 0
    stats = json.loads((out / "sft_data.json").read_text())
    assert stats["conversations"] == 12 and stats["domains"] == {"math": 12}
    assert stats["truncated"] == 0 and 0 < stats["trained_share"] < 0.5  # the tools' prompt dominates
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert (out / "hf" / "config.json").is_file()
