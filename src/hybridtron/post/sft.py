"""`hybridtron sft`: supervised fine-tuning of a pretrained model on conversations, loss on the assistant's tokens.

The recipe (Nemotron 3 Ultra's first post-training stage, at any scale):

- Data: conversations from a JSONL file or a directory of them (one `{"messages": [...]}` a line; the chat format
  is hybridtron.data.chat), or `env:NAME`, the worked solutions of a verifiable environment
  (`hybridtron.envs`: `env.sft_examples(sft.env_examples, sft.seed)` from its levels `sft.env_levels`; for a tool
  environment, `env:math-python` or `env:terminal`, expert trajectories through its real tools, successful and
  failed, each prefixed with its outcome: `hybridtron.envs.agentic_sft`).
  They are rendered in the chat format with the tokenizer and template of `--model`, masked, packed into rows of
  `sft.seq_len` tokens and split into training and held-out conversations by hybridtron.data.sft.
- Loss on the assistant's answers, tool calls and the `<|im_end|>` that closes each of its turns; the reasoning
  inside `<think> ... </think>` is masked (`sft.train_on_thinking = false`, as the report trained) unless
  `--set sft.train_on_thinking=true`. Data whose reasoning the model cannot write yet needs the switch: masked, the
  traces are context it is never taught to produce (env:math on the quickstart model: 0% masked, 14% trained;
  docs/LOG.md). Aggregation: token-mean over the whole optimizer step, normalised by the step's count of trained
  tokens summed over its micro-batches, so that `train.grad_accum` does not change the gradient (`sft_loss`).
- MTP stays trained: loss = CE + mtp_loss_weight x mean over the depths of their token-mean CE, the depth-k
  targets being the same masked labels k tokens on (`hybridtron.model.lm.mtp_targets`: only where the whole chain
  of labels is trained). A drafter left behind while the backbone learns a new format would stop agreeing with it
  (speculative decoding in the GRPO rollouts and in serving needs it); `--set train.mtp_loss_weight=0` turns it
  off (the MTP block still runs, for its routers' balance).
- The same trainer as pretraining (hybridtron.train.loop), its stability monitor, DCP checkpoints that resume bit
  for bit, metrics.jsonl and progress bar; validation is the held-out conversations' masked CE
  (`hybridtron.train.evaluate.HeldOutLoss`), at step 0, every `train.val_every` steps and at the end.
- Under torchrun (`torchrun --nproc-per-node N -m hybridtron sft ...`) the `[dist]` section lays the model out
  as pretraining does (hybridtron.distributed: FSDP2, TP, EP, PP, CP); each data-parallel rank trains on its rows of
  every micro-batch (under CP its share of their positions) and the token mean is over the whole global batch, so
  the losses are those of one process.
- [model] is the checkpoint's (its config.json); SFT does not change it. [train] has SFT's own defaults
  (`SFT_TRAIN`: 800 steps, peak LR 2e-3 after a 10-step warmup, the last 20% decaying), [sft] rows of 256 tokens.

The run directory (the run scaffold's rules: hybridtron.train.run):

    run_config.json   --model, --data and the resolved [model], [sft], [train], [monitor]
    sft_data.json     conversations, trained tokens, truncation and padding (hybridtron.data.sft.SFTStats)
    metrics.jsonl     one line per step: loss, lm_loss, mtp_loss_<d>, trained_tokens, val_loss, ...
    events.jsonl      the stability monitor's detections and actions
    checkpoints/      DCP checkpoints
    hf/               the fine-tuned model: config.json, safetensors, tokenizer files with the chat template
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.config import ModelConfig
from hybridtron.data.batch import as_token_batch
from hybridtron.data.chat import load_chat_tokenizer
from hybridtron.data.sft import SFTDataConfig, build_sft_data, conversations_from
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.mesh import check_run_layout, world_from_env
from hybridtron.distributed.step import held_out_shares
from hybridtron.envs import ENV_PREFIX, env_sft_examples
from hybridtron.ops.cross_entropy import IGNORE_INDEX, cross_entropy
from hybridtron.train.config import SectionedConfig, TrainConfig
from hybridtron.train.evaluate import HeldOutLoss
from hybridtron.train.monitor.config import MonitorConfig
from hybridtron.train.objectives import ObjectiveOutput, router_counts, target_counts, token_mean_shares, \
    token_stage_inputs, window_targets
from hybridtron.train.run import BuiltRun, Input, RunCommand, assemble_trainer, prepare_process, start_parallel

# [train] defaults of SFT, over TrainConfig's (pretraining's), measured on the quickstart model (3.7M parameters;
# docs/LOG.md, 2026-12-01): a short warmup, two thirds of pretraining's peak LR, the last 20% of the steps decaying
# (WSD). At lr 3e-4 the model learnt the format in 300 steps but still ignored the question; 2e-3 learnt to copy it.
# Every other field (AdamW betas, weight decay 0.1, clipping at 1.0, fp32) is pretraining's. A model of billions of
# parameters wants an LR of 1e-5 to 1e-4.
SFT_TRAIN = dict(steps=800, lr=2e-3, warmup_steps=10, decay_fraction=0.2, val_every=50, checkpoint_every=100)


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """The `[sft]` section: how conversations become batches (hybridtron.data.sft.SFTDataConfig's fields) and
    where `--data env:NAME` draws them from."""

    train_on_thinking: bool = False  # loss on <think> ... </think> too; the report masked the reasoning
    reasoning_history: str = "last_turn"  # reasoning kept in earlier assistant turns: "last_turn" or "all"
    seq_len: int = 256  # tokens per packed row (3 math conversations); a longer conversation is truncated, counted
    batch_size: int = 8  # rows per micro-batch
    val_fraction: float = 0.05  # share of conversations held out (by a hash of their messages)
    val_batches: int | None = 8  # held-out batches evaluated; none = all
    pack_window: int = 64  # open rows that first-fit packing searches
    document_mask: bool = True  # conversations sharing a row do not see each other (attention, Mamba scan)
    seed: int = 0  # epoch order, and the draw of env:NAME examples
    env_examples: int = 5000  # env:NAME: conversations drawn (training split of the environment)
    env_levels: tuple[int, ...] = ()  # env:NAME: difficulty levels; empty = the environment's default (all)

    def data_config(self) -> SFTDataConfig:
        return SFTDataConfig(**{f.name: getattr(self, f.name) for f in fields(SFTDataConfig)})

    def validate(self) -> None:
        self.data_config()  # SFTDataConfig checks its fields, naming them sft.<field>
        if self.env_examples < 1:
            raise ValueError(f"sft.env_examples: expected a positive integer, got {self.env_examples}")


@dataclass(frozen=True, kw_only=True)
class SFTRunConfig(SectionedConfig):
    """What `hybridtron sft` runs: the base model and data as given on the command line, and the sections."""

    MODEL_FROM = "base_model"

    base_model: str  # --model: an HF checkpoint directory with tokenizer files
    data: str  # --data: FILE.jsonl, a directory of them, or env:NAME
    model: ModelConfig  # the checkpoint's config.json (read-only)
    sft: SFTConfig = SFTConfig()
    train: TrainConfig = TrainConfig(**SFT_TRAIN)
    monitor: MonitorConfig = MonitorConfig()
    dist: DistConfig = DistConfig()  # the layout under torchrun (hybridtron.distributed; pretraining's [dist])

    def command_line(self) -> str:
        return f"hybridtron sft --model {self.base_model} --data {self.data}"


# ------------------------------------------------------------------------------------------------- loss
def sft_loss(logits_BTV, labels_BT, global_count: int):
    """The step's token-mean cross entropy, this micro-batch's share of it:

        sum over the labelled tokens t of -log softmax(logits_t)[labels_t]  /  global_count

    `labels_BT` are already shifted and masked (IGNORE_INDEX where no token is trained: prompts, the template,
    masked reasoning, padding); `global_count` is the number of labelled tokens in the WHOLE optimizer step (all
    its micro-batches), so summing the shares of the micro-batches gives the step's token mean whatever the split.

    Departs from the usual SFT loss (the InstructGPT/Tulu form, a mean over each micro-batch's own tokens) only in
    that divisor: dividing by each micro-batch's count weighs the tokens of sparse micro-batches more and makes the
    gradient depend on grad_accum (hybridtron.post.losses.token_mean says the same for GRPO). Every trained token
    weighs the same, so a long answer counts more than a short one, as in Tulu 3's sum-then-normalise."""
    count = int((labels_BT != IGNORE_INDEX).sum())
    if count == 0:  # nothing trained in this micro-batch: a zero that still has a gradient (of zeros)
        return logits_BTV.sum() * 0.0
    if count > global_count:
        raise ValueError(f"sft_loss: this micro-batch has {count} labelled tokens but the step's count is "
                         f"{global_count}; pass the count of the whole step")
    return cross_entropy(logits_BTV.flatten(0, 1), labels_BT.flatten(), IGNORE_INDEX) * (count / global_count)


class SFTObjective:
    """Masked next-token CE plus mtp_loss_weight (the model config's) x the mean of the MTP depths' masked CE,
    each a token mean over the whole step (`sft_loss`; see the module docstring).

    `data_sum` (data parallelism: sums a tensor over the data-parallel ranks in place): the step's counts are
    summed over the ranks too, so each rank's loss is its share of the global batch's token mean.

    Metrics are this process's shares of the step's values, scaled by the number of micro-batches (the trainer
    averages a metric over the micro-batches, then sums it over the data-parallel ranks): loss, lm_loss,
    mtp_loss_<d>, trained_tokens (labelled tokens in the step)."""

    headline = ("lm_loss", "ce")

    def __init__(self, mtp_depths: int, data_sum=None):
        self.mtp_depths, self.data_sum = mtp_depths, data_sum
        self.counts: list[float] = []  # labelled tokens in the step: next token, then MTP depth 1, 2, ...
        self.micro_batches = 1

    def begin_step(self, micro_batches):
        counts = torch.stack([target_counts(batch.labels, self.mtp_depths, batch.input_ids.shape[1])
                              for batch in map(as_token_batch, micro_batches)]).sum(0)
        if self.data_sum is not None:  # one all-reduce a step
            counts = self.data_sum(counts.double())
        self.counts = counts.tolist()
        self.micro_batches = len(micro_batches)

    def __call__(self, model, micro_batch):
        batch = as_token_batch(micro_batch)  # under CP a share: its labels run on past its ids
        # lm_head's inputs, the MTP depths', expert counts (each conversation alone in its row under the document
        # mask: seq_idx); the loss is ours
        out = model(batch.input_ids, logits=False, **batch.model_inputs())
        result = self.loss_from_outputs(model, (out.hidden, *out.mtp_hidden), batch)
        result.tokens, result.expert_counts = batch.input_ids.numel(), router_counts(model, out)
        return result

    stage_inputs = staticmethod(token_stage_inputs)  # under PP: what the stages read of a micro-batch

    def loss_from_outputs(self, model, outputs, micro_batch):
        """The loss of one micro-batch from lm_head's inputs, `outputs` = (the final hidden, *each MTP depth's),
        through their logits (`model`'s lm_head; also what a pipeline's last stage calls, `model` the stage's; the
        expert counts are then the pipeline's to collect)."""
        labels_BT = as_token_batch(micro_batch).labels
        logits, *mtp_logits = [model.lm_head(state) for state in outputs]
        length = logits.shape[1]  # under CP `labels_BT` runs past the share (window_targets)
        targets = window_targets(labels_BT, 0, length)
        lm_loss = sft_loss(logits, targets, self.counts[0])
        depth_targets = [window_targets(labels_BT, depth, length) for depth in range(1, len(mtp_logits) + 1)]
        mtp_losses = [sft_loss(depth_logits, depth_targets[depth - 1], self.counts[depth])
                      for depth, depth_logits in enumerate(mtp_logits, start=1)]
        loss = lm_loss
        if mtp_losses:
            loss = loss + model.config.mtp_loss_weight * torch.stack(mtp_losses).mean()
        scale = self.micro_batches
        trained = (targets != IGNORE_INDEX).sum().double()
        metrics = {"loss": loss.detach() * scale, "lm_loss": lm_loss.detach() * scale,
                   "trained_tokens": trained * scale}
        return ObjectiveOutput(loss, metrics, targets.numel(), mtp_losses=[m.detach() * scale for m in mtp_losses],
                               mtp_shares=token_mean_shares(depth_targets, self.counts[1:], scale))


# ------------------------------------------------------------------------------------------------- data
def load_conversations(source: str, config: SFTConfig) -> list[dict]:
    """The conversations of `--data`: a JSONL file, a directory of them, or `env:NAME` (its SFT examples)."""
    if not source.startswith(ENV_PREFIX):
        return conversations_from(source)
    try:
        return conversations_from(env_sft_examples(source, config.env_examples, config.seed, config.env_levels))
    except ValueError as exc:
        raise ValueError(f"--data {exc}") from None


# ------------------------------------------------------------------------------------------------- the run
def build_sft(config: SFTRunConfig, out: Path, checkpoints, *, quiet: bool, stream=None) -> BuiltRun:
    """The SFT run of `config` in `out`: the model of --model with its chat tokenizer, the data, the trainer."""
    stream = sys.stderr if stream is None else stream  # the stderr of the moment, not of import time
    train, sft = config.train, config.sft
    model_config = config.model
    if train.mtp_loss_weight is not None:
        model_config = model_config.replace(mtp_loss_weight=train.mtp_loss_weight)
    # under torchrun: every rank builds the same data and model; each data-parallel rank trains on its rows of
    # every micro-batch and the loss is normalised by the trained tokens of the whole global batch
    parallel = start_parallel(config.dist, model_config, batch_size=sft.batch_size, grad_accum=train.grad_accum,
                              seq_len=sft.seq_len, context_parallel=True)
    main = parallel.is_main
    quiet = quiet or not main
    tokenizer = load_chat_tokenizer(config.base_model, vocab_size=model_config.vocab_size)
    prepare_process(train, model_config, sft.seq_len * sft.batch_size, stream, config.dist)

    data = build_sft_data(load_conversations(config.data, sft), tokenizer, sft.data_config())
    if main:
        (out / "sft_data.json").write_text(json.dumps(data.stats.to_dict(), indent=2))
    if not quiet:
        print(data.stats.format(), file=stream)

    model = load_pretrained(config.base_model, config=model_config, dtype=torch.float32)
    objective = SFTObjective(model_config.mtp_depths, data_sum=parallel.sum_over_data)
    val_batches, sum_over_shares = held_out_shares(data.val_batches, parallel)  # under CP: this rank's shares
    evaluators = [HeldOutLoss(val_batches, train.val_every, sum_over_shares)] if val_batches else []
    trainer = assemble_trainer(model, objective, data.train_loader, evaluators, train=train,
                               monitor_config=config.monitor, out=out, checkpoints=checkpoints, quiet=quiet,
                               stream=stream, parallel=parallel)
    return BuiltRun(trainer, tokenizer)


def check_layout(config: SFTRunConfig) -> None:
    """The run's [dist] layout on this torchrun world, before anything is written: a ValueError with the reason."""
    check_run_layout(config.dist, config.model, world_from_env()[0], batch_size=config.sft.batch_size,
                     grad_accum=config.train.grad_accum, seq_len=config.sft.seq_len, context_parallel=True)


class SFT(RunCommand):
    name = "sft"
    config_class = SFTRunConfig
    default_steps = SFT_TRAIN["steps"]
    set_example = "--set sft.train_on_thinking=true --set train.lr=1e-4"
    quiet_help = "no data summary and no progress bar"
    inputs = (Input("--model", "base_model", "the model to fine-tune: an HF checkpoint directory with its tokenizer "
                                             "files, or a run directory (its hf/ export; e.g. runs/quickstart)",
                    checkpoint=True),
              Input("--data", "data", "conversations: a .jsonl file ({\"messages\": [...]} a line), a directory of "
                                      ".jsonl files, or env:NAME for an environment's worked solutions (env:math, "
                                      "env:code) or expert trajectories (env:math-python, env:terminal)"))

    def default_config(self, args, inputs):
        return SFTRunConfig(model=ModelConfig.from_hf(inputs["base_model"]), **inputs)

    def check(self, config):
        check_layout(config)

    def build(self, config, out, checkpoints, *, quiet):
        return build_sft(config, out, checkpoints, quiet=quiet)


COMMAND = SFT()
add_arguments, run = COMMAND.add_arguments, COMMAND.run
