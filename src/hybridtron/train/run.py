"""Run directories and sectioned configurations: what every training command (`hybridtron pretrain`,
`hybridtron sft`, ...) does the same way.

A run directory holds everything its run makes: `run_config.json` (the resolved configuration, which `--config`
reads back), `metrics.jsonl`, `events.jsonl`, `checkpoints/` (DCP) and `hf/` (the final model). Its rules:

- a run that trained to its last step and wrote its HF export is complete: the same command again says so and
  where the outputs are, and changes nothing;
- a directory holding checkpoints of an unfinished run is continued only with `--resume`: never overwritten,
  never continued silently;
- `--resume` restores the latest complete checkpoint (an incomplete one, left by a crash in the middle of a save,
  is removed first); an explicit `--steps N` replans the schedule to N steps, to extend a run.

Configurations are sections of frozen dataclasses (`[train]`, `[monitor]`, ...), read from defaults, then a TOML
file, then `--set SECTION.FIELD=VALUE` overrides, each value parsed by the type of the field it names
(`merge_sections`).

Under torchrun every rank runs the same command: global rank 0 alone writes the run directory (run_config.json,
metrics, events, the HF export, gathered from the shards) and prints; all ranks build the same model, parallelize
it by the `[dist]` layout (`start_parallel`, `assemble_trainer(parallel=...)`) and train together. A worker that
torchrun restarts after a failure (`--max-restarts`) continues from the latest complete checkpoint, as `--resume`
does.

Command modules build their parsers from this module, so its top-level imports stay light (no torch).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Callable

RUN_CONFIG = "run_config.json"


# --------------------------------------------------------------------------------------------- arguments
def add_run_arguments(parser, *, sections: str, set_example: str, default_steps: int,
                      config_default: str = "the defaults", quiet_help: str = "no progress bar") -> None:
    """The options every training command has: --out, --steps, --config, --set, --resume, --print-config,
    --quiet. `sections` names the config file's sections for the help text, e.g. "[train] and [monitor]"."""
    parser.add_argument("--out", help="run directory; created, and holds the checkpoints, metrics and HF export "
                                      "(required unless --print-config)")
    parser.add_argument("--steps", type=int, help=f"optimizer steps (default: the config's, {default_steps}; same "
                                                  f"as --set train.steps=N)")
    parser.add_argument("--config", help=f"a TOML file with {sections} sections, or a run's run_config.json "
                                         f"(default: none, {config_default})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help=f"override one field, e.g. {set_example} (repeatable)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its latest complete checkpoint (default: start anew)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration as TOML (which --config accepts) and exit")
    parser.add_argument("--quiet", action="store_true", help=quiet_help)


def step_overrides(args) -> list[str]:
    """`--set` overrides, then `--steps` as `train.steps=N`."""
    return list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps is not None else [])


def saved_config_file(args) -> Path:
    """`--resume`: the run config of the run in `--out`, which must exist."""
    if not args.out:
        raise ValueError("--resume needs --out: the run directory to continue")
    path = Path(args.out) / RUN_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path}: nothing to resume (no run config in --out)")
    return path


# ------------------------------------------------------------------------------------------ configuration
def read_toml_sections(path: str | Path, sections: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The sections of a TOML config file; a missing file, invalid TOML or an unknown section is a ValueError
    (FileNotFoundError for the first) that names the file."""
    from hybridtron.train.config import read_toml

    raw = read_toml(path)
    for section, values in raw.items():
        if section not in sections or not isinstance(values, dict):
            raise ValueError(f"{path}: unknown section [{section}]; expected "
                             f"{', '.join(f'[{s}]' for s in sections)}")
    return raw


def merge_sections(base: dict[str, Any], toml_path: str | Path | None = None, overrides: list[str] = (), *,
                   fixed: dict[str, str] | None = None) -> dict[str, Any]:
    """`base` (section name -> frozen dataclass) with a TOML file's values, then `--set` overrides, applied; each
    section is rebuilt by `_build` and validated by its `validate()` if it has one. `fixed`: sections that neither
    may change, each with the reason its error gives."""
    from hybridtron.train.config import _build, _plain, parse_override

    fixed = fixed or {}
    names = tuple(base) + tuple(name for name in fixed if name not in base)
    changes: dict[str, dict[str, Any]] = {name: {} for name in names}
    if toml_path is not None:
        for section, values in read_toml_sections(toml_path, names).items():
            if section in fixed and values:
                raise ValueError(f"{toml_path}: [{section}] cannot be set here: {fixed[section]}")
            changes[section].update(values)
    for text in overrides:
        section, name, value = parse_override(text)
        if section in fixed:
            raise ValueError(f"--set {text!r}: {section}.{name} cannot be set: {fixed[section]}")
        if section not in base:
            raise ValueError(f"--set {text!r}: unknown section {section!r}; expected {', '.join(base)}")
        changes[section][name] = value
    merged = {}
    for section, obj in base.items():
        merged[section] = _build(type(obj), {**_plain(obj), **changes[section]}, section)
        if hasattr(merged[section], "validate"):
            merged[section].validate()
    return merged


def sections_toml(sections: dict[str, Any]) -> str:
    """Sections of frozen dataclasses as TOML that `read_toml_sections` reads back to the same values, each field
    with the comment its dataclass gives it."""
    from hybridtron.train.config import section_toml

    return "\n".join(line for name, obj in sections.items() for line in section_toml(name, obj) + [""])


# ------------------------------------------------------------------------------------------- the trainer
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


def restarted_by_torchrun() -> bool:
    """torchrun restarted this worker after a failure of the job (`--max-restarts`)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def start_parallel(dist_config, model_config, *, batch_size: int, grad_accum: int, seq_len: int,
                   context_parallel: bool = False):
    """The run's process groups (hybridtron.dist.mesh.init_parallel): None for one process and the default
    layout; a layout the planner rejects is a ValueError before any process group is built. `context_parallel`:
    the run's batches can be split by position (pretraining's fixed-length sequences)."""
    from hybridtron.dist.mesh import init_parallel

    return init_parallel(dist_config, model_config, batch_size=batch_size, grad_accum=grad_accum, seq_len=seq_len,
                         context_parallel=context_parallel)


def prepare_process(train, model_config, micro_batch_tokens: int, stream=None) -> None:
    """Before anything is built: refuse a single-process run that cannot fit in memory (a sharded one is sized by
    `hybridtron plan --layout`), warn of a slow bf16 CPU, set the thread count and the seed (model initialization
    and everything after it draw from it)."""
    import torch

    from hybridtron.dist.mesh import world_from_env
    from hybridtron.train.preflight import bf16_warning, check_memory

    device = torch.device("cpu")
    if world_from_env()[0] == 1:
        check_memory(model_config, micro_batch_tokens, device, "this run")
    warning = bf16_warning(train.precision, device)
    if warning:
        print(warning, file=sys.stderr if stream is None else stream)
    if train.threads:
        torch.set_num_threads(train.threads)
    torch.manual_seed(train.seed)


def assemble_trainer(model, objective, loader, evaluators, *, train, monitor_config, out: Path, checkpoints,
                     quiet: bool, stream=None, parallel=None):
    """A `Trainer` for `model` as every training command runs it: the precision policy applied, the model
    parallelized (`train.compile`, `train.recompute`, and under torchrun the `[dist]` layout of `parallel`), the
    stability monitor (and its fault injector, which may corrupt the loader's batches), `grad_accum`
    micro-batches a step from `loader` (this rank's rows of them), metrics.jsonl and, unless `quiet`, the progress
    bar (both on global rank 0 only). `loader` may instead be a batch source that gives each step's micro-batches
    itself, this rank's rows included (RL rollouts: a `next_step` method); it is used as it is, and its `bind(trainer)`
    is called with the trainer, whose model may be the parallelized one."""
    stream = sys.stderr if stream is None else stream  # the stderr of the moment, not of import time
    import torch

    from hybridtron.dist.parallelize import parallelize
    from hybridtron.numerics.policy import convert_for_training
    from hybridtron.train import hooks as H
    from hybridtron.train.loop import Trainer
    from hybridtron.train.monitor import build_monitor
    from hybridtron.train.objectives import LoaderBatches

    if parallel is None:
        convert_for_training(model, train)  # precision policy, output-layer grad accumulation dtype
    else:  # under FSDP the output layer's gradient is reduced in grad_accum_dtype instead (see dist.parallelize)
        convert_for_training(model, dataclasses.replace(train, grad_accum_dtype="fp32"))
    model = parallelize(model, parallel, recompute=train.recompute, compile=train.compile,
                        output_reduce_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[train.grad_accum_dtype])
    main = parallel is None or parallel.is_main
    if parallel is not None and main and not quiet:
        print(f"[dist] {parallel.describe()}", file=stream)
    monitor, faults = build_monitor(monitor_config, out, model.config, stream)
    if not main and monitor.events is not None:  # every rank judges the same steps; rank 0 alone records them
        monitor.events.path, monitor.events.stream = Path(os.devnull), open(os.devnull, "w")
    if hasattr(loader, "next_step"):  # a batch source already
        batches = loader
    else:
        batches = LoaderBatches(loader, train.grad_accum)
        if faults is not None:
            batches = faults.wrap_batches(batches, model.config.vocab_size)
        if parallel is not None:
            from hybridtron.dist.step import DataParallelBatches

            batches = DataParallelBatches(batches, parallel, model.config.mtp_depths)
    hooks = [H.MetricsLogger(out, every=train.log_every)] if main else []
    if not quiet and main:
        hooks.append(H.ProgressBar(stream))
        if monitor.events is not None:
            monitor.events.newline_first = hooks[-1].interactive
    trainer = Trainer(model, objective, batches, train, checkpoints, hooks=hooks, evaluators=evaluators,
                      monitor=monitor, faults=faults, parallel=parallel)
    if batches is loader and hasattr(loader, "bind"):
        loader.bind(trainer)
    return trainer


# ---------------------------------------------------------------------------------------------- the run
def finished_run(out: Path, config, checkpoints, load_config: Callable[[Path], Any]) -> bool:
    """`out` holds a run of this configuration that trained to its last step and wrote its HF export."""
    from hybridtron.checkpoint.dcp import step_of

    latest = checkpoints.latest()
    if latest is None or not (out / "hf" / "config.json").is_file() or not (out / RUN_CONFIG).is_file():
        return False
    return load_config(out / RUN_CONFIG) == config and step_of(latest) >= config.train.steps


def train_in_run_dir(args, config, load_config: Callable[[Path], Any], build: Callable):
    """Train `config` in `args.out` by the rules of the module docstring. `build(out, checkpoints)` returns
    `(trainer, extra)`; this returns the same pair once the trainer has trained, or None when the run in `out` was
    already complete (which it says). `config` needs `save(path)`, equality and `train.steps` /
    `train.keep_checkpoints`; `load_config(path)` reads a saved one back."""
    from hybridtron.checkpoint.dcp import CheckpointManager

    if not args.out:
        raise ValueError("--out is required: the run directory to create (e.g. --out runs/mine)")
    out = Path(args.out)
    checkpoints = CheckpointManager(out / "checkpoints", keep=config.train.keep_checkpoints)
    main = is_main_process()
    try:
        resume = args.resume or (restarted_by_torchrun() and checkpoints.latest() is not None)
        latest = checkpoints.latest() if resume else None
        if args.resume and latest is None:
            raise FileNotFoundError(f"{out / 'checkpoints'}: no complete checkpoint to resume from")
        if finished_run(out, config, checkpoints, load_config):
            print(f"{out}: this run is complete ({config.train.steps} steps); nothing to do.\n"
                  f"checkpoints: {checkpoints.directory}\nmetrics:     {out / 'metrics.jsonl'}\n"
                  f"HF export:   {out / 'hf'}\n(to train further: --resume --steps N with a larger N; for a new "
                  f"run: another --out)")
            return None
        if not resume and checkpoints.list():
            raise ValueError(f"{out}: holds an unfinished run (checkpoint {checkpoints.latest().name}); pass --resume "
                             f"to continue it, or choose another --out for a new run")
        out.mkdir(parents=True, exist_ok=True)
        if main:
            config.save(out / RUN_CONFIG)
        trainer, extra = build(out, checkpoints)
        if latest is not None:
            checkpoints.remove_incomplete()
            trainer.load_checkpoint(latest)
            if args.steps is not None and args.steps != trainer.schedule.total_steps:
                # an explicit --steps on resume replans the schedule to the new total (e.g. to extend a run)
                trainer.schedule = trainer.new_schedule()
            if main:
                print(f"resumed from {latest} (step {trainer.step})", file=sys.stderr)
        trainer.train()
    finally:
        checkpoints.close()
    return trainer, extra


def export_model(trainer, hf_dir: Path, tokenizer, model_max_length: int) -> bool:
    """Write the trained model and its tokenizer files as an HF checkpoint into `hf_dir`; under torchrun every rank
    takes part (the shards are gathered), global rank 0 writes, and every rank returns once the directory is whole
    (the MOPD warmup's ranks read it next). Returns whether this process wrote it."""
    from hybridtron.checkpoint.hf import save_pretrained
    from hybridtron.data.chat import save_tokenizer_files

    parallel = trainer.parallel
    if parallel is None:
        model = trainer.model
    else:
        from hybridtron.dist.step import full_state_dict
        from hybridtron.model.lm import HybridLM

        state = full_state_dict(trainer.model, parallel)
        if parallel.is_main:
            model = HybridLM(trainer.model.config, init=False)
            model.load_state_dict(state)
    writes = parallel is None or parallel.is_main
    if writes:
        save_pretrained(model, hf_dir)
        save_tokenizer_files(tokenizer, hf_dir, model_max_length=model_max_length)
    if parallel is not None:
        parallel.barrier()
    return writes


def validation_loss_line(history) -> str:
    (_, first), (_, last) = history[0], history[-1]
    return f"validation loss {first:.3f} -> {last:.3f} ({last / first:.0%} of step 0)"


def pass_at_1_line(history, what: str = "held-out pass@1") -> str:
    (first_step, first), (last_step, last) = history[0], history[-1]
    return f"{what} {first:.1%} (step {first_step}) -> {last:.1%} (step {last_step})"


def finish_run(trainer, out: Path, tokenizer, model_max_length: int, summary_line=validation_loss_line) -> None:
    """The end of every training command: the HF export `out/hf` with the tokenizer files (under torchrun gathered
    from the shards; global rank 0 writes), the first evaluator's first and last value (`summary_line(history)`),
    where the outputs are, and the process group closed."""
    hf_dir = out / "hf"
    if export_model(trainer, hf_dir, tokenizer, model_max_length):
        history = trainer.evaluators[0].history if trainer.evaluators else []
        if history:
            print(summary_line(history))
        print(f"checkpoints: {out / 'checkpoints'}\nmetrics:     {out / 'metrics.jsonl'}\nHF export:   {hf_dir}")
    if trainer.parallel is not None:
        trainer.parallel.close()
