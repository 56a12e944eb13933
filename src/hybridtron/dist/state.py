"""The checkpoint state of a parallelized model: DCP-ready, in the single-process layout, at any world size.

`get_state_dict` gives every parameter and optimizer state as a DTensor under its single-process name, so DCP
reshards it to whatever layout loads it. One exception needs care: a TP-packed parameter (Mamba's in_proj and
conv1d, `tensor_parallel.Packing`) is stored rank-major, so its DTensor's global layout is not the single-process
one. `checkpoint_state` presents each such tensor as a ShardedTensor of the single-process layout instead: this
rank's rows, cut into the runs they form in that layout, as views of the same storage. A save writes the
single-process layout; a load reads into the views, so the parameters and optimizer states change in place.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as LocalShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hybridtron.dist.mesh import Parallel


def _rows(tensor: DTensor) -> tuple[int, int]:
    """The rows [start, stop) of the (rank-major) global tensor this rank holds."""
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return offset[0], offset[0] + shape[0]


def packings(model: torch.nn.Module) -> dict:
    """Canonical parameter name -> Packing of every TP-packed parameter of `model`."""
    return getattr(model, "_tp_packings", {})


def checkpoint_state(state: dict, model: torch.nn.Module, parallel: Parallel | None) -> dict:
    """`state` ({"model": ..., "optimizer": ...} from get_state_dict) with every TP-packed tensor replaced by a
    ShardedTensor view in the single-process layout; the rest is shared, not copied."""
    packed = packings(model)
    if parallel is None or not packed:
        return state
    group = parallel.group("dp_shard_cp_tp")  # the ranks of one replica of one stage: each row held once
    me = dist.get_rank(group)
    runs = {name: packing.canonical_runs(*_rows(state["model"][name])) for name, packing in packed.items()}
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, runs, group=group)
    model_state = dict(state["model"])
    optimizer_state = {**state["optimizer"], "state": dict(state["optimizer"]["state"])}
    for name in packed:
        all_runs = [(rank, rank_runs[name]) for rank, rank_runs in enumerate(everyone)]
        model_state[name] = _sharded_view(model_state[name], runs[name], all_runs, me, group)
        per_param = dict(optimizer_state["state"].get(name, {}))
        for key, value in per_param.items():
            if isinstance(value, DTensor) and value.shape == model_state[name].shape:
                per_param[key] = _sharded_view(value, runs[name], all_runs, me, group)
        if name in optimizer_state["state"]:
            optimizer_state["state"][name] = per_param
    return {**state, "model": model_state, "optimizer": optimizer_state}


def _sharded_view(tensor: DTensor, my_runs, all_runs, me: int, group) -> ShardedTensor:
    local = tensor.to_local()
    rest = list(tensor.shape[1:])
    device = local.device

    def metadata(rank, canonical, length):
        return ShardMetadata(shard_offsets=[canonical] + [0] * len(rest), shard_sizes=[length] + rest,
                             placement=f"rank:{rank}/{device}")

    shards = [LocalShard(local.narrow(0, offset, length), metadata(me, canonical, length))
              for canonical, offset, length in my_runs]
    everything = [metadata(rank, canonical, length) for rank, runs in all_runs for canonical, _, length in runs]
    properties = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False,
                                  memory_format=torch.contiguous_format, pin_memory=False)
    global_metadata = ShardedTensorMetadata(shards_metadata=everything, size=tensor.shape,
                                            tensor_properties=properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(shards, global_metadata, process_group=group)


def canonical_full_state(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A full (gathered) state dict with the TP-packed tensors put back in the single-process layout."""
    packed = packings(model)
    return {name: packed[name].canonical(value) if name in packed else value for name, value in state.items()}
