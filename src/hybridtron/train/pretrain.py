"""`hybridtron pretrain`: train a hybrid model from scratch on a bucketed data mixture, resumably.

The run directory holds everything the run makes:

    run_config.json      the resolved [model], [data], [train] configuration
    mixture.json         tokens, share and epochs per bucket
    metrics.jsonl        one line per step; tensorboard/ too when tensorboard is installed
    events.jsonl         the stability monitor's detections and actions (metrics.rolled_back.jsonl: the lines of
                         steps a rollback abandoned); `hybridtron report RUN_DIR` draws it all
    checkpoints/         DCP checkpoints (model, optimizer, schedule, loader position, RNG, hooks)
    hf/                  the final model as an HF checkpoint (config.json, safetensors, tokenizer.json)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from hybridtron.checkpoint.dcp import CheckpointManager
from hybridtron.config import PRESETS
from hybridtron.train.config import RunConfig, build_run_config

RUN_CONFIG = "run_config.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                        help="model preset to start from (default: tiny, a few million parameters)")
    parser.add_argument("--out", required=True, help="run directory (created; holds checkpoints, metrics, HF export)")
    parser.add_argument("--steps", type=int, help="optimizer steps (same as --set train.steps=N)")
    parser.add_argument("--config", help="TOML file with [model], [data] and [train] sections")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override one field, e.g. --set train.lr=3e-4 --set data.vocab_size=2048 (repeatable)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its latest complete checkpoint")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def resolve_config(args) -> RunConfig:
    out = Path(args.out)
    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps is not None else [])
    if args.resume:
        if not (out / RUN_CONFIG).is_file():
            raise FileNotFoundError(f"{out / RUN_CONFIG}: nothing to resume (no run config in --out)")
        return build_run_config(toml_path=args.config, overrides=overrides, base=RunConfig.load(out / RUN_CONFIG))
    return build_run_config(args.preset, args.config, overrides)


def run(args) -> int:
    from hybridtron.data import build_data
    from hybridtron.model.lm import HybridLM
    from hybridtron.numerics.policy import convert_for_training
    from hybridtron.train import hooks as H
    from hybridtron.train.loop import Trainer
    from hybridtron.train.monitor import monitor_hooks

    out = Path(args.out)
    config = resolve_config(args)
    checkpoints = CheckpointManager(out / "checkpoints", keep=config.train.keep_checkpoints)
    latest = checkpoints.latest() if args.resume else None
    if args.resume and latest is None:
        raise FileNotFoundError(f"{out / 'checkpoints'}: no complete checkpoint to resume from")
    if not args.resume and checkpoints.list():
        raise ValueError(f"{out}: already holds checkpoints; pass --resume to continue it or choose a new --out")
    out.mkdir(parents=True, exist_ok=True)
    config.save(out / RUN_CONFIG)
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    torch.manual_seed(config.train.seed)

    data = build_data(config.data,
                      total_sequences=config.train.steps * config.train.grad_accum * config.data.batch_size)
    if data.tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(f"the tokenizer has {data.tokenizer.vocab_size} tokens but model.vocab_size is "
                         f"{config.model.vocab_size}; set them equal (--set data.vocab_size=... or model.vocab_size)")
    data.mixture_report.save(out / "mixture.json")
    if not args.quiet:
        print(data.mixture_report.format(max_rows=12), file=sys.stderr)

    model_config = config.model
    if config.train.mtp_loss_weight is not None:
        model_config = model_config.replace(mtp_loss_weight=config.train.mtp_loss_weight)
    model = HybridLM(model_config)
    convert_for_training(model, config.train)  # precision policy, output-layer grad accumulation dtype
    logger = H.MetricsLogger(out, every=config.train.log_every)
    watch, recovery = monitor_hooks(config.monitor, out, model_config)
    hooks = [H.ExpertLoad(config.train.maxvio_window), H.Validation(data.val_batches, config.train.val_every),
             *watch, logger, H.Checkpointing(config.train.checkpoint_every)]
    if not args.quiet:
        hooks.append(H.ProgressBar())
    hooks += recovery  # last: a rollback happens after every other hook has seen the step
    trainer = Trainer(model, data.train_loader, config.train, hooks, checkpoints)
    trainer.logger = logger
    if latest is not None:
        checkpoints.remove_incomplete()
        trainer.load_checkpoint(latest)
        if args.steps is not None and args.steps != trainer.schedule.total_steps:
            # an explicit --steps on resume replans the schedule to the new total (e.g. to extend a run)
            trainer.schedule = trainer.new_schedule()
        print(f"resumed from {latest} (step {trainer.step})", file=sys.stderr)
    trainer.train()

    hf_dir = out / "hf"
    model.save_pretrained(hf_dir)
    data.tokenizer.save(hf_dir / "tokenizer.json")
    validation = trainer.hooks.find(H.Validation)
    first, last = validation.history[0][1], validation.history[-1][1]
    print(f"validation loss {first:.3f} -> {last:.3f} ({last / first:.0%} of step 0)")
    print(f"checkpoints: {checkpoints.directory}\nmetrics:     {logger.path}\nHF export:   {hf_dir}")
    return 0
