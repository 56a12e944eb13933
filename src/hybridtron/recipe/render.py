"""The pipeline's results: the stage table with each MOPD stage's recovery per domain and the recipe's goals
(`summarize`, `format_table`: what BENCHMARKS.md records), and the page `pipeline.html` (the table, a chart of the
stage metrics, and each stage's training curves drawn by hybridtron.train.report).

Recovery, as in the report's Table 5: (MOPD - RLVR) / (teacher - RLVR) per domain, on math pass@1, on the code
pass rate and on terminal pass@1 (the agentic teacher's; undefined where the teacher is not better than the
student)."""

from __future__ import annotations

import html
from pathlib import Path

from hybridtron.recipe.config import PipelineConfig
from hybridtron.recipe.stage import AGENTIC_DOMAIN, CODE_DOMAIN, MATH_DOMAIN, resolve
from hybridtron.recipe.stages import EVAL_FILE, GOALS, STAGE_FILE, active_stages, enabled_stages, read_json
from hybridtron.train import report

# each domain's metric: what its recovery is measured on
METRICS = {MATH_DOMAIN: "math_pass_at_1", CODE_DOMAIN: "code_pass_rate", AGENTIC_DOMAIN: f"{AGENTIC_DOMAIN}_pass_at_1"}


def recovery(student: float, rlvr: float, teacher: float) -> float | None:
    """(MOPD - RLVR) / (teacher - RLVR): the share of the teacher's lead over the RLVR student that distillation
    won back (the report's Table 5); None where the teacher is not ahead."""
    gap = teacher - rlvr
    return None if gap <= 0 else (student - rlvr) / gap


def summarize(config: PipelineConfig, out: Path) -> dict:
    """The stage table, the recovery of each distilled stage per domain (its declared `recovery`), and the goals of
    the recipe (`GOALS`)."""
    rows = []
    for stage in enabled_stages(config):
        record, evaluation = read_json(out / stage.name / STAGE_FILE), read_json(out / stage.name / EVAL_FILE)
        if record is None or evaluation is None:
            continue
        rows.append({"stage": stage.name, "what": stage.what, "train_seconds": record["seconds"],
                     **{k: v for k, v in evaluation.items() if k != "fingerprint"}})
    by_stage = {row["stage"]: row for row in rows}
    recoveries = {}
    for stage in enabled_stages(config):
        measured = stage.recovery
        if measured is None or stage.name not in by_stage or measured.baseline.name not in by_stage:
            continue
        baseline = by_stage[measured.baseline.name]
        teachers = {domain: resolve(source, config).name for domain, source in measured.teachers.items()}
        recoveries[stage.name] = {domain: recovery(by_stage[stage.name][key], baseline[key],
                                                   by_stage[teachers[domain]][key])
                                  for domain, key in METRICS.items()
                                  if domain in teachers and teachers[domain] in by_stage}
    goals = {goal.name: checked for goal in GOALS if (checked := goal.check(by_stage, recoveries)) is not None}
    missing = [name for name in active_stages(config) if name not in by_stage]
    total = sum(row["train_seconds"] + row["seconds"] for row in rows)
    return {"stages": rows, "recovery": recoveries, "goals": goals, "missing": missing, "total_seconds": total,
            "config": config.to_dict()}


def _cell(value, percent=False) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1%}" if percent else f"{value:.3f}" if isinstance(value, float) else str(value)


def format_table(result: dict) -> str:
    """The stage table as Markdown (what BENCHMARKS.md records), then the recovery and the goals."""
    lines = [f"| stage | math pass@1 | code pass rate | code pass@1 | {AGENTIC_DOMAIN} pass@1 | val loss (math / code) "
             "| MTP acceptance | train s | eval s |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["stages"]:
        by_domain = f" ({row['math_val_loss']:.2f} / {row['code_val_loss']:.2f})" if "code_val_loss" in row else ""
        lines.append(f"| {row['stage']} | {_cell(row['math_pass_at_1'], True)} | {_cell(row['code_pass_rate'], True)} "
                     f"| {_cell(row['code_pass_at_1'], True)} | {_cell(row[METRICS[AGENTIC_DOMAIN]], True)} "
                     f"| {row['val_loss']:.3f}{by_domain} "
                     f"| {row['acceptance_length']:.2f} | {row['train_seconds']:.0f} | {row['seconds']:.0f} |")
    if result["recovery"]:
        lines += ["", f"| recovery (MOPD - RLVR) / (teacher - RLVR) | {' | '.join(METRICS)} |",
                  "|---" * (len(METRICS) + 1) + "|"]
        for name, values in result["recovery"].items():
            lines.append(f"| {name} | {' | '.join(_cell(values.get(domain), True) for domain in METRICS)} |")
    if result["goals"]:
        lines.append("")
        for goal, values in result["goals"].items():
            numbers = ", ".join(f"{k} {_cell(v)}" for k, v in values.items() if k != "met")
            lines.append(f"- {goal}: {'met' if values['met'] else 'NOT met'} ({numbers})")
    if result["missing"]:
        lines.append(f"\nnot run yet: {', '.join(result['missing'])}")
    lines.append(f"\ntotal wall time {result['total_seconds'] / 60:.1f} min (training + evaluation)")
    return "\n".join(lines)


def render_html(result: dict, out: Path) -> str:
    """A self-contained page: the table, the recovery and goals, a chart of the stage metrics, each stage's
    curves (hybridtron.train.report's loss and rollout panels)."""
    parts = [f"<html><head><meta charset='utf-8'><title>hybridtron pipeline {html.escape(str(out))}</title>"
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}</style></head><body>",
             f"<h1>Pipeline {html.escape(str(out))}</h1>"]
    table = format_table(result).split("\n")
    rows = [line for line in table if line.startswith("|") and not line.startswith("|---")]
    parts.append("<table>")
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        tag = "th" if cells[0] in ("stage", "recovery (MOPD - RLVR) / (teacher - RLVR)") else "td"
        parts.append("<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>")
    parts.append("</table><ul>")
    parts += [f"<li>{html.escape(line[2:])}</li>" for line in table if line.startswith("- ")]
    parts.append("</ul>")
    if result["stages"]:
        parts.append("<h2>Stage metrics</h2>" + _img(_stage_chart(result)))
    for row in result["stages"]:
        run_dir = out / row["stage"]
        if not (run_dir / "metrics.jsonl").is_file():
            continue
        data = report.load_run(run_dir)
        parts.append(f"<h2>{html.escape(row['stage'])}: {html.escape(row['what'])}</h2>")
        if data.keys("reverse_kl"):
            parts.append(_img(_plot_reverse_kl(data)))
        elif data.keys("reward_mean"):
            parts.append(_img(report.plot_rl(data)))
        if data.steps("loss")[0] or data.steps("val_loss")[0]:
            parts.append(_img(report.plot_losses(data)))
    parts.append("</body></html>")
    return "\n".join(parts)


def _img(png_base64: str) -> str:
    return f"<img src='data:image/png;base64,{png_base64}'>"


def _plot_reverse_kl(data) -> str:
    """A MOPD run's sampled reverse KL to the teachers, overall and per domain."""
    plt, figure, axes = report.new_figure()
    for key in data.keys("reverse_kl"):
        steps, values = data.steps(key)
        axes.plot(steps, values, "-", linewidth=1, label=key, **report.point_markers(len(steps)))
    axes.set_xlabel("step")
    axes.set_ylabel("KL(student || teacher), nats a token")
    report.legend_beside(axes)
    return report.figure_png(plt, figure)


def _stage_chart(result: dict) -> str:
    import matplotlib  # optional: only drawing needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [row["stage"] for row in result["stages"]]
    figure, (scores, acceptance) = plt.subplots(1, 2, figsize=(12, 3.6), dpi=90)
    bars = [(key, key.replace("_pass_at_1", " pass@1").replace("_pass_rate", " pass rate")) for key in METRICS.values()]
    width = 0.8 / len(bars)
    for offset, (key, label) in enumerate(bars):
        scores.bar([i + (offset - (len(bars) - 1) / 2) * width for i in range(len(names))],
                   [row[key] for row in result["stages"]], width, label=label)
    scores.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    scores.legend(fontsize=8)
    scores.set_title("held-out accuracy", fontsize=9)
    acceptance.plot(names, [row["acceptance_length"] for row in result["stages"]], "o-")
    acceptance.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    acceptance.set_title("MTP acceptance length (greedy)", fontsize=9)
    return report.figure_png(plt, figure)
