"""The progress bar: durations in whole units, the objective's headline labelled as the validation loss is, one line
redrawn in place on a terminal and plain lines (no carriage returns) into a file or a pipe."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from hybridtron.train.hooks import ProgressBar, format_duration
from hybridtron.train.monitor import Decision
from hybridtron.train.objectives import PretrainObjective
from hybridtron.train.stats import StepStats


@pytest.mark.parametrize("seconds, text", [
    (0, "0s"), (-3, "0s"), (12.4, "12s"), (59.4, "59s"), (59.6, "1m00s"), (245, "4m05s"),
    (2159.6, "36m00s"),  # rounded once, before splitting: never "35m60s"
    (3599.4, "59m59s"), (3599.6, "1h00m"), (7380, "2h03m"), (7379.9, "2h03m"),
])
def test_format_duration_uses_whole_units(seconds, text):
    assert format_duration(seconds) == text


class Terminal(io.StringIO):
    def isatty(self):
        return True


def drive(stream, total: int = 25, val_every: int = 10) -> str:
    """Run the bar over `total` fake pretraining steps: the total loss (with MTP) 9.x, the CE 5.x."""
    bar = ProgressBar(stream)
    trainer = SimpleNamespace(step=0, schedule=SimpleNamespace(total_steps=total), objective=PretrainObjective())
    bar.on_train_start(trainer)
    for step in range(1, total + 1):
        trainer.step = step
        evaluation = {"val_loss": 4.5 + 1 / step} if step % val_every == 0 else {}
        stats = StepStats(step=step, lr=1e-3, losses={"loss": 9 + 1 / step, "lm_loss": 5 + 1 / step}, tokens=1024,
                          expert_counts={}, seconds=0.5, evaluation=evaluation)
        bar.on_step_end(trainer, stats, Decision())
    return stream.getvalue()


def test_the_bar_shows_the_cross_entropy_labelled_as_the_validation_loss():
    assert PretrainObjective.headline == ("lm_loss", "ce")
    lines = drive(io.StringIO()).splitlines()
    assert lines[0].startswith("step 10/25 ce 5.100 val ce 4.600 2048 tok/s ETA ")
    assert "9.1" not in lines[0], "the total with MTP is not what the bar shows"
    assert lines[-1].startswith("step 25/25 ce 5.040 val ce 4.550")  # the last validation value stays shown


def test_into_a_file_or_pipe_plain_lines_without_carriage_returns():
    text = drive(io.StringIO())
    assert "\r" not in text
    assert [line.split()[1] for line in text.splitlines()] == ["10/25", "20/25", "25/25"]


def test_on_a_terminal_one_line_redrawn_in_place():
    text = drive(Terminal())
    assert text.count("\r") == 25 and text.endswith("\n") and text.count("\n") == 1
    assert "[############################] 25/25 ce 5.040" in text
