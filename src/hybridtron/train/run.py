"""The run scaffold: what every training command (`pretrain`, `sft`, `grpo`, `mopd`, `mtp-boost`, `branch`, and the
pipeline's stages) does around its trainer, written once. A command is a `RunCommand` that declares its
configuration class, its inputs (`--model`, `--data`, ...), its defaults, its checks and how to build its trainer;
this module gives it the rest:

- the options: --out, --steps, --config (TOML, or a run's run_config.json), --set SECTION.FIELD=VALUE,
  --resume, --print-config, --quiet, with the command's own inputs;
- the configuration: the command's defaults (or, with --resume, the run's saved configuration) <- the TOML file
  <- --set <- --steps (hybridtron.train.config);
- the run directory `--out`, which holds everything the run makes: run_config.json, metrics.jsonl,
  events.jsonl, checkpoints/ (DCP) and hf/ (the final model), and the command's own files. Its rules:
  - a run that trained to its last step and wrote its HF export is complete: the same command again says so,
    how to extend it, and changes nothing;
  - a directory holding checkpoints of an unfinished run is continued only with --resume: never overwritten,
    never continued silently;
  - --resume restores the latest complete checkpoint (an incomplete one, left by a crash in the middle of a
    save, is removed first). What it may change is each section's `RESUMABLE` fields (a longer run: --steps, the
    LR, the monitor's thresholds, the layout); the changes are applied and recorded in events.jsonl at the step
    they take effect. Any other change ([model], the data, the batch, the number formats) is refused before
    anything is written, in one line naming each field and both values, and the run is left as it was;
- interruption: Ctrl-C (SIGINT) or SIGTERM lets the step in flight finish, writes a checkpoint, records the
  interruption in events.jsonl and ends the command with one line saying where the checkpoint is and how to
  resume (exit status 130 or 143); a second signal stops at once, leaving the last complete checkpoint;
- the end: the HF export with the tokenizer files, the first evaluator's first and last value, where the outputs
  are, and (for a validation loss that ended far above its start) a warning and exit status 4.

Under torchrun every rank runs the same command: global rank 0 alone writes the run directory (run_config.json,
metrics, events, the HF export, gathered from the shards) and prints; all ranks build the same model, parallelize
it by the `[dist]` layout (`start_parallel`, `assemble_trainer(parallel=...)`) and train together. A worker that
torchrun restarts after a failure (`--max-restarts`) continues from the latest complete checkpoint, as --resume
does.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from hybridtron.checkpoint.dcp import CheckpointManager, step_of
from hybridtron.checkpoint.hf import check_checkpoint_target, resolve_checkpoint_dir, save_pretrained, staged_checkpoint
from hybridtron.config import HYBRIDTRON_H, ModelConfig
from hybridtron.data.chat import save_tokenizer_files
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.mesh import Parallel, init_parallel, run_device
from hybridtron.distributed.parallelize import parallelize
from hybridtron.distributed.step import DataParallelBatches, full_state_dict
from hybridtron.errors import RunInterrupted
from hybridtron.files import METRICS_FILE, RUN_CONFIG
from hybridtron.model.lm import HybridLM
from hybridtron.numerics.grad_accum import ACCUM_DTYPES
from hybridtron.numerics.policy import convert_for_training
from hybridtron.ops.compile_cache import use_compile_cache
from hybridtron.train.config import SectionedConfig, change_config, resume_changes
from hybridtron.train.hooks import MetricsLogger, ProgressBar
from hybridtron.train.loop import Trainer
from hybridtron.train.monitor import RUN_EVENT, build_monitor
from hybridtron.train.objectives import LoaderBatches
from hybridtron.train.optimizers import ADAMW, split_summary
from hybridtron.train.preflight import bf16_warning, check_memory

DIVERGED_EXIT = 4  # a run whose validation loss ended far above its start
DIVERGED_RATIO = 1.10  # "far above": the last validation loss over the first


# ------------------------------------------------------------------------------------------- declarations
@dataclass(frozen=True)
class Input:
    """A command-line input of a run that is not a section: a checkpoint directory, a data source. Stored in the
    configuration under `field`; required for a new run unless `optional`; a resumed run takes the saved one, and
    a different one given with --resume is refused."""

    flag: str  # e.g. "--model"
    field: str  # the configuration's field, e.g. "base_model"
    help: str
    optional: bool = False
    checkpoint: bool = False  # an HF checkpoint directory, read as every command reads --model (a run directory:
    # its hf/ export; a training checkpoint is refused naming `hybridtron convert`)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclass
class BuiltRun:
    """What a command's `build` returns: the trainer, the tokenizer written beside the HF export (None: the run
    exports no model), and what to close when training ends (rollout pipelines, environments)."""

    trainer: Trainer
    tokenizer: Any = None
    closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for close in self.closers:
            close()
        self.closers = []


@dataclass(frozen=True)
class Phase:
    """A run a command trains in a subdirectory of its run directory before its own trainer (MOPD's warmup SFT):
    `command` trains it by the same rules (resumed where its checkpoints are, skipped once complete) and writes its
    HF export, which the command's own trainer starts from. `config(run_config, out)` gives the phase's
    configuration, or None where this run has no such phase; it is called only when the phase may train, so it may
    write the phase's data into `out` first."""

    directory: str
    command: RunCommand
    config: Callable[[SectionedConfig, Path], SectionedConfig | None]


class RunCommand:
    """A training command. Subclasses set `name`, `config_class`, `inputs` and `default_steps`, and define
    `default_config`, `build` and, where they have them, `check`, `add_command_arguments` and `summary_line`.
    The flow (`run`: resolve, check, `train_in`, `finish`) is the scaffold's; what a command needs of it is a hook:
    `command_for` (arguments another command runs), `flag_overrides` and `steps_setting` (its flags as --set),
    `rebase` (a run's configuration given as --config), `phases` (runs trained before its own), `default_out` and
    `train_run` (a command whose run is not one trainer's, such as `branch`)."""

    name = ""
    config_class: type[SectionedConfig] = SectionedConfig
    inputs: tuple[Input, ...] = ()
    default_steps = 0  # for --steps' help text
    set_example = "--set train.lr=3e-4"
    quiet_help = "no progress bar"
    out_help = ("run directory; created, and holds the checkpoints, metrics and HF export (required unless "
                "--print-config)")
    steps_help = ""  # what --steps means, where it is not the run's optimizer steps (default: those)
    steps_setting = "train.steps"  # the field --steps N sets
    phases: tuple[Phase, ...] = ()  # trained in this order, each in its directory of --out, before the command's own

    # ------------------------------------------------------------------------------ declared by each command
    def default_config(self, args, inputs: dict[str, Any]) -> SectionedConfig:
        """A new run's configuration before the TOML file and --set: the command's defaults for `inputs`."""
        raise NotImplementedError

    def add_command_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of this command beyond its inputs (e.g. pretraining's --preset)."""

    def check(self, config) -> None:
        """Before anything is written: the layout fits this world, the inputs are usable (a ValueError says why)."""

    def build(self, config, out: Path, checkpoints: CheckpointManager, *, quiet: bool) -> BuiltRun:
        raise NotImplementedError

    def summary_line(self, history: list[tuple[int, float]]) -> str:
        return validation_loss_line(history)

    def command_for(self, args) -> RunCommand:
        """The command that runs `args`: this one, or another its options select (pretraining's --phase)."""
        return self

    def flag_overrides(self, args) -> list[str]:
        """The command's own options as `--set` overrides, applied after --set (e.g. branch's --tokens)."""
        return []

    def rebase(self, config: SectionedConfig) -> SectionedConfig:
        """A new run's configuration read from another run's run_config.json (`--config`), its inputs already this
        run's: the architecture of this run's checkpoint (`MODEL_FROM`) where it has one."""
        source = self.config_class.MODEL_FROM
        if source is None:
            return config
        return dataclasses.replace(config, model=self.model_config_of(getattr(config, source)))

    def default_out(self, config) -> Path:
        """The run directory when --out is not given."""
        raise ValueError(f"--out is required: the run directory to create (e.g. --out runs/{self.name})")

    def checkpoint_dirs(self, out: Path) -> list[Path]:
        """Where this run's checkpoints are: its own, then each phase's."""
        return [out / "checkpoints"] + [out / phase.directory / "checkpoints" for phase in self.phases]

    def has_started(self, out: Path) -> bool:
        """`out` holds checkpoints of this run, its phases' included: what --resume, a pipeline stage or a torchrun
        restart continues."""
        return any(has_checkpoints(directory) for directory in self.checkpoint_dirs(out))

    def model_config_of(self, source: str) -> ModelConfig:
        """The architecture of the checkpoint named by the input `MODEL_FROM` fixes: its config.json."""
        return ModelConfig.from_hf(source)

    def same_input(self, flag: str, given, saved) -> bool:
        """Whether an input given with --resume is the run's own (paths compared resolved)."""
        if isinstance(given, str) and isinstance(saved, str) and ":" not in given + saved:
            return Path(given).resolve() == Path(saved).resolve()
        return given == saved

    # ----------------------------------------------------------------------------------------- the options
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        for item in self.inputs:
            required = "" if item.optional else "; required unless --resume"
            parser.add_argument(item.flag, dest=item.dest, help=f"{item.help}{required}")
        self.add_command_arguments(parser)
        sections = ", ".join(f"[{name}]" for name in self.section_names())
        parser.add_argument("--out", help=self.out_help)
        parser.add_argument("--steps", type=int, help=self.steps_help or (
            f"optimizer steps (default: the config's, {self.default_steps}; the same as --set train.steps=N; with "
            f"--resume on a finished run, a larger N trains it further). The warmup is train.warmup_steps steps (a "
            f"shorter run warns that its LR never peaks) and the decay the last train.decay_fraction of the run"))
        parser.add_argument("--config", help=f"a TOML file with {sections} sections, or a run's run_config.json "
                                             f"(default: none, the command's defaults)")
        parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                            help=f"override one field, e.g. {self.set_example} (repeatable)")
        parser.add_argument("--resume", action="store_true",
                            help="continue the run in --out from its latest complete checkpoint; its saved "
                                 "configuration is the base, and --set may change the fields a resume allows "
                                 "(default: start anew)")
        parser.add_argument("--print-config", action="store_true",
                            help="print the resolved configuration as TOML (which --config accepts) and exit")
        parser.add_argument("--quiet", action="store_true", help=self.quiet_help)

    def section_names(self) -> list[str]:
        hints = [f.name for f in dataclasses.fields(self.config_class)]
        model_is_section = self.config_class.MODEL_FROM is None
        return [name for name in hints if name not in {i.field for i in self.inputs}
                and (name != "model" or model_is_section)]

    # ----------------------------------------------------------------------------------- the configuration
    def given_inputs(self, args) -> dict[str, Any]:
        """The inputs given on the command line (None where a flag was not given)."""
        given = {item.field: getattr(args, item.dest, None) for item in self.inputs}
        for item in self.inputs:
            if item.checkpoint and given[item.field] is not None:
                given[item.field] = str(resolve_checkpoint_dir(given[item.field], item.flag)[0])
        return given

    def resolve(self, args) -> tuple[SectionedConfig, SectionedConfig | None]:
        """(the configuration to run, the run's saved configuration with --resume, else None). A resume's changes
        that the sections do not allow are refused here, before anything is written."""
        overrides = list(args.overrides) + self.flag_overrides(args) + (
            [f"{self.steps_setting}={args.steps}"] if args.steps is not None else [])
        toml_path, given = args.config, self.given_inputs(args)
        if args.resume:
            if toml_path is not None and Path(toml_path).suffix == ".json":
                raise ValueError("--resume continues with the run's own run_config.json; --config then takes a TOML "
                                 "file of changes")
            saved = self.config_class.load(saved_config_file(args))
            for item in self.inputs:
                value, kept = given[item.field], getattr(saved, item.field)
                if value is not None and not self.same_input(item.flag, value, kept):
                    raise ValueError(f"--resume: {item.flag} {value} is not the run's ({kept}, in "
                                     f"{Path(args.out) / RUN_CONFIG}); resume with the run's {item.flag}, or start "
                                     f"a new run in another --out")
            self.check_model_unchanged(saved, args.out)
            config = change_config(saved, toml_path, overrides)
            applied, refused = resume_changes(saved, config)
            if refused:
                raise ValueError(f"--resume cannot change {'; '.join(str(c) for c in refused)} (the run's value -> "
                                 f"the given one); {args.out} is left as it was. To train with these settings, start "
                                 f"a new run from this one's: --config {Path(args.out) / RUN_CONFIG} --out NEW_DIR")
            return config, saved
        if toml_path is not None and Path(toml_path).suffix == ".json":  # a run's own run_config.json
            if not Path(toml_path).is_file():
                raise FileNotFoundError(f"{toml_path}: config file not found")
            base = self.config_class.load(toml_path)
            base = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
            if any(v is not None for v in given.values()):  # other inputs than that run's: what they fix
                base = self.rebase(base)
            return change_config(base, None, overrides), None
        for item in self.inputs:
            if not item.optional and not given[item.field]:
                raise ValueError(f"{item.flag} is required (see hybridtron {self.name} --help)")
        return change_config(self.default_config(args, given), toml_path, overrides), None

    def check_model_unchanged(self, saved: SectionedConfig, out) -> None:
        """A fine-tuning run's checkpoint must still hold the model the run began with."""
        source = self.config_class.MODEL_FROM
        if source is None:
            return
        from_checkpoint = self.model_config_of(getattr(saved, source))
        if from_checkpoint != saved.model:
            raise ValueError(f"--resume: {getattr(saved, source)}/config.json changed since the run started; the run "
                             f"trains the model it began with (see {Path(out) / RUN_CONFIG})")

    # ---------------------------------------------------------------------------------------------- the run
    def run(self, args) -> int:
        command = self.command_for(args)
        if command is not self:
            return command.run(args)
        config, saved = self.resolve(args)
        if args.print_config:
            print(config.to_toml(), end="")
            return 0
        out = Path(args.out) if args.out else self.default_out(config)
        self.check(config)
        return self.train_run(config, out, resume=args.resume, quiet=args.quiet, saved=saved)

    def train_run(self, config, out: Path, *, resume: bool, quiet: bool, saved=None) -> int:
        """Train the checked `config` in `out` and end the command (`train_in`, then `finish`); its exit status."""
        # the run owns RUN/hf and replaces its own export at the end; a directory there holding something else is
        # refused now, not after the training
        check_checkpoint_target(out / "hf", overwrite=True, option="the run's HF export")
        built = self.train_in(config, out, resume=resume, quiet=quiet, saved=saved)
        if built is None:  # the run in --out was already complete
            return 0
        return self.finish(built, out)

    def train_in(self, config, out: Path, *, resume: bool, quiet: bool, saved=None) -> BuiltRun | None:
        """Train `config` in the run directory `out` by the rules of the module docstring, its `phases` first: the
        built run once it has trained, or None when the run in `out` was already complete (which it says).
        `saved`: the run's saved configuration when resuming."""
        started = self.has_started(out)
        resume = resume or (restarted_by_torchrun() and started)
        complete = complete_steps(out)
        if not resume and started:
            if complete is not None:
                say_complete(out, self.name, complete)
                return None
            raise unfinished_run(out, *self.checkpoint_dirs(out)[1:])
        if resume and complete is not None and config.train.steps <= complete:
            say_complete(out, self.name, complete)
            return None
        checkpoints = CheckpointManager(out / "checkpoints", keep=config.train.keep_checkpoints)
        try:
            latest = checkpoints.latest() if resume else None
            phase_started = any(has_checkpoints(directory) for directory in self.checkpoint_dirs(out)[1:])
            if resume and latest is None and not phase_started:  # a resume stopped in a phase continues there
                raise FileNotFoundError(f"{out / 'checkpoints'}: no complete checkpoint to resume from")
            if latest is not None and step_of(latest) > config.train.steps:
                raise ValueError(f"--resume: the run's checkpoint is at step {step_of(latest)}, past train.steps="
                                 f"{config.train.steps}; give --steps N with N >= {step_of(latest)}")
            if is_main_process():  # before any phase: a run stopped in one resumes from this file
                config.save(out / RUN_CONFIG)
            self.train_phases(config, out, quiet=quiet)
            built = self.build(config, out, checkpoints, quiet=quiet)
            trainer = built.trainer
            try:
                if latest is not None:
                    resume_trainer(trainer, checkpoints, latest, saved, config)
                with stop_on_signals(trainer):
                    trainer.train()
            except RunInterrupted as stopped:
                stopped.resume_command = f"{launcher()}hybridtron {self.name} --out {out} --resume"
                raise
            finally:
                built.close()
        finally:
            checkpoints.close()
        return built

    def train_phases(self, config, out: Path, *, quiet: bool) -> None:
        """Each phase of this run in its directory, resumed where it stopped, skipped once complete; its HF
        export written (under torchrun gathered, and whole on every rank's return)."""
        for phase in self.phases:
            directory = out / phase.directory
            phase_config = phase.config(config, out) if complete_steps(directory) is None else None
            if phase_config is None:
                continue
            built = phase.command.train_in(phase_config, directory, quiet=quiet,
                                           resume=has_checkpoints(directory / "checkpoints"))
            if built is not None and export_model(built.trainer, directory / "hf", built.tokenizer):
                history = built.trainer.evaluators[0].history if built.trainer.evaluators else []
                if history:
                    print(f"{phase.directory}: {phase.command.summary_line(history)}", file=sys.stderr)

    def finish(self, built: BuiltRun, out: Path) -> int:
        """The end of the command: the HF export, the summary, the process group closed; the exit status."""
        trainer = built.trainer
        status = 0
        writes = export_model(trainer, out / "hf", built.tokenizer) if built.tokenizer is not None else \
            is_main_process()
        if writes:
            history = trainer.evaluators[0].history if trainer.evaluators else []
            if history:
                print(self.summary_line(history))
                status = divergence_status(trainer, history)
            outputs = {"checkpoints": out / "checkpoints", "metrics": out / METRICS_FILE}
            if built.tokenizer is not None:
                outputs["HF export"] = out / "hf"
            print("\n".join(f"{name + ':':<13}{path}" for name, path in outputs.items()))
        trainer.parallel.close()
        return status


def has_checkpoints(directory: Path) -> bool:
    """`directory` holds a checkpoint (complete or not: a crash mid-save still marks a run as started)."""
    return directory.is_dir() and any(p.is_dir() and p.name.startswith("step_") for p in directory.iterdir())


def unfinished_run(out: Path, *directories: Path) -> ValueError:
    """The error of a directory that holds an unfinished run (checkpoints in `out/checkpoints` or `directories`),
    named by its latest checkpoint."""
    latest = max((p.name.split(".")[0] for d in (out / "checkpoints", *directories) if d.is_dir()
                  for p in d.glob("step_*")), default="none")
    return ValueError(f"{out}: holds an unfinished run (checkpoint {latest}); pass --resume to continue it, or "
                      f"choose another --out for a new run")


def complete_steps(out: Path) -> int | None:
    """The steps of the run in `out` if it is complete (its HF export written after it trained to its last step,
    by its saved configuration), else None."""
    if not (out / "hf" / "config.json").is_file() or not (out / RUN_CONFIG).is_file():
        return None
    directory = out / "checkpoints"
    complete = [step_of(p) for p in directory.glob("step_*") if p.is_dir() and (p / "COMPLETE").exists()] \
        if directory.is_dir() else []
    try:
        steps = int(json.loads((out / RUN_CONFIG).read_text())["train"]["steps"])
    except (ValueError, KeyError, TypeError):  # not a run config this rule can read: not complete
        return None
    return steps if complete and max(complete) >= steps else None


def say_complete(out: Path, command: str, steps: int) -> None:
    print(f"{out}: this run is complete ({steps} steps); nothing to do.\n"
          f"checkpoints: {out / 'checkpoints'}\nmetrics:     {out / METRICS_FILE}\nHF export:   {out / 'hf'}\n"
          f"To train it further: hybridtron {command} --out {out} --resume --steps N (N > {steps}); for a new run, "
          f"another --out.")


def resume_trainer(trainer: Trainer, checkpoints: CheckpointManager, latest: Path, saved, config) -> None:
    """Restore `latest` into the trainer, then apply what the resume changed: a new schedule when its length or
    decay changed, and one `config_changed` event per changed field at the step it takes effect."""
    checkpoints.remove_incomplete()
    trainer.load_checkpoint(latest)
    applied = resume_changes(saved, config)[0] if saved is not None else []
    if any(c.key in ("train.steps", "train.decay_fraction") for c in applied):
        trainer.schedule = trainer.new_schedule()  # e.g. a finished run extended: the decay moves to the new end
    for change in applied:
        trainer.events.write(trainer.step, RUN_EVENT, "config_changed", f"{change} from step {trainer.step + 1} on",
                             key=change.key, saved=change.saved, given=change.given)
    if is_main_process():
        print(f"resumed from {latest} (step {trainer.step})", file=sys.stderr)


@contextlib.contextmanager
def stop_on_signals(trainer: Trainer):
    """While training: SIGINT (Ctrl-C) and SIGTERM ask the trainer to stop after the step in flight (it writes a
    checkpoint and raises RunInterrupted); a second signal stops at once (KeyboardInterrupt). Outside the main
    thread (where Python allows no handlers) nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request_stop(number, frame):
        if trainer.stop_signal is not None:
            raise KeyboardInterrupt
        trainer.stop_signal = number
        if is_main_process():
            print(f"\n{signal.Signals(number).name}: stopping after step {trainer.step + 1} and saving a checkpoint "
                  f"(send it again to stop at once)", file=sys.stderr, flush=True)

    previous = {number: signal.signal(number, request_stop) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def divergence_status(trainer: Trainer, history: list[tuple[int, float]]) -> int:
    """DIVERGED_EXIT (after saying so) when a validation loss ended far above its start, unless the run is a drill
    that expects it (`monitor.expect_divergence`); else 0. Only a loss is judged (a pass rate that falls is the
    evaluation's to report)."""
    evaluator = trainer.evaluators[0]
    if getattr(evaluator, "key", "") != "val_loss" or len(history) < 2:
        return 0
    (_, first), (_, last) = history[0], history[-1]
    if math.isfinite(last) and last <= first * DIVERGED_RATIO:
        return 0
    expected = trainer.monitor.config.expect_divergence
    print(f"the validation loss ended {last / first:.0%} of its start ({first:.3f} -> {last:.3f}): the run diverged"
          + ("; monitor.expect_divergence is set, so this drill exits 0" if expected else
             f"; see {trainer.events.path if trainer.events is not None else 'the run'}"), file=sys.stderr)
    return 0 if expected else DIVERGED_EXIT


# ------------------------------------------------------------------------------------ building the trainer
def saved_config_file(args) -> Path:
    """`--resume`: the run config of the run in `--out`, which must exist."""
    if not args.out:
        raise ValueError("--resume needs --out: the run directory to continue")
    path = Path(args.out) / RUN_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path}: nothing to resume (no run config in --out)")
    return path


def is_main_process() -> bool:
    """Global rank 0 under torchrun (RANK), or a plain process: the one that writes the run directory."""
    return int(os.environ.get("RANK", "0")) == 0


def refuse_torchrun(command: str) -> None:
    """A command that runs as one process stops under torchrun: N copies would each train and write one
    directory."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ValueError(f"hybridtron {command} runs as one process (it does not shard over processes), but torchrun "
                         f"started {world}; run it without torchrun")


def launcher() -> str:
    """How this process was started, as a command line's prefix: `torchrun --nproc-per-node N -m ` for one machine's
    torchrun world (a checkpoint also resumes at any other world size), else nothing."""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return f"torchrun --nproc-per-node {local} -m " if world > 1 and world == local else ""


def restarted_by_torchrun() -> bool:
    """torchrun restarted this worker after a failure of the job (`--max-restarts`)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def start_parallel(dist_config, model_config, *, batch_size: int, grad_accum: int, seq_len: int,
                   context_parallel: bool = False):
    """The run's process groups (hybridtron.distributed.mesh.init_parallel): a world of one without any for one process
    and the default layout; a layout the planner rejects is a ValueError before any process group is built.
    `context_parallel`: the run's batches can be split by position (pretraining's fixed-length sequences)."""
    return init_parallel(dist_config, model_config, batch_size=batch_size, grad_accum=grad_accum, seq_len=seq_len,
                         context_parallel=context_parallel)


def prepare_process(train, model_config, micro_batch_tokens: int, stream=None, dist_config=None) -> None:
    """Before anything is built: refuse a run whose share on this rank (the whole of it in one process; under
    torchrun the `[dist]` layout's share, `dist_config`) cannot fit in memory, on every rank; warn of a slow bf16 CPU
    and of a schedule that will not do what its settings suggest; set the thread count, the seed (model
    initialization and everything after it draw from it) and the compile cache (`train.compile_cache`, on every
    rank; a directory that cannot be written is one warning line, and the run goes on)."""
    stream = sys.stderr if stream is None else stream
    dist_config = DistConfig() if dist_config is None else dist_config
    check_memory(model_config, micro_batch_tokens, train=train, dist_config=dist_config)
    device = run_device(dist_config)
    cache_warning = use_compile_cache(train.compile_cache) if train.compile_cache else None
    if is_main_process():
        slow_bf16 = bf16_warning(train.precision, device)
        warnings = [slow_bf16, cache_warning] + [f"warning: {w}" for w in train.schedule_warnings()]
        for warning in filter(None, warnings):
            print(warning, file=stream)
    if train.threads:
        torch.set_num_threads(train.threads)
    torch.manual_seed(train.seed)


def assemble_trainer(model, objective, batches, evaluators, *, train, monitor_config, out: Path, checkpoints,
                     quiet: bool, parallel: Parallel, stream=None) -> Trainer:
    """A `Trainer` for `model` as every training command runs it: the precision policy applied, the model
    parallelized (`train.compile`, `train.recompute`, and under torchrun the `[dist]` layout of `parallel`), the
    stability monitor (and its fault drill, which may corrupt a loader's batches), metrics.jsonl and, unless `quiet`,
    the progress bar (both on global rank 0 only). `batches` is a loader of (input_ids, labels) micro-batches, taken
    `grad_accum` a step (under torchrun each rank takes its rows of them), or a batch source that gives each step's
    micro-batches itself, this rank's rows included (RL rollouts: a `hybridtron.train.objectives.BatchSource`)."""
    stream = sys.stderr if stream is None else stream  # the stderr of the moment, not of import time
    # precision policy, output-layer grad accumulation dtype; under FSDP the output layer's gradient is reduced in
    # grad_accum_dtype instead (see dist.parallelize)
    convert_for_training(model, dataclasses.replace(train, grad_accum_dtype="fp32") if parallel.distributed else train)
    model = parallelize(model, parallel, recompute=train.recompute, compile=train.compile,
                        output_reduce_dtype=ACCUM_DTYPES[train.grad_accum_dtype])
    main = parallel.is_main
    if parallel.distributed and main and not quiet:  # a single process has no layout to report
        print(f"[dist] {parallel.describe()}", file=stream)
    monitor, faults = build_monitor(monitor_config, out, model.config, stream)
    if not main and monitor.events is not None:  # every rank judges the same steps; rank 0 alone records them
        monitor.events.path, monitor.events.stream = Path(os.devnull), open(os.devnull, "w")
    if not hasattr(batches, "next_step"):  # a loader: grad_accum of its micro-batches a step
        batches = LoaderBatches(batches, train.grad_accum)
        if faults is not None:
            batches = faults.wrap_batches(batches, model.config.vocab_size, model.config.pad_token_id)
        batches = DataParallelBatches(batches, parallel, model.config.mtp_depths)
    hooks = [MetricsLogger(out, every=train.log_every)] if main else []
    if not quiet and main:
        hooks.append(ProgressBar(stream))
        if monitor.events is not None:
            monitor.events.newline_first = hooks[-1].interactive
    if faults is not None:  # the drill installs itself from outside the loop
        hooks.append(faults)
    if main and not quiet and train.optimizer != ADAMW:  # which tensors the matrix optimizer takes
        print(split_summary(model, train), file=stream)
    return Trainer(model, objective, batches, train, checkpoints, hooks=hooks, evaluators=evaluators,
                   monitor=monitor, parallel=parallel)


# ------------------------------------------------------------------------------------------------ the end
def export_model(trainer, hf_dir: Path, tokenizer, model_max_length: int | None = None) -> bool:
    """Write the trained model and its tokenizer files as an HF checkpoint into `hf_dir`; under torchrun every rank
    takes part (the shards are gathered), global rank 0 writes, and every rank returns once the directory is whole
    (the next stage's ranks read it next). `model_max_length`: the tokenizer's (default: the model's context).
    Returns whether this process wrote it."""
    parallel = trainer.parallel
    model_max_length = model_max_length or trainer.model.config.max_position_embeddings
    state = full_state_dict(trainer.model, parallel)  # in one process the model's own tensors, not copies
    writes = parallel.is_main
    if writes:
        model = HybridLM(trainer.model.config, init=False)
        model.load_state_dict(state)
        blocker = trainer.model.config.nemotron_h_blocker()
        if blocker is not None:
            print(f"[export] {hf_dir} is in hybridtron's own format (model_type {HYBRIDTRON_H!r}: hybridtron loads it, "
                  f"transformers refuses it): {blocker}", file=sys.stderr)
        # the run owns its export: a resumed run replaces it (a user's own files there are kept), model and
        # tokenizer published together
        with staged_checkpoint(hf_dir, overwrite=True) as staging:
            save_pretrained(model, staging, nemotron_h=False)
            save_tokenizer_files(tokenizer, staging, model_max_length=model_max_length)
    parallel.barrier()
    return writes


def validation_loss_line(history) -> str:
    (_, first), (_, last) = history[0], history[-1]
    return f"validation loss {first:.3f} -> {last:.3f} ({last / first:.0%} of step 0)"


def pass_at_1_line(history, what: str = "held-out pass@1") -> str:
    (first_step, first), (last_step, last) = history[0], history[-1]
    return f"{what} {first:.1%} (step {first_step}) -> {last:.1%} (step {last_step})"
