"""Per-row functions of a linear layer's outputs (the lm head's log-probs of chosen tokens), a block of rows at a
time, without the [tokens, vocab] logits.

The RL passes need, per token, a few numbers of the next-token distribution: the sampled token's log-prob (under
the rollout's temperature and top-k / top-p filter), the distribution's entropy, the log-probs of a teacher's
top-K tokens, or a teacher's own top K. Through the logits that is several [tokens, vocab] fp32 tensors (the
logits, their scaled and filtered copies, the log-softmax kept for the backward): at Ultra's vocabulary of 131,072
a 64K-token rollout is 32 GiB per tensor. `linear_logprobs(hidden, weight, fn, *row_inputs, chunk=...)` applies
lm_head (`F.linear`, as `nn.Linear` does) to `chunk` rows at a time and `fn` to each block's logits, keeping only
`fn`'s per-row outputs (miles' `--log-probs-chunk-size`, 128 rows by default). The backward recomputes each block's
logits and differentiates `fn` on them with autograd (the very ops the whole-logits path runs, row for row), then
does lm_head's two backward GEMMs for the block, accumulating the weight's gradient. Memory: one block's logits
and `fn`'s intermediates; the inputs, outputs and the weight's gradient as before. FLOPs: one more lm_head GEMM
(the recomputation) than through the logits. Numerics: a row's outputs and its hidden state's gradient are those of
the whole-logits path to the bit wherever BLAS rounds a block's GEMM as it rounds the whole one (measured on an
AVX-512 Xeon with torch's CPU BLAS: every block of three rows or more; a block of one or two rows takes another
kernel, off in the last bits); the weight's gradient sums the rows block by block, in another order.

Departure from `linear_cross_entropy` (pretraining's fused loss, which computes its gradients in the forward):
the outputs here are per-row tensors whose incoming gradients (a policy loss weights each token by its advantage,
ratio and clip) exist only in the backward, hence the recomputation. Autocast is restored around it, so the
recomputed logits are the forward's. A second-order gradient is not available.

Vocabulary-parallel (`vocab_group`, tensor parallelism's lm_head): `weight_VD` is this rank's equal share of the
vocabulary's rows, in rank order over the group, and every rank of the group holds the same rows of `hidden_ND`.
A block's local logits [R, V / tp] are all-gathered along the vocabulary to [R, V] (one block's, never [N, V]) and
`fn` runs on them whole, on every rank alike, so its outputs are replicated. The backward recomputes the block the
same way, differentiates `fn` on it, and keeps this rank's columns of the logits' gradient: the weight's gradient
is this rank's share, the hidden states' one this rank's part of a sum over the group, which the caller completes
(under TP, the backward of the sequence all-gather that made `hidden_ND` whole sums it). Against the alternative
that keeps the logits split (a vocabulary-parallel log-softmax: all-reduces of the row maxima and sums, Megatron's
cross entropy), this one costs one all-gather of [R, V] per block, forward and recompute, but takes any `fn`
unchanged (top-k / top-p filters, top K, entropy), which the split softmax would have to rewrite collective by
collective; its memory is one block of whole logits as in one process.

Without a weight (`weight_VD` None) the rows are logits already, [N, V], as a caller gets them where lm_head is not
its to apply (a pipeline's last stage; a quantized head, whose GEMMs the precision policy emulates): `fn` then runs
by blocks of them, and of the [N, V] tensors only the logits and their gradient exist, not `fn`'s intermediates.

`linear_logprobs_ref` is `fn` on the whole logits, `F.linear(hidden, weight)`: the path the RL passes took before
(the tests compare the two, forward and backward).

Shapes: N rows, D hidden width, V vocabulary, R rows of a block.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

RowFunction = Callable[..., tuple[torch.Tensor, ...]]  # fn(logits_RV, *row_inputs_R) -> per-row outputs [R, ...]


def _block_logits(hidden_RD: torch.Tensor, weight_VD: torch.Tensor | None, group=None) -> torch.Tensor:
    if weight_VD is None:
        return hidden_RD
    logits_RV = F.linear(hidden_RD, weight_VD)
    if group is None:
        return logits_RV
    parts = [torch.empty_like(logits_RV) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits_RV, group=group)
    return torch.cat(parts, dim=-1)


class _LinearRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, fn, chunk, group, *row_inputs):
        device = hidden_ND.device.type
        ctx.fn, ctx.chunk, ctx.group = fn, chunk, group
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden_ND, weight_VD, *row_inputs)
        # no rows still runs `fn` once, on an empty block: its outputs then have their shapes and dtypes
        blocks = [fn(_block_logits(hidden_ND[start:start + chunk], weight_VD, group),
                     *(x[start:start + chunk] for x in row_inputs))
                  for start in range(0, max(1, hidden_ND.shape[0]), chunk)]
        outputs = tuple(torch.cat(parts) for parts in zip(*blocks))
        ctx.mark_non_differentiable(*(out for out in outputs if not out.is_floating_point()))
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        hidden_ND, weight_VD, *row_inputs = ctx.saved_tensors
        device, autocast, autocast_dtype = ctx.autocast
        grad_hidden_ND = torch.zeros_like(hidden_ND) if ctx.needs_input_grad[0] else None
        grad_weight_VD = torch.zeros_like(weight_VD, dtype=torch.promote_types(weight_VD.dtype, torch.float32)) \
            if ctx.needs_input_grad[1] else None
        head = weight_VD is not None
        # under a vocabulary group, this rank's columns of the gathered logits (equal shares, in rank order)
        columns = None if ctx.group is None else \
            slice(dist.get_rank(ctx.group) * weight_VD.shape[0], (dist.get_rank(ctx.group) + 1) * weight_VD.shape[0])
        for start in range(0, hidden_ND.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            hidden_RD = hidden_ND[rows]
            with torch.enable_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast):
                logits_RV = _block_logits(hidden_RD, weight_VD, ctx.group).detach().requires_grad_(True)
                outputs = ctx.fn(logits_RV, *(x[rows] for x in row_inputs))
                pairs = [(out, grad[rows]) for out, grad in zip(outputs, grads)
                         if grad is not None and out.requires_grad]
                if not pairs:
                    continue
                grad_logits_RV, = torch.autograd.grad([out for out, _ in pairs], logits_RV,
                                                      [grad for _, grad in pairs], allow_unused=True)
            if grad_logits_RV is None:
                continue
            if not head:
                grad_hidden_ND[rows] = grad_logits_RV
                continue
            if columns is not None:
                grad_logits_RV = grad_logits_RV[:, columns]
            grad_logits_RV = grad_logits_RV.to(weight_VD.dtype)
            if grad_hidden_ND is not None:
                grad_hidden_ND[rows] = grad_logits_RV @ weight_VD
            if grad_weight_VD is not None:
                grad_weight_VD.addmm_(grad_logits_RV.t().to(grad_weight_VD.dtype), hidden_RD.to(grad_weight_VD.dtype))
        if grad_weight_VD is not None:
            grad_weight_VD = grad_weight_VD.to(weight_VD.dtype)
        return grad_hidden_ND, grad_weight_VD, None, None, None, *(None for _ in row_inputs)


def linear_logprobs(hidden_ND: torch.Tensor, weight_VD: torch.Tensor | None, fn: RowFunction,
                    *row_inputs: torch.Tensor, chunk: int, vocab_group=None) -> tuple[torch.Tensor, ...]:
    """`fn(F.linear(hidden_ND, weight_VD), *row_inputs)` computed `chunk` rows at a time (see the module docstring):
    `fn` maps a block of logits [R, V] and the block's rows of each `row_inputs` tensor [R, ...] to a tuple of
    per-row outputs [R, ...], row by row (a row's outputs may not depend on other rows). Floating outputs are
    differentiable with respect to `hidden_ND` [N, D] and `weight_VD` [V, D]; integer ones (token ids) are not.
    `weight_VD` None: `hidden_ND` are the logits [N, V]. `vocab_group` (a process group): `weight_VD` is this rank's
    share of the vocabulary over it (the module docstring's vocabulary-parallel form)."""
    weight_shape = None if weight_VD is None else tuple(weight_VD.shape)
    if hidden_ND.ndim != 2 or weight_shape is not None and (len(weight_shape) != 2
                                                            or hidden_ND.shape[1] != weight_shape[1]):
        raise ValueError(f"linear_logprobs: hidden {tuple(hidden_ND.shape)} and weight {weight_shape} do not match "
                         f"([N, D], [V, D]; or logits [N, V] and no weight)")
    if any(x.shape[:1] != hidden_ND.shape[:1] for x in row_inputs):
        raise ValueError(f"linear_logprobs: row inputs {[tuple(x.shape) for x in row_inputs]} do not all have "
                         f"hidden's {hidden_ND.shape[0]} rows")
    if chunk < 1:
        raise ValueError(f"linear_logprobs: chunk must be >= 1 rows, got {chunk}")
    if vocab_group is not None and weight_VD is None:
        raise ValueError("linear_logprobs: a vocab_group splits lm_head's weight, and no weight was given")
    return _LinearRows.apply(hidden_ND, weight_VD, fn, chunk, vocab_group, *row_inputs)


def linear_logprobs_ref(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, fn: RowFunction, *row_inputs: torch.Tensor,
                        chunk: int = 0) -> tuple[torch.Tensor, ...]:
    """`fn` on the whole logits (`chunk` ignored: the same signature as `linear_logprobs`)."""
    return tuple(fn(_block_logits(hidden_ND, weight_VD), *row_inputs))
