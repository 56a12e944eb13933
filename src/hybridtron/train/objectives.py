"""Objectives and batch sources: the two pieces of `Trainer` that change from one training stage to the next.

An objective turns one micro-batch into its share of the step's loss, plus what to log. The trainer sums the
backward of every micro-batch of a step, so each objective scales its loss so that the sum is the step's loss:
pretraining divides each micro-batch's mean CE by the number of micro-batches; a token-mean objective (SFT, GRPO,
MOPD) divides its token sum by the step's total count of valid tokens, which `begin_step` sees before any forward.

Under data parallelism each rank sees its own rows of every micro-batch, and the trainer sums the gradients and the
metrics over the data-parallel ranks: an objective returns this rank's share of both, normalized by counts over
the whole global batch (the `data_sum` it is given all-reduces them in `begin_step`), so the sum over the ranks is
what one process computes on the whole batch, whatever the world size.

A batch source hands the trainer one step's micro-batches at a time and has a `state_dict` (its position), so that
a resumed run reads exactly the batches it would have read, and a rollback can skip a window of them.

Pretraining (`PretrainObjective`, `LoaderBatches`): loss = CE + mtp_loss_weight x mean over the MTP depths of
their CE (hybridtron.model.lm; a depth without a target adds a zero), on packed rows of the data mixture. Its
micro-batches, and SFT's, are `TokenBatch`es (hybridtron.data.batch): ids, labels and, with a document mask,
seq_idx, which the objective hands the model with the ids (and, under PP, the stages: `token_stage_inputs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from hybridtron.data.batch import TokenBatch, as_token_batch
from hybridtron.distributed.pipeline import MicroBatchInputs
from hybridtron.model.lm import cross_entropy, mean_or_zero, mtp_targets
from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.ops.linear_cross_entropy import linear_cross_entropy


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # this micro-batch's share of the step's loss (the trainer calls backward on it)
    metrics: dict[str, torch.Tensor]  # detached scalars; the trainer logs their mean over the micro-batches
    tokens: int  # tokens this micro-batch trained on
    expert_counts: dict[str, torch.Tensor] = field(default_factory=dict)  # router name -> tokens per expert
    mtp_losses: list[torch.Tensor] = field(default_factory=list)  # detached, MTP depth d's loss at index d - 1
    # detached, per depth: this micro-batch's share of the step's depth-d statistic, scaled as `mtp_losses`; the
    # trainer logs depth d's loss as sum(losses) / sum(shares) over the micro-batches and the data-parallel ranks,
    # and no loss at all for a depth whose shares sum to 0 (the step had no target there: `StepStats.mtp_losses`)
    mtp_shares: list[torch.Tensor] = field(default_factory=list)
    # detached [min, max] of a per-token statistic over this micro-batch (RL: the policy ratio); the trainer keeps
    # the extremes over the step (`StepStats.ranges`)
    ranges: dict[str, torch.Tensor] = field(default_factory=dict)


class Objective(Protocol):
    headline: tuple[str, str]  # (metric key, label): what the progress bar shows

    def begin_step(self, micro_batches: list[Any]) -> None:
        """See the whole step before its first forward (e.g. to count its valid tokens)."""

    def __call__(self, model, micro_batch: Any) -> ObjectiveOutput: ...

    # Under pipeline parallelism the trainer runs the model through the schedule instead of calling the objective:
    #   stage_inputs(micro_batch) -> MicroBatchInputs      what the stages read (ids, routing replay)
    #   loss_from_outputs(model, outputs, micro_batch)     the loss on the last stage, from lm_head's inputs
    #                                                      (the final hidden, *each MTP depth's), `model` the stage's


class BatchSource:
    """Gives the trainer each step's micro-batches. Subclasses define `next_step`, `state_dict` and
    `load_state_dict`; a source whose batches depend on the model (RL rollouts) also `sync_weights`."""

    def next_step(self) -> list[Any]:
        """The micro-batches of the next optimizer step."""
        raise NotImplementedError

    def sync_weights(self, model, version: int, total_steps: int) -> None:
        """The model's weights after optimizer step `version` (0: the start), which the next batches are to be
        sampled with (RL: the rollout role's policy). Fixed data ignores them. `total_steps`: the run's last step."""

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError


def router_counts(model, out) -> dict[str, torch.Tensor]:
    """Expert counts of an `LMOutput` keyed by router name (`HybridLM.routers()`): backbone rows, then MTP rows."""
    rows = []
    for counts in (out.expert_counts, out.mtp_expert_counts):
        if counts is not None:
            rows.extend(counts.unbind(0))
    return dict(zip(model.routers(), rows))


def window_targets(labels_BT: torch.Tensor, depth: int, length: int) -> torch.Tensor:
    """The targets of depth `depth` (0: the next token, k: MTP depth k) at the first `length` positions. `labels`
    may run past them: a context-parallel share's labels carry the next share's first ones, which its last
    positions' MTP depths are scored against."""
    return (labels_BT if depth == 0 else mtp_targets(labels_BT, depth))[:, :length]


def token_mean_shares(depth_targets: list[torch.Tensor], step_counts: list[float], scale: float
                      ) -> list[torch.Tensor]:
    """`ObjectiveOutput.mtp_shares` of a token-mean objective (SFT, GRPO, MOPD: each depth's loss a sum over its
    targets / the step's count of them, `step_counts`): each depth's targets here / the step's, 0 where the step has
    none, times `scale` as the metrics are."""
    return [(targets != IGNORE_INDEX).sum() * (scale / count if count else 0.0)
            for targets, count in zip(depth_targets, step_counts)]


def target_counts(labels_BT: torch.Tensor, depths: int, length: int | None = None) -> torch.Tensor:
    """[1 + depths]: the valid next-token targets of a micro-batch (of its first `length` positions), then those of
    each MTP depth."""
    length = labels_BT.shape[1] if length is None else length
    return torch.stack([(window_targets(labels_BT, d, length) != IGNORE_INDEX).sum() for d in range(depths + 1)])


def token_stage_inputs(micro_batch: TokenBatch) -> MicroBatchInputs:
    """What a pipeline's stages read of a `TokenBatch`: the ids, under CP with the ids that follow the share (the
    MTP depths embed them), and its seq_idx; its tokens are the share's positions."""
    batch = as_token_batch(micro_batch)
    following = [] if batch.following_ids is None else [batch.following_ids]
    return MicroBatchInputs(torch.cat([batch.input_ids, *following], dim=1), tokens=batch.input_ids.numel(),
                            lookahead=following[0].shape[1] if following else 0, seq_idx=batch.seq_idx)


def local_head_weight(model) -> torch.Tensor | None:
    """lm_head's weight where a loss can apply it itself (`linear_cross_entropy`): a plain `nn.Linear` holding its
    whole weight as a local tensor. None for an FSDP or TP shard (gathered only within a call of the module, which
    the RL passes make theirs: `distributed.head.apply_head`; pretraining takes the logits there) and for a
    converted head (`MainGradLinear` accumulates its own weight gradient)."""
    head = getattr(model, "lm_head", None)
    if type(head) is not torch.nn.Linear or head.bias is not None or isinstance(head.weight, DTensor):
        return None
    return head.weight


class PretrainObjective:
    """Next-token CE plus the MTP depths' CE (`HybridLM.forward`'s loss), each micro-batch weighted equally.

    Where lm_head's weight is local, the loss applies lm_head itself, a block of tokens at a time
    (`linear_cross_entropy`: no [tokens, vocab] logits); otherwise it takes the model's logits. `data_sum` (data
    parallelism: sums a tensor over the data-parallel ranks in place) and `mtp_depths` (the model's): each rank's
    CE means are weighted by its share of the micro-batch's valid targets, depth by depth, so the shares sum to the
    single-process means of the whole micro-batch. A micro-batch is a `TokenBatch`, under context parallelism a
    share of one (`dist.step.share_of_batch`: its labels run on past its ids, and `following_ids`, the ids that
    follow it, feed MTP); its seq_idx, where it has one, goes to the model with its ids. `compile_loss`
    (`train.compile`): the cross entropy over the logits runs compiled (the per-block softmax and its gradient fused
    into one loop; the fused lm_head loss stays eager). `fused_head=False`: always through the logits
    (bench/compile.py compares the two)."""

    headline = ("lm_loss", "ce")

    def __init__(self, data_sum=None, mtp_depths: int = 0, compile_loss: bool = False, fused_head: bool = True):
        self.micro_batches, self.fused_head = 1, fused_head
        self.data_sum, self.mtp_depths = data_sum, mtp_depths
        self.global_counts: list[torch.Tensor] = []
        self.compile_loss = compile_loss
        self.cross_entropy = torch.compile(cross_entropy) if compile_loss else cross_entropy

    def begin_step(self, micro_batches):
        self.micro_batches = len(micro_batches)
        if self.data_sum is not None:  # one all-reduce per step: every micro-batch's valid targets, per depth
            counts = torch.stack([target_counts(batch.labels, self.mtp_depths, batch.input_ids.shape[1])
                                  for batch in map(as_token_batch, micro_batches)])
            self.global_counts = list(self.data_sum(counts.double()).unbind(0))

    def __call__(self, model, micro_batch):
        batch = as_token_batch(micro_batch)
        out = model(batch.input_ids, logits=False, **batch.model_inputs())
        return self.loss_from_outputs(model, (out.hidden, *out.mtp_hidden), batch, router_counts(model, out))

    stage_inputs = staticmethod(token_stage_inputs)  # under PP: what the stages read

    def loss_from_outputs(self, model, outputs, micro_batch, expert_counts=None):
        """One micro-batch's loss from lm_head's inputs, `outputs` = (the final hidden, *each MTP depth's), as the
        forward stopped before lm_head (`__call__`) or a pipeline's last stage (`model` the stage's) hands them: the
        loss `HybridLM.forward` computes, lm_head applied by blocks of tokens where its weight is local, else through
        the logits of its own forward, on every output (under FSDP or TP its hooks run on every rank, a target or
        not). Under a pipeline the expert counts are the pipeline's to collect."""
        batch = as_token_batch(micro_batch)
        weight = local_head_weight(model) if self.fused_head else None
        if weight is None:
            mean_loss, outputs = self.cross_entropy, [model.lm_head(state) for state in outputs]
        else:
            def mean_loss(hidden, targets):
                return linear_cross_entropy(hidden.flatten(0, 1), weight, targets.flatten(), IGNORE_INDEX)
        lm_loss, *mtp_losses = self._losses(mean_loss, outputs, batch.labels)
        loss, metrics, depth_losses, shares = self._combine(model, lm_loss, mtp_losses, batch.labels,
                                                            batch.input_ids.shape[1])
        return ObjectiveOutput(loss / self.micro_batches, metrics, batch.input_ids.numel(), expert_counts or {},
                               depth_losses, shares)

    @staticmethod
    def _losses(mean_loss, outputs, labels):
        """`mean_loss` of each output against its targets: the next tokens for the first, depth d's targets for the
        MTP depth d (a zero where there is none, `mean_or_zero`)."""
        return [mean_or_zero(mean_loss, output, window_targets(labels, depth, output.shape[1]))
                for depth, output in enumerate(outputs)]

    def _combine(self, model, lm_loss, mtp_losses, labels, length):
        """The micro-batch's loss, CE + mtp_loss_weight x the mean of the MTP depths' CE, its metrics, each
        depth's loss (detached) and share (`ObjectiveOutput.mtp_shares`: 1, or 0 for a depth without a target);
        under data parallelism this rank's share of them: each mean times local / global valid targets (0 where
        the micro-batch has none anywhere)."""
        local = target_counts(labels, len(mtp_losses), length).double()
        if self.data_sum is not None:
            total = self.global_counts.pop(0).to(local.device)
            weights = torch.where(total > 0, local / total.clamp(min=1), 0.0).to(lm_loss.dtype)
            lm_loss = lm_loss * weights[0]
            mtp_losses = [loss * weights[d] for d, loss in enumerate(mtp_losses, start=1)]
        else:
            weights = (local > 0).to(lm_loss.dtype)
        loss = lm_loss + model.config.mtp_loss_weight * torch.stack(mtp_losses).mean() if mtp_losses else lm_loss
        return (loss, {"loss": loss.detach(), "lm_loss": lm_loss.detach()}, [m.detach() for m in mtp_losses],
                list(weights[1:].unbind(0)))


class LoaderBatches(BatchSource):
    """`grad_accum` micro-batches per step from a resumable loader of `TokenBatch`es."""

    def __init__(self, loader, grad_accum: int):
        self.loader, self.grad_accum = loader, grad_accum

    def next_step(self):
        return [next(self.loader) for _ in range(self.grad_accum)]

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)
