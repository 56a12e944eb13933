"""`hybridtron branch`: continue a pretraining checkpoint as it was trained and in BF16; report the loss gap.

Experiment 1 of the Nemotron 3 Ultra report: BF16 branches forked from the NVFP4 run at 5T, 10T and 16T tokens
and trained 60B tokens more on the same data; the relative train-loss gap

    gap = mean over the window of (loss_nvfp4 - loss_bf16) / loss_bf16

was 0.27/0.28/0.25% over the first 5B tokens and 0.33/0.34/0.30% after 60B.

Here each arm loads the DCP checkpoint `--from` (model, optimizer, LR schedule, data-loader position, RNG) into a
fresh model with the Trainer's `load_checkpoint`, converts it for its precision and trains `branch.tokens` more
tokens (`--tokens`, rounded up to whole steps) with the forked run's own [model], [data] and [train] (from its
run_config.json, fixed: a branch changes only the number formats) and the run's LR schedule, so every arm sees the
same batches in the same order. The loss compared is the train loss of each step's batches as each arm computes
it (the backbone's next-token CE, `lm_loss`; the total with MTP is recorded as well).

Arms (`--arm`, repeatable, or `branch.arms`; default `as-trained`), against the reference `bf16`:

    bf16                       the reference: every GEMM in BF16 (operands rounded to bfloat16, fp32
                               accumulation), router fp32; all else as in the quantized arms (fp32)
    as-trained                 the checkpoint's train.precision, precision_policy and nvfp4 switches
    RECIPE[:POLICY][:no-sr][:no-rht][:no-2d]
                               e.g. nvfp4:ultra, nvfp4:all, nvfp4:ultra:no-sr, mxfp8:ultra

The output layer's gradient accumulation follows the run's `train.grad_accum_dtype` in every arm. The
stochastic-rounding streams continue the checkpoint's where the forked run had them (so the as-trained arm continues
the run exactly) and start from `train.seed` elsewhere. Each gap comes with a standard error from the means of 8
blocks of consecutive steps (a window shorter than 16 steps has none: the summary says how long a window needs);
two arms' gaps differ meaningfully only when the difference is several of those.

The branch directory (`--out`, default <run>/branches/<step_N>_<tokens>) follows the run rules of every training
command (hybridtron.train.run):

    run_config.json      the checkpoint, the forked run's [model], [data], [train], and [branch]
    arms/<arm>/          each arm a run of its own: checkpoints/ (its latest only) and metrics.jsonl
    branch.json          per-step losses and the gaps, written once every arm has trained: the branch is complete
    branch.png           the losses and the gaps

Ctrl-C or SIGTERM stops the arm in training after its step with a checkpoint; `--resume` skips the arms already
trained and continues that one from its checkpoint, to the same numbers as an uninterrupted branch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from hybridtron.checkpoint.dcp import COMPLETE, CheckpointManager, step_of
from hybridtron.config import ModelConfig
from hybridtron.data import DataConfig, build_data
from hybridtron.errors import RunInterrupted
from hybridtron.files import METRICS_FILE, RUN_CONFIG, atomic_write_json
from hybridtron.model.lm import HybridLM
from hybridtron.numerics.grad_accum import apply_output_grad_accumulation
from hybridtron.numerics.policy import POLICIES, RECIPES, apply_precision
from hybridtron.train.config import RunConfig, SectionedConfig, TrainConfig, section_values
from hybridtron.train.hooks import Hook, MetricsLogger
from hybridtron.train.loop import Trainer
from hybridtron.train.objectives import LoaderBatches, PretrainObjective
from hybridtron.train.run import (BuiltRun, Input, RunCommand, has_checkpoints, refuse_torchrun, resume_trainer,
                                  stop_on_signals)

REFERENCE = "bf16"
AS_TRAINED = "as-trained"
GAP_BLOCKS = 8  # blocks of consecutive steps behind a gap's standard error
BLOCK_STEPS = 2  # the fewest steps a block holds: a one-step block is a single step, correlated with its neighbours
REPORT_FILE = "branch.json"  # written last: its presence marks the branch complete
PLOT_FILE = "branch.png"
ARMS_DIR = "arms"
# --arm flag -> (the Arm / QuantRecipe field it turns off, the TrainConfig field of a run)
SWITCHES = {"no-sr": ("stochastic_rounding", "nvfp4_stochastic_rounding"), "no-rht": ("rht", "nvfp4_rht"),
            "no-2d": ("two_d_weights", "nvfp4_2d_weights")}
FORKED_SECTIONS = ("model", "data", "train")  # the forked run's, fixed: every arm continues them as trained


# ------------------------------------------------------------------------------------------------ the arms
@dataclass(frozen=True)
class Arm:
    """One branch: `recipe` is a precision recipe, "fp32" (no conversion) or "bf16-autocast" (the run's
    train.precision=bf16); the NVFP4 switches apply to nvfp4 only."""

    label: str
    recipe: str
    policy: str = "ultra"
    stochastic_rounding: bool = True
    rht: bool = True
    two_d_weights: bool = True

    @property
    def directory(self) -> str:
        """The arm's run directory under OUT/arms/: its label in characters every file system takes."""
        return re.sub(r"[^A-Za-z0-9.+-]+", "_", self.label).strip("_")


REFERENCE_ARM = Arm(REFERENCE, "bf16", "all")


def parse_arm(spec: str, train: TrainConfig | None = None) -> Arm:
    """`as-trained` (needs the run's TrainConfig) or `RECIPE[:POLICY][:no-sr][:no-rht][:no-2d]`."""
    if spec == AS_TRAINED:
        if train is None:
            raise ValueError("--arm as-trained needs the run's train config")
        if train.precision in ("fp32", "bf16"):
            return Arm(f"{AS_TRAINED} ({train.precision})", "fp32" if train.precision == "fp32" else "bf16-autocast")
        switches = {field: getattr(train, train_field) for field, train_field in SWITCHES.values()}
        label = f"{train.precision}:{train.precision_policy}" + "".join(
            f":{flag}" for flag, (field, _) in SWITCHES.items() if not switches[field])
        return Arm(label, train.precision, train.precision_policy, **switches)
    recipe, *rest = spec.split(":")
    if recipe not in RECIPES:
        raise ValueError(f"--arm {spec!r}: recipe {recipe!r} is not one of {', '.join(RECIPES)} (or use {AS_TRAINED})")
    policy, switches = "ultra", {}
    for part in rest:
        if part in POLICIES:
            policy = part
        elif part in SWITCHES:
            if recipe != "nvfp4":
                raise ValueError(f"--arm {spec!r}: {part} is an nvfp4 switch, the recipe is {recipe}")
            switches[SWITCHES[part][0]] = False
        else:
            raise ValueError(f"--arm {spec!r}: unknown part {part!r}; expected a policy ({', '.join(POLICIES)}) "
                             f"or {', '.join(SWITCHES)}")
    return Arm(spec, recipe, policy, **switches)


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(checkpoint dir, run dir) for runs/X/checkpoints/step_N; ValueError/FileNotFoundError naming the path."""
    checkpoint = Path(path)
    if not checkpoint.is_dir():
        raise FileNotFoundError(f"--from {checkpoint}: no such checkpoint directory")
    if not (checkpoint / COMPLETE).exists():
        raise ValueError(f"--from {checkpoint}: not a complete DCP checkpoint (expected runs/X/checkpoints/step_N "
                         f"holding a {COMPLETE} marker)")
    run_dir = checkpoint.parent.parent
    if not (run_dir / RUN_CONFIG).is_file():
        raise FileNotFoundError(f"{run_dir / RUN_CONFIG}: the checkpoint's run has no run config "
                                f"(expected the checkpoint in <run>/checkpoints/)")
    return checkpoint, run_dir


# ------------------------------------------------------------------------------------------ configuration
@dataclass(frozen=True, kw_only=True)
class BranchConfig:
    tokens: int = 0  # tokens each arm trains from the checkpoint, rounded up to whole steps (--tokens N; or steps)
    steps: int = 0  # steps each arm trains instead (--steps N; 0: the tokens give them)
    arms: tuple[str, ...] = (AS_TRAINED,)  # compared with the bf16 reference (--arm): as-trained or
    #   RECIPE[:POLICY][:no-sr][:no-rht][:no-2d], e.g. nvfp4:all, nvfp4:ultra:no-sr, mxfp8

    # The window and the arms are the experiment: a resumed branch finishes the one it began (another window or
    # other arms are a new branch, in another --out)
    RESUMABLE: ClassVar = ()


@dataclass(frozen=True, kw_only=True)
class BranchRunConfig(SectionedConfig):
    """`hybridtron branch`'s configuration: the checkpoint it forks (--from), the forked run's [model], [data] and
    [train] as that run saved them, and [branch], the one section a user sets (`sections`)."""

    checkpoint: str  # the DCP checkpoint every arm starts from: runs/X/checkpoints/step_N
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    branch: BranchConfig = field(default_factory=BranchConfig)

    @classmethod
    def forking(cls, checkpoint: str | Path, branch: BranchConfig | None = None) -> BranchRunConfig:
        """A branch of `checkpoint`, with [model], [data] and [train] from its run's run_config.json."""
        checkpoint, run_dir = resolve_checkpoint(checkpoint)
        forked = RunConfig.load(run_dir / RUN_CONFIG)
        return cls(checkpoint=str(checkpoint), model=forked.model, data=forked.data, train=forked.train,
                   branch=branch or BranchConfig())

    def sections(self):
        return {"branch": self.branch}  # the forked run's sections are not settable: not sections here

    def to_dict(self) -> dict:
        return {**super().to_dict(), **{name: section_values(getattr(self, name)) for name in ("data", "train")}}

    def command_line(self) -> str:
        return (f"hybridtron branch --from {self.checkpoint}  ([model], [data] and [train] are that run's, "
                f"{Path(self.checkpoint).parent.parent / RUN_CONFIG})")

    @property
    def fork_step(self) -> int:
        return step_of(Path(self.checkpoint))

    @property
    def tokens_per_step(self) -> int:
        return self.train.grad_accum * self.data.batch_size * self.data.seq_len

    @property
    def steps(self) -> int:
        """The steps each arm trains: branch.steps, or branch.tokens rounded up to whole steps."""
        return self.branch.steps or math.ceil(self.branch.tokens / self.tokens_per_step)

    def fixed_section(self, name):
        if name in FORKED_SECTIONS:
            return (f"[{name}] is the forked run's (its {RUN_CONFIG}), which every arm continues as it was trained; "
                    f"a branch sets [branch] (the arms' formats: --arm)")
        return super().fixed_section(name)

    def arms(self) -> list[Arm]:
        """The reference, then each arm of branch.arms; a ValueError for a spec that does not parse or a repeat."""
        arms = [REFERENCE_ARM] + [parse_arm(spec, self.train) for spec in self.branch.arms]
        directories = [arm.directory for arm in arms]
        if len(set(directories)) != len(directories):
            raise ValueError(f"--arm: the arms {[arm.label for arm in arms]} repeat one (the {REFERENCE} reference "
                             f"always runs)")
        return arms

    def default_out(self) -> Path:
        """<run>/branches/<step_N>_<tokens>, the tokens rounded up to whole steps."""
        return Path(self.checkpoint).parent.parent / "branches" / \
            f"{Path(self.checkpoint).name}_{self.steps * self.tokens_per_step}"


# ---------------------------------------------------------------------------------------------- one arm
class ArmProgress(Hook):
    """One updating line on stderr per arm."""

    def __init__(self, label: str):
        self.label = label

    def on_step_end(self, trainer, stats, decision):
        print(f"\r  {self.label}: step {stats.step} lm_loss {stats.losses['lm_loss']:.4f}", end="", file=sys.stderr)

    def on_train_end(self, trainer):
        print(file=sys.stderr)


def build_arm(config: BranchRunConfig, arm: Arm, loader, out: Path, checkpoints: CheckpointManager, *,
              quiet: bool) -> BuiltRun:
    """The trainer of `arm`: the forked run's model converted for the arm's precision, its [train] settings (the
    arm's autocast aside), every step's losses into out/metrics.jsonl. No monitor: a skip or rollback in one arm
    would compare different trajectories. No HF export (tokenizer None). The weights come from a checkpoint load."""
    train = config.train
    model_config = config.model
    if train.mtp_loss_weight is not None:
        model_config = model_config.replace(mtp_loss_weight=train.mtp_loss_weight)
    model = HybridLM(model_config, init=False)
    if arm.recipe in RECIPES:
        apply_precision(model, arm.recipe, arm.policy, stochastic_rounding=arm.stochastic_rounding, rht=arm.rht,
                        two_d_weights=arm.two_d_weights, seed=train.seed)
    apply_output_grad_accumulation(model, train.grad_accum_dtype)
    arm_train = dataclasses.replace(train, precision="bf16" if arm.recipe == "bf16-autocast" else "fp32")
    hooks = [MetricsLogger(out, every=1)] + ([] if quiet else [ArmProgress(arm.label)])
    trainer = Trainer(model, PretrainObjective(), LoaderBatches(loader, train.grad_accum), arm_train, checkpoints,
                      hooks=hooks)
    return BuiltRun(trainer)


def train_arm(config: BranchRunConfig, arm: Arm, loader, out: Path, *, quiet: bool) -> list[dict]:
    """Train `arm` in its run directory `out` to the window's last step: from the fork point, or from its own latest
    checkpoint where an interrupted branch left it (an arm already trained is only read back). Its per-step rows."""
    end = config.fork_step + config.steps
    # the latest checkpoint is all a resume needs: no monitor rolls an arm back
    checkpoints = CheckpointManager(out / "checkpoints", keep=1)
    try:
        latest = checkpoints.latest()
        if latest is None or step_of(latest) < end:
            trainer = build_arm(config, arm, loader, out, checkpoints, quiet=quiet).trainer
            if latest is None:
                checkpoints.remove_incomplete()
                trainer.load_checkpoint(Path(config.checkpoint))
            else:
                resume_trainer(trainer, checkpoints, latest, saved=None, config=None)  # nothing a resume changes
            if not quiet:
                print(f"branch {arm.label}: steps {trainer.step + 1}-{end} of {config.fork_step + 1}-{end} "
                      f"({config.steps * config.tokens_per_step:,} tokens) from {config.checkpoint}", file=sys.stderr)
            with stop_on_signals(trainer):
                trainer.train(until=end)
        elif not quiet:
            print(f"branch {arm.label}: trained ({out})", file=sys.stderr)
    finally:
        checkpoints.close()
    return arm_rows(out / METRICS_FILE, config.fork_step, end)


def arm_rows(metrics: Path, fork_step: int, end: int) -> list[dict]:
    """The window's steps from an arm's metrics.jsonl: the step, its losses, LR and gradient norm (not its timings,
    which differ from run to run)."""
    rows = []
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if fork_step < record["step"] <= end:
            rows.append({key: (float(value) if key != "step" else value) for key, value in record.items()
                         if key in ("step", "lm_loss", "loss", "lr", "grad_norm") or key.startswith("mtp_loss_")})
    return rows


# ------------------------------------------------------------------------------------------------ the gaps
def relative_gap(losses: list[float], reference: list[float]) -> list[float]:
    return [(q - r) / r for q, r in zip(losses, reference)]


def block_standard_error(gaps: list[float]) -> float | None:
    """Standard error of the window's mean gap from the means of GAP_BLOCKS blocks of consecutive steps; None for a
    window shorter than GAP_BLOCKS blocks of BLOCK_STEPS steps.

    Consecutive steps' gaps are correlated (a branch that drifted ahead stays ahead for a while), so the spread of
    single steps would understate the uncertainty; block means are close to independent. Fewer blocks than 8 give a
    standard error too uncertain itself to judge a gap by.
    """
    if len(gaps) < GAP_BLOCKS * BLOCK_STEPS:
        return None
    means = [float(np.mean(block)) for block in np.array_split(np.asarray(gaps, dtype=np.float64), GAP_BLOCKS)]
    return float(np.std(means, ddof=1) / math.sqrt(GAP_BLOCKS))


def gap_summary(gaps: list[float]) -> dict:
    """Mean over the window (the report's number) with its standard error (None: too few steps), and the first and
    second halves."""
    half = len(gaps) // 2
    mean = lambda values: sum(values) / len(values) if values else float("nan")  # noqa: E731
    return {"mean": mean(gaps), "standard_error": block_standard_error(gaps), "first_half": mean(gaps[:half]),
            "second_half": mean(gaps[half:])}


def gap_report(config: BranchRunConfig, rows: dict[str, list[dict]]) -> dict:
    """branch.json: each arm's per-step rows and each arm's gap to the reference."""
    reference = rows[REFERENCE]
    report = {
        "checkpoint": config.checkpoint, "start_step": config.fork_step, "steps": config.steps,
        "tokens": config.steps * config.tokens_per_step, "tokens_per_step": config.tokens_per_step,
        "reference": REFERENCE, "loss": "lm_loss (next-token CE of the step's training batches)",
        "arms": rows, "gaps": {},
    }
    for label, steps in rows.items():
        if label == REFERENCE:
            continue
        gaps = relative_gap([row["lm_loss"] for row in steps], [row["lm_loss"] for row in reference])
        total_gaps = relative_gap([row["loss"] for row in steps], [row["loss"] for row in reference])
        report["gaps"][label] = {**gap_summary(gaps), "total_loss_mean": gap_summary(total_gaps)["mean"],
                                 "per_step": gaps}
    return report


# ---------------------------------------------------------------------------------------------- the branch
def run_branch(config: BranchRunConfig, out: Path, *, resume: bool = False, quiet: bool = False) -> dict:
    """Train the reference and each arm of `config` in `out` (module docstring) and write branch.json and
    branch.png; the report. A branch already complete in `out` is read back (and says so); one begun and not
    finished is continued only with `resume`."""
    arms = config.arms()
    if (out / RUN_CONFIG).is_file():
        try:
            BranchRunConfig.load(out / RUN_CONFIG)
        except ValueError:
            raise ValueError(f"{out}: holds another command's run ({out / RUN_CONFIG} is not a branch's); choose "
                             f"another --out") from None
    if (out / REPORT_FILE).is_file():
        print(f"{out}: this branch is complete; nothing to do (another window or other arms: another --out)",
              file=sys.stderr)
        return json.loads((out / REPORT_FILE).read_text())
    if not resume and any(has_checkpoints(out / ARMS_DIR / arm.directory / "checkpoints") for arm in arms):
        raise ValueError(f"{out}: holds an unfinished branch (arms in {out / ARMS_DIR}); pass --resume to continue "
                         f"it, or choose another --out for a new branch")
    if not all(has_checkpoints(out / ARMS_DIR / arm.directory / "checkpoints") for arm in arms):
        resolve_checkpoint(config.checkpoint)  # an arm yet to start loads the fork point: it must still be there
    end, last = config.fork_step + config.steps, config.train.steps
    if end > last:  # the schedule of the forked run ends there: past it the LR stays at its floor
        print(f"warning: the window ends at step {end}, past the forked run's last step {last} (train.steps): its "
              f"last {end - last} steps train at the LR's floor {config.train.lr * config.train.min_lr_ratio:g}",
              file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    config.save(out / RUN_CONFIG)
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    data = build_data(config.data, total_sequences=last * config.train.grad_accum * config.data.batch_size)
    rows = {}
    try:
        for arm in arms:  # each arm reloads the fork point, loader position included: the same batches in order
            rows[arm.label] = train_arm(config, arm, data.train_loader, out / ARMS_DIR / arm.directory, quiet=quiet)
    except RunInterrupted as stopped:
        stopped.resume_command = f"hybridtron branch --out {out} --resume"
        raise
    report = gap_report(config, rows)
    plot_branch(report, out / PLOT_FILE)
    atomic_write_json(out / REPORT_FILE, report)
    return report


def plot_branch(report: dict, path: Path) -> None:
    import matplotlib  # lazy: matplotlib is optional, and only the plot needs it

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
        error = f" ± {100 * gap['standard_error']:.2f}%" if gap["standard_error"] is not None else ""
        bottom.plot(x, [100 * g for g in gap["per_step"]], linewidth=1, color=colors[label],
                    label=f"{label}: mean {100 * gap['mean']:.2f}%{error}")
        bottom.axhline(100 * gap["mean"], color=colors[label], linestyle="--", linewidth=1)
    bottom.axhline(0, color="black", linewidth=0.5)
    bottom.set_ylabel(f"relative gap to {report['reference']} (%)")
    bottom.set_xlabel("tokens since the checkpoint")
    bottom.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_report(report: dict, out: Path) -> str:
    """The closing summary: the gap table, a warning where the window is too short for a standard error, and
    where the outputs are."""
    percent = lambda value: "n/a" if value is None else f"{100 * value:.3f}%"  # noqa: E731
    title = (f"{report['steps']} steps ({report['tokens']:,} tokens) from step {report['start_step']}; "
             f"relative train-loss gap to {report['reference']} (mean over the window):")
    lines = [title, "",
             "| arm | gap (mean) | standard error | first half | second half | gap of total loss (with MTP) |",
             "|---|---|---|---|---|---|"]
    for label, gap in report["gaps"].items():
        lines.append(f"| {label} | {percent(gap['mean'])} | {percent(gap['standard_error'])} | "
                     f"{percent(gap['first_half'])} | {percent(gap['second_half'])} | "
                     f"{percent(gap['total_loss_mean'])} |")
    needed = GAP_BLOCKS * BLOCK_STEPS
    if report["steps"] < needed:
        lines += ["", (f"warning: the standard error needs at least {GAP_BLOCKS} blocks of {BLOCK_STEPS} consecutive "
                       f"steps, a window of {needed} steps (--tokens {needed * report['tokens_per_step']}); this one "
                       f"has {report['steps']}, so it reads n/a")]
    lines += ["", f"plot and numbers: {out / PLOT_FILE}, {out / REPORT_FILE}",
              f"arms:             {out / ARMS_DIR} (each arm's checkpoint and metrics.jsonl)"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the command
class Branch(RunCommand):
    """The scaffold's options, configuration and resume checks; its run trains the arms (`train_run`: `run_branch`),
    since the scaffold's `train_in` trains one trainer to its schedule's end and calls a run complete by its HF
    export, while each arm is a run of its own that ends inside the forked run's schedule and exports nothing."""

    name = "branch"
    config_class = BranchRunConfig
    inputs = (Input("--from", "checkpoint", "the DCP checkpoint to branch: runs/X/checkpoints/step_NNNNNN"),)
    set_example = "--set branch.tokens=122880"
    quiet_help = "no progress lines (default: one line per arm)"
    out_help = ("the branch directory; created, and holds each arm's run, branch.json and branch.png (default: "
                "<run>/branches/<step_N>_<tokens>)")
    steps_help = ("steps to train each arm for, instead of --tokens (the same as --set branch.steps=N; default: none, "
                  "--tokens)")
    steps_setting = "branch.steps"

    def add_command_arguments(self, parser):
        parser.add_argument("--tokens", type=int,
                            help="tokens to train each arm for, rounded up to whole steps (the same as --set "
                                 "branch.tokens=N; required unless --steps, --config or --resume gives the window)")
        parser.add_argument("--arm", dest="arms", action="append", metavar="SPEC",
                            help="a branch to compare with the bf16 reference (repeatable; default as-trained; the "
                                 "same as --set branch.arms=SPEC,...): as-trained or "
                                 "RECIPE[:POLICY][:no-sr][:no-rht][:no-2d], e.g. nvfp4:all")

    def section_names(self):
        return ["branch"]

    def default_config(self, args, inputs):
        return BranchRunConfig.forking(inputs["checkpoint"])

    def flag_overrides(self, args):
        return ([f"branch.tokens={args.tokens}"] if args.tokens is not None else []) + (
            [f"branch.arms={','.join(args.arms)}"] if args.arms else [])

    def rebase(self, config):
        """Another branch's configuration as --config: its [branch] on --from's run (that run's sections)."""
        return BranchRunConfig.forking(config.checkpoint, config.branch)

    def default_out(self, config):
        return config.default_out()

    def check(self, config):
        refuse_torchrun(self.name)  # the arms train one after the other in one process
        branch = config.branch
        if branch.tokens > 0 and branch.steps > 0:
            raise ValueError(f"branch.tokens={branch.tokens} and branch.steps={branch.steps} both give the window each "
                             f"arm trains; give one (--tokens N or --steps N)")
        if branch.tokens <= 0 and branch.steps <= 0:
            raise ValueError(f"the window each arm trains must be positive: --tokens N or --steps N (branch.tokens="
                             f"{branch.tokens}, branch.steps={branch.steps})")
        config.arms()  # every spec parses, none repeats

    def train_run(self, config, out, *, resume, quiet, saved=None):
        report = run_branch(config, out, resume=resume, quiet=quiet)
        print(format_report(report, out))
        return 0


COMMAND = Branch()
add_arguments, run = COMMAND.add_arguments, COMMAND.run
