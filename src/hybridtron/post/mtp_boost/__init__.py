"""MTP boosting: train only the MTP block, so that its drafts agree with the backbone more often.

The recipe (the Nemotron 3 Ultra report, the last post-training stage):

- Backbone, embedding and lm_head frozen; only the MTP block's weights train.
- Loss: forward KL from the backbone's next-token distribution to the block's, both at temperature T = 2, scaled
  by T^2 (distillation's usual factor, which keeps the gradient's size independent of T); no gold-token CE.
- Self-conditioned inputs: the block is unrolled for `depths` steps (7 in the report) exactly as the drafter runs
  it. Depth 1 at anchor a reads the backbone's hidden state h_a and the token x_{a+1}; depth j > 1 reads the
  block's own output of depth j-1 and the token x_{a+j}, and predicts x_{a+j+1}, whose target is the backbone's
  distribution at position a+j. Its attention sees the depth-1 entries of positions 0..a and the chain's own
  entries of depths 2..j, the same keys the drafter's cache holds (`hybridtron.infer.speculative`).
- Data: on-policy samples of the model itself at temperature 1 (the backbone is frozen, so a pool drawn once stays
  on-policy).
- Departure from the report: the tokens fed at depths > 1 are the sample's (teacher forcing), not the drafter's own
  draft tokens; under greedy verification only drafts equal to the target's tokens matter, and the sample's tokens
  are what the target produced.

`mtp_chain` computes every anchor's chain in parallel, one depth at a time, with the model's own MTP block
(`model.mtp`); only its attention layers read a different set of keys (`ChainAttention`: the depth-1 keys of every
position up to the anchor and the anchor's own chain keys), which is what the drafter's cache holds. `mtp_chain_ref`
runs the drafter's cached code path (`MTPBlock.forward` with a KV cache), one position per depth, and is the
reference it is tested against. Acceptance is measured with greedy self-speculative decoding on fixed prompts at
step 0, every `train.val_every` steps and at the end (those pieces: `hybridtron.post.mtp_boost.training`).

`hybridtron mtp-boost --model DIR --out RUN_DIR [--prompts FILE] [--steps N] [--set SECTION.FIELD=VALUE]` trains on
the one `Trainer` by the run scaffold's rules (hybridtron.train.run: resumable, interruptible, a complete run left
as it is), as one process. Its sections: [boost] (`BoostConfig`), [train] (the AdamW over the MTP block, with
mtp-boost's defaults `BOOST_TRAIN`) and [monitor] (off by default, `BOOST_MONITOR`); [model] is --model's
config.json. The run directory:

    run_config.json   --model, --prompts and the resolved [model], [boost], [train], [monitor]
    metrics.jsonl     a line per step: loss (the KL, mean over the depths), mtp_loss_<d> (depth d's KL), and
                      acceptance_length where it was measured
    events.jsonl      resumes, interruptions, configuration changes
    checkpoints/      DCP checkpoints (the model, the MTP block's AdamW state, the pool's position, RNG)
    hf/               the boosted checkpoint, with the model's tokenizer files
    mtp_boost.json    the configuration and the acceptance length before and after

This module is the configuration, the library function that builds the run (`build_mtp_boost`) and the command.

Shapes: B batch, T time (anchors), H hidden, V vocabulary, Hq / Hkv query / key-value heads, D head dim.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from hybridtron.checkpoint.hf import load_pretrained
from hybridtron.config import ModelConfig
from hybridtron.data.chat import declared_chat_template, load_chat_tokenizer, tokenize_chat
from hybridtron.data.sft import read_conversations
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.files import METRICS_FILE, atomic_write_json
from hybridtron.distributed.mesh import Parallel
from hybridtron.infer.speculative import MAX_DRAFT_LENGTH, check_drafter
from hybridtron.model.lm import HybridLM
from hybridtron.post.mtp_boost.training import AcceptanceLength, BoostObjective, PoolBatches, on_policy_samples
from hybridtron.train.config import SectionedConfig, TrainConfig, section_values
from hybridtron.train.monitor.config import MonitorConfig
from hybridtron.train.run import (BuiltRun, Input, RunCommand, assemble_trainer, export_model, prepare_process,
                                  refuse_torchrun)

RECORD_FILE = "mtp_boost.json"  # in the run directory: the configuration and the acceptance before and after
# without --prompts the pool is sampled from bos alone, and acceptance is measured on prompts sampled the same way
HELD_OUT_PROMPTS, HELD_OUT_PROMPT_TOKENS = 8, 8


@dataclass(frozen=True, kw_only=True)
class BoostConfig:
    """The `[boost]` section: the chain and its loss, the on-policy pool and the acceptance measurement (the
    optimizer and its schedule are [train]'s)."""

    # the loss
    depths: int = 7  # self-conditioned depths the MTP block is unrolled for (7 in the report)
    kl_temperature: float = 2.0  # T of the forward KL from the backbone to the chain, scaled by T^2 (2 in the report)
    # the on-policy pool, sampled once before the first step from --prompts (default: the bos token alone)
    num_samples: int = 256  # sequences in the pool
    sample_length: int = 64  # tokens sampled after each prompt
    sample_temperature: float = 1.0  # the pool's sampling temperature (1: the model's own distribution)
    batch_size: int = 8  # pool rows per micro-batch, drawn with replacement (train.grad_accum micro-batches a step)
    seed: int = 0  # the pool's sampling and the rows each step draws (train.seed: the process's torch seed)
    # the acceptance measurement: greedy self-speculative decoding at step 0, every train.val_every steps, the end
    draft_length: int = 7  # tokens the MTP block drafts per step
    eval_tokens: int = 64  # tokens generated for each acceptance prompt

    # Every field defines the run's data, its loss or the measurement whose first and last values the run compares:
    # a resumed run changes none of them.
    RESUMABLE: ClassVar = ()

    def validate(self) -> None:
        for name in ("depths", "num_samples", "sample_length", "batch_size", "eval_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"boost.{name} must be an integer >= 1, got {value!r}")
        if not 1 <= self.draft_length <= MAX_DRAFT_LENGTH:
            raise ValueError(f"boost.draft_length must be in [1, {MAX_DRAFT_LENGTH}], got {self.draft_length!r}")
        for name in ("kl_temperature", "sample_temperature"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"boost.{name} must be a positive finite number, got {value!r}")


# [train] for mtp-boost: AdamW over the MTP block at a constant LR of 3e-4 (no warmup, no decay), no weight decay,
# torch's default beta2, clipping at 1. No router bias moves (the rate is 0): balancing would move the frozen
# backbone's too, and with them its target distributions. Acceptance at step 0, halfway and the end. One checkpoint
# kept: each holds the whole model, the frozen backbone included, and no rollback needs an older one.
BOOST_TRAIN = TrainConfig(steps=200, lr=3e-4, warmup_steps=0, decay_fraction=0.0, weight_decay=0.0, beta2=0.999,
                          grad_clip=1.0, router_bias_rate=0.0, val_every=100, keep_checkpoints=1)
# [monitor] off: its detectors watch what a run that trains the backbone can break (lm_loss spikes, MTP losses
# running ahead of the main loss, expert imbalance from the router biases, quantization underflow), and here the
# backbone, its routers and lm_head are frozen and the loss is the MTP block's KL alone; watching would only add a
# step-0 checkpoint of the whole model and sampled signals. `--set monitor.enabled=true` turns it on (its
# nonfinite detector then skips a step whose gradient is not finite).
BOOST_MONITOR = MonitorConfig(enabled=False)


@dataclass(frozen=True, kw_only=True)
class MTPBoostRunConfig(SectionedConfig):
    """mtp-boost's configuration: the checkpoint to boost (--model, whose config.json is [model]), the prompts
    (--prompts), [boost], [train] and [monitor]. `for_model` builds a new run's."""

    MODEL_FROM = "base_model"

    base_model: str  # --model: the HF checkpoint directory whose MTP block trains
    prompts: str | None = None  # --prompts: a text file (a prompt a line) or a .jsonl file of conversations
    model: ModelConfig
    boost: BoostConfig = field(default_factory=BoostConfig)
    train: TrainConfig = BOOST_TRAIN
    monitor: MonitorConfig = BOOST_MONITOR

    @classmethod
    def for_model(cls, base_model, prompts=None, **sections) -> MTPBoostRunConfig:
        """A new run's configuration: [model] from `base_model`'s config.json; `sections` (boost=, train=,
        monitor=) replace mtp-boost's defaults."""
        return cls(base_model=str(base_model), prompts=None if prompts is None else str(prompts),
                   model=ModelConfig.from_hf(base_model), **sections)

    def command_line(self) -> str:
        prompts = f" --prompts {self.prompts}" if self.prompts is not None else ""
        return f"hybridtron mtp-boost --model {self.base_model}{prompts}"


@dataclass
class BoostedRun(BuiltRun):
    """The built run and its configuration (`finish` records it beside the export)."""

    config: MTPBoostRunConfig | None = None


# ------------------------------------------------------------------------------------------------ library
def export_tokenizer(model_dir: str, vocab_size: int) -> Tokenizer:
    """The tokenizer the boosted export carries: the model's own. The export writes hybridtron's chat template
    (`save_tokenizer_files`), so a model that declares a chat template must declare that one."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        raise ValueError(f"--model {model_dir}: no tokenizer.json; the boosted checkpoint carries the model's "
                         f"tokenizer")
    if declared_chat_template(model_dir)[0] is None:
        return Tokenizer.load(model_dir)
    return load_chat_tokenizer(model_dir, vocab_size=vocab_size)


def read_prompts(prompts: str | None, model_dir: str, bos_id: int, vocab_size: int) -> list[list[int]] | None:
    """The token ids of each prompt of the file `prompts` (None for no file): a text file's lines after bos, or a
    .jsonl file's conversations in the chat format, each ending with the assistant's generation prompt (a reply that
    closes a conversation is dropped: the model writes its own)."""
    if prompts is None:
        return None
    path = Path(prompts)
    if path.suffix == ".jsonl":
        tokenizer = load_chat_tokenizer(model_dir, vocab_size=vocab_size, require_template=True)
        encoded = []
        for conversation in read_conversations(path, require_reply=False):
            messages = conversation["messages"]
            messages = messages[:-1] if messages[-1]["role"] == "assistant" else messages
            encoded.append(tokenize_chat(tokenizer, messages, add_generation_prompt=True).ids.tolist())
    else:
        if not path.is_file():
            raise FileNotFoundError(f"--prompts {prompts}: no such file")
        tokenizer = Tokenizer.load(model_dir)
        encoded = [[bos_id] + tokenizer.encode(line) for line in path.read_text().splitlines() if line.strip()]
    if not encoded:
        raise ValueError(f"--prompts {prompts}: no prompts in it")
    return encoded


def bos_of(model_config: ModelConfig) -> int:
    """The token every prompt starts with: the model's bos (0 where its config names none)."""
    return model_config.bos_token_id if model_config.bos_token_id is not None else 0


def check_mtp_boost(config: MTPBoostRunConfig) -> None:
    """Before anything is written: one process, every section valid, a model whose MTP block can draft, and the
    tokenizer and prompts readable (a ValueError says what is wrong)."""
    refuse_torchrun("mtp-boost")
    for section in config.sections().values():
        section.validate()
    if config.train.router_bias_rate != 0:
        raise ValueError(f"train.router_bias_rate must be 0 for mtp-boost, got {config.train.router_bias_rate}: "
                         f"balancing moves every router's bias, the frozen backbone's too")
    if config.train.mtp_loss_weight is not None:
        raise ValueError(f"train.mtp_loss_weight ({config.train.mtp_loss_weight}) does not apply to mtp-boost, "
                         f"whose loss is the MTP block's KL alone; leave it unset")
    if config.monitor.inject_fault:
        raise ValueError(f"monitor.inject_fault ({config.monitor.inject_fault!r}): mtp-boost runs no fault drills; "
                         f"they poison the backbone's gradient, corrupt loader batches or move a router's bias, and "
                         f"here the backbone is frozen and the batches come from the pool")
    check_drafter(HybridLM.on_meta(config.model), config.boost.draft_length)
    export_tokenizer(config.base_model, config.model.vocab_size)
    read_prompts(config.prompts, config.base_model, bos_of(config.model), config.model.vocab_size)


def build_mtp_boost(config: MTPBoostRunConfig, out: Path, checkpoints, *, quiet: bool, stream=None) -> BoostedRun:
    """The boosting run of `config` (checked by `check_mtp_boost`) in `out`: the model with everything but its MTP
    block frozen, the on-policy pool, the acceptance prompts and the trainer. Messages go to `stream` (default: the
    `sys.stderr` of the moment)."""
    stream = sys.stderr if stream is None else stream
    boost, train = config.boost, config.train
    prepare_process(train, config.model, boost.batch_size * boost.sample_length, stream)
    tokenizer = export_tokenizer(config.base_model, config.model.vocab_size)
    model = load_pretrained(config.base_model, config=config.model)
    # the trainer's optimizer takes the parameters that require gradients: the MTP block's alone
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("mtp."))
    bos = bos_of(config.model)
    prompts = read_prompts(config.prompts, config.base_model, bos, config.model.vocab_size)
    # Plain decoding runs the backbone alone, which the run never changes: a resumed run samples the same prompts
    # and pool again
    eval_prompts = prompts or on_policy_samples(model, [[bos]], HELD_OUT_PROMPTS, HELD_OUT_PROMPT_TOKENS,
                                                boost.sample_temperature, boost.seed + 1).tolist()
    pool = on_policy_samples(model, prompts or [[bos]], boost.num_samples, boost.sample_length,
                             boost.sample_temperature, boost.seed)
    if not quiet:
        print(f"on-policy pool: {pool.shape[0]} sequences of {pool.shape[1]} tokens; acceptance measured on "
              f"{len(eval_prompts)} prompts", file=stream)
    batches = PoolBatches(pool, boost.batch_size, train.grad_accum, boost.seed)
    acceptance = AcceptanceLength(eval_prompts, boost.draft_length, boost.eval_tokens, train.val_every)
    trainer = assemble_trainer(model, BoostObjective(boost.depths, boost.kl_temperature), batches, [acceptance],
                               train=train, monitor_config=config.monitor, out=out, checkpoints=checkpoints,
                               quiet=quiet, stream=stream, parallel=Parallel.single_process())
    return BoostedRun(trainer, tokenizer, config=config)


def acceptance_line(history: list[tuple[int, float]], draft_length: int) -> str:
    (_, first), (_, last) = history[0], history[-1]
    return f"mean acceptance length (greedy, draft length {draft_length}): {first:.2f} -> {last:.2f}"


# ------------------------------------------------------------------------------------------------ command
class MTPBoost(RunCommand):
    name = "mtp-boost"
    config_class = MTPBoostRunConfig
    inputs = (
        Input("--model", "base_model", "the checkpoint to boost: an HF directory (config.json, safetensors, "
                                       "tokenizer.json) whose MTP block trains, or a run directory (its "
                                       "hf/ export)", checkpoint=True),
        Input("--prompts", "prompts", "prompts to sample the pool from and measure acceptance on: a text file, one "
                                      "prompt a line, or a .jsonl file of conversations ({\"messages\": [...]} a "
                                      "line, rendered with the model's chat template and the generation prompt) "
                                      "(default: the bos token alone)", optional=True),
    )
    default_steps = BOOST_TRAIN.steps
    set_example = "--set train.lr=1e-3 --set boost.depths=3"

    def default_config(self, args, inputs):
        return MTPBoostRunConfig.for_model(inputs["base_model"], inputs["prompts"])

    def check(self, config):
        check_mtp_boost(config)

    def build(self, config, out, checkpoints, *, quiet):
        return build_mtp_boost(config, out, checkpoints, quiet=quiet)

    def finish(self, built: BoostedRun, out: Path) -> int:
        """The HF export, mtp_boost.json, the acceptance before and after, and where the outputs are."""
        config, history = built.config, built.trainer.evaluators[0].history
        export_model(built.trainer, out / "hf", built.tokenizer)
        atomic_write_json(out / RECORD_FILE, {
            "base_model": config.base_model, "prompts": config.prompts, "boost": section_values(config.boost),
            "train": section_values(config.train), "acceptance_before": history[0][1],
            "acceptance_after": history[-1][1], "acceptance_by_step": history})
        print(acceptance_line(history, config.boost.draft_length))
        outputs = {"checkpoints": out / "checkpoints", "metrics": out / METRICS_FILE, "HF export": out / "hf",
                   "acceptance": out / RECORD_FILE}
        print("\n".join(f"{name + ':':<13}{path}" for name, path in outputs.items()))
        return 0


COMMAND = MTPBoost()
add_arguments, run = COMMAND.add_arguments, COMMAND.run
