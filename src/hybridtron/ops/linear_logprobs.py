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

Without a weight (`weight_VD` None) the rows are logits already, [N, V], as a caller gets them where lm_head is not
its to apply (a sharded head; a pipeline's last stage): `fn` then runs by blocks of them, and of the [N, V] tensors
only the logits and their gradient exist, not `fn`'s intermediates.

`linear_logprobs_ref` is `fn` on the whole logits, `F.linear(hidden, weight)`: the path the RL passes took before
(the tests compare the two, forward and backward).

Shapes: N rows, D hidden width, V vocabulary, R rows of a block.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

RowFunction = Callable[..., tuple[torch.Tensor, ...]]  # fn(logits_RV, *row_inputs_R) -> per-row outputs [R, ...]


def _block_logits(hidden_RD: torch.Tensor, weight_VD: torch.Tensor | None) -> torch.Tensor:
    return hidden_RD if weight_VD is None else F.linear(hidden_RD, weight_VD)


class _LinearRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, fn, chunk, *row_inputs):
        device = hidden_ND.device.type
        ctx.fn, ctx.chunk = fn, chunk
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden_ND, weight_VD, *row_inputs)
        # no rows still runs `fn` once, on an empty block: its outputs then have their shapes and dtypes
        blocks = [fn(_block_logits(hidden_ND[start:start + chunk], weight_VD),
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
        for start in range(0, hidden_ND.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            hidden_RD = hidden_ND[rows]
            with torch.enable_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast):
                logits_RV = _block_logits(hidden_RD, weight_VD).detach().requires_grad_(True)
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
            grad_logits_RV = grad_logits_RV.to(weight_VD.dtype)
            if grad_hidden_ND is not None:
                grad_hidden_ND[rows] = grad_logits_RV @ weight_VD
            if grad_weight_VD is not None:
                grad_weight_VD.addmm_(grad_logits_RV.t().to(grad_weight_VD.dtype), hidden_RD.to(grad_weight_VD.dtype))
        if grad_weight_VD is not None:
            grad_weight_VD = grad_weight_VD.to(weight_VD.dtype)
        return grad_hidden_ND, grad_weight_VD, None, None, *(None for _ in row_inputs)


def linear_logprobs(hidden_ND: torch.Tensor, weight_VD: torch.Tensor | None, fn: RowFunction,
                    *row_inputs: torch.Tensor, chunk: int) -> tuple[torch.Tensor, ...]:
    """`fn(F.linear(hidden_ND, weight_VD), *row_inputs)` computed `chunk` rows at a time (see the module docstring):
    `fn` maps a block of logits [R, V] and the block's rows of each `row_inputs` tensor [R, ...] to a tuple of
    per-row outputs [R, ...], row by row (a row's outputs may not depend on other rows). Floating outputs are
    differentiable with respect to `hidden_ND` [N, D] and `weight_VD` [V, D]; integer ones (token ids) are not.
    `weight_VD` None: `hidden_ND` are the logits [N, V]."""
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
    return _LinearRows.apply(hidden_ND, weight_VD, fn, chunk, *row_inputs)


def linear_logprobs_ref(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, fn: RowFunction, *row_inputs: torch.Tensor,
                        chunk: int = 0) -> tuple[torch.Tensor, ...]:
    """`fn` on the whole logits (`chunk` ignored: the same signature as `linear_logprobs`)."""
    return tuple(fn(_block_logits(hidden_ND, weight_VD), *row_inputs))
