"""`torchrun ... -m hybridtron sft` shards the learner as pretraining does: on 2 processes with DP 2 x EP 2 and with
CP 2 x EP 2 the per-step losses, trained-token counts, gradient norms and held-out losses are those of one process
on the same global batches (1e-5, fp32), rank 0 alone writes the run directory, and a bad layout fails before
anything is written. (GRPO and MOPD: test_dist_rl.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridtron.checkpoint import load_pretrained, save_pretrained
from hybridtron.cli import main as cli_main
from hybridtron.data.chat import save_tokenizer_files
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.model.lm import HybridLM
from hybridtron.post.sft import SFTConfig, load_conversations

STEPS = 4
TOLERANCE = 1e-5
FAST = ["--steps", str(STEPS), "--data", "env:math", "--quiet", "--set", "sft.env_examples=48",
        "--set", "sft.env_levels=1,2", "--set", "sft.seq_len=64", "--set", "sft.batch_size=4",
        "--set", "sft.val_batches=1", "--set", "sft.val_fraction=0.1", "--set", "train.val_every=2",
        "--set", "train.checkpoint_every=2", "--set", "train.warmup_steps=1", "--set", "train.grad_accum=2",
        "--set", "train.lr=1e-3", "--set", "train.threads=1"]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, small_config) -> Path:
    """A small random model (8 experts, so EP 2 splits them) with a chat tokenizer, as an HF checkpoint."""
    conversations = load_conversations("env:math", SFTConfig(env_examples=48, env_levels=(1, 2)))
    texts = [m["content"] for c in conversations for m in c["messages"]] * 4
    tokenizer = Tokenizer.train(texts, 512)
    directory = tmp_path_factory.mktemp("sft_base") / "hf"
    torch.manual_seed(0)
    config = small_config(vocab_size=512, mtp_num_depths=2, max_position_embeddings=256)
    save_pretrained(HybridLM(config), directory)
    save_tokenizer_files(tokenizer, directory, model_max_length=256)
    return directory


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def single_run(base_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft_single") / "run"
    with pytest.warns(UserWarning, match="SFT data"):  # long conversations truncated to the short test rows
        assert cli_main(["sft", "--model", str(base_model), "--out", str(out), *FAST]) == 0
    return out


# DP 2 x EP 2; CP 2 x EP 2 (each rank holds half of every packed row's positions, the MTP depths reading on into
# the next half: the per-step losses and held-out loss of one process are sums over the two halves)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [["dist.ep=2"], ["dist.cp=2", "dist.ep=2"]], ids=["dp2-ep2", "cp2-ep2"])
def test_sft_on_two_processes_matches_one_process(base_model, single_run, tmp_path, layout):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "hybridtron", "sft", "--model", str(base_model), "--out", str(tmp_path / "world2"), *FAST,
               *[arg for setting in layout for arg in ("--set", setting)]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=220,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    single, world2 = records(single_run), records(tmp_path / "world2")
    assert [r["step"] for r in world2] == [r["step"] for r in single]  # one writer: no line twice
    trained = [r for r in single if "loss" in r]
    assert len(trained) == STEPS and any("val_loss" in r for r in single)
    for got, want in zip(world2, single):
        for key in ("loss", "lm_loss", "mtp_loss_1", "mtp_loss_2", "trained_tokens", "val_loss", "grad_norm"):
            if key in want:
                scale = abs(want[key]) if key in ("grad_norm", "trained_tokens") else 1.0
                assert abs(got[key] - want[key]) <= TOLERANCE * scale, (want["step"], key, got[key], want[key])
    saved = json.loads((tmp_path / "world2" / "run_config.json").read_text())["dist"]
    for setting in layout:
        name, value = setting.removeprefix("dist.").split("=")
        assert saved[name] == int(value), (name, saved)
    ours, theirs = load_pretrained(tmp_path / "world2" / "hf"), load_pretrained(single_run / "hf")
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert (tmp_path / "world2" / "hf" / "tokenizer_config.json").is_file()


def test_sft_rejects_a_bad_layout_before_writing_anything(base_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets it; no process group is built before the check
    out = tmp_path / "sft"
    assert cli_main(["sft", "--model", str(base_model), "--out", str(out), *FAST, "--set", "dist.tp=4"]) == 2
    assert "tp 4 does not divide n_groups 2 (Mamba's B/C and gated norm split by group)" in capsys.readouterr().err
    assert not out.exists()
