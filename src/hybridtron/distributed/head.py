"""lm_head applied by a caller that never builds its [tokens, vocab] logits (the RL log-prob passes:
`ops.linear_logprobs` by blocks of rows; their MTP losses: `ops.linear_cross_entropy`), under every layout that
holds the head as a linear layer, whole or split.

`apply_head(head, op, hidden_BTD)` runs `op(hidden_BTD, weight_VD, vocab_group)` *as a call of the lm_head module*:
its forward is swapped, for that call only, for one that hands `op` the weight to multiply by, so whatever hooks the
layout put on the module run as they do for its own forward:
    one process      the weight as it is (`vocab_group` None)
    FSDP2            `fully_shard`'s pre-forward hook all-gathers the weight (what `op` gets is the unsharded
                     parameter) and registers, on the inputs, the post-backward that reduce-scatters the gradient
                     autograd leaves on it; its post-forward hook registers the pre-backward on the outputs. FSDP2
                     supports calling a wrapped head on its own outside the root's forward (a "chunked loss": the
                     root completes the head's skipped post-forward, `_force_complete_incomplete_states`), and
                     lm_head keeps its gathered weight to the backward (`reshard_after_forward=False`).
    TP               lm_head vocabulary-parallel (`tensor_parallel.py`: a DTensor Shard(0) on the TP mesh): `op`
                     gets the local rows [V / tp, D] and the TP group, and `hidden_BTD` gathered along the sequence
                     (`collectives.gather_shares`, whose backward sums the ranks' partial gradients and keeps this
                     rank's shard), in place of the TP forward that would gather the whole logits
    MainGradLinear   the weight through its `applied_weight` (the converted head of `train.grad_accum_dtype`: the
                     gradient accumulated in its `main_grad`, counted as one application)
    PP               the last stage's lm_head (`pipeline.StageView`: the stage hands the loss lm_head's inputs),
                     under FSDP or TP as above within the stage; its gradient from the loss's backward on that stage
`blockwise_head(model)` is the lm_head `apply_head` can run, or None: a quantized head (QuantLinear: its GEMMs are
the precision policy's emulation, which `op`'s plain GEMMs would not be), a biased one, and a pipeline stage
without lm_head. Those callers take the logits of the head's own forward instead.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hybridtron.distributed.collectives import gather_shares
from hybridtron.numerics.grad_accum import MainGradLinear

HeadOp = Callable[..., object]  # op(hidden_BTD, weight_VD, vocab_group) -> tensors


def blockwise_head(model) -> nn.Module | None:
    """`model.lm_head` where `apply_head` can run it (the module docstring), else None."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, MainGradLinear):
        return head if head.recipe is None and head.bias is None else None
    return head if isinstance(head, nn.Linear) and head.bias is None else None


def apply_head(head: nn.Module, op: HeadOp, hidden_BTD: torch.Tensor):
    """`op(hidden_BTD, weight_VD, vocab_group)` as a call of `head` (a `blockwise_head`; the module docstring):
    `weight_VD` the weight (or under TP this rank's rows of the vocabulary, of `vocab_group`) that `op` multiplies
    `hidden_BTD` [B, T, D] by (under TP gathered along T first)."""

    def forward(hidden):
        weight, group = head.weight, None
        if isinstance(head, MainGradLinear):
            weight = head.applied_weight()
        if isinstance(weight, DTensor):  # TP's vocabulary shards (under FSDP too: unsharded over dp by now)
            group = weight.device_mesh.get_group()
            hidden, weight = gather_shares(hidden, 1, group), weight.to_local()
        return op(hidden, weight, group)

    own = head.__dict__.get("forward")  # TP's `LocalShardParallel` sets its forward on the instance
    head.forward = forward
    try:
        return head(hidden_BTD)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
