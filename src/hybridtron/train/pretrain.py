"""`hybridtron pretrain`: train a hybrid model from scratch on a bucketed data mixture, resumably.

The run directory holds everything the run makes (the rules every training command shares: hybridtron.train.run):

    run_config.json      the resolved [model], [data], [train], [monitor], [dist] configuration (`--config` reads
                         it back)
    mixture.json         tokens, share and epochs per bucket
    metrics.jsonl        one line per step; tensorboard/ too when tensorboard is installed
    events.jsonl         the stability monitor's detections and actions, resumes, interruptions, configuration
                         changes (metrics.rolled_back.jsonl: the lines of steps a rollback abandoned);
                         `hybridtron report RUN_DIR` draws it all
    checkpoints/         DCP checkpoints (model, optimizer, schedule, loader position, RNG, monitor, hooks)
    hf/                  the final model as an HF checkpoint (config.json, safetensors, tokenizer files)

Across processes: `torchrun --nproc-per-node N -m hybridtron pretrain ...` with the same options; the `[dist]`
section lays the model out (FSDP2, TP, EP, PP; docs/scale-out.md), and a checkpoint resumes at any world size.

`--phase long_context --from CHECKPOINT` (or a config file with a `[phase]` section) runs the long-context phase
from a pretrained checkpoint instead (hybridtron.train.long_context); `--resume` knows a phase's run directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hybridtron.config import PRESETS, preset
from hybridtron.data import build_data
from hybridtron.distributed.mesh import check_run_layout, world_from_env
from hybridtron.distributed.step import held_out_shares
from hybridtron.files import RUN_CONFIG
from hybridtron.model.lm import HybridLM
from hybridtron.train.config import RunConfig
from hybridtron.train.evaluate import HeldOutLoss
from hybridtron.train.long_context import LONG_CONTEXT, PHASE, phase_of_config_file
from hybridtron.train.objectives import PretrainObjective
from hybridtron.train.run import BuiltRun, RunCommand, assemble_trainer, prepare_process, start_parallel


def build_pretraining(config: RunConfig, out: Path, checkpoints, *, quiet: bool, stream=None) -> BuiltRun:
    """The pretraining run of `config` in `out`: data, model under its precision policy, monitor and hooks. Its
    messages go to `stream`, by default the `sys.stderr` of the moment (not of import time: it may be redirected)."""
    stream = sys.stderr if stream is None else stream
    train = config.train
    model_config = config.model
    if train.mtp_loss_weight is not None:
        model_config = model_config.replace(mtp_loss_weight=train.mtp_loss_weight)
    parallel = start_parallel(config.dist, model_config, batch_size=config.data.batch_size,
                              grad_accum=train.grad_accum, seq_len=config.data.seq_len, context_parallel=True)
    main = parallel.is_main
    quiet = quiet or not main
    prepare_process(train, model_config, config.data.seq_len * config.data.batch_size, stream, config.dist)

    with parallel.main_first():  # one rank fills the cache
        data = build_data(config.data, total_sequences=train.steps * train.grad_accum * config.data.batch_size)
    if data.tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(f"the tokenizer has {data.tokenizer.vocab_size} tokens but model.vocab_size is "
                         f"{model_config.vocab_size}; set them equal (--set data.vocab_size=... or model.vocab_size)")
    if main:
        data.mixture_report.save(out / "mixture.json")
    if not quiet:
        print(data.mixture_report.format(max_rows=12), file=stream)

    # every rank builds the model on the meta device and `parallelize` fills in its own shards
    # (hybridtron.distributed.materialize): no rank holds the whole model, and every layout starts from these weights
    model = HybridLM.on_meta(model_config)
    val_batches = [batch.to(parallel.device) for batch in data.val_batches]
    val_batches, sum_over_shares = held_out_shares(val_batches, parallel)  # under CP: this rank's shares
    objective = PretrainObjective(parallel.sum_over_data, model_config.mtp_depths, train.compile)
    # data.val_fraction = 0 holds nothing out: no validation
    validation = [HeldOutLoss(val_batches, train.val_every, sum_over_shares=sum_over_shares, per_batch_mean=True)
                  ] if val_batches else []
    trainer = assemble_trainer(model, objective, data.train_loader, validation,
                               train=train, monitor_config=config.monitor, out=out, checkpoints=checkpoints,
                               quiet=quiet, stream=stream, parallel=parallel)
    return BuiltRun(trainer, data.tokenizer)


class Pretrain(RunCommand):
    name = "pretrain"
    config_class = RunConfig
    default_steps = RunConfig().train.steps
    set_example = "--set train.lr=3e-4 --set data.vocab_size=2048"
    quiet_help = "no mixture table and no progress bar"

    def add_command_arguments(self, parser):
        parser.add_argument("--preset", choices=sorted(PRESETS),
                            help="model preset to start from (default: tiny, 3.7M parameters, trains on a laptop CPU; "
                                 "ignored with --resume or a run_config.json as --config)")
        parser.add_argument("--phase", choices=(PHASE,),
                            help=f"{PHASE}: continue a pretrained --from checkpoint at longer sequence lengths (the "
                                 f"[phase] section; docs/pretraining.md) (default: none, pretraining from scratch)")
        for item in LONG_CONTEXT.inputs:
            parser.add_argument(item.flag, dest=item.dest, help=f"with --phase: {item.help} (required with --phase, "
                                                                f"unless --resume)")

    def default_config(self, args, inputs):
        return RunConfig(model=preset(args.preset or "tiny"))

    def command_for(self, args):
        """The long-context phase (hybridtron.train.long_context) for --phase, its config file or its run."""
        phase = getattr(args, "phase", None) == PHASE or phase_of_config_file(args.config) or (
            args.resume and args.out is not None and phase_of_config_file(str(Path(args.out) / RUN_CONFIG)))
        if phase:
            if getattr(args, "preset", None) is not None:
                raise ValueError(f"--preset: the {PHASE} phase trains the model of its --from checkpoint")
            return LONG_CONTEXT
        if getattr(args, "from", None) is not None:
            raise ValueError(f"--from starts the long-context phase from a checkpoint: add --phase {PHASE}")
        return self

    def check(self, config):
        check_run_layout(config.dist, config.model, world_from_env()[0], batch_size=config.data.batch_size,
                         grad_accum=config.train.grad_accum, seq_len=config.data.seq_len, context_parallel=True)

    def build(self, config, out, checkpoints, *, quiet):
        return build_pretraining(config, out, checkpoints, quiet=quiet)


COMMAND = Pretrain()
add_arguments, run = COMMAND.add_arguments, COMMAND.run
