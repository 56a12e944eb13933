"""Pipeline parallelism with torch.distributed.pipelining: stages at layer boundaries, a 1F1B schedule.

The layers are cut where the planner cuts them (`plan.pipeline_stages`: contiguous, balanced by estimated
compute), the embedding on the first stage, norm_f, lm_head, the MTP block and the loss on the last. With the
interleaved schedule each rank holds two stages, r and r + pp (virtual stages: the bubble shrinks by half).

Each rank keeps one HybridLM, `stage_model`, with the layers of its stages and placeholders (`AbsentLayer`, no
parameters) for the rest, so every parameter keeps its single-process name: the optimizer, DCP (which merges
the stages' checkpoints and reshards them to another pp) and the routers' bookkeeping see the model they know.
A `StageView` per stage runs that stage's part of `HybridLM.forward`:

    first stage    ids -> embeddings -> its layers -> (hidden, embeddings)
    middle stages  (hidden, embeddings) -> its layers -> (hidden, embeddings)
    last stage     ... -> norm_f (the final hidden), and the MTP depths (their hidden): lm_head's inputs

The last stage stops before lm_head, as `HybridLM.forward(logits=False)` does, and the loss on that stage applies
the head (the stage model's `lm_head`) itself: the RL objectives by blocks of rows (`distributed.head.apply_head`),
never building the [tokens, vocab] logits, pretraining's and SFT's as they do in one process. The head stays a
submodule of the last view, so under FSDP that view is its root and its gradient is reduced by the loss's backward
on that stage's ranks.

The embeddings travel with the hidden state because the MTP block on the last stage reads them (token t + k's
embedding at depth k). Under CP the first stage embeds the ids that follow each chunk as well (HybridLM's
`following_ids`, PAST_END embedded as zeros), so the embeddings run `lookahead` positions past the hidden state.
A step runs the step's `grad_accum` micro-batches through the schedule as its micro-batches (so grad_accum >= pp,
the planner's rule), each described by a `MicroBatchInputs`: its ids, with a document mask each position's document
(`seq_idx`, which every layer and the MTP block read, as `HybridLM.forward` passes it) and, for the RL learners, the
experts to replay (routing replay) and the positions whose routing counts. Every stage's forward is told the index
of its micro-batch (a keyword input, which the schedules hand to every stage), and so is the loss: the objective's
loss runs on the last stage on the whole micro-batch the index names (rollout log-probs, advantages, teacher scores:
whatever it reads), its metrics are broadcast from there, and each MoE layer's expert counts are summed over the
micro-batches as the stages run them (a recomputed forward, under activation checkpointing, is not counted again).
The replay ids and the seq_idx stay with the Pipeline, by micro-batch index, as the schedule runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleLoopedBFS,
)

from hybridtron.config import ModelConfig
from hybridtron.distributed.costs import cluster_for
from hybridtron.distributed.mesh import Parallel
from hybridtron.distributed.plan import Workload, pipeline_stages
from hybridtron.model.lm import counted_at_depth, cross_entropy, embed_ahead
from hybridtron.ops.cross_entropy import cross_entropy_sum_and_count


@dataclass
class MicroBatchInputs:
    """What the stages read of one micro-batch (the loss reads the rest on the last stage, by its index).

    input_ids [B, L + lookahead]: under CP a share's ids and the `lookahead` ids that follow it (the MTP depths read
    their embeddings); expert_ids {backbone router: [B, L, K]}: routing replay, or None; counted [B, L + lookahead]:
    the real positions, whose routing the expert counts include (`HybridLM.forward(counted=...)`; None: all; the RL
    learners leave padding out); tokens: the micro-batch's token count for the step's throughput; seq_idx [B, L]
    (the lookahead not included): each position's document within its row (`HybridLM.forward(seq_idx=...)`), or
    None for no document mask."""

    input_ids: torch.Tensor
    tokens: int
    lookahead: int = 0
    expert_ids: dict[str, torch.Tensor] | None = None
    counted: torch.Tensor | None = None
    seq_idx: torch.Tensor | None = None


class AbsentLayer(nn.Module):
    """A layer another pipeline stage holds: no parameters; `kind` None, so the model's router and MoE
    listings skip it."""

    kind = None

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"layer {self.index} lives on another pipeline stage")


def stage_layers(config: ModelConfig, stages: int, seq_len: int) -> list[list[int]]:
    """The layer indices of each of `stages` stages, as the planner cuts them."""
    workload = Workload(seq_len=seq_len, tokens_per_iter=seq_len)
    cut = pipeline_stages(config, cluster_for("h100", 8), workload, stages)
    return [[int(unit.name.split()[1]) for unit in stage.units if unit.name.startswith("layer")] for stage in cut]


class StageView(nn.Module):
    """One pipeline stage's part of `HybridLM.forward` (module docstring), over the stage model's modules."""

    def __init__(self, model: nn.Module, layers: list[int], first: bool, last: bool):
        super().__init__()
        self.config = model.config
        self.first, self.last = first, last
        self.carries_embeddings = model.config.has_mtp
        self.lookahead = 0  # under CP: how many ids past the share the first stage embeds (`Pipeline.step`)
        self.pipeline: "Pipeline | None" = None  # the Pipeline running this view: replay ids, expert counts
        self.layer_indices = layers
        self.layers = nn.ModuleList(model.backbone.layers[i] for i in layers)
        if first:
            self.embeddings = model.backbone.embeddings
        if last:  # lm_head, which the loss applies, stays under the view: under FSDP the stage's root completes it
            self.norm_f, self.lm_head, self.mtp = model.backbone.norm_f, model.lm_head, model.mtp
            self.mtp_routers = [name for name in model.routers() if name.startswith("mtp.")]

    def forward(self, *inputs, micro_batch: torch.Tensor):
        index = int(micro_batch)  # which micro-batch of the step this is (a [1] chunk of the step's indices)
        if self.first:  # under CP the ids run `lookahead` past the chunk: MTP's, as HybridLM's following_ids
            embeddings = embed_ahead(self.embeddings, inputs[0]) if self.lookahead else self.embeddings(inputs[0])
            hidden = embeddings[:, :embeddings.shape[1] - self.lookahead] if self.lookahead else embeddings
        else:
            hidden = inputs[0]
            embeddings = inputs[1] if self.carries_embeddings else None
        seq_idx = self.pipeline.documents(index)
        for layer_index, layer in zip(self.layer_indices, self.layers):
            name = str(layer_index)
            hidden = layer(hidden, None, None, self.pipeline.replay(index, name), seq_idx=seq_idx)
            self.pipeline.count(index, [name])
        if not self.last:
            # a fresh view: a stage's outputs must not be its inputs themselves
            return (hidden, embeddings.view_as(embeddings)) if self.carries_embeddings else hidden
        hidden = self.norm_f(hidden)
        outputs = [hidden]
        if self.mtp is not None:  # as HybridLM.forward: depth k reads the embedding of token t + k
            previous, length = hidden, embeddings.shape[1] - self.lookahead
            for depth in range(1, self.config.mtp_num_depths + 1):
                ahead = embeddings[:, depth:depth + length]
                previous = self.mtp(previous, F.pad(ahead, (0, 0, 0, length - ahead.shape[1])), seq_idx=seq_idx)
                self.pipeline.count(index, self.mtp_routers, depth)
                outputs.append(previous)
        return tuple(outputs)


def split_for_stages(model: nn.Module, keep: set[int], first: bool, last: bool) -> nn.Module:
    """`model` with the layers outside `keep` (and the embedding / head of other stages) removed, in place."""
    for index in range(len(model.backbone.layers)):
        if index not in keep:
            model.backbone.layers[index] = AbsentLayer(index)
    if not first:
        model.backbone.embeddings = None
    if not last:
        model.backbone.norm_f, model.lm_head, model.mtp = None, None, None
    return model


class Pipeline:
    """This rank's stages and the schedule that runs a step's micro-batches through all of them."""

    def __init__(self, stage_model: nn.Module, views: list[StageView], stage_indices: list[int], num_stages: int,
                 parallel: Parallel, schedule: str):
        self.model, self.views, self.parallel = stage_model, views, parallel
        self.stage_indices, self.num_stages, self.schedule_name = stage_indices, num_stages, schedule
        self.group = parallel.group("pp")
        self.holds_loss = num_stages - 1 in stage_indices
        self.loss_rank = parallel.world - parallel.world // parallel.layout.pp  # the last stage's first rank
        self._stages: dict[str, tuple[tuple, list[PipelineStage]]] = {}  # per use, the stages of its last shape
        self.routers = stage_model.routers()
        self.inputs: list[MicroBatchInputs] = []  # the running step's (replay ids, counted positions)
        self.seq_idx: list[torch.Tensor | None] = []  # the running step's or evaluation's, per micro-batch
        self.counts: dict[str, torch.Tensor] = {}
        for view in views:
            view.pipeline = self

    def replay(self, index: int, name: str) -> torch.Tensor | None:
        """The experts backbone router `name` replays for micro-batch `index`, or None (no replay, or no router)."""
        expert_ids = self.inputs[index].expert_ids if index < len(self.inputs) else None
        return expert_ids.get(name) if expert_ids else None

    def documents(self, index: int) -> torch.Tensor | None:
        """Micro-batch `index`'s seq_idx [B, L] (each position's document), or None (no document mask)."""
        return self.seq_idx[index] if index < len(self.seq_idx) else None

    def count(self, index: int, names: list[str], depth: int = 0) -> None:
        """Add the last routing of routers `names` (those this stage holds), over micro-batch `index`'s counted
        positions, to the step's counts (the MTP block's once per depth, as `HybridLM.forward` counts them)."""
        if index >= len(self.inputs):  # not a training step (an evaluation)
            return
        inputs = self.inputs[index]
        counted = inputs.counted
        if counted is not None:
            counted = counted_at_depth(counted, depth, inputs.input_ids.shape[1] - inputs.lookahead)
        for name in names:
            moe = self.routers.get(name)
            if moe is None:
                continue
            counts = moe.last_expert_counts if counted is None else moe.counted_expert_counts(counted)
            self.counts[name] = counts if name not in self.counts else self.counts[name] + counts

    def stages(self, key: str, ids_shape: tuple[int, int], lookahead: int = 0) -> list[PipelineStage]:
        """Pipeline stages for micro-batches of `ids_shape` (and, under CP, `lookahead` ids past each share, which
        every view is told), with every stage's input and output shapes given (static mode: no metadata inference,
        which would run a stage on placeholder data). Each use (`key`) keeps the stages of its last shape only (the
        RL learners' micro-batches change length from step to step)."""
        for view in self.views:
            view.lookahead = lookahead
        shape = (ids_shape, lookahead)
        if key not in self._stages or self._stages[key][0] != shape:
            self._stages[key] = (shape, [
                PipelineStage(view, index, self.num_stages, self.parallel.device, group=self.group,
                              input_args=self._example(view, ids_shape, lookahead, inputs=True),
                              output_args=self._example(view, ids_shape, lookahead, inputs=False))
                for view, index in zip(self.views, self.stage_indices)])
        return self._stages[key][1]

    def _example(self, view: "StageView", ids_shape: tuple[int, int], lookahead: int, inputs: bool
                 ) -> tuple[torch.Tensor, ...]:
        """Meta tensors of a stage's inputs or outputs: ids (and the lookahead), (hidden, embeddings) between
        stages (hidden sequence-sharded under TP), and out of the last lm_head's inputs: the final hidden and each MTP
        depth's (sequence-sharded under TP too: the head gathers them)."""
        rows, length = ids_shape
        config, tp = self.model.config, self.parallel.layout.tp
        meta = dict(device="meta", dtype=torch.float32, requires_grad=True)  # activations carry gradients
        if inputs and view.first:
            return (torch.empty(rows, length + lookahead, device="meta", dtype=torch.long),)
        hidden = torch.empty(rows, length // tp, config.hidden_size, **meta)
        if not inputs and view.last:
            return tuple(torch.empty(hidden.shape, **meta) for _ in range(1 + config.mtp_depths))
        embeddings = torch.empty(rows, length + lookahead, config.hidden_size, **meta)
        return (hidden, embeddings) if view.carries_embeddings else (hidden,)

    def _schedule(self, stages, micro_batches: int, loss_fn, name: str):
        if name == "interleaved-1f1b":
            return ScheduleInterleaved1F1B(stages, micro_batches, loss_fn=loss_fn, scale_grads=False)
        kind = Schedule1F1B if name == "1f1b" else ScheduleGPipe
        return kind(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=False)

    def step(self, micro_batches: list[MicroBatchInputs], loss_fn) -> dict[str, torch.Tensor]:
        """Forward and backward of every micro-batch; `loss_fn(outputs, index)` runs on the last stage, `outputs`
        lm_head's inputs (the final hidden, then each MTP depth's) and `index` the micro-batch's position in
        `micro_batches` (a [1] tensor). Returns this rank's expert counts per router, summed over the micro-batches."""
        first = micro_batches[0]
        shape = (first.input_ids.shape, first.lookahead)
        if any((mb.input_ids.shape, mb.lookahead) != shape for mb in micro_batches):
            shapes = sorted({tuple(mb.input_ids.shape) for mb in micro_batches})
            raise ValueError("a pipeline step's micro-batches must all have one shape (its stages exchange "
                             f"fixed-shape activations); got {shapes}")
        rows, width = first.input_ids.shape
        stages = self.stages("train", (rows, width - first.lookahead), first.lookahead)
        schedule = self._schedule(stages, len(micro_batches), loss_fn, self.schedule_name)
        self.inputs, self.counts = micro_batches, {}
        self.seq_idx = [mb.seq_idx for mb in micro_batches]
        try:
            self._run(schedule, "step", torch.cat([mb.input_ids for mb in micro_batches]), len(micro_batches))
        finally:
            self.inputs, self.seq_idx = [], []
        counts, self.counts = self.counts, {}
        return counts

    def _run(self, schedule, method: str, ids: torch.Tensor, micro_batches: int, **options) -> None:
        """`schedule.step` or `.eval` on this rank: the ids into the first stage, the micro-batch indices to every
        stage (a keyword input) and, on the last, to the loss as its target."""
        index = torch.arange(micro_batches, device=ids.device)
        inputs = (ids,) if 0 in self.stage_indices else ()
        getattr(schedule, method)(*inputs, target=index if self.holds_loss else None, micro_batch=index, **options)

    @torch.no_grad()
    def lm_loss(self, input_ids: torch.Tensor, labels: torch.Tensor, sum_over_shares=None,
                seq_idx: torch.Tensor | None = None) -> float:
        """The next-token CE of one batch (no MTP), computed on the last stage (through its lm_head's logits) and
        known to every rank. Under CP (`sum_over_shares`: a sum over the cp group) the batch is a share: the CE over
        all the shares' targets. `seq_idx`: the batch's document indices (a document mask), or None."""
        def batch_loss(outputs, index):
            logits = self.model.lm_head(outputs[0])
            if sum_over_shares is None:
                return cross_entropy(logits, labels)
            ce_sum, count = sum_over_shares(cross_entropy_sum_and_count(logits, labels))
            return ce_sum / count

        losses: list[torch.Tensor] = []
        stages = self.stages("eval", tuple(input_ids.shape))
        # one micro-batch through every stage this rank holds (two under the interleaved schedule)
        schedule = ScheduleLoopedBFS(stages, 1, loss_fn=batch_loss) if len(stages) > 1 else \
            ScheduleGPipe(stages[0], 1, loss_fn=batch_loss)
        self.seq_idx = [seq_idx]
        try:
            self._run(schedule, "eval", input_ids, 1, losses=losses)
        finally:
            self.seq_idx = []
        value = float(losses[0]) if losses else None
        return self.parallel.broadcast_object(value, src=self.loss_rank)


def cut_for_rank(model: nn.Module, parallel: Parallel, seq_len: int) -> tuple[list[int], list[list[int]], int]:
    """Cut `model` in place down to this rank's stage(s); returns (this rank's stage indices, every stage's
    layers, the number of stages)."""
    pp, rank = parallel.layout.pp, parallel.pp_rank
    per_rank = 2 if parallel.config.pp_schedule == "interleaved-1f1b" else 1
    num_stages = pp * per_rank
    if num_stages > model.config.num_hidden_layers:
        raise ValueError(f"dist.pp={pp} with the {parallel.config.pp_schedule} schedule needs {num_stages} stages "
                         f"but the model has {model.config.num_hidden_layers} layers")
    cuts = stage_layers(model.config, num_stages, seq_len)
    indices = [rank + pp * v for v in range(per_rank)]
    split_for_stages(model, {layer for i in indices for layer in cuts[i]}, first=0 in indices,
                     last=num_stages - 1 in indices)
    return indices, cuts, num_stages
