"""Tensor parallelism with sequence parallelism: DTensor plans applied to a built HybridLM (Megatron's layout).

Between the mixers the residual stream is sequence-sharded: each TP rank holds [B, T/tp, D] (SP). A mixer
all-gathers its input along the sequence, computes its share of the heads (or columns) on local tensors and
reduce-scatters its output back to sequence shards:

    attention     q, k, v column-parallel by heads (kv heads too: tp must divide them), o_proj row-parallel
    Mamba-2       in_proj column-parallel, split into its z | x | B | C | dt parts, each by head (B, C by group);
                  conv1d channels (x | B | C) and A_log, D, dt_bias by head; the gated norm by group (so tp must
                  divide n_groups); out_proj row-parallel
    MLP, shared   up column-parallel, down row-parallel (the shared expert on the MoE's flattened tokens)
    embedding     vocabulary-parallel; its output all-reduced, then cut into sequence shards for the first block
    lm_head       vocabulary-parallel on the gathered sequence; the logits gathered (the loss is replicated);
                  the RL passes gather one block of rows' logits at a time instead (`distributed/head.py`)

Everything that acts token by token on sequence shards runs on local tensors with weights replicated over TP:
the block norms, norm_f, the MoE router, latent projections and routed experts (which EP dispatches; under ETP
they gather the TP group's tokens and split their width instead, `expert_parallel.py`), and the MTP block's norms
and eh_proj. Their gradients differ across the TP ranks (each saw other tokens), so FSDP
shards them over dp x tp and sums them there (`parallelize.apply_fsdp`). A router's expert counts over a mask of
the whole sequence (`MoE.counted_expert_counts`, the RL learner's completions) take this rank's share of the mask;
summed over the TP ranks, they are one process's.

The mixers run on local shards (`LocalShardParallel`): their parameters are DTensors (so FSDP, the optimizer and
DCP see sharded tensors), swapped for their local shards for the duration of a forward (which a compiled block
runs eagerly), with the mixer's head counts set to the local ones. That keeps the model code free of parallelism and lets the precision policy's
emulated GEMMs (QuantLinear) run unchanged on each shard. A packed parameter (Mamba's in_proj and conv1d) is
stored rank-major: rank r's shard is [z_r | x_r | B_r | C_r | dt_r]; `Packing` maps its rows back to the
single-process layout for checkpoints and exports (`hybridtron.distributed.state`).

Not supported under TP: routing replay (`expert_ids`), biases on row-parallel layers, tp > kv heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel, parallelize_module

from hybridtron.config import ATTENTION, MAMBA, MLP as MLP_KIND, MOE
from hybridtron.distributed.mesh import Parallel


@dataclass(frozen=True)
class Packing:
    """A parameter whose dim 0 concatenates `parts` (global sizes), each split over `tp` ranks: the rank-major
    layout puts rank r's chunk of every part together, [part_0 chunk r | part_1 chunk r | ...]."""

    parts: tuple[int, ...]
    tp: int

    @property
    def rows(self) -> int:
        return sum(self.parts)

    def rank_major(self, canonical: torch.Tensor) -> torch.Tensor:
        """The single-process layout -> the rank-major one."""
        pieces = [part.chunk(self.tp) for part in canonical.split(list(self.parts))]
        return torch.cat([piece[rank] for rank in range(self.tp) for piece in pieces])

    def canonical(self, rank_major: torch.Tensor) -> torch.Tensor:
        """The rank-major layout -> the single-process one."""
        local = [size // self.tp for size in self.parts]
        blocks = [block.split(local) for block in rank_major.chunk(self.tp)]
        return torch.cat([blocks[rank][part] for part in range(len(self.parts)) for rank in range(self.tp)])

    def canonical_runs(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Rows [start, stop) of the rank-major layout as (canonical row, offset from start, length) runs."""
        runs, block = [], self.rows // self.tp
        canonical_base, local_base = 0, 0
        offsets = []
        for size in self.parts:
            offsets.append((canonical_base, local_base, size // self.tp))
            canonical_base, local_base = canonical_base + size, local_base + size // self.tp
        row = start
        while row < stop:
            rank, in_block = divmod(row, block)
            for canonical_base, local_base, local_size in offsets:
                if local_base <= in_block < local_base + local_size:
                    length = min(stop - row, local_base + local_size - in_block)
                    runs.append((canonical_base + rank * local_size + in_block - local_base, row - start, length))
                    row += length
                    break
        return runs


def _to_local_input(x: torch.Tensor, mesh: DeviceMesh, gather_dim: int | None) -> torch.Tensor:
    """A sequence (or token) shard -> the whole of it on every TP rank; its gradient, a partial sum on each rank,
    is reduce-scattered back."""
    if gather_dim is None:
        return x
    return DTensor.from_local(x, mesh, [Shard(gather_dim)], run_check=False).redistribute(
        mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def _from_local_output(y: torch.Tensor, mesh: DeviceMesh, mode: str | None, dim: int) -> torch.Tensor:
    if mode == "reduce_scatter":  # partial sums of a row-parallel GEMM -> this rank's shard of their sum
        return DTensor.from_local(y, mesh, [Partial()], run_check=False).redistribute(mesh, [Shard(dim)]).to_local()
    if mode == "all_gather":  # column shards -> all columns on every rank
        return DTensor.from_local(y, mesh, [Shard(dim % y.dim())], run_check=False).redistribute(
            mesh, [Replicate()]).to_local()
    return y


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    *path, attr = name.split(".")
    for part in path:
        module = getattr(module, part)
    return module, attr


class LocalShardParallel(ParallelStyle):
    """Run a module on this rank's shards of its parameters (module docstring).

    `placements`: parameter name -> its TP placement; `packings`: the packed ones among them; `local_attrs`:
    attributes set to their per-rank values (head counts); `gather_dim`: the input's sharded dimension, gathered
    before the forward (None: the input is already whole); `output`: "reduce_scatter" (row-parallel partial sums)
    or "all_gather" (column shards) along `output_dim`."""

    def __init__(self, placements: dict[str, Placement], *, packings: dict[str, tuple[int, ...]] | None = None,
                 local_attrs: dict[str, int] | None = None, gather_dim: int | None = 1,
                 output: str | None = "reduce_scatter", output_dim: int = 1):
        super().__init__()
        self.placements, self.packings = placements, packings or {}
        self.local_attrs = local_attrs or {}
        self.gather_dim, self.output, self.output_dim = gather_dim, output, output_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        for name, placement in self.placements.items():
            owner, attr = _owner(module, name)
            full = getattr(owner, attr).data
            if name in self.packings:
                full = Packing(self.packings[name], tp).rank_major(full)
            # every rank built the same model: each keeps its own shard, nothing is sent
            owner.register_parameter(attr, nn.Parameter(distribute_tensor(full, device_mesh, [placement],
                                                                           src_data_rank=None)))
        for attr, value in self.local_attrs.items():
            setattr(module, attr, value)
        original = module.forward

        # Swapping parameters is not something a compiled graph can replay (it would keep the first call's
        # tensors), so under `train.compile` the mixer runs eagerly while the rest of its block is compiled.
        @torch.compiler.disable
        def forward(*args, **kwargs):
            swapped = []
            for name in self.placements:
                owner, attr = _owner(module, name)
                param = owner._parameters[attr]  # FSDP has gathered it over dp: a DTensor on the TP mesh
                swapped.append((owner, attr, param))
                owner._parameters[attr] = param.to_local()
            try:
                output = original(_to_local_input(args[0], device_mesh, self.gather_dim), *args[1:], **kwargs)
            finally:
                for owner, attr, param in swapped:
                    owner._parameters[attr] = param
            return _from_local_output(output, device_mesh, self.output, self.output_dim)

        module.forward = forward
        module._tp_packings = {name: Packing(parts, tp) for name, parts in self.packings.items()}
        return module


def _sequence_shard(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's sequence shard (dim 1) of `x`, whole on every TP rank: a slice; its backward all-gathers."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)]).to_local()


class SequenceShardInputs(ParallelStyle):
    """The positional inputs at `positions`, whole on every TP rank, cut to this rank's sequence shard (a slice;
    its backward all-gathers the gradient). The other inputs pass through."""

    def __init__(self, positions: tuple[int, ...]):
        super().__init__()
        self.positions = positions

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        @torch.compiler.disable  # eager, also in a compiled block: traced, its backward loses the all-gather
        def shard(mod, args):
            return tuple(_sequence_shard(a, device_mesh) if i in self.positions else a for i, a in enumerate(args))

        module.register_forward_pre_hook(shard)
        return module


def _mixer_style(kind: str, mixer: nn.Module, tp: int) -> LocalShardParallel | None:
    if kind == ATTENTION:
        return LocalShardParallel(
            {"q_proj.weight": Shard(0), "k_proj.weight": Shard(0), "v_proj.weight": Shard(0),
             "o_proj.weight": Shard(1)},
            local_attrs={"num_heads": mixer.num_heads // tp, "num_kv_heads": mixer.num_kv_heads // tp})
    if kind == MAMBA:
        d, heads = mixer.inner_size, mixer.num_heads
        group_width = mixer.n_groups * mixer.state_size
        placements = {"in_proj.weight": Shard(0), "conv1d.weight": Shard(0), "dt_bias": Shard(0),
                      "A_log": Shard(0), "D": Shard(0), "norm.weight": Shard(0), "out_proj.weight": Shard(1)}
        packings = {"in_proj.weight": (d, d, group_width, group_width, heads),
                    "conv1d.weight": (d, group_width, group_width)}
        if mixer.conv1d.bias is not None:
            placements["conv1d.bias"] = Shard(0)
            packings["conv1d.bias"] = packings["conv1d.weight"]
        return LocalShardParallel(placements, packings=packings, local_attrs={
            "num_heads": heads // tp, "n_groups": mixer.n_groups // tp, "inner_size": d // tp,
            "conv_channels": mixer.conv_channels // tp})
    if kind == MLP_KIND:
        return LocalShardParallel({"up_proj.weight": Shard(0), "down_proj.weight": Shard(1)})
    return None


def _count_sequence_share(moe: nn.Module, mesh: DeviceMesh) -> None:
    """`moe.counted_expert_counts` takes the whole sequence's `counted` mask [B, T] (what the objective has, and
    what a forward on one process routes) and counts this rank's share of it: the router saw this rank's sequence
    shard only. The TP ranks' counts sum to one process's (`ExpertBalance` sums them over the token ranks)."""
    count = moe.counted_expert_counts
    moe.counted_expert_counts = lambda counted: count(_sequence_shard(counted, mesh))


def _no_routing_replay(module, args, kwargs):
    if kwargs.get("expert_ids") is not None:
        raise ValueError("routing replay (expert_ids) is not supported under tensor parallelism: the MoE layers see "
                         "sequence shards; use dist.tp=1 for a replayed learner")


def _check(model: nn.Module, tp: int) -> None:
    config = model.config
    if config.num_key_value_heads % tp:
        raise ValueError(f"dist.tp={tp}: training splits the kv heads, so tp must divide num_key_value_heads "
                         f"{config.num_key_value_heads} (replicating kv heads is not implemented)")
    for flag in ("attention_bias", "use_bias", "mlp_bias"):
        if getattr(config, flag):
            raise ValueError(f"dist.tp={tp}: model.{flag}=true is not supported under TP (row-parallel biases)")


def apply_tensor_parallel(model: nn.Module, parallel: Parallel) -> None:
    """Apply the plan of the module docstring to `model` (a HybridLM, before FSDP) in place."""
    mesh = parallel.meshes["tp"]
    tp = mesh.size()
    _check(model, tp)
    packings = {}
    if model.backbone.embeddings is not None:  # (a pipeline stage may hold no embedding or no head)
        parallelize_module(model.backbone.embeddings, mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
        first = next(layer for layer in model.backbone.layers if getattr(layer, "kind", None) is not None)
        parallelize_module(first, mesh, SequenceShardInputs((0,)))  # the whole embeddings -> this rank's shard
    for name, module in model.named_modules():
        kind = getattr(module, "kind", None)
        if kind is None or not hasattr(module, "mixer"):
            continue
        style = _mixer_style(kind, module.mixer, tp)
        if style is not None:
            parallelize_module(module.mixer, mesh, style)
            packings.update({f"{name}.mixer.{p}": packing for p, packing in module.mixer._tp_packings.items()})
        if kind == MOE:
            parallelize_module(module.mixer.shared_experts, mesh, LocalShardParallel(
                {"up_proj.weight": Shard(0), "down_proj.weight": Shard(1)}, gather_dim=0, output_dim=0))
            module.mixer.register_forward_pre_hook(_no_routing_replay, with_kwargs=True)
            _count_sequence_share(module.mixer, mesh)
    if getattr(model, "mtp", None) is not None:  # its inputs: the last hidden shard, the whole next embeddings
        parallelize_module(model.mtp, mesh, SequenceShardInputs((1,)))
    if model.lm_head is not None:
        parallelize_module(model.lm_head, mesh, LocalShardParallel({"weight": Shard(0)}, output="all_gather",
                                                                   output_dim=-1))
    model._tp_packings = packings  # canonical parameter name -> Packing, for checkpoints and exports
