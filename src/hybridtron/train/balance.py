"""Aux-loss-free load balancing and MaxVio.

After each optimizer step every MoE layer's router bias moves by a fixed step toward balance, using the expert loads
counted over the whole global batch (Megatron's `get_updated_expert_bias`, DeepSeek-V3):

    b_i += u * sign(mean_load - load_i)          u = 1e-3

MaxVio follows the Ultra report's definition, max_i load_i / mean load (1 = perfect balance), so its upper bound is
E/K (every token on the same K experts): 23.27 for Ultra. Wang et al. subtract 1; we do not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def update_router_biases(biases: list[torch.Tensor], counts_LE: torch.Tensor, rate: float) -> None:
    """`counts_LE` [layers, experts]: this step's tokens per expert (summed over micro-batches and ranks)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts_LE)
    loads = counts_LE.float()
    direction = torch.sign(loads.mean(dim=1, keepdim=True) - loads)
    for bias, step in zip(biases, direction):
        bias.add_(rate * step)


def max_violation(counts_LE: torch.Tensor) -> torch.Tensor:
    """Per layer: max load / mean load."""
    loads = counts_LE.float()
    return loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-12)
