"""`hybridtron eval` (a command of the registry, replacing `python -m hybridtron.post.evaluate`): a checkpoint's
pass@1, and pass@k with samples, on environments' held-out tasks; the held-out CE of conversations by domain."""

from __future__ import annotations

import json

import pytest
import torch

from hybridtron.checkpoint import load_pretrained, save_pretrained
from hybridtron.cli import main
from hybridtron.data.chat import load_chat_tokenizer, save_tokenizer_files
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.envs import get_env
from hybridtron.eval.conversations import conversation_batches, held_out_loss
from hybridtron.eval.tasks import k_values, pass_at_k
from hybridtron.model.lm import HybridLM
from hybridtron.ops.cross_entropy import IGNORE_INDEX


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, small_config):
    """A small random model (every layer kind) with chat tokenizer files."""
    with get_env("math", levels=(1,)) as env:
        texts = [json.dumps(example) for example in env.sft_examples(40, 0)]
    tokenizer = Tokenizer.train(texts, 512)
    directory = tmp_path_factory.mktemp("eval") / "hf"
    torch.manual_seed(0)
    save_pretrained(HybridLM(small_config(vocab_size=512)), directory)
    save_tokenizer_files(tokenizer, directory, model_max_length=256)
    return directory


def test_pass_at_k_is_the_unbiased_estimate():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3, 2) / C(4, 2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    assert k_values(1) == [1] and k_values(8) == [1, 2, 4, 8] and k_values(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError, match="1 <= k <= samples"):
        pass_at_k(2, 1, 3)


def test_the_command_scores_each_environment_and_writes_json(checkpoint, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "tasks", "--model", str(checkpoint), "--env", "math,code", "--levels", "1", "--tasks", "3",
                 "--samples", "2", "--temperature", "1.0", "--max-tokens", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "math test (1): pass@1" in printed and "pass@2" in printed and "code test (1)" in printed
    result = json.loads(out.read_text())
    assert {"math", "code"} <= result.keys()
    assert result["math"]["tasks"] == 3 and result["math"]["samples"] == 2
    assert set(result["math"]["pass_at_k"]) == {"1", "2"}


def test_several_greedy_samples_are_refused(checkpoint, capsys):
    assert main(["eval", "tasks", "--model", str(checkpoint), "--tasks", "2", "--samples", "2"]) == 2
    assert "needs samples >= 1, and a temperature > 0" in capsys.readouterr().err


def test_conversation_loss_scores_only_the_assistant_turns(checkpoint):
    model = load_pretrained(checkpoint)
    tokenizer = load_chat_tokenizer(checkpoint)
    chats = {"math": [{"messages": [{"role": "user", "content": "1 + 1?"},
                                    {"role": "assistant", "content": "\\boxed{2}"}]}]}
    [batch] = conversation_batches(tokenizer, chats["math"], 256)
    ids, labels = batch.input_ids, batch.labels
    assert batch.seq_idx is None  # one conversation a row
    assert ids.shape == labels.shape and (labels != IGNORE_INDEX).sum() < labels.numel()
    with torch.no_grad():
        logits = model(ids, mtp=False).logits[0]
    scored = labels[0] != IGNORE_INDEX
    expected = torch.nn.functional.cross_entropy(logits[scored], labels[0][scored])
    losses = held_out_loss(model, tokenizer, chats)
    assert losses["math"] == pytest.approx(float(expected), rel=1e-5) and losses["all"] == losses["math"]


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory, small_config):
    """A small random model that takes 4K positions, with its tokenizer, and a JSONL of long documents."""
    root = tmp_path_factory.mktemp("long")
    texts = [" ".join(f"word{(i * 7 + j) % 97}" for j in range(3000)) for i in range(6)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    tokenizer = Tokenizer.train(texts, 512)
    torch.manual_seed(0)
    save_pretrained(HybridLM(small_config(vocab_size=512, max_position_embeddings=4096)), root / "hf")
    save_tokenizer_files(tokenizer, root / "hf")
    return root


def test_eval_loss_writes_the_table_json_and_plot(long_checkpoint, tmp_path, capsys):
    out = tmp_path / "loss"
    assert main(["eval", "loss", "--model", str(long_checkpoint / "hf"), "--lengths", "64,256", "--data",
                 str(long_checkpoint / "docs.jsonl"), "--held-out", "0", "--windows", "2", "--training-length",
                 "64", "--out", str(out)]) == 0
    assert "mean next-token CE" in capsys.readouterr().out
    report = json.loads((out / "loss_by_position.json").read_text())
    assert report["held_out"] == 0 and [length["length"] for length in report["lengths"]] == [64, 256]
    assert (out / "loss_by_position.png").stat().st_size > 0


def test_eval_ruler_scores_each_task_and_length(long_checkpoint, tmp_path, capsys):
    out = tmp_path / "ruler"
    assert main(["eval", "ruler", "--model", str(long_checkpoint / "hf"), "--lengths", "1k", "--tasks",
                 "niah_single_1", "--samples", "2", "--out", str(out)]) == 0
    assert "niah_single_1" in capsys.readouterr().out
    result = json.loads((out / "ruler.json").read_text())
    assert result["tasks"] == ["niah_single_1"] and len(result["samples"]) == 2
    assert 0 <= result["scores"]["niah_single_1"]["1024"] <= 100 and (out / "ruler.png").is_file()


@pytest.mark.parametrize("argv, message", [
    (["ruler", "--lengths", "8k", "--tasks", "niah_single_1"], "beyond"),
    (["ruler", "--lengths", "1k", "--tasks", "niah_single_9"], "unknown RULER task 'niah_single_9'"),
    (["loss", "--lengths", "1k,4q"], "'4q' is not a length"),
    (["loss", "--lengths", "8k"], "beyond the model's max_position_embeddings"),
    (["loss", "--lengths", "64", "--held-out", "0.01"], "holds out none of its documents"),
])
def test_bad_eval_input_is_one_line(long_checkpoint, argv, message, capsys):
    data = ["--data", str(long_checkpoint / "docs.jsonl")] if argv[0] == "loss" else []
    assert main(["eval", argv[0], "--model", str(long_checkpoint / "hf"), *argv[1:], *data]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1


def test_a_checkpoint_without_its_tokenizer_is_one_line(long_checkpoint, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((long_checkpoint / "hf" / name).read_bytes())
    for command in ("loss", "ruler"):
        assert main(["eval", command, "--model", str(bare), "--lengths", "64"]) == 2
        assert "tokenizer.json" in capsys.readouterr().err


def test_eval_harness_hands_its_arguments_to_lm_eval(monkeypatch):
    from hybridtron.eval import lm_eval_adapter
    seen = []
    monkeypatch.setattr(lm_eval_adapter, "main", seen.append)
    assert main(["eval", "harness", "--model", "DIR", "--tasks", "x", "--limit", "4"]) == 0
    [argv] = seen
    assert argv[:6] == ["--model", "hybridtron", "--model_args", "pretrained=DIR", "--tasks", "x"]
    assert argv[argv.index("--limit") + 1] == "4.0"
