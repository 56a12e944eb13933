"""`hybridtron branch`: continue a pretraining checkpoint as it was trained and in BF16; report the loss gap.

Experiment 1 of the Nemotron 3 Ultra report: BF16 branches forked from the NVFP4 run at 5T, 10T and 16T tokens
and trained 60B tokens more on the same data; the relative train-loss gap

    gap = mean over the window of (loss_nvfp4 - loss_bf16) / loss_bf16

was 0.27/0.28/0.25% over the first 5B tokens and 0.33/0.34/0.30% after 60B.

Here each arm loads the DCP checkpoint (model, optimizer, LR schedule, data-loader position, RNG) into a fresh
model with the Trainer's ``load_checkpoint``, converts it for its precision and trains ``--tokens`` more tokens
with the run's own ``[train]`` settings, so every arm sees the same batches in the same order. The loss compared
is the train loss of each step's batches as each arm computes it (the backbone's next-token CE, ``lm_loss``;
the total with MTP is recorded as well).

Arms (``--arm``, repeatable; default ``as-trained``), against the reference ``bf16``:

    bf16                       the reference: every GEMM in BF16 (operands rounded to bfloat16, fp32
                               accumulation), router fp32; all else as in the quantized arms (fp32)
    as-trained                 the checkpoint's train.precision, precision_policy and nvfp4 switches
    RECIPE[:POLICY][:no-sr][:no-rht][:no-2d]
                               e.g. nvfp4:ultra, nvfp4:all, nvfp4:ultra:no-sr, mxfp8:ultra

The output layer's gradient accumulation follows the run's ``train.grad_accum_dtype`` in every arm. Stochastic
rounding streams restart from ``train.seed`` in each arm (they are not part of a checkpoint), so the arms differ
only in their number formats. Each gap comes with a standard error from the means of 6 blocks of consecutive
steps: two arms' gaps differ meaningfully only when the difference is several of those. Writes ``branch.json``
(per-step losses and the gaps) and ``branch.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from hybridtron.numerics.policy import POLICIES, RECIPES
from hybridtron.train.hooks import Hook

REFERENCE = "bf16"
GAP_BLOCKS = 6  # blocks of consecutive steps behind a gap's standard error
AS_TRAINED = "as-trained"
# --arm flag -> (the Arm / QuantRecipe field it turns off, the TrainConfig field of a run)
_SWITCHES = {"no-sr": ("stochastic_rounding", "nvfp4_stochastic_rounding"), "no-rht": ("rht", "nvfp4_rht"),
             "no-2d": ("two_d_weights", "nvfp4_2d_weights")}


@dataclass(frozen=True)
class Arm:
    """One branch: ``recipe`` is a precision recipe, "fp32" (no conversion) or "bf16-autocast" (the run's
    train.precision=bf16); the NVFP4 switches apply to nvfp4 only."""

    label: str
    recipe: str
    policy: str = "ultra"
    stochastic_rounding: bool = True
    rht: bool = True
    two_d_weights: bool = True


def parse_arm(spec: str, train=None) -> Arm:
    """``as-trained`` (needs the run's TrainConfig) or ``RECIPE[:POLICY][:no-sr][:no-rht][:no-2d]``."""
    if spec == AS_TRAINED:
        if train is None:
            raise ValueError("--arm as-trained needs the run's train config")
        if train.precision in ("fp32", "bf16"):
            return Arm(f"{AS_TRAINED} ({train.precision})", "fp32" if train.precision == "fp32" else "bf16-autocast")
        switches = {field: getattr(train, train_field) for field, train_field in _SWITCHES.values()}
        label = f"{train.precision}:{train.precision_policy}" + "".join(
            f":{flag}" for flag, (field, _) in _SWITCHES.items() if not switches[field])
        return Arm(label, train.precision, train.precision_policy, **switches)
    recipe, *rest = spec.split(":")
    if recipe not in RECIPES:
        raise ValueError(f"--arm {spec!r}: recipe {recipe!r} is not one of {', '.join(RECIPES)} (or use {AS_TRAINED})")
    policy, switches = "ultra", {}
    for part in rest:
        if part in POLICIES:
            policy = part
        elif part in _SWITCHES:
            if recipe != "nvfp4":
                raise ValueError(f"--arm {spec!r}: {part} is an nvfp4 switch, the recipe is {recipe}")
            switches[_SWITCHES[part][0]] = False
        else:
            raise ValueError(f"--arm {spec!r}: unknown part {part!r}; expected a policy ({', '.join(POLICIES)}) "
                             f"or {', '.join(_SWITCHES)}")
    return Arm(spec, recipe, policy, **switches)


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(checkpoint dir, run dir) for runs/X/checkpoints/step_N; ValueError/FileNotFoundError naming the path."""
    from hybridtron.checkpoint.dcp import COMPLETE

    checkpoint = Path(path)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"--from {checkpoint}: no such checkpoint directory")
    if not (checkpoint / COMPLETE).exists():
        raise ValueError(f"--from {checkpoint}: not a complete DCP checkpoint (expected runs/X/checkpoints/step_N "
                         f"holding a {COMPLETE} marker)")
    run_dir = checkpoint.parent.parent
    if not (run_dir / "run_config.json").is_file():
        raise FileNotFoundError(f"{run_dir / 'run_config.json'}: the checkpoint's run has no run config "
                                f"(expected the checkpoint in <run>/checkpoints/)")
    return checkpoint, run_dir


class _LossLog(Hook):
    """Keeps each step's losses."""

    def __init__(self):
        self.rows: list[dict] = []

    def on_step_end(self, trainer, stats, decision):
        self.rows.append({"step": stats.step, **stats.losses, "grad_norm": stats.grad_norm})


def run_arm(arm: Arm, checkpoint: Path, run_config, loader, steps: int, progress=None) -> list[dict]:
    """Load ``checkpoint`` into a fresh model converted for ``arm``; train ``steps`` steps; per-step losses."""
    from hybridtron.model.lm import HybridLM
    from hybridtron.numerics.grad_accum import apply_output_grad_accumulation
    from hybridtron.numerics.policy import apply_precision
    from hybridtron.train.loop import Trainer
    from hybridtron.train.objectives import LoaderBatches, PretrainObjective

    train = run_config.train
    model_config = run_config.model
    if train.mtp_loss_weight is not None:
        model_config = model_config.replace(mtp_loss_weight=train.mtp_loss_weight)
    model = HybridLM(model_config, init=False)
    if arm.recipe in RECIPES:
        apply_precision(model, arm.recipe, arm.policy, stochastic_rounding=arm.stochastic_rounding, rht=arm.rht,
                        two_d_weights=arm.two_d_weights, seed=train.seed)
    apply_output_grad_accumulation(model, train.grad_accum_dtype)
    arm_train = dataclasses.replace(train, precision="bf16" if arm.recipe == "bf16-autocast" else "fp32")
    log = _LossLog()
    hooks = [log] + ([progress] if progress is not None else [])
    # no checkpoint manager: the arm loads the fork point and never saves
    trainer = Trainer(model, PretrainObjective(), LoaderBatches(loader, train.grad_accum), arm_train, None,
                      hooks=hooks)
    trainer.load_checkpoint(checkpoint)
    trainer.train(until=trainer.step + steps)
    return log.rows


def relative_gap(losses: list[float], reference: list[float]) -> list[float]:
    return [(q - r) / r for q, r in zip(losses, reference)]


def block_standard_error(gaps: list[float], blocks: int = GAP_BLOCKS) -> float:
    """Standard error of the window's mean gap from the means of `blocks` consecutive blocks of steps.

    Consecutive steps' gaps are correlated (a branch that drifted ahead stays ahead for a while), so the spread of
    single steps would understate the uncertainty; block means are close to independent. NaN under 2 blocks.
    """
    import numpy as np

    if len(gaps) < 2 * blocks:
        blocks = len(gaps) // 2
    if blocks < 2:
        return float("nan")
    means = [float(np.mean(block)) for block in np.array_split(np.asarray(gaps, dtype=np.float64), blocks)]
    return float(np.std(means, ddof=1) / math.sqrt(blocks))


def gap_summary(gaps: list[float]) -> dict:
    """Mean over the window (the report's number) with its standard error, and the first and second halves."""
    half = len(gaps) // 2
    mean = lambda values: sum(values) / len(values) if values else float("nan")  # noqa: E731
    return {"mean": mean(gaps), "standard_error": block_standard_error(gaps), "first_half": mean(gaps[:half]),
            "second_half": mean(gaps[half:])}


def branch(checkpoint: str | Path, tokens: int, arms: list[str] = (AS_TRAINED,), out: str | Path | None = None,
           quiet: bool = False) -> dict:
    """Run the reference and each arm from ``checkpoint`` for ``tokens`` tokens; write branch.json/.png to out."""
    import torch

    from hybridtron.data import build_data
    from hybridtron.train.config import RunConfig

    checkpoint, run_dir = resolve_checkpoint(checkpoint)
    if tokens <= 0:
        raise ValueError(f"--tokens must be positive, got {tokens}")
    run_config = RunConfig.load(run_dir / "run_config.json")
    train, data_config = run_config.train, run_config.data
    tokens_per_step = train.grad_accum * data_config.batch_size * data_config.seq_len
    steps = math.ceil(tokens / tokens_per_step)
    parsed = [parse_arm(spec, train) for spec in arms]
    labels = [REFERENCE] + [arm.label for arm in parsed]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--arm: the arms {labels} repeat one (the {REFERENCE} reference always runs)")
    reference = Arm(REFERENCE, "bf16", "all")
    out = Path(out) if out is not None else run_dir / "branches" / f"{checkpoint.name}_{steps * tokens_per_step}"
    out.mkdir(parents=True, exist_ok=True)
    if train.threads:
        torch.set_num_threads(train.threads)

    data = build_data(data_config, total_sequences=train.steps * train.grad_accum * data_config.batch_size)
    results = {}
    for arm in [reference, *parsed]:
        if not quiet:
            print(f"branch {arm.label}: {steps} steps ({steps * tokens_per_step:,} tokens) from {checkpoint}",
                  file=sys.stderr)
        results[arm.label] = run_arm(arm, checkpoint, run_config, data.train_loader, steps,
                                     progress=None if quiet else _Progress(arm.label))
    ref_loss = [row["lm_loss"] for row in results[reference.label]]
    report = {
        "checkpoint": str(checkpoint), "start_step": results[reference.label][0]["step"] - 1, "steps": steps,
        "tokens": steps * tokens_per_step, "tokens_per_step": tokens_per_step, "reference": reference.label,
        "loss": "lm_loss (next-token CE of the step's training batches)",
        "arms": {label: rows for label, rows in results.items()},
        "gaps": {},
    }
    for arm in parsed:
        gaps = relative_gap([row["lm_loss"] for row in results[arm.label]], ref_loss)
        total_gaps = relative_gap([row["loss"] for row in results[arm.label]],
                                  [row["loss"] for row in results[reference.label]])
        report["gaps"][arm.label] = {**gap_summary(gaps), "total_loss_mean": gap_summary(total_gaps)["mean"],
                                     "per_step": gaps}
    (out / "branch.json").write_text(json.dumps(report, indent=1))
    plot_branch(report, out / "branch.png")
    report["out"] = str(out)
    return report


class _Progress(Hook):
    """One updating line on stderr per arm."""

    def __init__(self, label: str):
        self.label = label

    def on_step_end(self, trainer, stats, decision):
        print(f"\r  {self.label}: step {stats.step} lm_loss {stats.losses['lm_loss']:.4f}", end="", file=sys.stderr)

    def on_train_end(self, trainer):
        print(file=sys.stderr)


def plot_branch(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    tokens_per_step = report["tokens_per_step"]
    colors = {}  # one color per arm in both panels
    for label, rows in report["arms"].items():
        x = [(row["step"] - report["start_step"]) * tokens_per_step for row in rows]
        line, = top.plot(x, [row["lm_loss"] for row in rows], label=label, linewidth=1)
        colors[label] = line.get_color()
    top.set_ylabel("train loss (next-token CE)")
    top.set_title(f"branches from {Path(report['checkpoint']).name}")
    top.legend(fontsize="small")
    for label, gap in report["gaps"].items():
        rows = report["arms"][label]
        x = [(row["step"] - report["start_step"]) * tokens_per_step for row in rows]
        bottom.plot(x, [100 * g for g in gap["per_step"]], linewidth=1, color=colors[label],
                    label=f"{label}: mean {100 * gap['mean']:.2f}% ± {100 * gap['standard_error']:.2f}%")
        bottom.axhline(100 * gap["mean"], color=colors[label], linestyle="--", linewidth=1)
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_ylabel(f"relative gap to {report['reference']} (%)")
    bottom.set_xlabel("tokens since the checkpoint")
    bottom.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_report(report: dict) -> str:
    lines = [f"{report['steps']} steps ({report['tokens']:,} tokens) from step {report['start_step']}; "
             f"relative train-loss gap to {report['reference']} (mean over the window):", "",
             "| arm | gap (mean) | standard error | first half | second half | gap of total loss (with MTP) |",
             "|---|---|---|---|---|---|"]
    for label, gap in report["gaps"].items():
        lines.append(f"| {label} | {100 * gap['mean']:.3f}% | {100 * gap['standard_error']:.3f}% | "
                     f"{100 * gap['first_half']:.3f}% | "
                     f"{100 * gap['second_half']:.3f}% | {100 * gap['total_loss_mean']:.3f}% |")
    lines += ["", f"plot and numbers: {report['out']}/branch.png, branch.json"]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="checkpoint", required=True,
                        help="a DCP checkpoint directory: runs/X/checkpoints/step_NNNNNN (required)")
    parser.add_argument("--tokens", type=int, required=True,
                        help="tokens to train each branch for, rounded up to whole steps (required)")
    parser.add_argument("--out", help="output directory (default: <run>/branches/<step>_<tokens>)")
    parser.add_argument("--arm", dest="arms", action="append", metavar="SPEC",
                        help="a branch to compare with the bf16 reference (repeatable; default as-trained): "
                             "as-trained or RECIPE[:POLICY][:no-sr][:no-rht][:no-2d], e.g. nvfp4:all")
    parser.add_argument("--quiet", action="store_true", help="no progress lines (default: one line per arm)")


def run(args) -> int:
    report = branch(args.checkpoint, args.tokens, args.arms or [AS_TRAINED], args.out, args.quiet)
    print(format_report(report))
    return 0
