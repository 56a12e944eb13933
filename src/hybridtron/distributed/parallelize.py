"""`parallelize(model, parallel, ...)`: apply a layout to a built HybridLM, in torchtitan's order.

    0. pipeline parallelism (PP > 1): the model cut to this rank's stages (`pipeline.py`), then each stage:
    1. context parallelism (CP > 1): attention and the Mamba-2 mixers swapped for their forms that exchange keys,
       values and scan states over the cp group, `context_parallel.py` (the batch source hands each rank its share
       of the positions). Before TP, which runs whatever forward the mixer has on its local heads: under CP x TP
       each rank exchanges its own heads' keys, values and states with the cp ranks of its TP coordinate.
    2. tensor parallelism (TP > 1) with sequence parallelism: DTensor module plans, `tensor_parallel.py`
    3. expert parallelism (EP > 1, ETP > 1, or a capacity factor): the routed experts swapped for their EP share
       (under ETP each expert's hidden width split over the TP group too), `expert_parallel.py`
    4. activation checkpointing per block: `full` (keep each block's input, recompute the rest) or `selective`
       (keep the GEMM, attention, scan and collective outputs; recompute norms and activation functions)
    5. torch.compile per block (`train.compile`): each block's forward compiled in place, so parameter names stay
    6. FSDP2 `fully_shard` per block (the MTP block as one), then the embedding, norm_f, lm_head and the root (each
       pipeline stage's view under PP), each with a `MixedPrecisionPolicy`; lm_head's gradient is reduced in fp32
       unless `grad_accum_dtype` is bf16; with `dist.offload_optimizer` each with FSDP2's `CPUOffloadPolicy` too
    7. a model built on the meta device (`HybridLM.on_meta`, as `pretrain` builds it under torchrun): each rank's
       shards allocated on its device and filled with the single-process initialization, `materialize.py`

Which mesh each weight is FSDP-sharded over (`Parallel.fsdp_mesh`): the dense weights over dp_shard x cp (every
TP rank shards its own TP slice); under TP the weights applied token by token to sequence-parallel activations
(the block norms, norm_f, the MoE router and latent projections, the MTP block's norms and eh_proj) over
dp_shard x cp x tp, since each TP rank saw other tokens and their gradients must be summed over the TP ranks too;
the routed experts over efsdp (experts on the ep dimension). Every gradient reduction is a sum (the objectives
normalize by the global token count), so a layout computes the single-process gradient of the same global batch.

Optimizer offload (`dist.offload_optimizer`, torchtitan's `training.enable_cpu_offload`): FSDP2's
`CPUOffloadPolicy` on every group keeps each rank's sharded fp32 parameters (the master weights) in host memory,
pinned on a CUDA device; each all-gather first copies the shard to the device, each reduce-scatter's output
(the sharded gradient) is copied back to the host, so the optimizer, whose state is created like its parameters,
steps on the CPU with its state there. The gathered weights, the activations and the unsharded gradients stay on
the device. A meta-built model is materialized with its parameters on the host and its buffers on the device
(torchtitan's init_device "cpu", buffer_device the accelerator), never whole on the device first. On a CPU
device the policy changes nothing in memory (everything is in host memory already), but the code path is the
GPU's, which is how the tests run it.

Low-precision emulation composes, quantizing after every communication (FSDP gathers, TP gathers and all-to-alls
move high-precision tensors): under FSDP each rank quantizes the whole gathered weight as one process does, and an
activation's tensor scale comes from this rank's rows; under EP each local expert quantizes the rows it received;
under TP each rank quantizes its own weight shard, with the shard's amax.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from hybridtron.config import MOE
from hybridtron.distributed.context_parallel import apply_context_parallel
from hybridtron.distributed.expert_parallel import ExpertParallelExperts, apply_expert_parallel
from hybridtron.distributed.materialize import is_meta, materialize
from hybridtron.distributed.mesh import Parallel
from hybridtron.distributed.pipeline import Pipeline, StageView, cut_for_rank
from hybridtron.distributed.tensor_parallel import apply_tensor_parallel

RECOMPUTE_MODES = ("none", "selective", "full")

# Selective recompute keeps what is expensive to redo (GEMMs, attention, the chunked scan's matmuls, every
# collective) and recomputes the element-wise rest; the planner's "selective" (costs.py) assumes the same.
_SAVED_OPS = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._grouped_mm.default, torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.all_to_all_single.default, torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default, torch.ops._c10d_functional.all_reduce.default,
}


# FSDP's hooks on modules nested in a block (the routed experts under EP, the token-wise weights under TP) open
# profiler ranges a different number of times when the block is recomputed in the backward; those ops carry no data,
# so selective checkpointing may skip them as it skips the detaches it inserts itself.
torch.utils.checkpoint.SAC_IGNORED_OPS |= {torch.ops.profiler._record_function_enter_new.default,
                                          torch.ops.profiler._record_function_exit.default,
                                          torch.ops.profiler._record_function_exit._RecordFunction}


# FSDP2 warns whenever a module it wraps returns a view, since an in-place op on that view would drop its
# pre-backward hook (pytorch/pytorch#181832). Ours are views by construction and never modified in place: TP's
# outputs of the embedding and lm_head (`DTensor.to_local`, which the root returns with the logits) and the
# embeddings a pipeline stage passes on (`pipeline.StageView`: a stage's outputs must not be its inputs). The model
# computes out of place, and a skipped all-gather would break the equality of every layout's losses and gradients
# with one process's (tests/distributed/test_parallel_layouts.py). Avoiding the views would copy the logits. Upstream
# replaces the warning by one at an actual mutation (pytorch/pytorch#197154); until then it is silenced for these
# modules only.
warnings.filterwarnings(
    "ignore", category=UserWarning, module=r"torch\.distributed\.fsdp\._fully_shard\._fsdp_state",
    message=r"FSDP2-wrapped module \((FSDPEmbedding|FSDP\w*Linear|FSDPHybridLM|FSDPStageView)\) returned a view")


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _wrap(block: nn.Module, recompute: str) -> nn.Module:
    if recompute == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    if recompute == "selective":
        return checkpoint_wrapper(block, preserve_rng_state=False,
                                  context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                               _selective_policy))
    return block


def parallelize(model: nn.Module, parallel: Parallel, *, recompute: str = "none", compile: bool = False,
                output_reduce_dtype: torch.dtype = torch.float32, seq_len: int = 4096,
                compile_backend: str = "inductor") -> nn.Module:
    """Apply PP, TP, EP, CP, activation checkpointing, compile and FSDP (module docstring) to `model` in place, and
    materialize it if it was built on the meta device; returns it (under PP: this rank's stage model, and
    `parallel.pipeline` runs it). In a single process (`Parallel.single_process`) only checkpointing and compile
    apply. `seq_len` weighs attention in the pipeline cut;
    `compile_backend` is torch.compile's (tests trace with "aot_eager", which skips code generation)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}")
    layout = parallel.layout
    views = None
    if layout.pp > 1:
        stage_indices, cuts, num_stages = cut_for_rank(model, parallel, seq_len)
    if layout.cp > 1:  # before TP, which wraps the forward of the class it finds
        apply_context_parallel(model, parallel.group("cp"), parallel.config.cp_attention)
    if layout.tp > 1:
        apply_tensor_parallel(model, parallel)
    # expert parallelism's token exchange (and its capacity limit) runs over a process group
    if parallel.distributed and (layout.ep > 1 or layout.etp > 1 or parallel.config.ep_capacity_factor > 0):
        apply_expert_parallel(model, parallel.meshes["ep_etp"], parallel.config.ep_capacity_factor)
    if compile:
        # every block runs one code object (Block.forward, or the checkpoint wrapper's), and dynamo keeps one graph
        # per (mixer class, input types, shapes) with it: the layer kinds, the MTP block's arguments and a layout's
        # wrapped mixers and DTensor inputs come near its default limit of 8, past which the remaining blocks would
        # run eagerly without a word
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for parent, key in _all_blocks(model):
        block = _wrap(_get(parent, key), recompute)
        if compile:
            block.compile(backend=compile_backend)
        _set(parent, key, block)
    if layout.pp > 1:
        views = [StageView(model, cuts[i], first=i == 0, last=i == num_stages - 1) for i in stage_indices]
    if parallel.distributed:  # FSDP shards over a process group; one without any keeps its weights whole
        apply_fsdp(model, parallel, output_reduce_dtype, roots=views)
    if views is not None:
        parallel.pipeline = Pipeline(model, views, stage_indices, num_stages, parallel, parallel.config.pp_schedule)
    if is_meta(model):
        if parallel.config.offload_optimizer:
            materialize_offloaded(model, parallel)
        else:
            materialize(model, parallel)
    return model


def offload_policy(parallel: Parallel) -> OffloadPolicy:
    """FSDP2's offload policy for the layout: CPU offload with `dist.offload_optimizer` (pinned host memory on a
    CUDA device, for asynchronous copies; torch refuses to pin without an accelerator), else none."""
    if not parallel.config.offload_optimizer:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=parallel.device.type == "cuda")


def materialize_offloaded(model: nn.Module, parallel: Parallel) -> None:
    """`materialize` with the parameters (FSDP's shards, which CPU offload keeps on the host and checks there at
    its first forward) allocated and filled on the CPU and the buffers moved to this rank's device, where the
    forward reads them."""
    materialize(model, dataclasses.replace(parallel, device=torch.device("cpu")))
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            module._buffers[name] = buffer.to(parallel.device)  # as nn.Module.to does, buffers only


def _all_blocks(model: nn.Module) -> list[tuple[nn.Module, int | str]]:
    """(parent, key) of every unit that is checkpointed, compiled and sharded as one: each backbone layer, and the
    MTP block as a whole (its layers are never called as modules: the block's forward reaches into them, once per
    depth)."""
    found = []
    layers = getattr(model.backbone, "layers", None) if getattr(model, "backbone", None) is not None else None
    if layers is not None:  # a pipeline stage's placeholders for other stages' layers are skipped
        found += [(layers, i) for i in range(len(layers)) if getattr(layers[i], "kind", None) is not None]
    if getattr(model, "mtp", None) is not None:
        found.append((model, "mtp"))
    return found


def _get(parent: nn.Module, key: int | str) -> nn.Module:
    return parent[key] if isinstance(key, int) else getattr(parent, key)


def _set(parent: nn.Module, key: int | str, module: nn.Module) -> None:
    if isinstance(key, int):
        parent[key] = module
    else:
        setattr(parent, key, module)


def _unwrapped(module: nn.Module) -> nn.Module:
    return getattr(module, "_checkpoint_wrapped_module", module)


def _layers_of(unit: nn.Module) -> list[nn.Module]:
    """The layers (Block or MTPLayer) of a unit: the block itself, or the MTP block's layers."""
    inner = _unwrapped(unit)
    return list(inner.layers) if hasattr(inner, "layers") else [inner]


def _token_modules(unit: nn.Module) -> list[nn.Module]:
    """A unit's modules that act token by token on sequence-parallel activations under TP (see the docstring)."""
    found = []
    for layer in _layers_of(unit):
        found.append(layer.norm)
        for name in ("enorm", "hnorm", "eh_proj", "final_layernorm"):  # the MTP layers' own
            if getattr(layer, name, None) is not None:
                found.append(getattr(layer, name))
        if layer.kind == MOE:
            found.append(layer.mixer.gate)
            if layer.mixer.latent:
                found += [layer.mixer.fc1_latent_proj, layer.mixer.fc2_latent_proj]
            found += [norm for norm in (layer.mixer.latent_norm, layer.mixer.output_norm) if norm is not None]
    return found


def apply_fsdp(model: nn.Module, parallel: Parallel, output_reduce_dtype: torch.dtype = torch.float32,
               roots: list[nn.Module] | None = None) -> None:
    """fully_shard per block (innermost groups first: token-wise weights under TP, the routed experts on their own
    mesh), then the embedding, norm_f, lm_head and the root (under PP: each stage's view is a root). Gradients are
    summed, never averaged."""
    layout = parallel.layout
    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    dense, tokens, experts = (parallel.fsdp_mesh(region) for region in ("dense", "tokens", "experts"))
    offload = offload_policy(parallel)
    units = _all_blocks(model)
    for position, (parent, key) in enumerate(units):
        unit = _get(parent, key)
        if layout.tp > 1:
            for module in _token_modules(unit):
                fully_shard(module, mesh=tokens, mp_policy=policy, offload_policy=offload)
        for layer in _layers_of(unit):
            if layer.kind == MOE and (layout.tp > 1 or isinstance(layer.mixer.experts, ExpertParallelExperts)):
                fully_shard(layer.mixer.experts, mesh=experts, mp_policy=policy, offload_policy=offload)
        # the last unit's weights are needed again at once by the backward (and the MTP block's by each depth)
        fully_shard(unit, mesh=dense, mp_policy=policy, offload_policy=offload,
                    reshard_after_forward=position < len(units) - 1)
    backbone = getattr(model, "backbone", None)
    if backbone is not None and getattr(backbone, "embeddings", None) is not None:
        fully_shard(backbone.embeddings, mesh=dense, mp_policy=policy, offload_policy=offload)
    if backbone is not None and getattr(backbone, "norm_f", None) is not None:
        fully_shard(backbone.norm_f, mesh=tokens if layout.tp > 1 else dense, mp_policy=policy,
                    offload_policy=offload)
    if getattr(model, "lm_head", None) is not None:
        fully_shard(model.lm_head, mesh=dense, reshard_after_forward=False, offload_policy=offload,
                    mp_policy=MixedPrecisionPolicy(param_dtype=None, reduce_dtype=output_reduce_dtype))
    for root in roots or [model]:
        fully_shard(root, mesh=dense, mp_policy=policy, offload_policy=offload)
    for module in [m for root in roots or [model] for m in root.modules()] + list(model.modules()):
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum


def set_output_reduce_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Switch lm_head's FSDP gradient reduction to `dtype` (the monitor's rollback turns bf16 back to fp32).
    FSDP2 has no public setter: this replaces the group's policy and re-derives its dtypes (`_init_mp_dtypes`),
    which FSDP itself does at its lazy initialization. A pipeline stage without lm_head has nothing to switch."""
    head = getattr(model, "lm_head", None)
    if head is None:
        return
    if not isinstance(head, FSDPModule):
        raise ValueError("set_output_reduce_dtype: lm_head is not FSDP-sharded")
    group = head._get_fsdp_state()._fsdp_param_group
    if group is not None:
        group.mp_policy = MixedPrecisionPolicy(param_dtype=group.mp_policy.param_dtype, reduce_dtype=dtype)
        group._init_mp_dtypes()
