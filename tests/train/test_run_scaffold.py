"""The run scaffold (hybridtron.train.run) as a user meets it when a run is changed, interrupted or resumed: a clear
line, never a traceback, and a run directory that is never left half-changed.

The runs are pretraining's (every training command shares this code), on a 512-token vocabulary, a few stdlib
families and 4 x 64 tokens a step; a module fixture trains one 3-step run that the tests copy."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridtron.cli import main
from hybridtron.files import ABANDONED_EVENTS_FILE, EVENTS_FILE, RUN_CONFIG
from hybridtron.train import hooks

FAST = ["--set", "data.families=json,text,functional", "--set", "data.seq_len=64", "--set", "data.batch_size=4",
        "--set", "data.vocab_size=512", "--set", "model.vocab_size=512", "--set", "data.val_batches=2",
        "--set", "train.warmup_steps=1", "--set", "train.threads=1", "--set", "train.checkpoint_every=2"]


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 3-step run that trained to its end and wrote its HF export."""
    root = tmp_path_factory.mktemp("scaffold")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYBRIDTRON_CACHE", str(root / "cache"))
        assert main(["pretrain", "--out", str(root / "run"), "--steps", "3", *FAST, "--quiet"]) == 0
    return root / "run"


@pytest.fixture
def run_dir(finished, tmp_path, monkeypatch):
    """A copy of the finished run, on the same caches."""
    monkeypatch.setenv("HYBRIDTRON_CACHE", str(finished.parent / "cache"))
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def test_resume_refuses_a_changed_model_in_one_line_and_leaves_the_run_as_it_was(run_dir, capsys):
    saved = (run_dir / RUN_CONFIG).read_bytes()
    listing = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    code = main(["pretrain", "--out", str(run_dir), "--resume", "--steps", "5", "--set", "model.hidden_size=100",
                 "--set", "data.seq_len=32", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    [line] = err.strip().splitlines()
    assert "--resume cannot change model.hidden_size 192 -> 100; data.seq_len 64 -> 32" in line
    assert f"{run_dir} is left as it was" in line
    assert (run_dir / RUN_CONFIG).read_bytes() == saved, "run_config.json untouched: later resumes still work"
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) == listing
    assert main(["pretrain", "--out", str(run_dir), "--resume", "--steps", "4", "--quiet"]) == 0  # still resumable


def test_resume_applies_a_new_learning_rate_and_records_it(run_dir, capsys):
    assert main(["pretrain", "--out", str(run_dir), "--resume", "--steps", "5", "--set", "train.lr=1e-3",
                 "--quiet"]) == 0
    changes = [e for e in records(run_dir / EVENTS_FILE) if e["action"] == "config_changed"]
    assert {(e["key"], e["saved"], e["given"], e["step"]) for e in changes} == {
        ("train.steps", 3, 5, 3), ("train.lr", 0.003, 0.001, 3)}
    steps = {r["step"]: r for r in records(run_dir / "metrics.jsonl") if "lr" in r}
    assert steps[4]["lr"] == pytest.approx(1e-3) and steps[3]["lr"] != pytest.approx(1e-3)
    assert json.loads((run_dir / RUN_CONFIG).read_text())["train"]["lr"] == 1e-3, "the next resume keeps it"


def test_resume_refuses_a_new_batch_naming_the_field(run_dir, capsys):
    assert main(["pretrain", "--out", str(run_dir), "--resume", "--steps", "5", "--set", "train.grad_accum=2"]) == 2
    assert "--resume cannot change train.grad_accum 1 -> 2" in capsys.readouterr().err


def test_a_finished_run_asked_for_more_steps_says_how_to_extend_it_and_resume_does(run_dir, capsys):
    assert main(["pretrain", "--out", str(run_dir), "--steps", "5", *FAST, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"{run_dir}: this run is complete (3 steps); nothing to do." in out
    assert f"To train it further: hybridtron pretrain --out {run_dir} --resume --steps N (N > 3)" in out
    assert "unfinished" not in out
    assert main(["pretrain", "--out", str(run_dir), "--resume", "--steps", "5", "--quiet"]) == 0
    assert [r["step"] for r in records(run_dir / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4, 5]
    capsys.readouterr()
    assert main(["pretrain", "--out", str(run_dir), "--resume", "--steps", "5", "--quiet"]) == 0
    assert "this run is complete (5 steps)" in capsys.readouterr().out


def test_a_run_shorter_than_its_warmup_says_so(tmp_path, finished, monkeypatch, capsys):
    monkeypatch.setenv("HYBRIDTRON_CACHE", str(finished.parent / "cache"))
    assert main(["pretrain", "--out", str(tmp_path / "run"), "--steps", "2", *FAST, "--set", "train.warmup_steps=40",
                 "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "warning: train.warmup_steps=40 >= train.steps=2: the LR never reaches its peak 0.003" in err


def test_a_diverged_run_says_so_and_exits_4_unless_the_drill_expects_it(tmp_path, finished, monkeypatch, capsys):
    monkeypatch.setenv("HYBRIDTRON_CACHE", str(finished.parent / "cache"))
    wild = [*FAST, "--set", "train.lr=30", "--set", "train.grad_clip=0", "--set", "train.val_every=2",
            "--set", "monitor.on_nonfinite=warn", "--set", "monitor.on_loss_spike=warn", "--quiet"]
    assert main(["pretrain", "--out", str(tmp_path / "a"), "--steps", "4", *wild]) == 4
    err = capsys.readouterr().err
    assert "the run diverged" in err and "Traceback" not in err
    assert main(["pretrain", "--out", str(tmp_path / "b"), "--steps", "4", *wild,
                 "--set", "monitor.expect_divergence=true"]) == 0
    assert "this drill exits 0" in capsys.readouterr().err


class Crash(Exception):
    """What a `kill -9` leaves, in process: the run stops after a step, before its next checkpoint."""


def test_a_resumed_run_does_not_count_the_abandoned_steps_events_twice(tmp_path, finished, monkeypatch):
    """A fault injected at step 3 fires again when a run killed after step 3 resumes from its step-2 checkpoint;
    the first firing's event moves to events.abandoned.jsonl, so the run's events hold it once."""
    monkeypatch.setenv("HYBRIDTRON_CACHE", str(finished.parent / "cache"))
    out = tmp_path / "run"
    drill = [*FAST, "--set", "monitor.inject_fault=lr_spike@3", "--set", "monitor.inject_lr_factor=1.5",
             "--set", "monitor.on_loss_spike=warn", "--quiet"]
    original = hooks.MetricsLogger.on_step_end

    def crash_after_step_3(self, trainer, stats, decision):
        original(self, trainer, stats, decision)
        if stats.step == 3:
            raise Crash

    monkeypatch.setattr(hooks.MetricsLogger, "on_step_end", crash_after_step_3)
    with pytest.raises(Crash):
        main(["pretrain", "--out", str(out), "--steps", "5", *drill])
    monkeypatch.setattr(hooks.MetricsLogger, "on_step_end", original)
    assert [e["step"] for e in records(out / EVENTS_FILE) if e["detector"] == "inject"] == [3]
    assert main(["pretrain", "--out", str(out), "--steps", "5", *drill, "--resume"]) == 0
    events = records(out / EVENTS_FILE)
    assert [e["step"] for e in events if e["detector"] == "inject"] == [3], "once in the run's events"
    assert [e["step"] for e in records(out / ABANDONED_EVENTS_FILE) if e["detector"] == "inject"] == [3]
    assert [e["step"] for e in events if e["action"] == "resume"] == [2]


@pytest.mark.parametrize("number, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_checkpoints_the_finished_step_and_says_how_to_resume(tmp_path, finished, monkeypatch, capsys,
                                                                      number, code):
    """Ctrl-C (SIGINT) or SIGTERM mid-run: the step finishes, a checkpoint holds it, one line says where and how to
    resume, the exit status is the shell's for that signal, no traceback; --resume continues from there. The signal
    goes to a real process (its handlers and exit status are the point); the resume runs in this one."""
    out = tmp_path / "run"
    env = {**os.environ, "HYBRIDTRON_CACHE": str(finished.parent / "cache"), "PYTHONUNBUFFERED": "1"}
    args = ["pretrain", "--out", str(out), "--steps", "200", *FAST, "--set", "train.checkpoint_every=1000", "--quiet"]
    process = subprocess.Popen([sys.executable, "-m", "hybridtron", *args], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not [r for r in records(out / "metrics.jsonl") if r.get("step", 0) >= 2]:
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.2)
    process.send_signal(number)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == code, stderr
    assert "Traceback" not in stderr
    [line] = [line for line in stderr.splitlines() if line.startswith("hybridtron pretrain: interrupted")]
    step = next(e["step"] for e in records(out / EVENTS_FILE) if e["action"] == "interrupted")
    assert f"checkpoint {out / 'checkpoints' / f'step_{step:06d}'}" in line
    assert f"resume with: hybridtron pretrain --out {out} --resume" in line
    assert (out / "checkpoints" / f"step_{step:06d}" / "COMPLETE").exists()
    monkeypatch.setenv("HYBRIDTRON_CACHE", env["HYBRIDTRON_CACHE"])
    capsys.readouterr()
    assert main([*args[:args.index("--steps")], "--steps", str(step + 1), "--resume", "--quiet"]) == 0
    assert f"resumed from {out / 'checkpoints' / f'step_{step:06d}'} (step {step})" in capsys.readouterr().err


def test_resume_below_the_checkpoints_step_is_refused_before_anything_changes(run_dir, capsys):
    shutil.rmtree(run_dir / "hf")  # unfinished: its last checkpoint is step 3
    saved = (run_dir / RUN_CONFIG).read_bytes()
    assert main(["pretrain", "--out", str(run_dir), "--resume", "--steps", "2", "--quiet"]) == 2
    assert "the run's checkpoint is at step 3, past train.steps=2; give --steps N with N >= 3" in \
        capsys.readouterr().err
    assert (run_dir / RUN_CONFIG).read_bytes() == saved


def test_resuming_another_commands_run_says_so(run_dir, capsys):
    assert main(["sft", "--out", str(run_dir), "--resume"]) == 2
    assert "not a run config of this command" in capsys.readouterr().err
