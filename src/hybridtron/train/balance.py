"""Aux-loss-free load balancing and MaxVio, for every router of the model (the MTP block's included).

After each applied optimizer step every router's bias moves by a fixed step toward balance, using the expert loads
counted over the whole global batch (Megatron's `get_updated_expert_bias`, DeepSeek-V3):

    b_i += u * sign(mean_load - load_i)          u = 1e-3

MaxVio follows the Ultra report's definition, max_i load_i / mean load (1 = perfect balance), so its upper bound is
E/K (every token on the same K experts): 23.27 for Ultra. Wang et al. subtract 1; we do not. It is measured over the
loads of the last `window` steps (the report: 20 iterations) and logged as `maxvio/<router>`, the router named as
`HybridLM.routers()` names it (`maxvio/3` for backbone layer 3, `maxvio/mtp.1` for the MTP block's MoE layer).
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist


def max_violation_bound(num_experts: int, top_k: int) -> float:
    """MaxVio's upper bound E/K: every token routed to the same K experts."""
    return num_experts / top_k


@torch.no_grad()
def update_router_biases(biases: list[torch.Tensor], counts_RE: torch.Tensor, rate: float) -> None:
    """`counts_RE` [routers, experts]: this step's tokens per expert, summed over micro-batches and ranks."""
    loads = counts_RE.float()
    direction = torch.sign(loads.mean(dim=1, keepdim=True) - loads)
    for bias, step in zip(biases, direction):
        bias.add_(rate * step)


def max_violation(counts_RE: torch.Tensor) -> torch.Tensor:
    """Per router: max load / mean load."""
    loads = counts_RE.float()
    return loads.max(dim=1).values / loads.mean(dim=1).clamp_min(1e-12)


class ExpertBalance:
    """The balancing state of a run: the global expert counts of the last `window` steps (for MaxVio)."""

    def __init__(self, router_names: list[str], rate: float, window: int, group=None):
        """`group`: the ranks whose counts make up the global batch for these routers (distributed: every rank of
        the pipeline stage that holds the routers; None = the whole world when torch.distributed is initialized)."""
        self.names, self.rate, self.group = list(router_names), rate, group
        self.window: collections.deque[torch.Tensor] = collections.deque(maxlen=window)
        self.step_counts: torch.Tensor | None = None

    def measure(self, counts: dict[str, torch.Tensor]) -> dict[str, float]:
        """Reduce this step's counts over the data-parallel ranks (once, for MaxVio and the update alike) and return
        each router's MaxVio over the window, by router name."""
        if not self.names:
            return {}
        counts_RE = torch.stack([counts[name] for name in self.names])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts_RE, group=self.group)
        self.step_counts = counts_RE
        self.window.append(counts_RE)
        values = max_violation(torch.stack(list(self.window)).sum(0)).tolist()
        return {name: round(value, 4) for name, value in zip(self.names, values)}

    def update(self, biases: list[torch.Tensor]) -> None:
        """Move every router's bias by this step's counts (after an applied update only)."""
        if self.step_counts is not None:
            update_router_biases(biases, self.step_counts, self.rate)

    def state_dict(self) -> dict:
        return {"window": list(self.window), "names": list(self.names)}

    def load_state_dict(self, state: dict) -> None:
        """Also from a state of other routers (a pipeline stage's from the whole model's): the rows of ours."""
        rows = [state["names"].index(name) for name in self.names] if "names" in state else None
        self.window.clear()
        self.window.extend(counts if rows is None or rows == list(range(len(counts))) else counts[rows]
                           for counts in state["window"])
