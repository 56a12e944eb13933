"""A model built on the meta device, given its values after it is sharded: no rank ever holds the whole model.

Every rank builds `HybridLM` on the meta device (shapes only), `parallelize` cuts and shards it as usual, and
`materialize` then allocates each rank's shards on its device and fills them. The fills are `HybridLM.initializers`,
run in their order on one whole tensor at a time, on the CPU and from torch's global generator, exactly as one
process initializes its model from the same seed; each rank keeps its shard of the tensor (a TP-packed one
re-laid rank-major first) and drops the rest. So every layout starts from the single-process weights, bit for bit,
and a rank's peak memory is its shards plus about two of the largest single tensors (the whole one and its
redistributed part; `bench/materialize.py`), not the model. The cost is time: every rank draws every value (a
pipeline stage too, for the layers it does not hold), which is what keeps the generator in step.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from hybridtron.distributed.mesh import Parallel
from hybridtron.distributed.state import canonical_name, packings
from hybridtron.model.lm import HybridLM


def is_meta(model: nn.Module) -> bool:
    return any(tensor.is_meta for tensor in itertools.chain(model.parameters(), model.buffers()))


def local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full` (the whole tensor, on this rank's device) in the layout of `like`: for a DTensor its
    local shard (a replicated DTensor redistributed to `like`'s placements: each rank slices, nothing is sent), else
    `full` itself."""
    if not isinstance(like, DTensor):
        return full
    mesh = like.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements).to_local()


@torch.no_grad()
def materialize(model: nn.Module, parallel: Parallel) -> nn.Module:
    """Allocate `model`'s meta tensors on this rank's device and fill each with its
    part of the single-process initialization (module docstring). `model` is a meta-built HybridLM after
    `parallelize`: cut to this rank's pipeline stages, sharded, wrapped, or as built."""
    device = parallel.device
    model.to_empty(device=device)
    local = {canonical_name(name): tensor
             for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers())}
    reference = HybridLM.on_meta(model.config)  # the whole model's tensors: their names, shapes and dtypes
    shapes = {name: (tensor.shape, tensor.dtype)
              for name, tensor in itertools.chain(reference.named_parameters(), reference.named_buffers())}
    initializers = reference.initializers()
    missing = sorted(set(local) - {name for name, _ in initializers})
    if missing:
        raise ValueError(f"materialize: no initializer for {', '.join(missing)}: a module added to the model after "
                         f"it was built (HybridLM.initializers covers the model's own tensors); build it on a "
                         f"device instead of the meta device")
    packed = packings(model)
    for name, initialize in initializers:
        shape, dtype = shapes[name]
        full = torch.empty(shape, dtype=dtype)  # on the CPU: the global generator the single process draws from
        initialize(full, None)
        target = local.get(name)
        if target is None:  # another pipeline stage's: drawn all the same, to keep the generator in step
            continue
        if name in packed:
            full = packed[name].rank_major(full)
        target_local = target.to_local() if isinstance(target, DTensor) else target
        target_local.copy_(local_part(full.to(device=device, dtype=target.dtype), target))
    return model
