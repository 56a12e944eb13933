"""pipeline.html: a stage that logged one or two steps (every stage of the micro preset) still shows its points."""

from __future__ import annotations

import json

from hybridtron.train import report


def one_step_run(directory):
    directory.mkdir()
    lines = [{"step": 0, "val_loss": 6.3}, {"step": 1, "loss": 6.4, "lm_loss": 6.2, "mtp_loss_1": 6.6, "val_loss": 6.1,
                                            "reward_mean": 0.5, "reverse_kl": 0.2}]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return report.load_run(directory)


def test_single_point_series_are_drawn_with_markers(tmp_path, monkeypatch):
    figures = []
    real_png = report.figure_png
    monkeypatch.setattr(report, "figure_png", lambda plt, figure: (figures.append(figure), real_png(plt, figure))[1])
    data = one_step_run(tmp_path / "stage")
    report.plot_losses(data)
    report.plot_rl(data)
    lines = [line for figure in figures for axes in figure.axes for line in axes.get_lines()
             if line.get_label() in ("loss", "lm_loss", "mtp_loss_1", "reward_mean")]
    assert {line.get_label() for line in lines} == {"loss", "lm_loss", "mtp_loss_1", "reward_mean"}
    assert all(line.get_marker() == "o" for line in lines), [(line.get_label(), line.get_marker()) for line in lines]
    assert report.point_markers(2) == {"marker": "o"} and report.point_markers(3) == {}
