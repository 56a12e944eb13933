"""The long-context phase: `hybridtron pretrain --phase long_context --from CHECKPOINT --out DIR`.

Nemotron 3 Ultra extended its context in a continued-pretraining phase of its own (the report's numbers, at 1M):

    constant LR 2.5e-6, from the pretrained weights (a new optimizer and schedule)
    a fixed 25,165,824 tokens per iteration: 24 sequences of 1M, or as many of 4K as hold the same tokens
    92% of iterations at 1M on long documents, 8% at 4K on math and code SFT-style data (to keep the short
    benchmarks), never two lengths in one iteration

Here each iteration's length comes from `LengthSchedule` (default 92% at 8x the tiny preset's 256 tokens, 8% at
1x) and its rows from that length's source: a corpus packed as in pretraining (`stdlib-repos`: each stdlib package
stitched into one long document) or `env:NAME` conversations packed as in SFT (loss on the answers). Documents
sharing a row are masked from each other (`data.document_mask`, on for this phase: at 8x the base length a row
would otherwise hold several unrelated files, which is the context a long-context phase must not teach). The batch
size follows from the length: tokens_per_iteration / length rows, in train.grad_accum micro-batches.

The run directory is pretraining's, plus `phase.json`: per length its share, source, planned and trained
iterations and tokens (the mixture report of the phase). A resumed run continues the schedule and every source
where it stopped (the batch source's state is the schedule's counts and each loader's position), so nothing is
repeated or skipped. `--from` is an HF checkpoint (config.json, safetensors, tokenizer files: a run's `hf/`), a
run directory with one, or a training checkpoint (a DCP step directory, its tokenizer from the run's export).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.config import ModelConfig
from hybridtron.data import build_data
from hybridtron.data.build import DataConfig
from hybridtron.data.chat import load_chat_tokenizer
from hybridtron.data.sft import SFTDataConfig, build_sft_data, conversations_from
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.convert import load_dcp_model, model_config_of, tokenizer_dir_of
from hybridtron.distributed.mesh import check_run_layout, world_from_env
from hybridtron.distributed.step import held_out_shares
from hybridtron.envs import ENV_PREFIX, env_sft_examples
from hybridtron.train.config import SectionedConfig, TrainConfig
from hybridtron.train.evaluate import HeldOutLoss
from hybridtron.train.monitor.config import MonitorConfig
from hybridtron.train.objectives import BatchSource, PretrainObjective
from hybridtron.train.run import (BuiltRun, Input, RunCommand, assemble_trainer, is_main_process, prepare_process,
                                  start_parallel)

PHASE = "long_context"
PHASE_REPORT = "phase.json"
SOURCE_JOIN = "+"  # several sources for one length: "env:math+env:code"

# [train] defaults of the phase, over pretraining's: a constant LR (no warmup, no decay) a tenth of the tiny
# preset's pretraining peak (the report: 2.5e-6 at Ultra's scale), checkpoints and evaluations as often.
PHASE_TRAIN = dict(steps=100, lr=3e-4, warmup_steps=0, decay_fraction=0.0, val_every=25, checkpoint_every=25)
# [data] defaults of the phase: the long documents of stdlib-repos cut at 64K characters (about 20K tokens: a row
# of 2K reads one document, and a phase of a few hundred thousand tokens sees dozens of packages instead of the one
# or two that 1M-character documents would give it), documents masked from each other, a tenth of the packages
# held out (`hybridtron eval loss` reads the same ones by default)
PHASE_DATA = DataConfig(source=("stdlib-repos",), max_repo_chars=1 << 16, document_mask=True, val_fraction=0.1,
                        val_batches=4)


@dataclass(frozen=True, kw_only=True)
class LongContextConfig:
    """The `[phase]` section: the lengths, their shares of the iterations, their data, the tokens of an iteration."""

    lengths: tuple[int, ...] = (2048, 256)  # tokens per row of each kind of iteration (8x and 1x the tiny preset's)
    shares: tuple[float, ...] = (0.92, 0.08)  # share of the iterations at each length (they sum to 1)
    sources: tuple[str, ...] = ("stdlib-repos", "env:math+env:code")  # each length's data: corpus sources as
    #   data.source takes them, or env:NAME conversations (SFT-style: loss on the answers); "+" joins several
    tokens_per_iteration: int = 4096  # every optimizer step trains on this many tokens, whatever its length
    env_examples: int = 1500  # env:NAME sources: conversations drawn from each environment (env:code has ~1.8K)

    RESUMABLE: ClassVar = ()  # the schedule and the data define the phase

    def validate(self) -> None:
        for name in ("lengths", "shares", "sources"):
            if len(getattr(self, name)) != len(self.lengths) or not self.lengths:
                raise ValueError(f"phase.{name}: expected one entry per length ({len(self.lengths)}), got "
                                 f"{list(getattr(self, name))}")
        if any(length < 2 for length in self.lengths) or len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"phase.lengths: expected distinct lengths of 2 or more tokens, got {list(self.lengths)}")
        if any(share < 0 for share in self.shares) or abs(sum(self.shares) - 1) > 1e-6:
            raise ValueError(f"phase.shares: expected non-negative shares that sum to 1, got {list(self.shares)}")
        for length in self.lengths:
            if self.tokens_per_iteration % length:
                raise ValueError(f"phase.tokens_per_iteration: {self.tokens_per_iteration} is not a whole number of "
                                 f"rows of {length} tokens (phase.lengths); expected a multiple of every length")
        if self.env_examples < 1:
            raise ValueError(f"phase.env_examples: expected a positive integer, got {self.env_examples}")

    def rows(self, length: int) -> int:
        return self.tokens_per_iteration // length


class LengthSchedule:
    """The length of each iteration: the one furthest behind its share, share x iterations - its count so far
    (ties to the first length). Deterministic, and every prefix of the run is within one iteration of the shares
    at every length (a seeded draw would wander by the square root of the iterations); one length per iteration.
    Its state is the counts."""

    def __init__(self, lengths: tuple[int, ...], shares: tuple[float, ...]):
        self.lengths, self.shares = tuple(lengths), tuple(shares)
        self.counts = [0] * len(lengths)

    def next(self) -> int:
        done = sum(self.counts) + 1
        behind = [share * done - count for share, count in zip(self.shares, self.counts)]
        index = max(range(len(behind)), key=lambda i: (behind[i], -i))
        self.counts[index] += 1
        return self.lengths[index]

    def plan(self, iterations: int) -> list[int]:
        """The iterations at each length over a run of `iterations` from the start."""
        schedule = LengthSchedule(self.lengths, self.shares)
        for _ in range(iterations):
            schedule.next()
        return schedule.counts

    def state_dict(self) -> dict:
        return {"lengths": list(self.lengths), "counts": list(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        if list(state["lengths"]) != list(self.lengths):
            raise ValueError(f"phase state: lengths {state['lengths']} != this run's {list(self.lengths)}")
        self.counts = list(state["counts"])


class PhaseBatches(BatchSource):
    """Each step's micro-batches, all at the step's length (`LengthSchedule`) from that length's loader; its state is
    the schedule's and every loader's."""

    def __init__(self, schedule: LengthSchedule, loaders: dict[int, object], grad_accum: int):
        self.schedule, self.loaders, self.grad_accum = schedule, loaders, grad_accum

    def next_step(self):
        loader = self.loaders[self.schedule.next()]
        return [next(loader) for _ in range(self.grad_accum)]

    def state_dict(self):
        return {"schedule": self.schedule.state_dict(),
                "loaders": {str(length): loader.state_dict() for length, loader in self.loaders.items()}}

    def load_state_dict(self, state):
        self.schedule.load_state_dict(state["schedule"])
        for length, loader in self.loaders.items():
            loader.load_state_dict(state["loaders"][str(length)])


# ------------------------------------------------------------------------------------------- the checkpoint
def checkpoint_files(source: str | Path) -> tuple[Path, Path | None]:
    """(the checkpoint to load: an HF directory or a DCP step directory, the directory of its tokenizer files or
    None) of `--from`: an HF checkpoint, a run directory with its `hf/` export, or a DCP step directory."""
    path = Path(source)
    if (path / "config.json").is_file():
        return path, path if (path / "tokenizer.json").is_file() else None
    if (path / "hf" / "config.json").is_file():
        return checkpoint_files(path / "hf")
    if (path / ".metadata").is_file():
        return path, path if (path / "tokenizer.json").is_file() else tokenizer_dir_of(path.parent.parent)
    raise FileNotFoundError(f"--from {source}: neither an HF checkpoint (config.json), a run directory with an hf/ "
                            f"export, nor a DCP step directory (.metadata)")


def checkpoint_model_config(source: str | Path) -> ModelConfig:
    checkpoint, _ = checkpoint_files(source)
    if (checkpoint / "config.json").is_file():
        return ModelConfig.from_hf(checkpoint)
    return model_config_of(checkpoint, None)


def checkpoint_tokenizer_dir(source: str | Path) -> Path:
    checkpoint, tokenizer = checkpoint_files(source)
    if tokenizer is None:
        raise FileNotFoundError(f"--from {source}: no tokenizer files (tokenizer.json) beside {checkpoint} or in its "
                                f"run's hf/ export; copy the pretraining run's tokenizer.json there")
    return tokenizer


def load_checkpoint_model(source: str | Path, model_config: ModelConfig) -> torch.nn.Module:
    checkpoint, _ = checkpoint_files(source)
    if (checkpoint / ".metadata").is_file():
        return load_dcp_model(checkpoint, model_config)
    return load_pretrained(checkpoint, config=model_config, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- the config
@dataclass(frozen=True, kw_only=True)
class LongContextRunConfig(SectionedConfig):
    """What `hybridtron pretrain --phase long_context` runs: the checkpoint it starts from (its architecture fixes
    [model]), [phase], [data] for the corpus sources (data.source, data.seq_len and data.batch_size are the phase's
    per length, data.tokenizer the checkpoint's), and pretraining's other sections."""

    MODEL_FROM = "init_from"

    init_from: str  # --from: the pretrained checkpoint
    model: ModelConfig  # the checkpoint's architecture (read-only)
    phase: LongContextConfig = LongContextConfig()
    data: DataConfig = PHASE_DATA
    train: TrainConfig = TrainConfig(**PHASE_TRAIN)
    monitor: MonitorConfig = MonitorConfig()
    dist: DistConfig = DistConfig()

    def command_line(self) -> str:
        return f"hybridtron pretrain --phase {PHASE} --from {self.init_from}"


# ------------------------------------------------------------------------------------------------- the data
def length_data(config: LongContextRunConfig, length: int, source: str, iterations: int, tokenizer_dir: Path,
                vocab_size: int):
    """(training loader, validation batches) of one length's `source`, `phase.rows(length) / grad_accum` rows per
    micro-batch, sized for `iterations` iterations."""
    phase, data, grad_accum = config.phase, config.data, config.train.grad_accum
    rows = phase.rows(length) // grad_accum
    parts = source.split(SOURCE_JOIN)
    if all(part.startswith(ENV_PREFIX) for part in parts):
        tokenizer = load_chat_tokenizer(tokenizer_dir, vocab_size=vocab_size)
        conversations = [conversation for part in parts for conversation in
                         conversations_from(env_sft_examples(part, phase.env_examples, data.seed))]
        sft = build_sft_data(conversations, tokenizer, SFTDataConfig(
            seq_len=length, batch_size=rows, seed=data.seed, val_batches=data.val_batches,
            document_mask=data.document_mask))
        return sft.train_loader, sft.val_batches
    if any(part.startswith(ENV_PREFIX) for part in parts):
        raise ValueError(f"phase.sources: {source!r} mixes env:NAME conversations with corpus sources; give each "
                         f"length one kind")
    bundle = build_data(replace(data, source=tuple(parts), tokenizer=str(tokenizer_dir)), seq_len=length,
                        batch_size=rows, total_sequences=max(iterations, 1) * grad_accum * rows)
    return bundle.train_loader, bundle.val_batches


def phase_report(config: LongContextRunConfig, counts: list[int] | None = None) -> dict:
    """The phase's mixture report: per length its share, source, rows, and planned (and, given the schedule's
    `counts`, trained) iterations and tokens."""
    phase = config.phase
    planned = LengthSchedule(phase.lengths, phase.shares).plan(config.train.steps)
    rows = []
    for index, length in enumerate(phase.lengths):
        row = {"length": length, "share": phase.shares[index], "source": phase.sources[index],
               "rows_per_iteration": phase.rows(length), "planned_iterations": planned[index],
               "planned_tokens": planned[index] * phase.tokens_per_iteration}
        if counts is not None:
            row.update(iterations=counts[index], tokens=counts[index] * phase.tokens_per_iteration)
        rows.append(row)
    return {"tokens_per_iteration": phase.tokens_per_iteration, "lengths": rows}


def format_phase_report(report: dict) -> str:
    trained = "iterations" in report["lengths"][0]
    header = f"{'length':>8} {'share':>6} {'rows':>5} {'planned it':>10} {'planned tokens':>14}"
    header += f" {'trained it':>10} {'tokens':>12}" if trained else ""
    lines = [f"long-context phase: {report['tokens_per_iteration']:,} tokens per iteration", header + "  source"]
    for row in report["lengths"]:
        line = (f"{row['length']:>8} {row['share']:>6.2f} {row['rows_per_iteration']:>5} "
                f"{row['planned_iterations']:>10} {row['planned_tokens']:>14,}")
        line += f" {row['iterations']:>10} {row['tokens']:>12,}" if trained else ""
        lines.append(f"{line}  {row['source']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- the run
def build_long_context(config: LongContextRunConfig, out: Path, checkpoints, *, quiet: bool, stream=None
                       ) -> tuple[BuiltRun, PhaseBatches]:
    """The phase's run in `out`, and its batch source (whose schedule counts the iterations per length)."""
    stream = sys.stderr if stream is None else stream
    phase, train = config.phase, config.train
    model_config = config.model
    if train.mtp_loss_weight is not None:
        model_config = model_config.replace(mtp_loss_weight=train.mtp_loss_weight)
    longest = max(phase.lengths)
    parallel = start_parallel(config.dist, model_config, batch_size=phase.rows(longest) // train.grad_accum,
                              grad_accum=train.grad_accum, seq_len=longest, context_parallel=True)
    main = parallel.is_main
    quiet = quiet or not main
    prepare_process(train, model_config, phase.tokens_per_iteration // train.grad_accum, stream, config.dist)

    tokenizer_dir = checkpoint_tokenizer_dir(config.init_from)
    tokenizer = Tokenizer.load(tokenizer_dir)
    schedule = LengthSchedule(phase.lengths, phase.shares)
    planned = schedule.plan(train.steps)
    loaders, evaluators = {}, []
    with parallel.main_first():  # one rank fills the caches
        for index, length in enumerate(phase.lengths):
            loader, val_batches = length_data(config, length, phase.sources[index], planned[index], tokenizer_dir,
                                              model_config.vocab_size)
            loaders[length] = loader
            if val_batches:
                val_batches, sum_over_shares = held_out_shares([batch.to(parallel.device) for batch in val_batches],
                                                               parallel)
                # the first length's is the run's val_loss (the monitor and the summary read it)
                key = "val_loss" if not evaluators else f"val_loss_{length}"
                evaluators.append(HeldOutLoss(val_batches, train.val_every, sum_over_shares, key=key))
    if main:
        (out / PHASE_REPORT).write_text(json.dumps(phase_report(config), indent=2) + "\n")
    if not quiet:
        print(format_phase_report(phase_report(config)), file=stream)

    model = load_checkpoint_model(config.init_from, model_config)
    objective = PretrainObjective(parallel.sum_over_data, model_config.mtp_depths, train.compile)
    batches = PhaseBatches(schedule, loaders, train.grad_accum)
    trainer = assemble_trainer(model, objective, batches, evaluators, train=train, monitor_config=config.monitor,
                               out=out, checkpoints=checkpoints, quiet=quiet, stream=stream, parallel=parallel)
    return BuiltRun(trainer, tokenizer), batches


class LongContextPhase(RunCommand):
    name = f"pretrain --phase {PHASE}"
    config_class = LongContextRunConfig
    default_steps = PHASE_TRAIN["steps"]
    set_example = "--set phase.lengths=4096,256 --set phase.tokens_per_iteration=8192"
    quiet_help = "no phase table and no progress bar"
    inputs = (Input("--from", "init_from", "the pretrained checkpoint: an HF checkpoint directory with its "
                                           "tokenizer (e.g. runs/quickstart/hf), a run directory with an hf/ "
                                           "export, or a DCP step directory (runs/x/checkpoints/step_000400)"),)

    def __init__(self):
        self.config: LongContextRunConfig | None = None  # the run being trained, and its batch source
        self.batches: PhaseBatches | None = None

    def model_config_of(self, source: str) -> ModelConfig:
        return checkpoint_model_config(source)

    def default_config(self, args, inputs):
        return LongContextRunConfig(model=checkpoint_model_config(inputs["init_from"]), **inputs)

    def check(self, config):
        config.phase.validate()
        checkpoint_tokenizer_dir(config.init_from)  # a checkpoint without its tokenizer: refused before any write
        for length in config.phase.lengths:
            rows = config.phase.rows(length)
            if rows % config.train.grad_accum:
                raise ValueError(f"phase.tokens_per_iteration: {rows} rows of {length} tokens do not split into "
                                 f"train.grad_accum={config.train.grad_accum} micro-batches")
            if length > config.model.max_position_embeddings:
                raise ValueError(f"phase.lengths: {length} is beyond the model's max_position_embeddings "
                                 f"{config.model.max_position_embeddings} ({config.init_from}/config.json)")
            check_run_layout(config.dist, config.model, world_from_env()[0],
                             batch_size=rows // config.train.grad_accum, grad_accum=config.train.grad_accum,
                             seq_len=length, context_parallel=True)

    def build(self, config, out, checkpoints, *, quiet):
        built, self.batches = build_long_context(config, out, checkpoints, quiet=quiet)
        self.config = config
        return built

    def finish(self, built, out):
        """The report of what the phase trained at each length (phase.json, printed), then the run's end."""
        if is_main_process():
            report = phase_report(self.config, self.batches.schedule.counts)
            (out / PHASE_REPORT).write_text(json.dumps(report, indent=2) + "\n")
            print(format_phase_report(report))
        return super().finish(built, out)


LONG_CONTEXT = LongContextPhase()


def phase_of_config_file(path: str | None) -> bool:
    """Whether the TOML or run_config.json at `path` configures the long-context phase (it has a [phase] section)."""
    if path is None or not Path(path).is_file():
        return False
    if Path(path).suffix == ".json":
        return "phase" in json.loads(Path(path).read_text())
    return any(line.strip() == "[phase]" for line in Path(path).read_text().splitlines())
