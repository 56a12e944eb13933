"""The long-context phase (`hybridtron pretrain --phase long_context`, train/long_context.py): the length schedule
hits its shares at every prefix and never mixes lengths in an iteration; a phase from a pretrained checkpoint (its
HF export, or a DCP step directory) trains every iteration on a fixed token budget at one length from that length's
source, documents masked, at a constant LR; its report counts iterations and tokens per length; a run stopped
mid-phase and resumed gives the uninterrupted run's losses bit for bit; bad input is one line."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from hybridtron.cli import main
from hybridtron.files import METRICS_FILE
from hybridtron.train import pretrain
from hybridtron.train.evaluate import HeldOutLoss
from hybridtron.train.long_context import PHASE_REPORT, LengthSchedule, LongContextConfig, PhaseBatches


def test_the_schedule_hits_its_shares_at_every_prefix():
    schedule = LengthSchedule((2048, 256), (0.92, 0.08))
    drawn = [schedule.next() for _ in range(1000)]
    for prefix in range(1, 1001):
        assert abs(drawn[:prefix].count(256) - 0.08 * prefix) <= 1
    assert drawn.count(256) == 80 and schedule.plan(1000) == [920, 80]
    three = LengthSchedule((8, 4, 2), (0.5, 0.3, 0.2))
    assert [three.plan(n) for n in (10, 100)] == [[5, 3, 2], [50, 30, 20]]


class _Rows:
    """A loader of rows of one length, whose position is how many it gave."""

    def __init__(self, length):
        self.length, self.given = length, 0

    def __next__(self):
        self.given += 1
        return torch.full((2, self.length), self.given)

    def state_dict(self):
        return {"given": self.given}

    def load_state_dict(self, state):
        self.given = state["given"]


def test_an_iteration_is_one_length_and_a_resumed_source_continues_where_it_stopped():
    def source():
        return PhaseBatches(LengthSchedule((16, 4), (0.75, 0.25)), {16: _Rows(16), 4: _Rows(4)}, grad_accum=3)

    whole = source()
    steps = [whole.next_step() for _ in range(12)]
    assert all(len({batch.shape[1] for batch in step}) == 1 and len(step) == 3 for step in steps)
    assert [step[0].shape[1] for step in steps].count(4) == 3
    first, second = source(), source()
    for _ in range(5):
        first.next_step()
    second.load_state_dict(first.state_dict())
    for want in steps[5:]:
        assert all(torch.equal(a, b) for a, b in zip(second.next_step(), want))


@pytest.mark.parametrize("change, message", [
    ({"lengths": (64, 32), "shares": (1.0,)}, "phase.shares: expected one entry per length"),
    ({"shares": (0.5, 0.4)}, "phase.shares: expected non-negative shares that sum to 1"),
    ({"tokens_per_iteration": 100}, "phase.tokens_per_iteration: 100 is not a whole number of rows"),
])
def test_a_bad_phase_section_is_one_line(change, message):
    with pytest.raises(ValueError, match=message):
        LongContextConfig(**change).validate()


def _phase_args(trained_run, out, steps, *, resume=False, source=None):
    overrides = ["phase.lengths=512,128", "phase.shares=0.75,0.25", "phase.tokens_per_iteration=1024",
                 "phase.sources=stdlib-repos,env:math", "phase.env_examples=64",
                 "data.families=json,text,functional", "data.max_repo_chars=4096", "data.val_batches=1",
                 "data.val_fraction=0",
                 f"data.cache_dir={trained_run.parent / 'cache'}", "train.grad_accum=2", "train.val_every=2",
                 "train.checkpoint_every=2"]
    return argparse.Namespace(preset=None, phase="long_context", out=str(out), steps=steps, config=None,
                              overrides=[] if resume else overrides, resume=resume, quiet=True, print_config=False,
                              **{"from": None if resume else str(source or trained_run / "hf")})


def _losses(out):
    return [(line["step"], line.get("loss"), line.get("val_loss"), line.get("val_loss_128"))
            for line in map(json.loads, (out / METRICS_FILE).read_text().splitlines())]


def _summary(capsys) -> str:
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("validation loss"))


def test_a_phase_from_a_checkpoint_trains_each_length_on_its_source_and_resumes_bit_for_bit(trained_run, tmp_path,
                                                                                           capsys):
    whole = tmp_path / "whole"
    assert pretrain.run(_phase_args(trained_run, whole, 4)) == 0
    summary = _summary(capsys)
    report = json.loads((whole / PHASE_REPORT).read_text())
    rows = {row["length"]: row for row in report["lengths"]}
    assert rows[512]["iterations"] == 3 and rows[128]["iterations"] == 1
    assert rows[512]["tokens"] == 3 * 1024 and rows[512]["rows_per_iteration"] == 2
    assert rows[128]["source"] == "env:math" and rows[128]["rows_per_iteration"] == 8
    lines = [json.loads(line) for line in (whole / METRICS_FILE).read_text().splitlines()]
    assert {line["lr"] for line in lines if "lr" in line} == {3e-4}  # constant
    assert (whole / "hf" / "tokenizer.json").is_file()

    stopped = tmp_path / "stopped"
    assert pretrain.run(_phase_args(trained_run, stopped, 2)) == 0
    capsys.readouterr()
    assert pretrain.run(_phase_args(trained_run, stopped, 4, resume=True)) == 0
    assert _losses(stopped) == _losses(whole)
    assert _summary(capsys) == summary  # the held-out history resumed with the run
    assert json.loads((stopped / PHASE_REPORT).read_text()) == report


def test_a_phase_starts_from_a_training_checkpoint(trained_run, tmp_path):
    step = sorted((trained_run / "checkpoints").glob("step_*"))[-1]
    assert pretrain.run(_phase_args(trained_run, tmp_path / "run", 1, source=step)) == 0


def test_bad_phase_input_is_one_line(trained_run, tmp_path, capsys):
    no_tokenizer = tmp_path / "bare"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((trained_run / "hf" / "config.json").read_text())
    assert main(["pretrain", "--phase", "long_context", "--from", str(no_tokenizer), "--out",
                 str(tmp_path / "a")]) == 2
    assert "no tokenizer files" in capsys.readouterr().err
    assert main(["pretrain", "--from", str(trained_run / "hf"), "--out", str(tmp_path / "b")]) == 2
    assert "add --phase long_context" in capsys.readouterr().err
    assert main(["pretrain", "--phase", "long_context", "--from", str(trained_run / "hf"), "--out",
                 str(tmp_path / "c"), "--set", "phase.lengths=100000,128", "--set", "phase.shares=0.5,0.5",
                 "--set", "phase.tokens_per_iteration=6400000"]) == 2
    assert "beyond the model's max_position_embeddings" in capsys.readouterr().err


def test_each_held_out_set_keeps_its_own_history_in_a_checkpoint():
    """The phase's evaluators (val_loss at the first length, val_loss_<L> at the others) are saved under their own
    names; the first keeps the name older checkpoints used."""
    first, second = HeldOutLoss([], 1), HeldOutLoss([], 1, key="val_loss_128")
    assert (first.state_name, second.state_name) == ("HeldOutLoss", "HeldOutLoss:val_loss_128")
