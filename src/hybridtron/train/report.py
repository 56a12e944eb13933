"""`hybridtron report RUN_DIR`: a self-contained HTML page of a run's stability signals, and a terminal summary.

Reads what a run writes (run_config.json, metrics.jsonl, metrics.rolled_back.jsonl, events.jsonl; see
hybridtron.train.monitor) and draws, as PNGs embedded in the page (matplotlib, Agg backend, no files beside it):

    losses           loss, lm_loss, each MTP depth (each step faint, a centered moving average over it), validation
                     loss; steps a rollback abandoned drawn as dots
    gradient norms   global, the output layer (lm_head) and every layer's weight-gradient L2 norm (log scale)
    MaxVio heatmap   router x step (every backbone MoE layer and the MTP block's), colour scale from 1 (balanced)
                     to the bound E/K
    residual RMS     per layer over time (log scale)
    NVFP4 underflow  heatmap, quantized module x step: share of values flushed to zero (or a note: not quantized)
    balance/updates  router bias spread per router, update-to-weight ratio, learning rate
    events           every detection and action on a step axis

It works on a run that is still going: a half-written last line is ignored, and missing signals become notes.
Legends sit beside or below their axes, never over the curves.
Routers are named as the metrics name them (`maxvio/3`: backbone layer 3, `maxvio/mtp.1`: the MTP block's layer 1)
and labelled "layer 3" and "MTP layer 1".
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from hybridtron.files import RUN_CONFIG
from hybridtron.train.balance import max_violation_bound
from hybridtron.train.monitor import EVENTS_FILE, ROLLED_BACK_FILE

ACTION_STYLE = {  # colour and marker of each event action on the plots
    "warn": ("#b8860b", "o"), "skip": ("#ff7f0e", "v"), "rollback": ("#d62728", "X"), "anneal": ("#9467bd", "X"),
    "rolled_back": ("#d62728", "s"), "annealed": ("#9467bd", "s"), "mark_good": ("#2ca02c", "^"),
    "give_up": ("#000000", "X"), "resume": ("#1f77b4", "D"),
}
INTERVENTIONS = ("skip", "rollback", "anneal", "rolled_back", "annealed", "give_up")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory written by `hybridtron pretrain` (finished or running)")
    parser.add_argument("--out", help="where to write the HTML page (default: RUN_DIR/report.html)")


def run(args) -> int:
    run_dir = Path(args.run_dir)
    data = load_run(run_dir)
    out = Path(args.out) if args.out else run_dir / "report.html"
    out.write_text(render_html(data))
    print(summary(data))
    print(f"report: {out}")
    return 0


# ================================================================================================ reading
def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file; a half-written last line (a run still writing) is ignored. Non-finite
    numbers, which the metrics logger writes as strings ("nan", "inf"), come back as floats."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not text.endswith("\n"):
                break  # the last line is still being written
            raise ValueError(f"{path}:{number}: not a JSON line: {line[:80]!r}") from None
        records.append({k: _number(v) for k, v in record.items()})
    return records


def _number(value):
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value.lower().replace("infinity", "inf"))
    return value


@dataclass
class RunData:
    run_dir: Path
    metrics: list[dict]
    rolled_back: list[dict]
    events: list[dict]
    config: dict = field(default_factory=dict)

    def steps(self, key: str, rows: list[dict] | None = None) -> tuple[list[int], list[float]]:
        rows = self.metrics if rows is None else rows
        pairs = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def keys(self, prefix: str) -> list[str]:
        found = {k for row in self.metrics for k in row if k.startswith(prefix)}
        return sorted(found, key=_natural)

    @property
    def bound(self) -> float | None:
        """MaxVio's bound E/K from the run's model config; None without one (a run that has not started)."""

        model = self.config.get("model", {})
        if model.get("n_routed_experts") and model.get("num_experts_per_tok"):
            return max_violation_bound(model["n_routed_experts"], model["num_experts_per_tok"])
        return None

    @property
    def planned_steps(self) -> int | None:
        annealed = [e for e in self.events if e.get("action") == "annealed" and "total_steps" in e]
        if annealed:
            return annealed[-1]["total_steps"]
        return self.config.get("train", {}).get("steps")

    @property
    def last_step(self) -> int:
        return max((r.get("step", 0) for r in self.metrics), default=0)


def _natural(key: str):
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def router_label(key: str) -> str:
    """`maxvio/3` -> "layer 3" (backbone), `router_bias_spread/mtp.1` -> "MTP layer 1" (the MTP block's)."""
    name = key.split("/", 1)[1]
    return f"MTP layer {name.removeprefix('mtp.')}" if name.startswith("mtp.") else f"layer {name}"


def load_run(run_dir: Path) -> RunData:

    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    if not (run_dir / "metrics.jsonl").exists():
        raise FileNotFoundError(f"{run_dir / 'metrics.jsonl'}: missing (not a run directory, or the run has not "
                                f"written its first step yet)")
    config_path = run_dir / RUN_CONFIG
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    return RunData(run_dir, read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / ROLLED_BACK_FILE),
                   read_jsonl(run_dir / EVENTS_FILE), config)


# ================================================================================================ summary
def summary(data: RunData) -> str:
    """A few lines for the terminal: progress, losses, balance, residual spread, events."""

    lines = []
    planned = data.planned_steps
    finished = (data.run_dir / "hf" / "config.json").exists()
    state = "finished" if finished else "running (or stopped)"
    lines.append(f"run {data.run_dir}: step {data.last_step}" + (f" of {planned}" if planned else "") + f", {state}")
    _, losses = data.steps("lm_loss")
    if losses:
        finite = [v for v in losses if math.isfinite(v)]
        lines.append(f"  lm_loss {losses[-1]:.4g} (first {losses[0]:.4g}, min {min(finite):.4g})" if finite
                     else "  lm_loss: no finite value")
    for key in data.keys("mtp_loss_"):
        _, values = data.steps(key)
        lines.append(f"  {key} {values[-1]:.4g}")
    val_steps, val = data.steps("val_loss")
    if val:
        lines.append(f"  val_loss {val[-1]:.4g} at step {val_steps[-1]} (step {val_steps[0]}: {val[0]:.4g})")
    maxvio = {k: data.steps(k)[1][-1] for k in data.keys("maxvio/")}
    if maxvio:
        bound = f", bound E/K {data.bound:.4g}" if data.bound else ""
        lines.append("  MaxVio " + ", ".join(f"{router_label(k)} {v:.3g}" for k, v in maxvio.items()) + bound)
    residual = _last_sample(data, "residual_rms/")
    if len(residual) >= 2 and min(residual.values()) > 0:
        spread = math.log10(max(residual.values()) / min(residual.values()))
        lines.append(f"  residual RMS across layers: {min(residual.values()):.3g} .. {max(residual.values()):.3g} "
                     f"({spread:.2f} orders of magnitude)")
    underflow = _last_sample(data, "underflow/")
    if underflow:
        worst = max(underflow, key=underflow.get)
        lines.append(f"  NVFP4 underflow: worst {worst.split('/', 1)[1]} {underflow[worst]:.1%}")
    else:
        precision = data.config.get("train", {}).get("precision", "unknown")
        lines.append(f"  NVFP4 underflow: none logged (train.precision = {precision}: no quantized module)")
    counts: dict[str, int] = {}
    for event in data.events:
        counts[event.get("action", "?")] = counts.get(event.get("action", "?"), 0) + 1
    lines.append("  events: " + (", ".join(f"{n} {a}" for a, n in sorted(counts.items())) or "none"))
    for event in [e for e in data.events if e.get("action") not in ("mark_good",)][-5:]:
        lines.append(f"    step {event.get('step')}: {event.get('detector')} -> {event.get('action')}: "
                     f"{event.get('message', '')}")
    if data.rolled_back:
        lines.append(f"  {len(data.rolled_back)} metric lines of abandoned steps in {ROLLED_BACK_FILE}")
    return "\n".join(lines)


def _last_sample(data: RunData, prefix: str) -> dict[str, float]:
    """The newest line that carries any `prefix` key: those keys and values."""
    for row in reversed(data.metrics):
        values = {k: float(v) for k, v in row.items() if k.startswith(prefix) and isinstance(v, (int, float))}
        if values:
            return values
    return {}


# ================================================================================================== plots
def new_figure(height: float = 3.2):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(10, height), dpi=90)
    return plt, figure, axes


def figure_png(plt, figure) -> str:
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _event_lines(axes, data: RunData) -> None:
    """Vertical lines where the monitor intervened (skips, rollbacks, anneals)."""
    for event in data.events:
        if event.get("action") in INTERVENTIONS:
            color, _ = ACTION_STYLE.get(event["action"], ("#444444", "o"))
            axes.axvline(event["step"], color=color, alpha=0.35, linewidth=1)


def _finish_log_plot(axes, data: RunData, empty_note: str, ylabel: str) -> None:
    """A log-scale line plot over steps with the run's events marked, or `empty_note` when nothing was drawn."""
    if not axes.lines:
        _note(axes, empty_note)
        return
    axes.set_yscale("log")
    _event_lines(axes, data)
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    legend_beside(axes)


LEGEND_ROWS = 12  # entries per legend column beside a 3.6-inch plot


def legend_beside(axes, **options) -> None:
    """The legend to the right of the axes, outside the data (the figure's tight layout makes room for it)."""
    entries = len(options.get("handles") or axes.get_legend_handles_labels()[0])
    axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize=7,
                ncol=max(1, math.ceil(entries / LEGEND_ROWS)), **options)


def _legend_below(axes, columns: int = 2) -> None:
    """The legend under the axes' step label, for the small panels of a grid, where beside would squeeze them."""
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), borderaxespad=0, fontsize=7, ncol=columns)


def _note(axes, text: str) -> None:
    axes.text(0.5, 0.5, text, ha="center", va="center", transform=axes.transAxes, fontsize=11, color="#555555")
    axes.set_xticks([])
    axes.set_yticks([])


def centered_mean(values: list[float], window: int) -> list[float]:
    """Each value replaced by the mean of the finite values in a window of `window` values centred on it; near the
    ends the window shrinks to stay centred, so the curve neither lags nor leaves the data at the first and last
    step. NaN where a window holds no finite value."""
    sums, counts = [0.0], [0]
    for value in values:
        finite = math.isfinite(value)
        sums.append(sums[-1] + (value if finite else 0.0))
        counts.append(counts[-1] + finite)
    half, last = window // 2, len(values) - 1
    means = []
    for index in range(len(values)):
        reach = min(half, index, last - index)
        count = counts[index + reach + 1] - counts[index - reach]
        means.append((sums[index + reach + 1] - sums[index - reach]) / count if count else math.nan)
    return means


def loss_smoothing_window(points: int) -> int:
    """Logged steps the loss panel averages: about a twelfth of the run, odd (so centred), 1 (none) below 12 steps.
    Batches drawn bucket by bucket swing the per-step loss by 2-3 nats; a twelfth of the run shows the trend."""
    return max(3, round(points / 12)) // 2 * 2 + 1 if points >= 12 else 1


def point_markers(points: int) -> dict:
    """Markers for a series too short to draw as a line (a run of one or two steps: a stage of the micro pipeline)."""
    return {"marker": "o"} if points < 3 else {}


def plot_losses(data: RunData) -> str:
    plt, figure, axes = new_figure(3.6)
    keys = [k for k in ("loss", "lm_loss") if data.steps(k)[0]] + data.keys("mtp_loss_")
    window = loss_smoothing_window(max((len(data.steps(k)[0]) for k in keys), default=0))
    for index, key in enumerate(keys):
        color = f"C{index}"
        steps, values = data.steps(key)
        if window > 1:
            axes.plot(steps, values, color=color, linewidth=0.6, alpha=0.25)
            axes.plot(steps, centered_mean(values, window), label=key, color=color, linewidth=1.4)
        else:
            axes.plot(steps, values, label=key, color=color, linewidth=1, **point_markers(len(steps)))
        old_steps, old_values = data.steps(key, data.rolled_back)
        if old_steps:
            axes.plot(old_steps, old_values, ".", color=color, alpha=0.3, markersize=3)
    val_steps, val = data.steps("val_loss")
    if val:
        axes.plot(val_steps, val, "o-", color="black", label="val_loss", markersize=4, linewidth=1)
    if not keys and not val:
        _note(axes, "no losses logged yet")
    else:
        _event_lines(axes, data)
        axes.set_xlabel("step")
        axes.set_ylabel("cross-entropy (nats)")
        title = f"lines: centered mean\nof {window} steps;\nfaint: each step" if window > 1 and keys else None
        legend_beside(axes, title=title, title_fontsize=7)
        if data.rolled_back:
            axes.set_title("dots: steps abandoned by a rollback", fontsize=9)
    return figure_png(plt, figure)


def plot_grad_norms(data: RunData) -> str:
    plt, figure, axes = new_figure(3.6)
    layers = [k for k in data.keys("wgrad_norm/") if k != "wgrad_norm/lm_head"]
    for index, key in enumerate(layers):
        steps, values = data.steps(key)
        axes.plot(steps, values, linewidth=0.7, alpha=0.6, color=plt.cm.viridis(index / max(len(layers) - 1, 1)),
                  label=key.split("/", 1)[1])
    for key, color in (("grad_norm", "black"), ("wgrad_norm/lm_head", "#d62728")):
        steps, values = data.steps(key)
        if steps:
            axes.plot(steps, values, color=color, linewidth=1.4, label=key)
    _finish_log_plot(axes, data, "no gradient norms logged yet", "L2 norm (before clipping)")
    return figure_png(plt, figure)


def plot_maxvio(data: RunData) -> str:
    import numpy as np
    keys = data.keys("maxvio/")
    plt, figure, axes = new_figure(1.2 + 0.45 * max(len(keys), 2))
    rows = [r for r in data.metrics if any(k in r for k in keys)]
    if not rows:
        _note(axes, "no MaxVio logged (no MoE layer, or no step yet)")
        return figure_png(plt, figure)
    grid = np.array([[float(r.get(k, float("nan"))) for r in rows] for k in keys])
    steps = [r["step"] for r in rows]
    bound = data.bound or float(np.nanmax(grid))
    half = 0.5 * (steps[1] - steps[0]) if len(steps) > 1 else 0.5
    image = axes.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma", vmin=1.0, vmax=bound,
                        extent=(steps[0] - half, steps[-1] + half, len(keys) - 0.5, -0.5))
    axes.set_yticks(range(len(keys)))
    axes.set_yticklabels([router_label(k) for k in keys])
    axes.set_xlabel("step")
    colorbar = figure.colorbar(image, ax=axes)
    colorbar.set_label(f"MaxVio (bound E/K = {bound:.4g})")
    axes.set_title(f"max load / mean load per router; 1 = balanced, {bound:.4g} = every token on the same "
                   f"experts", fontsize=9)
    return figure_png(plt, figure)


def plot_residual(data: RunData) -> str:
    plt, figure, axes = new_figure(3.4)
    keys = data.keys("residual_rms/")
    for index, key in enumerate(keys):
        steps, values = data.steps(key)
        axes.plot(steps, values, ".-", linewidth=1, markersize=3, label=f"layer {key.split('/')[1]}",
                  color=plt.cm.plasma(index / max(len(keys) - 1, 1)))
    _finish_log_plot(axes, data, "no residual RMS sampled yet (monitor.residual_every)", "residual stream RMS")
    return figure_png(plt, figure)


def plot_underflow(data: RunData) -> str:
    """A heatmap, quantized module x sampled step: a real model has hundreds of quantized GEMMs."""
    import numpy as np
    keys = data.keys("underflow/")
    plt, figure, axes = new_figure(1.4 + 0.16 * max(len(keys), 6))
    rows = [r for r in data.metrics if any(k in r for k in keys)]
    if not rows:
        precision = data.config.get("train", {}).get("precision", "unknown")
        _note(axes, f"not an NVFP4 run (train.precision = {precision}): no quantized module to report")
        return figure_png(plt, figure)
    grid = 100 * np.array([[float(r.get(k, float("nan"))) for r in rows] for k in keys])
    image = axes.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0)
    axes.set_yticks(range(len(keys)))
    axes.set_yticklabels([k.split("/", 1)[1].replace("backbone.", "") for k in keys], fontsize=6)
    steps = [r["step"] for r in rows]
    ticks = sorted(set(np.linspace(0, len(steps) - 1, min(len(steps), 8)).round().astype(int)))
    axes.set_xticks(ticks)
    axes.set_xticklabels([steps[i] for i in ticks])
    axes.set_xlabel("step (sampled)")
    figure.colorbar(image, ax=axes).set_label("% of non-zero values flushed to 0")
    return figure_png(plt, figure)


def plot_balance_and_updates(data: RunData) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, (bias_axes, ratio_axes, lr_axes) = plt.subplots(1, 3, figsize=(10, 3.6), dpi=90)
    for key in data.keys("router_bias_spread/"):
        bias_axes.plot(*data.steps(key), linewidth=1, label=router_label(key))
    bias_axes.set_title("router bias spread (max - min)", fontsize=9)
    for key, style in (("update_ratio", "k.-"), ("update_ratio/lm_head", "r.-")):
        steps, values = data.steps(key)
        if steps:
            ratio_axes.plot(steps, values, style, linewidth=1, markersize=3, label=key)
    ratio_axes.set_title("update / weight norm", fontsize=9)
    lr_axes.plot(*data.steps("lr"), color="C0", linewidth=1)
    lr_axes.set_title("learning rate", fontsize=9)
    for axes in (bias_axes, ratio_axes, lr_axes):
        if axes.lines:
            axes.set_xlabel("step")
            if axes is not lr_axes:
                _legend_below(axes)
        else:
            _note(axes, "not logged yet")
    if ratio_axes.lines:
        ratio_axes.set_yscale("log")
    return figure_png(plt, figure)


def plot_events(data: RunData) -> str:
    plt, figure, axes = new_figure(2.6)
    detectors = sorted({e.get("detector", "?") for e in data.events})
    for event in data.events:
        color, marker = ACTION_STYLE.get(event.get("action"), ("#444444", "o"))
        axes.scatter(event.get("step", 0), detectors.index(event.get("detector", "?")), color=color, marker=marker,
                     s=40, zorder=3)
    if not data.events:
        _note(axes, "no events: nothing detected, no checkpoint marked yet")
    else:
        axes.set_yticks(range(len(detectors)))
        axes.set_yticklabels(detectors)
        axes.set_ylim(-0.7, len(detectors) - 0.3)
        axes.set_xlim(left=-1, right=max(data.last_step, max(e.get("step", 0) for e in data.events)) + 1)
        axes.set_xlabel("step")
        axes.grid(axis="x", alpha=0.3)
        seen = sorted({e.get("action") for e in data.events})
        legend_beside(axes, handles=[axes.scatter([], [], color=ACTION_STYLE.get(a, ("#444444", "o"))[0],
                                                   marker=ACTION_STYLE.get(a, ("#444444", "o"))[1], label=a)
                                      for a in seen])
    return figure_png(plt, figure)


def plot_rl(data: RunData) -> str:
    """GRPO's panels: rewards and held-out pass@1, completion lengths, the policy and mismatch statistics, and
    throughput with the MTP acceptance length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, grid = plt.subplots(2, 2, figsize=(10, 7.5), dpi=90)
    (rewards, lengths), (policy, speed) = grid
    panels = (
        (rewards, "rewards (train rollouts) and held-out pass@1", ("reward_mean", "reward_std", "reward_one_share",
                                                                    "pass_at_1")),
        (lengths, "completion length (tokens)", ("response_length", "response_length_max", "eval_response_length")),
        (policy, "policy and rollout-vs-trainer statistics (log)", ("is_mismatch", "is_out_of_bounds_share", "clip_fraction",
                                                              "kl", "entropy")),
        (speed, "tokens/s: rollout generation, training step", ("rollout_tokens_per_s", "tokens_per_s")),
    )
    for axes, title, keys in panels:
        for key in keys:
            steps, values = data.steps(key)
            if steps:
                evaluated = key.startswith(("pass_at_1", "eval_"))
                axes.plot(steps, values, "o-" if evaluated else "-", linewidth=1, markersize=3, label=key,
                          **({} if evaluated else point_markers(len(steps))))
        axes.set_title(title, fontsize=9)
        if axes.lines:
            axes.set_xlabel("step")
            _legend_below(axes, columns=3)
            _event_lines(axes, data)
        else:
            _note(axes, "not logged")
    if policy.lines:  # entropy in nats beside mismatches of 1e-6: log scale (zeros are not drawn)
        policy.set_yscale("log")
    steps, values = data.steps("mtp_acceptance_length")
    if steps:
        twin = speed.twinx()
        twin.plot(steps, values, color="#777777", linestyle=":", linewidth=1)
        twin.set_ylabel("MTP acceptance length (dotted)", fontsize=8)
    return figure_png(plt, figure)


PLOTS = (
    ("Losses", "loss, main loss, each MTP depth, validation", plot_losses),
    ("Gradient norms", "weight-gradient L2 norms before clipping: global, output layer, per layer", plot_grad_norms),
    ("MaxVio", "expert load imbalance per router (backbone MoE layers, then the MTP block's) over the MaxVio "
               "window", plot_maxvio),
    ("Residual stream", "RMS of the residual stream after each block", plot_residual),
    ("NVFP4 underflow", "share of non-zero fprop operand values flushed to zero, per quantized module",
     plot_underflow),
    ("Balance and updates", "router bias spread, update-to-weight ratio, learning rate", plot_balance_and_updates),
    ("Events", "detections and actions of the stability monitor", plot_events),
)
RL_PLOTS = (  # drawn for runs that log rollouts (hybridtron grpo)
    ("Rollouts", "GRPO: rewards, pass@1, lengths, IS mismatch, clip fraction, KL, entropy, throughput", plot_rl),
)


# =================================================================================================== page
def render_html(data: RunData) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(str(e.get('step')))}</td><td>{html.escape(str(e.get('detector')))}</td>"
        f"<td>{html.escape(str(e.get('action')))}</td><td>{html.escape(str(e.get('message', '')))}</td></tr>"
        for e in data.events)
    table = (f"<table><tr><th>step</th><th>detector</th><th>action</th><th>message</th></tr>{rows}</table>"
             if rows else "<p>No events.</p>")
    figures = []
    for title, caption, plot in PLOTS + (RL_PLOTS if data.steps("reward_mean")[0] else ()):
        below = table if plot is plot_events else ""  # the event log under its plot, under the one heading
        figures.append(f'<figure><h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" '
                       f'src="data:image/png;base64,{plot(data)}"><figcaption>{html.escape(caption)}</figcaption>'
                       f"{below}</figure>")
    # the summary wraps its long lines (paths, event messages) instead of running past the page's edge
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>hybridtron report: {html.escape(data.run_dir.name)}</title>
<style>
body {{ font-family: sans-serif; max-width: 960px; margin: 1em auto; padding: 0 8px; color: #222; }}
pre {{ background: #f4f4f4; padding: 0.8em; white-space: pre-wrap; overflow-wrap: anywhere; }}
figure {{ margin: 1.2em 0; }} img {{ max-width: 100%; }} h2 {{ font-size: 1.1em; margin-bottom: 0.2em; }}
figcaption {{ font-size: 0.85em; color: #555; margin-bottom: 0.6em; }}
table {{ border-collapse: collapse; font-size: 0.85em; }} td, th {{ border: 1px solid #ccc; padding: 2px 6px; }}
</style></head><body>
<h1>Stability report: {html.escape(str(data.run_dir))}</h1>
<pre>{html.escape(summary(data))}</pre>
{"".join(figures)}
</body></html>
"""
