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
from hybridtron.train.config import build_run_config

N_PLOTS = len(report.PLOTS)


def fake_run(run_dir: Path, steps: int = 60, nvfp4: bool = False, partial_line: bool = True,
             mtp_router: bool = False) -> Path:
    """A run directory as pretrain and the monitor write it: every signal, a NaN, a rollback, events, and (by
    default) a half-written last line, as while the run is still going. `mtp_router`: the MTP block's router
    (`mtp.1`) logs MaxVio and bias spread beside the backbone's."""
    rng = random.Random(0)
    run_dir.mkdir(parents=True)
    precision = "nvfp4" if nvfp4 else "fp32"
    (run_dir / "run_config.json").write_text(json.dumps(build_run_config(
        overrides=[f"train.precision={precision}", f"train.steps={steps}"]).to_dict(), default=str))
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


def test_the_mtp_router_is_named_in_the_summary_and_the_heatmap(tmp_path, capsys, monkeypatch):
    labels = []
    real_png = report._png

    def keep_labels(plt, figure):
        labels.append([tick.get_text() for axes in figure.axes for tick in axes.get_yticklabels()])
        return real_png(plt, figure)

    monkeypatch.setattr(report, "_png", keep_labels)
    write_report(fake_run(tmp_path / "run", mtp_router=True))
    assert "MaxVio layer 1 2.4, layer 3 1.2, layer 7 1.2, MTP layer 1 1.3, bound E/K 4" in capsys.readouterr().out
    maxvio_labels = labels[[title for title, _, _ in report.PLOTS].index("MaxVio")]
    assert [label for label in maxvio_labels if "layer" in label] == ["layer 1", "layer 3", "layer 7", "MTP layer 1"]
    assert report.router_label("router_bias_spread/mtp.1") == "MTP layer 1"
    assert report.router_label("maxvio/12") == "layer 12"


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


def rendered_title(page: Path, profile: Path) -> str:
    """Load the page in headless Chromium with PROBE added; the title it sets once every image has loaded."""
    probe = page.with_name("probe.html")
    probe.write_text(page.read_text().replace("<head>", "<head>" + PROBE, 1))
    result = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120)
    match = re.search(r"<title>([^<]*)</title>", result.stdout)
    assert match, f"Chromium printed no DOM (exit {result.returncode}): {result.stderr[-500:]}"
    return match.group(1)


def test_every_plot_renders_in_headless_chromium(tmp_path):
    page = write_report(fake_run(tmp_path / "run", nvfp4=True))
    assert rendered_title(page, tmp_path / "profile") == f"decoded {N_PLOTS} of {N_PLOTS} errors 0"
    # the probe does catch a plot that does not decode
    broken = page.read_text().replace("base64,iVBOR", "base64,AAAA", 1)
    page.write_text(broken)
    assert rendered_title(page, tmp_path / "profile2") == f"decoded {N_PLOTS - 1} of {N_PLOTS} errors 1"
