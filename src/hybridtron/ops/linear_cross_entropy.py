"""Mean cross entropy of a linear layer's outputs (the lm head's logits), without the [tokens, vocab] logits.

At a 32k-131k vocabulary the logits are a step's largest tensor (2,048 tokens x 32,000 in fp32: 262 MB), and
lm_head + `cross_entropy` passes over them five times: the GEMM writes them, the forward reads them for the
logsumexp, the backward reads them again and writes their gradient, which the two backward GEMMs read.
`linear_cross_entropy(hidden, weight, targets)` instead takes a block of rows at a time whose logits fit in
cache, and computes for it at once the loss and the gradients of the mean loss (the block's softmax - onehot,
times `weight` for hidden, and transposed times the block's hidden, accumulated, for `weight`), as Liger
Kernel's fused linear cross entropy does. The backward only scales the stored gradients by the incoming one.
The GEMM FLOPs are those of lm_head + cross entropy; the memory is a block's logits plus the two gradients.

Departure from a two-pass loss: the gradients are computed in the forward, so the forward of a loss that is
never backpropagated does the backward GEMMs too (evaluation goes through the logits instead), and a
second-order gradient is not available.

`compiled=True` runs the per-block softmax and its gradient as one compiled graph (`train.compile`).
`linear_cross_entropy_ref` is lm_head + `F.cross_entropy` in fp32 (the tests compare the two).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hybridtron.ops.cross_entropy import IGNORE_INDEX

BLOCK_ELEMENTS = 1 << 23  # 32 MiB of fp32 logits per block of rows: measured best on a Zen 4 core (docs/LOG.md)


def block_loss_and_grad(hidden_RD: torch.Tensor, weight_VD: torch.Tensor, targets_R: torch.Tensor,
                        scale_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over the block's rows of scale x CE, d(that sum)/d logits) for one block, in `scale_R`'s dtype (fp32 or
    wider); `targets_R` are valid ids (ignored rows have scale 0)."""
    logits_RV = (hidden_RD @ weight_VD.t()).to(scale_R.dtype)
    rows_R = torch.arange(len(targets_R), device=targets_R.device)
    target_logit_R = logits_RV[rows_R, targets_R]
    max_R = logits_RV.amax(dim=-1)
    # four passes over the block, in place (each a separate loop in eager; compiled, inductor fuses them)
    exp_RV = logits_RV.sub_(max_R[:, None]).exp_()
    sum_R = exp_RV.sum(dim=-1)
    logsumexp_R = max_R + sum_R.log()
    grad_RV = exp_RV.mul_((scale_R / sum_R)[:, None])
    grad_RV[rows_R, targets_R] -= scale_R
    return ((logsumexp_R - target_logit_R) * scale_R).sum(), grad_RV


@functools.cache
def compiled_block_loss_and_grad():
    return torch.compile(block_loss_and_grad, dynamic=False)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, ignore_index, compiled):
        block = compiled_block_loss_and_grad() if compiled else block_loss_and_grad
        rows = max(1, BLOCK_ELEMENTS // max(1, weight_VD.shape[0]))
        reduce_dtype = torch.promote_types(hidden_ND.dtype, torch.float32)
        valid_N = targets_N != ignore_index
        # 1 / count on every valid row: no valid row gives 0 / 0 = NaN, as F.cross_entropy's mean does
        scale_N = (valid_N / valid_N.sum()).to(reduce_dtype)
        safe_targets_N = targets_N.masked_fill(~valid_N, 0)
        grad_hidden_ND = torch.empty_like(hidden_ND)
        grad_weight_VD = torch.zeros_like(weight_VD, dtype=reduce_dtype)
        loss = hidden_ND.new_zeros((), dtype=reduce_dtype)
        for start in range(0, hidden_ND.shape[0], rows):
            hidden_RD = hidden_ND[start:start + rows]
            block_loss, grad_RV = block(hidden_RD, weight_VD, safe_targets_N[start:start + rows],
                                        scale_N[start:start + rows])
            loss += block_loss
            grad_hidden_ND[start:start + rows] = grad_RV.to(weight_VD.dtype) @ weight_VD
            grad_weight_VD.addmm_(grad_RV.t(), hidden_RD.to(reduce_dtype))
        ctx.save_for_backward(grad_hidden_ND, grad_weight_VD.to(weight_VD.dtype))
        return loss.float()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden_ND, grad_weight_VD = ctx.saved_tensors
        return grad_hidden_ND * grad_loss.to(grad_hidden_ND.dtype), grad_weight_VD * grad_loss.to(
            grad_weight_VD.dtype), None, None, None


def linear_cross_entropy(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX, *, compiled: bool = False) -> torch.Tensor:
    """Mean over the targets that are not `ignore_index` of -log softmax(hidden @ weight.T)[target] (NaN if
    there are none); the logits are never materialized whole. `hidden_ND` [N, D], `weight_VD` [V, D]."""
    if hidden_ND.shape[:1] != targets_N.shape or hidden_ND.shape[1:] != weight_VD.shape[1:]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden_ND.shape)}, weight {tuple(weight_VD.shape)} "
                         f"and targets {tuple(targets_N.shape)} do not match ([N, D], [V, D], [N])")
    return _LinearCrossEntropy.apply(hidden_ND, weight_VD, targets_N, ignore_index, compiled)


def linear_cross_entropy_ref(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor,
                             ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    return F.cross_entropy((hidden_ND @ weight_VD.t()).float(), targets_N, ignore_index=ignore_index)
