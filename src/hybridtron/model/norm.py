"""RMSNorm and the gated group RMSNorm of the Mamba-2 mixer: w * x / sqrt(mean(x^2) + eps), normalised in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:  # one call; it applies the weight before rounding to x's dtype
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class GatedGroupRMSNorm(nn.Module):
    """`w * GroupRMS(y * SiLU(z))`: the gate is applied before the norm, normalised in groups of `group_size`."""

    def __init__(self, size: int, group_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = y.float() * F.silu(z.float())
        normed = F.rms_norm(gated.unflatten(-1, (-1, self.group_size)), (self.group_size,), eps=self.eps)
        return self.weight * normed.flatten(-2).to(y.dtype)
