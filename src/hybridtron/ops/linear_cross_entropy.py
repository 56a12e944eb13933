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

One block's logits buffer serves every block (the GEMM writes into it, the softmax and its gradient overwrite it
in place): a fresh 32 MiB block each time is paged in afresh by the kernel once glibc has returned the last one,
which cost bench22m's step ~50 ms of page faults (docs/LOG.md, session 12). The per-block softmax is not compiled
under `train.compile`: inductor's version of the in-place passes was no faster than eager's in the whole step, and
slower on its own (an input it overwrites is copied).
`linear_cross_entropy_ref` is lm_head + `F.cross_entropy` in fp32 (the tests compare the two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridtron.ops.cross_entropy import IGNORE_INDEX

BLOCK_ELEMENTS = 1 << 23  # 32 MiB of fp32 logits per block of rows: measured best on a Zen 4 core (docs/LOG.md)


def block_loss_and_grad_(logits_RV: torch.Tensor, targets_R: torch.Tensor, scale_R: torch.Tensor) -> torch.Tensor:
    """The sum over the block's rows of scale x CE; `logits_RV` (in `scale_R`'s dtype, fp32 or wider) is
    overwritten with d(that sum)/d logits. `targets_R` are valid ids (ignored rows have scale 0)."""
    rows_R = torch.arange(len(targets_R), device=targets_R.device)
    target_logit_R = logits_RV[rows_R, targets_R]
    max_R = logits_RV.amax(dim=-1)
    # four passes over the block, in place
    exp_RV = logits_RV.sub_(max_R[:, None]).exp_()
    sum_R = exp_RV.sum(dim=-1)
    logsumexp_R = max_R + sum_R.log()
    grad_RV = exp_RV.mul_((scale_R / sum_R)[:, None])
    grad_RV[rows_R, targets_R] -= scale_R
    return ((logsumexp_R - target_logit_R) * scale_R).sum()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_N, ignore_index):
        rows = max(1, BLOCK_ELEMENTS // max(1, weight_VD.shape[0]))
        reduce_dtype = torch.promote_types(hidden_ND.dtype, torch.float32)
        valid_N = targets_N != ignore_index
        # 1 / count on every valid row: no valid row gives 0 / 0 = NaN, as F.cross_entropy's mean does
        scale_N = (valid_N / valid_N.sum()).to(reduce_dtype)
        safe_targets_N = targets_N.masked_fill(~valid_N, 0)
        grad_hidden_ND = torch.empty_like(hidden_ND)
        grad_weight_VD = torch.zeros_like(weight_VD, dtype=reduce_dtype)
        logits_buffer = hidden_ND.new_empty(min(rows, hidden_ND.shape[0]), weight_VD.shape[0], dtype=reduce_dtype)
        loss = hidden_ND.new_zeros((), dtype=reduce_dtype)
        for start in range(0, hidden_ND.shape[0], rows):
            hidden_RD = hidden_ND[start:start + rows]
            logits_RV = logits_buffer[:len(hidden_RD)]
            if hidden_RD.dtype == reduce_dtype and weight_VD.dtype == reduce_dtype:
                torch.mm(hidden_RD, weight_VD.t(), out=logits_RV)
            else:
                logits_RV.copy_(hidden_RD @ weight_VD.t())
            loss += block_loss_and_grad_(logits_RV, safe_targets_N[start:start + rows], scale_N[start:start + rows])
            grad_hidden_ND[start:start + rows] = logits_RV.to(weight_VD.dtype) @ weight_VD
            grad_weight_VD.addmm_(logits_RV.t(), hidden_RD.to(reduce_dtype))
        ctx.save_for_backward(grad_hidden_ND, grad_weight_VD.to(weight_VD.dtype))
        return loss.float()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden_ND, grad_weight_VD = ctx.saved_tensors
        return grad_hidden_ND * grad_loss.to(grad_hidden_ND.dtype), grad_weight_VD * grad_loss.to(
            grad_weight_VD.dtype), None, None


def linear_cross_entropy(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor,
                         ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean over the targets that are not `ignore_index` of -log softmax(hidden @ weight.T)[target] (NaN if
    there are none); the logits are never materialized whole. `hidden_ND` [N, D], `weight_VD` [V, D]."""
    if hidden_ND.shape[:1] != targets_N.shape or hidden_ND.shape[1:] != weight_VD.shape[1:]:
        raise ValueError(f"linear_cross_entropy: hidden {tuple(hidden_ND.shape)}, weight {tuple(weight_VD.shape)} "
                         f"and targets {tuple(targets_N.shape)} do not match ([N, D], [V, D], [N])")
    return _LinearCrossEntropy.apply(hidden_ND, weight_VD, targets_N, ignore_index)


def linear_cross_entropy_ref(hidden_ND: torch.Tensor, weight_VD: torch.Tensor, targets_N: torch.Tensor,
                             ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    return F.cross_entropy((hidden_ND @ weight_VD.t()).float(), targets_N, ignore_index=ignore_index)
