"""Autograd collectives over a process group for tensors that every rank holds a share of, along one dimension.

`gather_shares`: all-gather forward (every rank's share, in rank order); its backward sums the gradient over the
ranks (each rank used every share) and returns this rank's slice. `sum_shares`: the transpose, an all-reduce whose
result each rank keeps only its slice of; its backward all-gathers. The shares are of equal size. gloo has no
reduce-scatter, so a sum-then-slice is an all-reduce and a slice (twice the bytes of a reduce-scatter; on NCCL the
same call moves the same bytes). Every rank must call them in the same order, forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _sum_and_slice(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """A copy of this rank's slice of the sum: a view would keep the whole sum alive as its base (and FSDP2 warns of
    a wrapped module's output that is a view, as the experts' output under ETP is)."""
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    size = x.shape[dim] // dist.get_world_size(group)
    return x.narrow(dim, dist.get_rank(group) * size, size).clone()


class _GatherShares(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum_and_slice(grad.clone(), ctx.dim, ctx.group), None, None


class _SumShares(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _sum_and_slice(x.clone(), dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def gather_shares(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    return _GatherShares.apply(x, dim, group)


def sum_shares(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over the ranks of `x` (each rank's whole tensor), of which this rank keeps its slice along `dim`."""
    return _SumShares.apply(x, dim, group)
