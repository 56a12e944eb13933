"""`hybridtron branch`: arms, the gap arithmetic, checkpoint errors, and a tiny NVFP4 run branched end to end."""

from __future__ import annotations

import json
import math

import pytest

from hybridtron.cli import main as cli_main
from hybridtron.experiments.branch import (Arm, block_standard_error, gap_summary, parse_arm, relative_gap,
                                       resolve_checkpoint)
from hybridtron.train.config import TrainConfig

# A small, quick run (as tests/train/test_pretrain.py): a few stdlib families, short rows, tiny batches.
FAST = ["--set", "data.families=json,text,functional", "--set", "data.seq_len=32", "--set", "data.batch_size=2",
        "--set", "data.vocab_size=512", "--set", "model.vocab_size=512", "--set", "train.val_every=100",
        "--set", "data.val_batches=1", "--set", "train.checkpoint_every=2", "--set", "train.warmup_steps=2",
        "--set", "train.threads=1", "--quiet"]


def test_parse_arm():
    assert parse_arm("nvfp4:all") == Arm("nvfp4:all", "nvfp4", "all")
    assert parse_arm("nvfp4:ultra:no-sr:no-rht") == Arm("nvfp4:ultra:no-sr:no-rht", "nvfp4", "ultra",
                                                        stochastic_rounding=False, rht=False)
    assert parse_arm("mxfp8") == Arm("mxfp8", "mxfp8", "ultra")
    trained = TrainConfig(precision="nvfp4", precision_policy="all", nvfp4_2d_weights=False)
    assert parse_arm("as-trained", trained) == Arm("nvfp4:all:no-2d", "nvfp4", "all", two_d_weights=False)
    assert parse_arm("as-trained", TrainConfig(precision="bf16")).recipe == "bf16-autocast"
    assert parse_arm("as-trained", TrainConfig(precision="fp32")).recipe == "fp32"
    for spec, message in [("fp8", "recipe 'fp8'"), ("mxfp8:no-sr", "nvfp4 switch"), ("nvfp4:most", "unknown part")]:
        with pytest.raises(ValueError, match=message):
            parse_arm(spec)


def test_gap_is_the_mean_relative_difference():
    gaps = relative_gap([1.01, 2.0, 3.3, 4.0], [1.0, 2.0, 3.0, 5.0])
    assert gaps == pytest.approx([0.01, 0.0, 0.1, -0.2])
    summary = gap_summary(gaps)
    assert summary["mean"] == pytest.approx(-0.0225)
    assert summary["first_half"] == pytest.approx(0.005) and summary["second_half"] == pytest.approx(-0.05)
    assert summary["standard_error"] == pytest.approx(0.0275), "two blocks of two steps: |0.005 - -0.05| / 2"


def test_gap_standard_error_comes_from_block_means():
    # six blocks of 10 steps, block means 0..5 (x 1e-3): SE = stdev(0..5) / sqrt(6)
    gaps = [b * 1e-3 + (0.01 if i % 2 else -0.01) for b in range(6) for i in range(10)]
    assert block_standard_error(gaps) == pytest.approx(1.8708287e-3 / 6 ** 0.5)
    assert math.isnan(block_standard_error([0.1, 0.2, 0.3]))


def test_checkpoint_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        resolve_checkpoint(tmp_path / "nope")
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    with pytest.raises(ValueError, match="not a complete DCP checkpoint"):
        resolve_checkpoint(step)
    (step / "COMPLETE").write_text("2")
    with pytest.raises(FileNotFoundError, match="run_config.json"):
        resolve_checkpoint(step)


def test_branch_a_tiny_nvfp4_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HYBRIDTRON_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    assert cli_main(["pretrain", "--preset", "tiny", "--out", str(run), "--steps", "4",
                     "--set", "train.precision=nvfp4", *FAST]) == 0
    original = {json.loads(line)["step"]: json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()}
    capsys.readouterr()

    out = tmp_path / "branch"
    assert cli_main(["branch", "--from", str(run / "checkpoints" / "step_000002"), "--tokens", "100",
                     "--out", str(out), "--arm", "as-trained", "--arm", "nvfp4:all", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "| nvfp4:ultra |" in printed and "| nvfp4:all |" in printed

    report = json.loads((out / "branch.json").read_text())
    assert report["start_step"] == 2 and report["steps"] == 2 and report["tokens"] == 128  # whole steps of 64
    assert list(report["arms"]) == ["bf16", "nvfp4:ultra", "nvfp4:all"]
    assert [row["step"] for row in report["arms"]["bf16"]] == [3, 4]
    # The as-trained arm continues the run exactly: step 3's loss (forward before any SR draw) is the run's own.
    assert report["arms"]["nvfp4:ultra"][0]["lm_loss"] == original[3]["lm_loss"]
    for label, gap in report["gaps"].items():
        losses = [row["lm_loss"] for row in report["arms"][label]]
        reference = [row["lm_loss"] for row in report["arms"]["bf16"]]
        assert gap["mean"] == pytest.approx(sum((q - r) / r for q, r in zip(losses, reference)) / 2)
        assert abs(gap["mean"]) < 0.05  # a few steps from the same weights: small, whatever its sign
    assert (out / "branch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with pytest.raises(SystemExit):  # --tokens is required
        cli_main(["branch", "--from", str(run / "checkpoints" / "step_000002")])
    assert cli_main(["branch", "--from", str(run / "checkpoints" / "step_000002"), "--tokens", "0"]) == 2
    assert "--tokens must be positive" in capsys.readouterr().err
