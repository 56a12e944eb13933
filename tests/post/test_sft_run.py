"""`hybridtron sft`: the masked loss, its grad_accum invariance, the command end to end with resume, clear errors.

(The data side, rendering, masking, packing and the loader, is tested in tests/data/test_sft.py.)"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hybridtron.checkpoint import load_pretrained, save_pretrained
from hybridtron.cli import main as cli_main
from hybridtron.data.chat import Segment, load_chat_tokenizer, save_tokenizer_files, tokenize_chat
from hybridtron.data.sft import build_sft_data
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.model.lm import HybridLM
from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.post.sft import SFTConfig, SFTObjective, load_conversations, sft_loss

SEQ_LEN = 128


@pytest.fixture(scope="module")
def math_conversations():
    return load_conversations("env:math", SFTConfig(env_examples=48, env_levels=(1, 2)))


@pytest.fixture(scope="module")
def tokenizer(math_conversations):
    texts = [m["content"] for c in math_conversations for m in c["messages"]] * 4
    return Tokenizer.train(texts + ["the quick brown fox jumps over the lazy dog"] * 8, 512)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, tokenizer, small_config):
    """A small randomly initialised model (tests/conftest.py's small config, 512 tokens) saved as an HF checkpoint
    with chat tokenizer files."""
    directory = tmp_path_factory.mktemp("base") / "hf"
    torch.manual_seed(0)
    config = small_config(vocab_size=512, mtp_num_depths=2, max_position_embeddings=256)
    model = HybridLM(config)
    save_pretrained(model, directory)
    save_tokenizer_files(tokenizer, directory, model_max_length=256)
    return directory


# ------------------------------------------------------------------------------------------------- the loss
def test_sft_loss_is_the_token_sum_over_the_step_count():
    logits = torch.randn(2, 4, 7, dtype=torch.float64).float()
    labels = torch.tensor([[3, IGNORE_INDEX, 5, IGNORE_INDEX], [IGNORE_INDEX, IGNORE_INDEX, 1, 6]])
    log_probs = logits.log_softmax(-1)
    hand = -(log_probs[0, 0, 3] + log_probs[0, 2, 5] + log_probs[1, 2, 1] + log_probs[1, 3, 6])
    assert torch.allclose(sft_loss(logits, labels, global_count=4), hand / 4, atol=1e-6)
    assert torch.allclose(sft_loss(logits, labels, global_count=10), hand / 10, atol=1e-6)
    nothing = torch.full_like(labels, IGNORE_INDEX)
    logits.requires_grad_(True)
    zero = sft_loss(logits, nothing, global_count=4)
    zero.backward()
    assert zero.item() == 0 and logits.grad.abs().sum() == 0
    with pytest.raises(ValueError, match="count of the whole step"):
        sft_loss(logits, labels, global_count=3)


def test_the_loss_counts_only_assistant_tokens(tokenizer, small_config):
    """A hand-made conversation: the objective's CE is the model's CE on the tokens of the assistant's answer (and
    its <|im_end|>), whatever the logits at the prompt, the template and the reasoning."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "<think>2 + 3 = 5</think>\\boxed{5}"}]
    chat = tokenize_chat(tokenizer, messages)
    data = build_sft_data([{"messages": messages}], tokenizer, SFTConfig(val_fraction=0).data_config(),
                          seq_len=SEQ_LEN, batch_size=1)
    batch = next(data.train_loader)
    input_ids, labels = batch.input_ids, batch.labels
    assert input_ids[0, :len(chat)].tolist() == chat.ids.tolist()

    answer = torch.from_numpy(chat.segments == Segment.ANSWER)
    expected_targets = [int(chat.ids[t]) for t in range(1, len(chat)) if answer[t]]
    trained = [int(x) for x in labels[0] if x != IGNORE_INDEX]
    assert trained == expected_targets, "the labels are the answer's tokens, shifted"
    assert tokenizer.decode(trained) == "\n\\boxed{5}<|im_end|>"

    model = HybridLM(small_config(vocab_size=512)).eval()
    objective = SFTObjective(mtp_depths=model.config.mtp_num_depths)
    objective.begin_step([batch])
    out = objective(model, batch)
    logits = model(input_ids).logits[0, :len(chat) - 1]  # the row's first document: causal, no mask needed
    positions = [t - 1 for t in range(1, len(chat)) if answer[t]]
    hand = F.cross_entropy(logits[positions], torch.tensor(expected_targets))
    assert torch.allclose(out.metrics["lm_loss"], hand, atol=1e-5)
    assert out.metrics["trained_tokens"] == len(expected_targets)


def test_packed_conversations_do_not_see_each_other(tokenizer, math_conversations, small_config):
    """Two conversations packed into one row (the document mask on, SFT's default): the objective's loss is the loss
    of the same two conversations each alone in a row; without the mask the second reads the first."""
    conversations = math_conversations[:2]
    model = HybridLM(small_config(vocab_size=512)).eval()
    data_config = SFTConfig(val_fraction=0).data_config()

    def loss(config, seq_len, batch_size):
        batch = next(build_sft_data(conversations, tokenizer, config, seq_len=seq_len, batch_size=batch_size)
                     .train_loader)
        objective = SFTObjective(mtp_depths=model.config.mtp_num_depths)
        objective.begin_step([batch])
        with torch.no_grad():
            return batch, objective(model, batch).metrics

    packed, masked = loss(data_config, 2 * SEQ_LEN, 1)
    assert packed.input_ids.shape[0] == 1 and int(packed.seq_idx.max()) >= 1  # both in the row, and a pad tail
    alone_rows, alone = loss(data_config, SEQ_LEN, 2)
    assert alone_rows.input_ids.shape[0] == 2
    for key in ("loss", "lm_loss", "trained_tokens"):
        torch.testing.assert_close(masked[key], alone[key], atol=1e-5, rtol=1e-5, msg=key)
    _, shared = loss(replace(data_config, document_mask=False), 2 * SEQ_LEN, 1)
    assert not torch.allclose(shared["lm_loss"], alone["lm_loss"], atol=1e-4)


def test_thinking_is_masked_by_default_and_trained_with_the_switch(tokenizer, math_conversations):
    """On the math environment's traces: the default trains the answers only; train_on_thinking adds exactly
    the reasoning tokens (tags included)."""
    masked = build_sft_data(math_conversations, tokenizer, SFTConfig(seq_len=SEQ_LEN).data_config()).stats
    thinking = build_sft_data(math_conversations, tokenizer,
                              SFTConfig(seq_len=SEQ_LEN, train_on_thinking=True).data_config()).stats
    assert masked.thinking_tokens > 0 and masked.thinking_tokens == thinking.thinking_tokens
    assert thinking.trained_tokens == masked.trained_tokens + masked.thinking_tokens
    chat = tokenize_chat(tokenizer, math_conversations[0]["messages"])
    reasoning = tokenizer.decode(chat.ids[chat.segments == Segment.THINKING].tolist())
    assert reasoning.startswith("<think>") and reasoning.endswith("</think>") and " = " in reasoning


@pytest.mark.parametrize("grad_accum", [2, 4])
def test_grad_accum_does_not_change_the_gradient(small_config, grad_accum):
    """Four rows with very different numbers of trained tokens: one micro-batch of four, or 2 x 2, or 4 x 1, give
    the same gradient (the loss divides by the step's count, not each micro-batch's)."""
    torch.manual_seed(0)
    model = HybridLM(small_config(mtp_num_depths=2, mtp_loss_weight=0.3))
    input_ids = torch.randint(3, 128, (4, 24))
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    for row, (start, end) in enumerate([(2, 22), (20, 23), (5, 8), (0, 24)]):
        labels[row, start:end] = torch.randint(3, 128, (end - start,))

    def gradients(split: int) -> dict[str, torch.Tensor]:
        model.zero_grad()
        micro_batches = list(zip(input_ids.chunk(split), labels.chunk(split)))
        objective = SFTObjective(mtp_depths=2)
        objective.begin_step(micro_batches)
        for micro_batch in micro_batches:
            objective(model, micro_batch).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    whole, split = gradients(1), gradients(grad_accum)
    assert whole.keys() == split.keys()
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=1e-5, msg=name)

    # the bug this guards against: each micro-batch normalised by its own count gives another gradient
    model.zero_grad()
    for micro_batch in zip(input_ids.chunk(grad_accum), labels.chunk(grad_accum)):
        objective = SFTObjective(mtp_depths=2)
        objective.begin_step([micro_batch])
        (objective(model, micro_batch).loss / grad_accum).backward()
    assert not torch.allclose(model.lm_head.weight.grad, whole["lm_head.weight"], atol=1e-4)


def test_data_parallel_shares_sum_to_the_single_process_gradient(small_config):
    """Two data-parallel ranks, each with half the rows and the step's counts summed over both (what `data_sum`
    does with an all-reduce): their gradients and metrics add up to one process's on the whole batch."""
    from hybridtron.train.objectives import target_counts

    torch.manual_seed(0)
    model = HybridLM(small_config(mtp_num_depths=2))
    input_ids = torch.randint(3, 128, (4, 16))
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    for row, (start, end) in enumerate([(1, 15), (10, 12), (3, 9), (0, 16)]):
        labels[row, start:end] = torch.randint(3, 128, (end - start,))

    def run(rows, data_sum=None):
        objective = SFTObjective(mtp_depths=2, data_sum=data_sum)
        micro_batches = [(input_ids[rows], labels[rows])]
        objective.begin_step(micro_batches)
        out = objective(model, micro_batches[0])
        out.loss.backward()
        return out.metrics

    whole = run([0, 1, 2, 3])
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    halves = ([0, 1], [2, 3])
    metrics = []
    for rank, rows in enumerate(halves):
        other = target_counts(labels[list(halves[1 - rank])], 2).double()
        metrics.append(run(rows, data_sum=lambda counts, other=other: counts + other))
    for name, grad in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, atol=1e-6, rtol=1e-5, msg=name)
    for key in whole:
        torch.testing.assert_close(float(metrics[0][key] + metrics[1][key]), float(whole[key]), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- the command
FAST = ["--set", "sft.env_examples=64", "--set", "sft.env_levels=1,2", "--set", f"sft.seq_len={SEQ_LEN}",
        "--set", "sft.batch_size=2", "--set", "sft.val_batches=2", "--set", "sft.val_fraction=0.1",
        "--set", "train.val_every=3", "--set", "train.checkpoint_every=2", "--set", "train.warmup_steps=2",
        "--set", "train.decay_fraction=0", "--set", "train.lr=1e-3", "--set", "train.threads=1", "--quiet"]
DETERMINISTIC = ("loss", "lm_loss", "mtp_loss_1", "mtp_loss_2", "grad_norm", "lr", "trained_tokens")


def sft(base_model: Path, out: Path, steps: int, *extra: str, data: str = "env:math") -> int:
    return cli_main(["sft", "--model", str(base_model), "--data", data, "--out", str(out), "--steps", str(steps),
                     *FAST, *extra])


def step_records(run_dir: Path) -> dict[int, dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if "loss" in r}


def test_sft_end_to_end_and_resume_bit_for_bit(tmp_path, base_model, capsys):
    """A 6-step run, and a 3-step run resumed to 6: the same losses, gradients and validation bit for bit; the
    export loads with the chat template; a finished run is not trained again."""
    assert sft(base_model, tmp_path / "whole", 6) == 0
    assert sft(base_model, tmp_path / "split", 3) == 0
    assert sft(base_model, tmp_path / "split", 6, "--resume") == 0
    whole, split = step_records(tmp_path / "whole"), step_records(tmp_path / "split")
    assert sorted(split) == list(range(1, 7))
    for step in range(1, 7):
        for key in DETERMINISTIC:
            assert split[step][key] == whole[step][key], f"step {step} {key}"
    vals = [(r["step"], r["val_loss"]) for r in map(json.loads, (tmp_path / "whole" / "metrics.jsonl")
                                                    .read_text().splitlines()) if "val_loss" in r]
    assert [s for s, _ in vals] == [0, 3, 6]
    assert vals[-1][1] < vals[0][1], "the held-out loss falls"

    hf = tmp_path / "whole" / "hf"
    tuned, base = load_pretrained(hf), load_pretrained(base_model)
    assert tuned.config == base.config
    assert not torch.equal(tuned.lm_head.weight, base.lm_head.weight)
    load_chat_tokenizer(hf, vocab_size=tuned.config.vocab_size, require_template=True)
    stats = json.loads((tmp_path / "whole" / "sft_data.json").read_text())
    assert stats["thinking_tokens"] > 0 and not stats["train_on_thinking"]
    config = json.loads((tmp_path / "whole" / "run_config.json").read_text())
    assert config["base_model"] == str(base_model) and config["data"] == "env:math"
    assert config["train"]["lr"] == 1e-3 and config["sft"]["env_levels"] == [1, 2]

    capsys.readouterr()
    assert sft(base_model, tmp_path / "whole", 6) == 0
    out = capsys.readouterr().out
    assert "this run is complete (6 steps)" in out
    assert f"To train it further: hybridtron sft --out {tmp_path / 'whole'} --resume --steps N" in out
    # asked for more steps with --resume, the finished run continues from its last checkpoint (no --model needed:
    # the run's own is in run_config.json), and the change is recorded at the step it takes effect
    assert cli_main(["sft", "--out", str(tmp_path / "whole"), "--resume", "--steps", "8", "--quiet"]) == 0
    extended = step_records(tmp_path / "whole")
    assert sorted(extended) == list(range(1, 9))
    assert all(extended[step] == whole[step] for step in range(1, 7)), "the first 6 steps are kept as they were"
    events = [json.loads(line) for line in (tmp_path / "whole" / "events.jsonl").read_text().splitlines()]
    assert any(e["action"] == "config_changed" and e["key"] == "train.steps" for e in events)


def test_jsonl_data_and_the_thinking_switch(tmp_path, base_model, math_conversations):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in math_conversations))
    assert sft(base_model, tmp_path / "run", 2, "--set", "sft.train_on_thinking=true", data=str(data)) == 0
    stats = json.loads((tmp_path / "run" / "sft_data.json").read_text())
    assert stats["train_on_thinking"] and stats["conversations"] == len(math_conversations)


def test_print_config_reads_back(tmp_path, base_model, capsys):
    assert cli_main(["sft", "--model", str(base_model), "--data", "env:math", "--print-config",
                     "--set", "sft.train_on_thinking=true", "--set", "train.lr=1e-4"]) == 0
    text = capsys.readouterr().out
    assert "[sft]\ntrain_on_thinking = true" in text and "lr = 0.0001" in text and "[model]" not in \
        text.replace("# [model]", "")
    toml = tmp_path / "sft.toml"
    toml.write_text(text)
    assert cli_main(["sft", "--model", str(base_model), "--data", "env:math", "--print-config",
                     "--config", str(toml)]) == 0
    assert capsys.readouterr().out == text


def _without_chat_tokens(tmp_path: Path, base_model: Path) -> Path:
    """The base model with a tokenizer.json that has none of hybridtron's special tokens."""
    from tokenizers import Tokenizer as Backend, models, pre_tokenizers, trainers

    directory = tmp_path / "foreign"
    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        (directory / name).write_bytes((base_model / name).read_bytes())
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(["some text to learn from"] * 4, trainers.BpeTrainer(vocab_size=300))
    backend.save(str(directory / "tokenizer.json"))
    return directory


def _without_tokenizer(tmp_path: Path, base_model: Path) -> Path:
    directory = tmp_path / "bare"
    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        (directory / name).write_bytes((base_model / name).read_bytes())
    return directory


def _other_template(tmp_path: Path, base_model: Path) -> Path:
    directory = tmp_path / "other"
    directory.mkdir()
    for path in base_model.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("case, message", [
    ("env:chess", "--data env:chess: unknown environment 'chess'; known: code, copy, math"),
    ("malformed", "bad.jsonl line 2"),
    ("no tokenizer", "tokenizer.json does not exist"),
    ("no chat tokens", "the model was not trained with hybridtron's chat format"),
    ("other template", "a chat template other than hybridtron's"),
    ("set model", "[model] cannot be set here: the model is fixed by base_model ("),
    ("no model", "--model is required"),
])
def test_clear_errors(tmp_path, base_model, capsys, case, message):
    model, data, extra = base_model, "env:math", []
    if case == "env:chess":
        data = "env:chess"
    elif case == "malformed":
        data = tmp_path / "bad.jsonl"
        data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                        '{"messages": [{"role": "user", "content": "hi"}\n')
    elif case == "no tokenizer":
        model = _without_tokenizer(tmp_path, base_model)
    elif case == "no chat tokens":
        model = _without_chat_tokens(tmp_path, base_model)
    elif case == "other template":
        model = _other_template(tmp_path, base_model)
    elif case == "set model":
        extra = ["--set", "model.hidden_size=64"]
    args = ["sft", "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "1", *FAST, *extra]
    if case != "no model":
        args[1:1] = ["--model", str(model)]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
