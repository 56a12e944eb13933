"""`hybridtron branch`: arms, the gap arithmetic and its standard error, checkpoint errors, the configuration, and a
tiny NVFP4 run branched end to end, once straight through and once interrupted and resumed."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from hybridtron.cli import main as cli_main
from hybridtron.experiments.branch import (GAP_BLOCKS, Arm, block_standard_error, format_report, gap_summary,
                                           parse_arm, relative_gap, resolve_checkpoint)
from hybridtron.train.config import TrainConfig
from hybridtron.train.hooks import MetricsLogger

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
    assert parse_arm("nvfp4:ultra:no-sr").directory == "nvfp4_ultra_no-sr"
    assert parse_arm("as-trained", TrainConfig(precision="bf16")).directory == "as-trained_bf16"
    for spec, message in [("fp8", "recipe 'fp8'"), ("mxfp8:no-sr", "nvfp4 switch"), ("nvfp4:most", "unknown part")]:
        with pytest.raises(ValueError, match=message):
            parse_arm(spec)


def test_gap_is_the_mean_relative_difference():
    gaps = relative_gap([1.01, 2.0, 3.3, 4.0], [1.0, 2.0, 3.0, 5.0])
    assert gaps == pytest.approx([0.01, 0.0, 0.1, -0.2])
    summary = gap_summary(gaps)
    assert summary["mean"] == pytest.approx(-0.0225)
    assert summary["first_half"] == pytest.approx(0.005) and summary["second_half"] == pytest.approx(-0.05)
    assert summary["standard_error"] is None, "4 steps make no 8 blocks of 2"


def test_gap_standard_error_comes_from_block_means():
    # eight blocks of 10 steps, block means 0..7 (x 1e-3): SE = stdev(0..7) / sqrt(8)
    gaps = [b * 1e-3 + (0.01 if i % 2 else -0.01) for b in range(GAP_BLOCKS) for i in range(10)]
    assert block_standard_error(gaps) == pytest.approx(2.4494897e-3 / 8 ** 0.5)
    assert block_standard_error([0.1] * 15) is None and block_standard_error([0.1] * 16) == 0.0


def test_a_window_too_short_for_a_standard_error_says_how_long_one_must_be():
    def report(steps):
        gaps = [0.001 * (i % 3) for i in range(steps)]
        return {"steps": steps, "tokens": 64 * steps, "tokens_per_step": 64, "start_step": 2, "reference": "bf16",
                "gaps": {"nvfp4:all": {**gap_summary(gaps), "total_loss_mean": 0.001}}}

    short = format_report(report(2), out=Path("b"))
    assert "| nvfp4:all | 0.050% | n/a |" in short and "nan" not in short
    assert ("warning: the standard error needs at least 8 blocks of 2 consecutive steps, a window of 16 steps "
            "(--tokens 1024); this one has 2") in short
    enough = format_report(report(16), out=Path("b"))
    assert "n/a" not in enough and "warning" not in enough


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


# ------------------------------------------------------------------------------- a tiny NVFP4 run, branched
@pytest.fixture(scope="module")
def nvfp4_run(tmp_path_factory):
    """A 4-step NVFP4 run with checkpoints at steps 2 and 4: (its directory, its metrics by step)."""
    root = tmp_path_factory.mktemp("branch")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYBRIDTRON_CACHE", str(root / "cache"))
        run = root / "run"
        assert cli_main(["pretrain", "--preset", "tiny", "--out", str(run), "--steps", "4",
                         "--set", "train.precision=nvfp4", *FAST]) == 0
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        metrics = {line["step"]: line for line in lines}
        yield run, metrics


@pytest.fixture(scope="module")
def branched(nvfp4_run):
    """The run branched straight through from step 2 with the as-trained and the nvfp4:all arm: (out, branch.json,
    what it printed)."""
    run, _ = nvfp4_run
    out = run.parent / "branch"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYBRIDTRON_CACHE", str(run.parent / "cache"))
        assert cli_main(["branch", "--from", str(run / "checkpoints" / "step_000002"), "--tokens", "100",
                         "--out", str(out), "--arm", "as-trained", "--arm", "nvfp4:all", "--quiet"]) == 0
    return out, json.loads((out / "branch.json").read_text())


def test_branch_a_tiny_nvfp4_run(nvfp4_run, branched, capsys, monkeypatch):
    run, original = nvfp4_run
    out, report = branched
    assert report["start_step"] == 2 and report["steps"] == 2 and report["tokens"] == 128  # whole steps of 64
    assert list(report["arms"]) == ["bf16", "nvfp4:ultra", "nvfp4:all"]
    assert [row["step"] for row in report["arms"]["bf16"]] == [3, 4]
    # The as-trained arm continues the run exactly: same weights, batches, LR and stochastic-rounding streams.
    for row in report["arms"]["nvfp4:ultra"]:
        assert row["lm_loss"] == original[row["step"]]["lm_loss"] and row["lr"] == original[row["step"]]["lr"]
    for label, gap in report["gaps"].items():
        losses = [row["lm_loss"] for row in report["arms"][label]]
        reference = [row["lm_loss"] for row in report["arms"]["bf16"]]
        assert gap["mean"] == pytest.approx(sum((q - r) / r for q, r in zip(losses, reference)) / 2)
        assert abs(gap["mean"]) < 0.05  # a few steps from the same weights: small, whatever its sign
        assert gap["standard_error"] is None  # 2 steps: the summary warns instead
    assert (out / "branch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for arm in ("bf16", "nvfp4_ultra", "nvfp4_all"):  # each arm a run of its own, its latest checkpoint kept
        assert [p.name for p in (out / "arms" / arm / "checkpoints").iterdir()] == ["step_000004"]
    assert json.loads((out / "run_config.json").read_text())["branch"] == {"tokens": 100, "steps": 0,
                                                                          "arms": ["as-trained", "nvfp4:all"]}

    # The same command again: complete, nothing trains, the table again.
    monkeypatch.setenv("HYBRIDTRON_CACHE", str(run.parent / "cache"))
    capsys.readouterr()
    assert cli_main(["branch", "--from", str(run / "checkpoints" / "step_000002"), "--tokens", "100",
                     "--out", str(out), "--arm", "as-trained", "--arm", "nvfp4:all"]) == 0
    captured = capsys.readouterr()
    assert "this branch is complete" in captured.err and "| nvfp4:all |" in captured.out
    assert "warning: the standard error needs at least 8 blocks" in captured.out

    assert cli_main(["branch", "--from", str(run / "checkpoints" / "step_000002"), "--out", str(out)]) == 2
    assert "the window each arm trains must be positive: --tokens N or --steps N" in capsys.readouterr().err
    assert cli_main(["branch", "--from", str(run / "checkpoints" / "step_000002"), "--out", str(out), "--tokens",
                     "64", "--steps", "2"]) == 2
    assert "branch.tokens=64 and branch.steps=2 both give the window" in capsys.readouterr().err
    assert cli_main(["branch", "--from", str(run / "checkpoints" / "step_000002"), "--tokens", "64",
                     "--out", str(run)]) == 2  # a pretraining run's directory is never written over
    assert "holds another command's run" in capsys.readouterr().err


def test_an_interrupted_branch_resumes_to_the_same_numbers(nvfp4_run, branched, tmp_path, capsys, monkeypatch):
    run, _ = nvfp4_run
    monkeypatch.setenv("HYBRIDTRON_CACHE", str(run.parent / "cache"))
    command = ["branch", "--from", str(run / "checkpoints" / "step_000002"), "--tokens", "100",
               "--out", str(tmp_path / "branch"), "--arm", "as-trained", "--quiet"]

    # Ctrl-C during the as-trained arm's first step (the reference arm done): that step finishes and is saved.
    log_step = MetricsLogger.on_step_end

    def ctrl_c_in_the_second_arm(self, trainer, stats, decision):
        log_step(self, trainer, stats, decision)
        if self.run_dir.name == "nvfp4_ultra" and stats.step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    with monkeypatch.context() as patch:
        patch.setattr(MetricsLogger, "on_step_end", ctrl_c_in_the_second_arm)
        assert cli_main(command) == 130
    err = capsys.readouterr().err
    assert "stopped after step 3; checkpoint" in err and "arms/nvfp4_ultra/checkpoints/step_000003" in err
    assert f"resume with: hybridtron branch --out {tmp_path / 'branch'} --resume" in err
    assert not (tmp_path / "branch" / "branch.json").exists()

    assert cli_main(command) == 2  # not without --resume
    assert "holds an unfinished branch" in capsys.readouterr().err
    assert cli_main(["branch", "--out", str(tmp_path / "branch"), "--resume", "--tokens", "200"]) == 2
    assert "--resume cannot change branch.tokens 100 -> 200" in capsys.readouterr().err

    assert cli_main(["branch", "--out", str(tmp_path / "branch"), "--resume", "--quiet"]) == 0
    assert "arms/nvfp4_ultra/checkpoints/step_000003 (step 3)" in capsys.readouterr().err
    resumed = json.loads((tmp_path / "branch" / "branch.json").read_text())
    _, straight = branched
    for label in ("bf16", "nvfp4:ultra"):  # the arms are independent: the same numbers as the branch not interrupted
        assert resumed["arms"][label] == straight["arms"][label]
    assert resumed["gaps"]["nvfp4:ultra"] == straight["gaps"]["nvfp4:ultra"]


def test_print_config_round_trips_and_the_forked_sections_are_fixed(nvfp4_run, tmp_path, capsys):
    run, _ = nvfp4_run
    checkpoint = str(run / "checkpoints" / "step_000002")
    assert cli_main(["branch", "--from", checkpoint, "--tokens", "100", "--arm", "nvfp4:all", "--arm", "mxfp8",
                     "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "[branch]" in printed and "tokens = 100  # tokens each arm trains" in printed
    assert 'arms = ["nvfp4:all", "mxfp8"]' in printed and "\n[train]" not in printed and "\n[model]" not in printed
    (tmp_path / "branch.toml").write_text(printed)
    assert cli_main(["branch", "--from", checkpoint, "--config", str(tmp_path / "branch.toml"), "--print-config"]) == 0
    assert capsys.readouterr().out == printed

    assert cli_main(["branch", "--from", checkpoint, "--steps", "3", "--print-config"]) == 0
    assert "steps = 3  # steps each arm trains" in capsys.readouterr().out
    assert cli_main(["branch", "--from", checkpoint, "--tokens", "64", "--set", "train.lr=1e-4"]) == 2
    assert "[train] is the forked run's" in capsys.readouterr().err
    assert cli_main(["branch", "--from", checkpoint, "--tokens", "64", "--arm", "as-trained",
                     "--arm", "nvfp4:ultra"]) == 2  # as-trained is nvfp4:ultra
    assert "repeat one" in capsys.readouterr().err
    assert cli_main(["branch", "--tokens", "64"]) == 2
    assert "--from is required" in capsys.readouterr().err
