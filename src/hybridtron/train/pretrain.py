"""`hybridtron pretrain`: train a hybrid model from scratch on a bucketed data mixture, resumably.

The run directory holds everything the run makes:

    run_config.json      the resolved [model], [data], [train], [monitor] configuration (`--config` reads it back)
    mixture.json         tokens, share and epochs per bucket
    metrics.jsonl        one line per step; tensorboard/ too when tensorboard is installed
    events.jsonl         the stability monitor's detections and actions (metrics.rolled_back.jsonl: the lines of
                         steps a rollback abandoned); `hybridtron report RUN_DIR` draws it all
    checkpoints/         DCP checkpoints (model, optimizer, schedule, loader position, RNG, monitor, hooks)
    hf/                  the final model as an HF checkpoint (config.json, safetensors, tokenizer files)

Running the command again on a finished run says it is complete and where its outputs are; an interrupted run
continues with `--resume` (the run-directory rules every training command shares: hybridtron.train.run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridtron.config import PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hybridtron.train.run import add_run_arguments

    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                        help="model preset to start from (default: tiny, 3.7M parameters, trains on a laptop CPU)")
    add_run_arguments(parser, sections="[model], [data], [train] and [monitor]", default_steps=400,
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


def build_trainer(config, out: Path, checkpoints, *, quiet: bool, stream=sys.stderr):
    """The pretraining run of `config` in `out`: data, model under its precision policy, monitor and hooks."""
    import torch

    from hybridtron.data import build_data
    from hybridtron.model.lm import HybridLM
    from hybridtron.numerics.policy import convert_for_training
    from hybridtron.train import hooks as H
    from hybridtron.train.evaluate import ValidationLoss
    from hybridtron.train.loop import Trainer
    from hybridtron.train.monitor import build_monitor
    from hybridtron.train.objectives import LoaderBatches, PretrainObjective
    from hybridtron.train.preflight import bf16_warning, check_memory

    train = config.train
    model_config = config.model
    if train.mtp_loss_weight is not None:
        model_config = model_config.replace(mtp_loss_weight=train.mtp_loss_weight)
    device = torch.device("cpu")
    check_memory(model_config, config.data.seq_len * config.data.batch_size, device, "this run")
    warning = bf16_warning(train.precision, device)
    if warning:
        print(warning, file=stream)
    if train.threads:
        torch.set_num_threads(train.threads)
    torch.manual_seed(train.seed)

    data = build_data(config.data, total_sequences=train.steps * train.grad_accum * config.data.batch_size)
    if data.tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(f"the tokenizer has {data.tokenizer.vocab_size} tokens but model.vocab_size is "
                         f"{model_config.vocab_size}; set them equal (--set data.vocab_size=... or model.vocab_size)")
    data.mixture_report.save(out / "mixture.json")
    if not quiet:
        print(data.mixture_report.format(max_rows=12), file=stream)

    model = HybridLM(model_config)
    convert_for_training(model, train)  # precision policy, output-layer grad accumulation dtype
    monitor, faults = build_monitor(config.monitor, out, model_config, stream)
    batches = LoaderBatches(data.train_loader, train.grad_accum)
    if faults is not None:
        batches = faults.wrap_batches(batches, model_config.vocab_size)
    hooks = [H.MetricsLogger(out, every=train.log_every)]
    if not quiet:
        hooks.append(H.ProgressBar(stream))
        if monitor.events is not None:
            monitor.events.newline_first = hooks[-1].interactive
    trainer = Trainer(model, PretrainObjective(), batches, train, checkpoints, hooks=hooks,
                      evaluators=[ValidationLoss(data.val_batches, train.val_every)], monitor=monitor, faults=faults)
    return trainer, data


def run(args) -> int:
    from hybridtron.checkpoint.hf import save_pretrained
    from hybridtron.data.chat import save_tokenizer_files
    from hybridtron.train.config import RunConfig
    from hybridtron.train.run import print_summary, train_in_run_dir

    config = resolve_config(args)
    if args.print_config:
        print(config.to_toml(), end="")
        return 0
    result = train_in_run_dir(args, config, RunConfig.load, lambda out, checkpoints: build_trainer(
        config, out, checkpoints, quiet=args.quiet))
    if result is None:  # the run in --out was already complete
        return 0
    trainer, data = result
    out = Path(args.out)
    save_pretrained(trainer.model, out / "hf")
    save_tokenizer_files(data.tokenizer, out / "hf", model_max_length=config.model.max_position_embeddings)
    print_summary(trainer, out, out / "hf")
    return 0
