"""`hybridtron pretrain`: train a hybrid model from scratch on a bucketed data mixture, resumably.

The run directory holds everything the run makes:

    run_config.json      the resolved [model], [data], [train], [monitor], [dist] configuration (`--config` reads
                         it back)
    mixture.json         tokens, share and epochs per bucket
    metrics.jsonl        one line per step; tensorboard/ too when tensorboard is installed
    events.jsonl         the stability monitor's detections and actions (metrics.rolled_back.jsonl: the lines of
                         steps a rollback abandoned); `hybridtron report RUN_DIR` draws it all
    checkpoints/         DCP checkpoints (model, optimizer, schedule, loader position, RNG, monitor, hooks)
    hf/                  the final model as an HF checkpoint (config.json, safetensors, tokenizer files)

Running the command again on a finished run says it is complete and where its outputs are; an interrupted run
continues with `--resume` (the run-directory rules every training command shares: hybridtron.train.run).

Across processes: `torchrun --nproc-per-node N -m hybridtron pretrain ...` with the same options; the `[dist]`
section lays the model out (FSDP2, TP, EP, PP; docs/SCALE.md), and a checkpoint resumes at any world size.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from hybridtron.config import PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hybridtron.train.run import add_run_arguments

    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                        help="model preset to start from (default: tiny, 3.7M parameters, trains on a laptop CPU)")
    add_run_arguments(parser, sections="[model], [data], [train], [monitor] and [dist]", default_steps=400,
                      set_example="--set train.lr=3e-4 --set data.vocab_size=2048",
                      config_default="the preset's values", quiet_help="no mixture table and no progress bar")


def resolve_config(args):
    from hybridtron.train.config import RunConfig, build_run_config
    from hybridtron.train.run import saved_config_file, step_overrides

    overrides = step_overrides(args)
    if args.resume:
        return build_run_config(toml_path=args.config, overrides=overrides,
                                base=RunConfig.load(saved_config_file(args)))
    return build_run_config(args.preset, args.config, overrides)


def build_trainer(config, out: Path, checkpoints, *, quiet: bool, stream=None):
    """The pretraining run of `config` in `out`: data, model under its precision policy, monitor and hooks. Its
    messages go to `stream`, by default the `sys.stderr` of the moment (not of import time: it may be redirected)."""
    stream = sys.stderr if stream is None else stream
    from hybridtron.data import build_data
    from hybridtron.dist.step import held_out_shares
    from hybridtron.model.lm import HybridLM
    from hybridtron.train.evaluate import ValidationLoss
    from hybridtron.train.objectives import PretrainObjective
    from hybridtron.train.run import assemble_trainer, prepare_process, start_parallel

    train = config.train
    model_config = config.model
    if train.mtp_loss_weight is not None:
        model_config = model_config.replace(mtp_loss_weight=train.mtp_loss_weight)
    parallel = start_parallel(config.dist, model_config, batch_size=config.data.batch_size,
                              grad_accum=train.grad_accum, seq_len=config.data.seq_len, context_parallel=True)
    main = parallel is None or parallel.is_main
    quiet = quiet or not main
    prepare_process(train, model_config, config.data.seq_len * config.data.batch_size, stream)

    with parallel.main_first() if parallel is not None else contextlib.nullcontext():  # one rank fills the cache
        data = build_data(config.data, total_sequences=train.steps * train.grad_accum * config.data.batch_size)
    if data.tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(f"the tokenizer has {data.tokenizer.vocab_size} tokens but model.vocab_size is "
                         f"{model_config.vocab_size}; set them equal (--set data.vocab_size=... or model.vocab_size)")
    if main:
        data.mixture_report.save(out / "mixture.json")
    if not quiet:
        print(data.mixture_report.format(max_rows=12), file=stream)

    # under torchrun every rank builds the model on the meta device and `parallelize` fills in its own shards
    # (hybridtron.dist.materialize): no rank holds the whole model, and every layout starts from these weights
    model = HybridLM(model_config) if parallel is None else HybridLM.on_meta(model_config)
    val_batches = data.val_batches if parallel is None else \
        [(ids.to(parallel.device), labels.to(parallel.device)) for ids, labels in data.val_batches]
    val_batches, sum_over_shares = held_out_shares(val_batches, parallel)  # under CP: this rank's shares
    objective = PretrainObjective(compile_loss=train.compile) if parallel is None else PretrainObjective(
        parallel.sum_over_data, model_config.mtp_depths, train.compile)
    validation = ValidationLoss(val_batches, train.val_every, sum_over_shares=sum_over_shares)
    trainer = assemble_trainer(model, objective, data.train_loader, [validation],
                               train=train, monitor_config=config.monitor, out=out, checkpoints=checkpoints,
                               quiet=quiet, stream=stream, parallel=parallel)
    return trainer, data


def run(args) -> int:
    from hybridtron.dist.mesh import check_run_layout, world_from_env
    from hybridtron.train.config import RunConfig
    from hybridtron.train.run import finish_run, train_in_run_dir

    config = resolve_config(args)
    if args.print_config:
        print(config.to_toml(), end="")
        return 0
    check_run_layout(config.dist, config.model, world_from_env()[0], batch_size=config.data.batch_size,
                     grad_accum=config.train.grad_accum, seq_len=config.data.seq_len,
                     context_parallel=True)  # before anything is written
    result = train_in_run_dir(args, config, RunConfig.load, lambda out, checkpoints: build_trainer(
        config, out, checkpoints, quiet=args.quiet))
    if result is None:  # the run in --out was already complete
        return 0
    trainer, data = result
    finish_run(trainer, Path(args.out), data.tokenizer, config.model.max_position_embeddings)
    return 0
