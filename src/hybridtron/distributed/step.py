"""The pieces of a training step that depend on the layout: which rows a rank reads, global gradient norms and
clipping over sharded gradients, and gathering the model for an export.

Rows. The loader yields the global micro-batch on every rank (it is a pure function of its position, which is
global, so a checkpoint taken at one world size resumes at any other); each data-parallel rank takes its
contiguous batch_size / dp rows. TP and PP peers of a rank read the same rows. Under context parallelism each cp
rank of those rows takes its head and tail chunks of seq_len / (2 cp) positions, as two rows each
(`context_parallel.shard_sequence`), their document indices (`seq_idx`) cut the same way (`share_of_batch`).

Norms. A gradient is a DTensor sharded over some mesh dimensions and replicated over the rest (or over ranks
outside its mesh). Each rank sums the squares of its local shard, divided by how many ranks of its pipeline stage
hold that same shard; one all-reduce over the world then gives the global sum of squares, for the whole model and
for every parameter group at once.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.placement_types import _StridedShard

from hybridtron.data.batch import TokenBatch, as_token_batch
from hybridtron.distributed.context_parallel import chunk_rows, shard_sequence
from hybridtron.distributed.mesh import Parallel
from hybridtron.distributed.state import canonical_full_state, canonical_name


def share_of_batch(batch: TokenBatch, rank: int, size: int, lookahead: int) -> TokenBatch:
    """Context-parallel rank `rank` of `size`'s share of a `TokenBatch` [B, L]: its two chunks of each row as rows
    [2B, L / (2 size)] (`context_parallel.shard_sequence`), the labels running `lookahead` positions past them and
    the `lookahead` ids after them as `following_ids` (none with lookahead 0), seq_idx cut as the ids
    (`chunk_rows`: each chunk keeps its positions' document indices, so its first position need not be 0)."""
    input_ids, labels, following = shard_sequence(batch.input_ids, batch.labels, rank, size, lookahead)
    seq_idx = None if batch.seq_idx is None else chunk_rows(batch.seq_idx, rank, size)
    return TokenBatch(input_ids, labels, seq_idx, following if lookahead else None)


class DataParallelBatches:
    """A batch source whose micro-batches are this rank's rows of the global ones (module docstring), and under
    context parallelism its chunks of their positions (two rows per row), with the `lookahead` (the model's MTP
    depths) ids and labels after each (`share_of_batch`). Its position is the wrapped source's, unchanged, so it
    is the same at every world size."""

    def __init__(self, batches, parallel: Parallel, lookahead: int = 0):
        self.batches, self.parallel, self.lookahead = batches, parallel, lookahead
        self.rank, self.size = parallel.data_rank, parallel.layout.dp

    def shard(self, micro_batch):
        if isinstance(micro_batch, TokenBatch):
            return micro_batch.map(self.shard)
        if isinstance(micro_batch, torch.Tensor):
            rows = micro_batch.shape[0]
            if rows % self.size:
                raise ValueError(f"a micro-batch of {rows} rows does not split over {self.size} data-parallel ranks")
            per_rank = rows // self.size
            return micro_batch[self.rank * per_rank:(self.rank + 1) * per_rank].to(self.parallel.device)
        if isinstance(micro_batch, dict):
            return {key: self.shard(value) for key, value in micro_batch.items()}
        if isinstance(micro_batch, (tuple, list)):
            return type(micro_batch)(self.shard(value) for value in micro_batch)
        return micro_batch

    def next_step(self):
        micro_batches = [self.shard(micro_batch) for micro_batch in self.batches.next_step()]
        if self.parallel.layout.cp > 1:
            micro_batches = [self.share_of_sequence(micro_batch) for micro_batch in micro_batches]
        return micro_batches

    def share_of_sequence(self, micro_batch) -> TokenBatch:
        try:
            batch = as_token_batch(micro_batch)
        except ValueError:
            raise ValueError("context parallelism splits TokenBatch micro-batches (input_ids [B, T], labels [B, T]); "
                             f"this batch source yields {type(micro_batch).__name__}") from None
        return share_of_batch(batch, self.parallel.coordinate("cp"), self.parallel.layout.cp, self.lookahead)

    def sync_weights(self, model, version, total_steps):
        self.batches.sync_weights(model, version, total_steps)

    def state_dict(self):
        return self.batches.state_dict()

    def load_state_dict(self, state):
        self.batches.load_state_dict(state)


def held_out_shares(batches: list[TokenBatch], parallel: Parallel):
    """(held-out `TokenBatch`es, a sum over the ranks that share them) for an evaluator: under context parallelism
    each batch cut to this rank's chunks of its positions (`share_of_batch` with no lookahead: evaluation scores
    the next token only) and the cp group's sum, which puts a batch's CE sum and target count back together;
    otherwise the batches unchanged and None."""
    if parallel.layout.cp == 1:
        return batches, None
    rank, size = parallel.coordinate("cp"), parallel.layout.cp
    return [share_of_batch(as_token_batch(batch), rank, size, 0) for batch in batches], parallel.sum_over_context


def step_metrics(parallel: Parallel, metrics: list[dict[str, torch.Tensor]], tokens: int
                 ) -> tuple[dict[str, float], int]:
    """The step's metrics and token count for the global batch, on every rank: each rank's shares (means over its
    micro-batches) summed over the data-parallel ranks; under PP the last stage computes them and broadcasts."""
    counted = parallel.sum_over_data(torch.tensor([float(tokens)], dtype=torch.float64, device=parallel.device))
    values = None
    if metrics:
        keys = list(metrics[0])
        means = torch.stack([torch.stack([m[key] for m in metrics]).mean() for key in keys]).double()
        values = dict(zip(keys, parallel.sum_over_data(means).tolist()))
    if parallel.pipeline is not None:
        values = parallel.broadcast_object(values, src=parallel.pipeline.loss_rank)
    return values, int(counted)


def step_ranges(parallel: Parallel, ranges: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step's [min, max] of each statistic (this rank's: `train.stats.merge_ranges`) over the data-parallel
    ranks, on every rank; under PP the last stage's, broadcast as `step_metrics` does."""
    if ranges and parallel.layout.dp * parallel.layout.cp > 1:
        names = list(ranges)
        extremes = torch.stack([ranges[name] * torch.tensor([-1.0, 1.0], device=ranges[name].device)
                                for name in names]).double().to(parallel.device)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=parallel.group("data"))  # -min and max
        ranges = {name: row * torch.tensor([-1.0, 1.0], dtype=row.dtype, device=row.device)
                  for name, row in zip(names, extremes)}
    if parallel.pipeline is not None:
        ranges = parallel.broadcast_object({name: value.cpu() for name, value in ranges.items()},
                                           src=parallel.pipeline.loss_rank)
    return ranges


def merge_balance_states(parallel: Parallel, state: dict) -> dict:
    """Under PP: the router-load windows of every stage's routers as one state (`ExpertBalance.state_dict`'s
    form), so a checkpoint holds all routers whatever the stage cut that loads it."""
    everyone = [None] * parallel.world
    dist.all_gather_object(everyone, {"names": state["names"], "window": [w.cpu() for w in state["window"]]})
    names, parts = [], []
    for part in everyone:
        fresh = [i for i, name in enumerate(part["names"]) if name not in names]  # each stage's once
        if fresh:
            names += [part["names"][i] for i in fresh]
            parts.append([w[fresh] for w in part["window"]])
    window = [torch.cat(rows) for rows in zip(*parts)] if parts else []
    return {"names": names, "window": window}


def _local_and_copies(grad: torch.Tensor, stage_world: int) -> tuple[torch.Tensor, int]:
    """(this rank's shard, how many ranks of the pipeline stage hold that same shard)."""
    if not isinstance(grad, DTensor):
        return grad, stage_world
    assert not any(isinstance(p, Partial) for p in grad.placements), "a gradient left unreduced"
    shards = math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements)
                       if p.is_shard() or isinstance(p, _StridedShard))  # FSDP over TP shards: strided
    return grad.to_local(), stage_world // shards


@torch.no_grad()
def global_grad_norms(named_grads: list[tuple[str, torch.Tensor]], parallel: Parallel,
                      group_of=None) -> tuple[torch.Tensor, dict[str, float]]:
    """(global L2 norm as a 0-d tensor, per-group norms by `group_of(canonical name)`) of possibly sharded
    gradients; one all-reduce of [1 + groups] float64 values over the world."""
    groups = [] if group_of is None else list(dict.fromkeys(group_of(canonical_name(n)) for n, _ in named_grads))
    if group_of is not None:  # pipeline stages hold different groups: agree on all
        groups = list(parallel.merge_over_stages(dict.fromkeys(groups)))
    stage_world = parallel.world // parallel.layout.pp
    device = named_grads[0][1].device if named_grads else torch.device("cpu")
    squares = torch.zeros(1 + len(groups), dtype=torch.float64, device=device if device.type != "meta" else "cpu")
    locals_, copies = zip(*(_local_and_copies(g, stage_world) for _, g in named_grads)) if named_grads else ((), ())
    norms = torch._foreach_norm(list(locals_)) if locals_ else []
    for (name, _), norm, count in zip(named_grads, norms, copies):
        value = norm.double().square() / count
        squares[0] += value
        if group_of is not None:
            squares[1 + groups.index(group_of(canonical_name(name)))] += value
    if parallel.world > 1:
        dist.all_reduce(squares)
    roots = squares.sqrt()
    return roots[0].float(), dict(zip(groups, roots[1:].tolist()))


@torch.no_grad()
def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)) (torch's clip_grads_with_norm_), shard by shard."""
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if local:
        torch._foreach_mul_(local, coefficient.to(local[0].device))


class _SequentialGathers(logging.Filter):
    """Drops DTensor's note that it will gather a tensor sharded over two mesh dimensions (FSDP over TP or EP
    shards: `_StridedShard`, `Shard`) in sequential all-gathers, which "may give inconsistent results between
    ranks due to different reduction orders": an all-gather copies, it reduces nothing, so the results are exact
    whatever the order, and a full state is gathered once per export or weight sync, where one more collective's
    latency does not matter. Its other notes (reductions among them) pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_gather operations will be performed" not in record.getMessage()


def _full_model_state(model: torch.nn.Module, cpu_offload: bool) -> dict[str, torch.Tensor]:
    """`get_model_state_dict`'s full state, without DTensor's note on sequential gathers (`_SequentialGathers`)."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    quiet = _SequentialGathers()
    logger.addFilter(quiet)
    try:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
    finally:
        logger.removeFilter(quiet)


def full_state_dict(model: torch.nn.Module, parallel: Parallel, everywhere: bool = False
                    ) -> dict[str, torch.Tensor] | None:
    """The whole model's state, in canonical names and on the CPU, on global rank 0 (None elsewhere), or with
    `everywhere` on every rank. Every rank must call it; under PP each stage gathers its own part, and rank 0
    merges them (with `everywhere`: every rank, from the ranks of its pp group, one per stage)."""
    if everywhere:
        state = _full_model_state(model, cpu_offload=False)
        state = canonical_full_state({name: tensor.cpu() for name, tensor in state.items()}, model)
        if parallel.layout.pp == 1:
            return state
        stages = [None] * parallel.layout.pp
        dist.all_gather_object(stages, state, group=parallel.group("pp"))
        return {name: tensor for stage in stages for name, tensor in stage.items()}
    if parallel.layout.pp == 1:  # cpu_offload: the full tensors land on global rank 0 only
        state = _full_model_state(model, cpu_offload=True)
        return canonical_full_state(state, model) if parallel.is_main else None
    state = canonical_full_state({name: tensor.cpu() for name, tensor in
                                  _full_model_state(model, cpu_offload=False).items()}, model)
    first_of_stage = parallel.coordinate("dp_replicate") == parallel.coordinate("dp_shard") == \
        parallel.coordinate("cp") == parallel.coordinate("tp") == 0
    parts = [None] * parallel.world if parallel.is_main else None
    dist.gather_object(state if first_of_stage else None, parts, dst=0)
    if not parallel.is_main:
        return None
    merged = {}
    for part in parts:
        merged.update(part or {})
    return merged
