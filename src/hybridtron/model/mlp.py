"""Dense squared-ReLU MLP (`-` layers, and the MoE's shared expert): down(relu(up(x))^2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


def mlp_ref(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    up = x @ mlp.up_proj.weight.T
    if mlp.up_proj.bias is not None:
        up = up + mlp.up_proj.bias
    hidden = torch.where(up > 0, up * up, torch.zeros_like(up))
    out = hidden @ mlp.down_proj.weight.T
    return out + mlp.down_proj.bias if mlp.down_proj.bias is not None else out
