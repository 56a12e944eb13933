"""The checkpoint state of a parallelized model: DCP-ready, in the single-process layout, at any world size.

`get_state_dict` gives every parameter and optimizer state as a DTensor under its single-process name, so DCP
reshards it to whatever layout loads it. One exception needs care: a TP-packed parameter (Mamba's in_proj and
conv1d, `tensor_parallel.Packing`) is stored rank-major, so its DTensor's global layout is not the single-process
one. `checkpoint_state` presents each such tensor in the single-process layout instead: a DTensor whose local
tensor is DCP's `LocalShardsWrapper`, this rank's rows cut into the runs they form in that layout, each at its
offset there, as views of the same storage (DCP's successor to ShardedTensor for a rank that holds several pieces
of a tensor). A save writes the single-process layout; a load reads into the views, so the parameters and
optimizer states change in place.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (activation checkpointing, compile): the name a single
    process gives it, which checkpoints, metrics and the monitor use."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _rows(tensor: DTensor) -> tuple[int, int]:
    """The rows [start, stop) of the (rank-major) global tensor this rank holds."""
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return offset[0], offset[0] + shape[0]


def packings(model: torch.nn.Module) -> dict:
    """Canonical parameter name -> Packing of every TP-packed parameter of `model`."""
    return getattr(model, "_tp_packings", {})


def checkpoint_state(state: dict, model: torch.nn.Module) -> dict:
    """`state` ({"model": ..., "optimizer": ...} from get_state_dict) with every TP-packed tensor replaced by a
    view in the single-process layout; the rest is shared, not copied."""
    packed = packings(model)
    if not packed:  # only TP packs tensors
        return state
    model_state = dict(state["model"])
    optimizer_state = {**state["optimizer"], "state": dict(state["optimizer"]["state"])}
    for name, packing in packed.items():
        parameter = model_state[name]
        runs = packing.canonical_runs(*_rows(parameter))
        model_state[name] = _canonical_view(parameter, runs)
        if name in optimizer_state["state"]:  # Adam's moments share the parameter's layout; its step does not
            optimizer_state["state"][name] = {
                key: _canonical_view(value, runs) if isinstance(value, DTensor) and value.shape == parameter.shape
                else value for key, value in optimizer_state["state"][name].items()}
    return {**state, "model": model_state, "optimizer": optimizer_state}


def _canonical_view(tensor: DTensor, runs: list[tuple[int, int, int]]) -> DTensor:
    """`tensor` (rank-major) as this rank's `runs` (canonical row, local row, length) of the single-process layout.
    Built directly, not by `DTensor.from_local`, which would view the wrapper as a whole (unsupported for several
    pieces of a 3-D tensor, conv1d's weight); DCP reads only the pieces and the global shape."""
    local = tensor.to_local()
    rest = [0] * (tensor.dim() - 1)
    pieces = LocalShardsWrapper([local.narrow(0, offset, length) for _, offset, length in runs],
                                [torch.Size([canonical, *rest]) for canonical, _, _ in runs])
    spec = DTensorSpec(tensor.device_mesh, tensor.placements,
                       tensor_meta=TensorMeta(tensor.shape, tensor.stride(), tensor.dtype))
    return DTensor(pieces, spec, requires_grad=False)


def canonical_full_state(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A full (gathered) state dict with the TP-packed tensors put back in the single-process layout."""
    packed = packings(model)
    return {name: packed[name].canonical(value) if name in packed else value for name, value in state.items()}
