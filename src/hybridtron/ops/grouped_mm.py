"""Grouped matrix multiply for routed experts: one GEMM per expert over its slice of expert-sorted rows.

`grouped_mm` lays each expert's rows into a zero-padded [E, capacity, K] block and runs one batched matmul, so
the hot path has no Python loop over experts (the cost of the padding is the load imbalance, which the
router-bias update keeps small). `grouped_mm_ref` is the loop that defines the result.
"""

from __future__ import annotations

import torch


def padded_slots(group_sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For expert-sorted rows: (expert of each row, slot inside its expert, capacity = the largest group)."""
    num_rows = int(group_sizes.sum())
    expert_of_row = torch.repeat_interleave(torch.arange(len(group_sizes), device=group_sizes.device), group_sizes)
    group_starts = torch.cumsum(group_sizes, 0) - group_sizes
    slot_of_row = torch.arange(num_rows, device=group_sizes.device) - group_starts[expert_of_row]
    capacity = int(group_sizes.max()) if len(group_sizes) else 0
    return expert_of_row, slot_of_row, capacity


def grouped_mm(x_SK: torch.Tensor, w_EOK: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """y[rows of expert e] = x[rows of expert e] @ w[e].T, for rows sorted by expert."""
    num_experts, out_features, in_features = w_EOK.shape
    expert_of_row, slot_of_row, capacity = padded_slots(group_sizes)
    padded_ECK = x_SK.new_zeros(num_experts, capacity, in_features)
    padded_ECK = padded_ECK.index_put((expert_of_row, slot_of_row), x_SK)
    y_ECO = torch.bmm(padded_ECK, w_EOK.transpose(1, 2))
    return y_ECO[expert_of_row, slot_of_row]


def grouped_mm_ref(x_SK: torch.Tensor, w_EOK: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    rows = x_SK.split(group_sizes.tolist())
    outputs = [rows_e @ w_OK.T for rows_e, w_OK in zip(rows, w_EOK)]
    return torch.cat(outputs) if outputs else x_SK.new_zeros(0, w_EOK.shape[1])
