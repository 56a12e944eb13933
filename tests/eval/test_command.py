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
    assert main(["eval", "--model", str(checkpoint), "--env", "math,code", "--levels", "1", "--tasks", "3",
                 "--samples", "2", "--temperature", "1.0", "--max-tokens", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "math test (1): pass@1" in printed and "pass@2" in printed and "code test (1)" in printed
    result = json.loads(out.read_text())
    assert {"math", "code"} <= result.keys()
    assert result["math"]["tasks"] == 3 and result["math"]["samples"] == 2
    assert set(result["math"]["pass_at_k"]) == {"1", "2"}


def test_several_greedy_samples_are_refused(checkpoint, capsys):
    assert main(["eval", "--model", str(checkpoint), "--tasks", "2", "--samples", "2"]) == 2
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
