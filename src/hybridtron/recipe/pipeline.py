"""`hybridtron pipeline`: Nemotron 3 Ultra's training recipe end to end, from pretraining to MTP boosting, in one
resumable command.

The stages (hybridtron.recipe.stages) run in order, each in its run directory `OUT/<stage>/` as its command runs it
(the command's run configuration, built from the pipeline's configuration and the stages before it, trained by the
command's `RunCommand`), each leaving its model in `OUT/<stage>/hf/`. Every stage's command line is logged, runnable
as printed.

One configuration holds every stage (`--print-config` writes it as TOML; `--config FILE` reads one back;
`--set STAGE.FIELD=VALUE` changes one field): `[pipeline]` (model preset, torch threads, environments' levels),
`[eval]`, and a section per stage with `enabled`, `steps` and, as sub-tables, its command's settings
(`[rlvr.grpo] group_size = 8` is `hybridtron grpo --set grpo.group_size=8`; `--set rlvr.grpo.group_size=8` on the
pipeline's command line). Presets: `tiny` (the real run, sized for 2 CPU cores) and `micro` (CI). `--base DIR`
starts from a pretrained checkpoint of one's own instead of the pretrain stage.

Resumable stage by stage: a finished stage (its `stage.json` written after its command returned and its model was
evaluated) is skipped; a stage that was killed is continued from its checkpoints, as its command's --resume does. A
stage's fingerprint (its command line and those of the stages it builds on) is kept in `stage.json`: a
configuration that changed a finished stage is refused, naming the stage, rather than mixing the outputs of two
configurations. Ctrl-C stops the stage in flight as its command does (a checkpoint, then one line); the same
pipeline command continues it.

After every stage its model is evaluated the same way (hybridtron.recipe.evaluation); at the end, as in the report's
Table 5, each MOPD stage's recovery per domain (hybridtron.recipe.render). Written to `OUT/pipeline.json`,
printed, and drawn in `OUT/pipeline.html`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from hybridtron.checkpoint.hf import resolve_checkpoint_dir
from hybridtron.errors import RunInterrupted
from hybridtron.files import RUN_CONFIG
from hybridtron.recipe.evaluation import eval_set, evaluate_model, format_row
from hybridtron.recipe.render import format_table, render_html, summarize
from hybridtron.recipe.config import PRESET_SECTIONS, PipelineConfig, parse_set, read_pipeline_toml
from hybridtron.recipe.stages import (CONFIG_FILE, EVAL_FILE, HTML_FILE, RESULT_FILE, STAGE_FILE, active_stages,
                                      apply_changes, base_stage, check_data_tasks, command_line, declared,
                                      enabled_stages, fingerprints, pipeline_toml, preset_config, read_json, stage_run,
                                      validate)
from hybridtron.train.config import section_values
from hybridtron.train.run import refuse_torchrun


def saved_config(args) -> Path | None:
    """OUT's own configuration (what its last run wrote) when OUT has run before and no --config replaces it."""
    path = Path(args.out) / CONFIG_FILE if getattr(args, "out", None) else None
    return path if path is not None and path.is_file() and not args.config else None


def config_from_file(source, preset: str | None = None, *, in_out: bool = False) -> PipelineConfig:
    """The TOML file `source` over its preset: `preset` if given, else the one the file names (`[pipeline] preset`),
    else tiny. `in_out`: the file is a pipeline directory's own (its errors then offer another --out)."""
    changes = read_pipeline_toml(source)
    named = changes.get("pipeline", {}).get("preset")
    if named is not None and named not in PRESET_SECTIONS:
        raise ValueError(f"{source}: [pipeline] preset = {named!r}: unknown pipeline preset; expected one of "
                         f"{', '.join(PRESET_SECTIONS)}")
    if preset and named and preset != named:
        raise ValueError(f"--preset {preset}: {source} was resolved from the {named} preset; leave --preset "
                         f"out to use it" + (", or choose another --out" if in_out else ""))
    return apply_changes(preset_config(preset or named or "tiny"), changes, str(source))


def resolve_config(args) -> PipelineConfig:
    """The preset <- the TOML file (--config, or OUT/pipeline_config.toml when the pipeline continues in OUT: a
    directory remembers the --preset, --config, --base and --set it was started with) <- --base <- --set, validated.
    The preset is --preset, else the one the file names (`[pipeline] preset`), else tiny."""
    source = args.config or saved_config(args)
    config = config_from_file(source, args.preset, in_out=not args.config) if source else \
        preset_config(args.preset or "tiny")
    if getattr(args, "base", None):
        base = str(resolve_checkpoint_dir(args.base, "--base")[0])  # a run directory: its hf/ export
        replaced = {base_stage().name: {"enabled": False}}
        config = apply_changes(config, {"pipeline": {"base_model": base}, **replaced}, "--base")
    if args.overrides:
        overrides = parse_set(args.overrides)
        if "preset" in overrides.get("pipeline", {}):
            raise ValueError("--set pipeline.preset: the preset is what the other values start from; use --preset")
        config = apply_changes(config, overrides, "--set")
    validate(config)
    return config


def run_stage(name: str, config: PipelineConfig, out: Path, log) -> float:
    """Run (or continue) stage `name`; returns its wall time in seconds, writing its data included."""
    started = time.perf_counter()
    run_dir, writer = out / name, declared()[name].data
    if writer is not None and writer.writes(name, config.stages[name], config) and \
            not (run_dir / writer.file).is_file():
        writer.write(name, config, out, log)
    command, run_config = stage_run(name, config, out)
    command.check(run_config)
    resume = command.has_started(run_dir)
    log(f"[{name}] {'resuming' if resume else 'running'}: {command_line(name, config, out)}"
        + (" --resume" if resume else "") + " --quiet")
    try:
        saved = type(run_config).load(run_dir / RUN_CONFIG) if resume else None
        built = command.train_in(run_config, run_dir, resume=resume, quiet=True, saved=saved)
    except RunInterrupted as stopped:
        stopped.resume_command = f"hybridtron pipeline --out {out} (the same configuration: it continues {name})"
        raise
    if built is not None:  # None: the stage had trained and exported before (killed while it was evaluated)
        status = command.finish(built, run_dir)
        if status:
            log(f"[{name}] warning: hybridtron {command.name} ended with status {status} (see above)")
    return time.perf_counter() - started


def run_pipeline(config: PipelineConfig, out: Path, *, log=None, stop_after: str | None = None) -> dict:
    """Every enabled stage in order (skipping the finished ones), each evaluated; then the table. `stop_after`:
    end after that stage (what an interrupted run leaves, for tests and for running the pipeline in parts)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if config.pipeline.threads:
        torch.set_num_threads(config.pipeline.threads)
    out.mkdir(parents=True, exist_ok=True)
    prints = fingerprints(config, out)
    # every check before the first stage runs: a change to a finished stage, found after an hour of the stages
    # before it, would waste that hour
    for name in active_stages(config):
        record = read_json(out / name / STAGE_FILE)
        if record is not None and record.get("fingerprint") != prints[name]:
            raise ValueError(f"{out / name}: this stage was run with another configuration (or after other upstream "
                             f"stages; see its {STAGE_FILE}); remove {out / name} and the stages after it to rerun "
                             f"them, or choose another --out")
    eval_print = hashlib.sha256(json.dumps(section_values(config.eval), sort_keys=True).encode()).hexdigest()[:16]
    material = eval_set(config)  # drawn first: an environment without enough test tasks fails now, not in an hour
    check_data_tasks(config)  # and one without enough training tasks for the SFT stages' data
    (out / CONFIG_FILE).write_text(pipeline_toml(config))
    for stage in enabled_stages(config):
        name = stage.name
        record = read_json(out / name / STAGE_FILE)
        if record is not None:
            log(f"[{name}] done ({record['seconds']:.0f}s), skipped")
        else:
            seconds = run_stage(name, config, out, log)
            record = {"stage": name, "command": stage.command.name, "fingerprint": prints[name],
                      "command_line": command_line(name, config, out), "seconds": seconds,
                      "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            (out / name / STAGE_FILE).write_text(json.dumps(record, indent=2))
        evaluation = read_json(out / name / EVAL_FILE)
        if evaluation is None or evaluation.get("fingerprint") != eval_print + prints[name]:
            evaluation = {"fingerprint": eval_print + prints[name],
                          **evaluate_model(out / name / "hf", config, material)}
            (out / name / EVAL_FILE).write_text(json.dumps(evaluation, indent=2))
            log(f"[{name}] " + format_row(evaluation))
        if name == stop_after:
            break
    result = summarize(config, out)
    (out / RESULT_FILE).write_text(json.dumps(result, indent=2))
    (out / HTML_FILE).write_text(render_html(result, out))
    return result


# ================================================================================================ command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESET_SECTIONS),
                        help="tiny: the real run, sized for 2 CPU cores; micro: a minute, for CI (default: the "
                             "--config file's, or that of the pipeline that ran in --out before, else tiny)")
    parser.add_argument("--out", help="the pipeline's directory: one run directory per stage, pipeline.json, "
                                      "pipeline.html and pipeline_config.toml, the configuration a later run in it "
                                      "starts from (required unless --print-config)")
    parser.add_argument("--base", metavar="DIR",
                        help="start from this pretrained HF checkpoint (with tokenizer files) instead of the pretrain "
                             "stage; the same as --set pipeline.base_model=DIR --set pretrain.enabled=false "
                             "(default: none, pretrain)")
    parser.add_argument("--config", help="a TOML file with [pipeline], [eval] and [STAGE] sections ([STAGE.SECTION] "
                                         "tables: the stage command's settings), as --print-config writes "
                                         "(default: none, the preset's values)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="STAGE.FIELD=VALUE",
                        help="override one field, e.g. --set rlvr.steps=40 --set rlvr.grpo.group_size=8 --set "
                             "eval.math_tasks=200 (repeatable)")
    parser.add_argument("--stop-after", choices=list(declared()),
                        help="end after this stage; the rest runs when the pipeline is run again (default: none, "
                             "run every stage)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration as TOML (which --config accepts) and exit")


def run(args) -> int:
    refuse_torchrun("pipeline")  # its stages run in this process, one after another
    config = resolve_config(args)
    if saved_config(args) and not args.print_config:
        print(f"[pipeline] continuing in {args.out} with its configuration ({saved_config(args)}; --config, --base "
              f"and --set change it)", file=sys.stderr, flush=True)
    if args.print_config:
        print(pipeline_toml(config), end="")
        return 0
    if not args.out:
        raise ValueError("--out is required: the pipeline's directory (e.g. --out runs/pipe)")
    result = run_pipeline(config, Path(args.out), stop_after=args.stop_after)
    print(format_table(result))
    print(f"\n{Path(args.out) / RESULT_FILE}\n{Path(args.out) / HTML_FILE}")
    return 0
