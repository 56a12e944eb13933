"""Mean cross entropy over a large vocabulary without the [tokens, vocab] log-probability tensor.

`F.cross_entropy` writes log_softmax(logits) as a second [N, V] tensor and keeps it for the backward, whose NLL
step fills a third, all-zero [N, V] tensor before log_softmax's backward writes the gradient, a fourth. With a
32k-131k vocabulary these passes over memory cost as much as a layer of the model. `cross_entropy` keeps one fp32
logsumexp per row, computed over blocks of rows that fit in cache, and its backward writes the gradient
softmax(logits) - onehot(target) once, block by block. Reductions are in fp32 whatever the logits' dtype.

`cross_entropy_ref` is `F.cross_entropy` in fp32 (what the model used before; the tests compare the two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
BLOCK_ELEMENTS = 1 << 22  # 16 MiB of fp32 per block of rows: stays in a CPU's L2/L3


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NV: torch.Tensor, targets_N: torch.Tensor, ignore_index: int) -> torch.Tensor:
        rows = max(1, BLOCK_ELEMENTS // max(1, logits_NV.shape[1]))
        valid_N = targets_N != ignore_index
        safe_targets_N = targets_N.masked_fill(~valid_N, 0)
        logsumexp_N = torch.cat([torch.logsumexp(block.float(), dim=-1) for block in logits_NV.split(rows)]) \
            if logits_NV.shape[0] else logits_NV.new_zeros(0, dtype=torch.float32)
        target_logit_N = logits_NV.gather(1, safe_targets_N[:, None])[:, 0].float()
        count = valid_N.sum()
        ctx.save_for_backward(logits_NV, logsumexp_N, safe_targets_N, valid_N, count)
        ctx.rows = rows
        return ((logsumexp_N - target_logit_N) * valid_N).sum() / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        logits_NV, logsumexp_N, safe_targets_N, valid_N, count = ctx.saved_tensors
        row_scale_N = valid_N * (grad_loss.float() / count)
        grad_NV = torch.empty_like(logits_NV, memory_format=torch.contiguous_format)
        for grad_block, block, logsumexp, scale in zip(grad_NV.split(ctx.rows), logits_NV.split(ctx.rows),
                                                       logsumexp_N.split(ctx.rows), row_scale_N.split(ctx.rows)):
            grad_block.copy_((block.float() - logsumexp[:, None]).exp_().mul_(scale[:, None]))
        grad_NV.scatter_add_(1, safe_targets_N[:, None], -row_scale_N[:, None].to(grad_NV.dtype))
        return grad_NV, None, None


def cross_entropy(logits_NV: torch.Tensor, targets_N: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean over the targets that are not `ignore_index` of -log softmax(logits)[target] (NaN if there are none,
    as F.cross_entropy gives)."""
    return _CrossEntropy.apply(logits_NV, targets_N, ignore_index)


def cross_entropy_ref(logits_NV: torch.Tensor, targets_N: torch.Tensor,
                      ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    return F.cross_entropy(logits_NV.float(), targets_N, ignore_index=ignore_index)


def cross_entropy_sum_and_count(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """[the CE summed over the valid targets, their count] in float64, for evaluation: the two parts of a mean, for
    ranks that each hold a share of a batch's positions (context parallelism) to sum before dividing."""
    ce_sum = F.cross_entropy(logits_BTV.float().flatten(0, 1), labels_BT.flatten(), ignore_index=IGNORE_INDEX,
                             reduction="sum")
    return torch.stack([ce_sum.double(), (labels_BT != IGNORE_INDEX).sum().double()])
