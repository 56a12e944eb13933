"""`hybridtron report`: reads a run directory (finished or still being written), writes one self-contained HTML page
whose every plot is a real picture (decoded here; also in headless Chromium where it is installed), and prints a
terminal summary."""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hybridtron.cli import main as cli_main
from hybridtron.train import report
from hybridtron.train.config import RunConfig, change_config

N_PLOTS = len(report.PLOTS)


def fake_run(run_dir: Path, steps: int = 60, nvfp4: bool = False, partial_line: bool = True,
             mtp_router: bool = False) -> Path:
    """A run directory as pretrain and the monitor write it: every signal, a NaN, a rollback, events, and (by
    default) a half-written last line, as while the run is still going. `mtp_router`: the MTP block's router
    (`mtp.1`) logs MaxVio and bias spread beside the backbone's."""
    rng = random.Random(0)
    run_dir.mkdir(parents=True)
    precision = "nvfp4" if nvfp4 else "fp32"
    (run_dir / "run_config.json").write_text(json.dumps(change_config(
        RunConfig(), overrides=[f"train.precision={precision}", f"train.steps={steps}"]).to_dict(), default=str))
    lines, aside = [{"step": 0, "val_loss": 8.3}], []
    for step in range(1, steps + 1):
        loss = 3 + 5 * math.exp(-step / 15) + rng.gauss(0, 0.1)
        line = {"step": step, "loss": loss + 0.3, "lm_loss": loss, "mtp_loss_1": loss + 0.4, "mtp_loss_2": loss + 0.5,
                "lr": 3e-3, "grad_norm": 1 + rng.random(), "tokens_per_s": 1000.0,
                **{f"wgrad_norm/layer.{i}": 0.1 * (i + 1) for i in range(8)}, "wgrad_norm/lm_head": 0.8,
                **{f"maxvio/{i}": 1.2 + 0.02 * step * (i == 1) for i in (1, 3, 7)},
                **{f"router_bias_spread/{i}": 0.001 * step for i in (1, 3, 7)}}
        if mtp_router:
            line.update({"maxvio/mtp.1": 1.3, "router_bias_spread/mtp.1": 0.002 * step})
        if step % 10 == 0 or step == 1:
            line.update({f"residual_rms/{i}": 0.5 * 1.3 ** i for i in range(8)}, update_ratio=1e-3,
                        **{"update_ratio/lm_head": 2e-3})
            if nvfp4:
                line.update({f"underflow/backbone.layers.{i}.mixer.in_proj": 0.05 + 0.01 * i for i in (0, 4, 6)})
        if step == 30:
            line["grad_norm"] = "nan"  # how the metrics logger writes a non-finite float
            line.update(skipped=True, events=["nonfinite:skip"])
        lines.append(line)
        if step in (41, 42, 43):
            aside.append({**line, "rolled_back": 1})
    events = [{"time": 0, "step": 0, "detector": "checkpoint", "action": "mark_good", "message": "step 0"},
              {"time": 1, "step": 30, "detector": "nonfinite", "action": "skip", "message": "non-finite grad_norm"},
              {"time": 2, "step": 43, "detector": "loss_spike", "action": "rollback", "message": "lm_loss <b>9</b>"},
              {"time": 3, "step": 43, "detector": "monitor", "action": "rolled_back", "message": "step 43 -> 40",
               "target_step": 40}]
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if partial_line:
        text += '{"step": 61, "loss": 3.1, "lm_lo'
    (run_dir / "metrics.jsonl").write_text(text)
    (run_dir / "metrics.rolled_back.jsonl").write_text("".join(json.dumps(line) + "\n" for line in aside))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(event) + "\n" for event in events))
    return run_dir


def write_report(run_dir: Path) -> Path:
    assert report.run(argparse.Namespace(run_dir=str(run_dir), out=None)) == 0
    return run_dir / "report.html"


def images(page: str) -> list[bytes]:
    return [base64.b64decode(data) for data in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def test_page_embeds_every_plot_and_the_summary_names_the_signals(tmp_path, capsys):
    page = write_report(fake_run(tmp_path / "run")).read_text()
    pngs = images(page)
    assert len(pngs) == N_PLOTS and all(png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 2000 for png in pngs)
    assert "src=\"http" not in page and "<link" not in page, "self-contained: nothing fetched"
    out = capsys.readouterr().out
    assert "step 60 of 60, running" in out, "the half-written line 61 is ignored; no HF export yet"
    assert "MaxVio layer 1 2.4, layer 3 1.2, layer 7 1.2, bound E/K 4" in out
    assert "1 skip" in out and "1 rolled_back" in out
    assert "3 metric lines of abandoned steps" in out
    assert "not an NVFP4" not in out and "none logged (train.precision = fp32" in out
    assert "lm_loss &lt;b&gt;9&lt;/b&gt;" in page, "event messages are escaped"


def test_nvfp4_underflow_is_summarised(tmp_path, capsys):
    write_report(fake_run(tmp_path / "run", nvfp4=True))
    assert "NVFP4 underflow: worst backbone.layers.6.mixer.in_proj 11.0%" in capsys.readouterr().out


def test_a_run_that_just_started_still_gets_a_page(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "val_loss": 8.3}\n{"step": 1, "lo')
    assert len(images(write_report(run_dir).read_text())) == N_PLOTS


def test_mistakes_are_clear_errors(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no such run directory"):
        report.load_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert cli_main(["report", str(tmp_path / "empty")]) == 2
    assert "metrics.jsonl: missing" in capsys.readouterr().err
    run_dir = fake_run(tmp_path / "run", partial_line=False)
    text = (run_dir / "metrics.jsonl").read_text().splitlines()
    text[5] = text[5][:20]  # a broken line in the middle is corruption, not a run still writing
    (run_dir / "metrics.jsonl").write_text("\n".join(text) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:6: not a JSON line"):
        report.load_run(run_dir)


def test_every_plot_is_a_real_picture(tmp_path):
    """Without a browser: each embedded PNG decodes, has the figure's size, and draws something (a plot, not a
    blank canvas); one per plot, and no two alike."""
    from matplotlib import image

    pngs = images(write_report(fake_run(tmp_path / "run", nvfp4=True)).read_text())
    assert len(pngs) == N_PLOTS
    assert len(set(pngs)) == N_PLOTS, "every plot is its own picture"
    for (title, _, _), png in zip(report.PLOTS, pngs):
        pixels = image.imread(io.BytesIO(png), format="png")
        height, width = pixels.shape[:2]
        assert width == 900 and 100 <= height <= 900, f"{title}: {width}x{height}"  # 10 inches at 90 dpi
        rgb = pixels[..., :3].reshape(-1, 3)
        inked = (rgb < 0.9).any(axis=1).mean()  # share of pixels that are not (near) white
        assert 0.01 < inked < 0.9, f"{title}: {inked:.1%} of the pixels drawn"
        assert len({tuple(p) for p in rgb[:: max(1, len(rgb) // 20000)]}) > 20, f"{title}: too few colours"


@pytest.fixture
def drawn_figures(monkeypatch):
    """Every figure the report draws, by plot title, after the report laid it out and saved it."""
    figures = []
    real_png = report.figure_png

    def keep(plt, figure):
        png = real_png(plt, figure)
        figures.append(figure)
        return png

    monkeypatch.setattr(report, "figure_png", keep)
    titles = [title for title, _, _ in report.PLOTS]
    return lambda: dict(zip(titles, figures))


def test_the_mtp_router_is_named_in_the_summary_and_the_heatmap(tmp_path, capsys, drawn_figures):
    write_report(fake_run(tmp_path / "run", mtp_router=True))
    assert "MaxVio layer 1 2.4, layer 3 1.2, layer 7 1.2, MTP layer 1 1.3, bound E/K 4" in capsys.readouterr().out
    maxvio_labels = [tick.get_text() for axes in drawn_figures()["MaxVio"].axes for tick in axes.get_yticklabels()]
    assert [label for label in maxvio_labels if "layer" in label] == ["layer 1", "layer 3", "layer 7", "MTP layer 1"]
    assert report.router_label("router_bias_spread/mtp.1") == "MTP layer 1"
    assert report.router_label("maxvio/12") == "layer 12"


def test_centered_mean():
    """Centred: a straight line comes back as it is, ends included (the window shrinks there, it does not lag);
    a swing averages out; a NaN step is left out of its neighbours' means."""
    ramp = [2.0 * i + 1 for i in range(20)]
    assert report.centered_mean(ramp, 7) == pytest.approx(ramp)
    swing = [5.0 + (1.5 if i % 2 else -1.5) for i in range(21)]
    assert report.centered_mean(swing, 9)[4:-4] == pytest.approx([5.0 + 1.5 / 9 * (1 if i % 2 else -1)
                                                                   for i in range(4, 17)])
    with_nan = report.centered_mean([1.0, 2.0, math.nan, 4.0, 5.0], 3)
    assert with_nan == pytest.approx([1.0, 1.5, 3.0, 4.5, 5.0])
    assert math.isnan(report.centered_mean([math.nan] * 3, 3)[1])
    assert report.loss_smoothing_window(400) == 33 and report.loss_smoothing_window(60) == 5
    assert report.loss_smoothing_window(11) == 1


def test_loss_panel_draws_a_smoothed_line_over_the_faint_steps(tmp_path, drawn_figures):
    """Each loss: the per-step values faint, and over them a centered moving average, which the legend names (its
    window and kind); the smoothed line swings far less than the raw one."""
    run_dir = fake_run(tmp_path / "run", steps=120)
    write_report(run_dir)
    axes = drawn_figures()["Losses"].axes[0]
    data = report.load_run(run_dir)
    window = report.loss_smoothing_window(120)
    legend = axes.get_legend()
    assert f"centered mean\nof {window} steps" in legend.get_title().get_text()
    assert [text.get_text() for text in legend.get_texts()] == ["loss", "lm_loss", "mtp_loss_1", "mtp_loss_2",
                                                                "val_loss"]
    lines = {line.get_label(): line for line in axes.lines}
    for key in ("loss", "lm_loss", "mtp_loss_1", "mtp_loss_2"):
        steps, raw = data.steps(key)
        smooth = lines[key]
        assert list(smooth.get_xdata()) == steps
        assert list(smooth.get_ydata()) == pytest.approx(report.centered_mean(raw, window), nan_ok=True)
        faint = [line for line in axes.lines if line.get_alpha() is not None and line.get_alpha() <= 0.3
                 and list(line.get_ydata()) == pytest.approx(raw, nan_ok=True)]
        assert len(faint) == 1 and faint[0].get_color() == smooth.get_color(), key

        def swing(values):
            finite = [v for v in values if math.isfinite(v)]
            return sum(abs(b - a) for a, b in zip(finite, finite[1:]))

        assert swing(smooth.get_ydata()) < 0.5 * swing(raw), key


def test_legends_sit_outside_the_data(tmp_path, drawn_figures):
    """Every legend of every plot lies outside its axes (beside or below them, not over the curves) and inside the
    picture (not cut off)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    write_report(fake_run(tmp_path / "run", nvfp4=True))
    checked = 0
    for title, figure in drawn_figures().items():
        renderer = FigureCanvasAgg(figure).get_renderer()  # a closed figure's canvas no longer renders
        picture = figure.bbox
        for axes in figure.axes:
            legend = axes.get_legend()
            if legend is None:
                continue
            box, data_box = legend.get_window_extent(renderer), axes.get_window_extent(renderer)
            assert not box.overlaps(data_box), f"{title}: the legend covers the axes"
            assert picture.x0 <= box.x0 and box.x1 <= picture.x1 and picture.y0 <= box.y0 and box.y1 <= picture.y1, \
                f"{title}: the legend runs off the picture"
            checked += 1
    assert checked >= 6  # losses, gradient norms, residual RMS, two balance panels, events


def test_the_events_heading_appears_once(tmp_path):
    page = write_report(fake_run(tmp_path / "run")).read_text()
    assert len(re.findall(r"<h2>Events</h2>", page)) == 1
    heading, table = page.index("<h2>Events</h2>"), page.index("<th>detector</th>")
    assert heading < table and page.count("<table>") == 1


# ------------------------------------------------------------------------------------- headless Chromium
PROBE = """<script>
var errors = 0;
window.addEventListener('error', function () { errors += 1; }, true);
window.addEventListener('load', function () {
  var images = Array.prototype.slice.call(document.images);
  var decoded = images.filter(function (img) { return img.complete && img.naturalWidth > 0; }).length;
  document.title = 'decoded ' + decoded + ' of ' + images.length + ' errors ' + errors;
});
</script>"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("headless Chromium not found (Debian: apt-get install -y chromium)")


def rendered_title(page: Path, profile: Path, probe_script: str = PROBE) -> str:
    """Load the page in headless Chromium with `probe_script` added; the title it sets once the page has loaded."""
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("<head>", "<head>" + probe_script, 1))
    result = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120)
    match = re.search(r"<title>([^<]*)</title>", result.stdout)
    assert match, f"Chromium printed no DOM (exit {result.returncode}): {result.stderr[-500:]}"
    return match.group(1)


SUMMARY_PROBE = """<script>
window.addEventListener('load', function () {
  var summary = document.querySelector('pre');
  document.title = 'summary overflows by ' + Math.max(0, summary.scrollWidth - summary.clientWidth) + ' px, right edge '
    + Math.round(summary.getBoundingClientRect().right) + ' of ' + document.documentElement.clientWidth;
});
</script>"""


def test_the_summary_box_is_not_cut_off_in_headless_chromium(tmp_path):
    """A summary line longer than the page is wide (a long event message) wraps inside the box: nothing of it is
    hidden past the box's edge (Chromium's default window, 800 px wide)."""
    run_dir = fake_run(tmp_path / "run")
    long_message = "lm_loss 9.41 is 3.2 standard deviations above its EMA 3.05; a rollback to " + "/very/long" * 12
    with (run_dir / "events.jsonl").open("a") as events:
        events.write(json.dumps({"time": 4, "step": 50, "detector": "loss_spike", "action": "warn",
                                 "message": long_message}) + "\n")
    page = write_report(run_dir)
    title = rendered_title(page, tmp_path / "profile", SUMMARY_PROBE)
    overflow, right, width = map(int, re.fullmatch(r"summary overflows by (\d+) px, right edge (\d+) of (\d+)",
                                                   title).groups())
    assert overflow == 0 and right <= width, title


def test_every_plot_renders_in_headless_chromium(tmp_path):
    page = write_report(fake_run(tmp_path / "run", nvfp4=True))
    assert rendered_title(page, tmp_path / "profile") == f"decoded {N_PLOTS} of {N_PLOTS} errors 0"
    # the probe does catch a plot that does not decode
    broken = page.read_text().replace("base64,iVBOR", "base64,AAAA", 1)
    page.write_text(broken)
    assert rendered_title(page, tmp_path / "profile2") == f"decoded {N_PLOTS - 1} of {N_PLOTS} errors 1"
