"""Grouped matrix multiply for routed experts: one GEMM per expert over its slice of expert-sorted rows.

`grouped_mm` uses torch's native grouped GEMM (`torch.nn.functional.grouped_mm`, a CPU and GPU kernel since torch
2.10) where it applies: fp32/bf16/fp16, rows and weights whose strides are multiples of 16 bytes, at least one row.
Elsewhere `grouped_mm_padded` lays each expert's rows into a zero-padded [E, capacity, K] block and runs one batched
matmul (the cost of the padding is the load imbalance). Neither has a Python loop over experts.
`grouped_mm_ref` is the loop that defines the result.

The native GEMM runs as the custom ops `hybridtron::grouped_mm` and `hybridtron::grouped_mm_backward`, with fake
(shape-only) implementations: torch.compile traces them as opaque calls. (Called directly, the native op's own
fake implementation accepts only bf16, so a compiled fp32 MoE block would fail to trace.) The backward is the same
two grouped GEMMs the native autograd formula runs: dX = dY W_e per group, dW_e = dY_e^T X_e over each group's rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def padded_slots(group_sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For expert-sorted rows: (expert of each row, slot inside its expert, capacity = the largest group)."""
    num_rows = int(group_sizes.sum())
    expert_of_row = torch.repeat_interleave(torch.arange(len(group_sizes), device=group_sizes.device), group_sizes)
    group_starts = torch.cumsum(group_sizes, 0) - group_sizes
    slot_of_row = torch.arange(num_rows, device=group_sizes.device) - group_starts[expert_of_row]
    capacity = int(group_sizes.max()) if len(group_sizes) else 0
    return expert_of_row, slot_of_row, capacity


def native_applies(x_SK: torch.Tensor, w_EOK: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm") or x_SK.dtype not in NATIVE_DTYPES or w_EOK.dtype != x_SK.dtype:
        return False
    aligned = 16 // x_SK.element_size()
    # each expert's matrix may be stored either way round ([O, K] or, laid out for decoding, [K, O])
    return x_SK.shape[0] > 0 and x_SK.is_contiguous() \
        and (w_EOK.is_contiguous() or w_EOK.transpose(1, 2).is_contiguous()) \
        and w_EOK.shape[1] % aligned == 0 and w_EOK.shape[2] % aligned == 0


def grouped_mm(x_SK: torch.Tensor, w_EOK: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """y[rows of expert e] = x[rows of expert e] @ w[e].T, for rows sorted by expert. Under autocast both operands
    are cast to its dtype first, as autocast casts a matmul's: it does not cast a custom op's, and the native
    kernel wants one dtype (else the padded GEMM, whose capacity is read back to Python, breaks a compiled graph)."""
    device = x_SK.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x_SK, w_EOK = x_SK.to(dtype), w_EOK.to(dtype)
    if not native_applies(x_SK, w_EOK):
        return grouped_mm_padded(x_SK, w_EOK, group_sizes)
    return native_grouped_mm(x_SK, w_EOK, torch.cumsum(group_sizes, 0, dtype=torch.int32))


@torch.library.custom_op("hybridtron::grouped_mm", mutates_args=())
def native_grouped_mm(x_SK: torch.Tensor, w_EOK: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The native grouped GEMM; `offsets` [E] int32: the end row of each expert's group."""
    return F.grouped_mm(x_SK, w_EOK.transpose(1, 2), offs=offsets)


@native_grouped_mm.register_fake
def _(x_SK, w_EOK, offsets):
    return x_SK.new_empty(x_SK.shape[0], w_EOK.shape[1])


@torch.library.custom_op("hybridtron::grouped_mm_backward", mutates_args=())
def native_grouped_mm_backward(dy_SO: torch.Tensor, x_SK: torch.Tensor, w_EOK: torch.Tensor,
                               offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dy_SO = dy_SO.contiguous()  # the native op rejects stride-0 (expanded) gradients
    dx_SK = F.grouped_mm(dy_SO, w_EOK if w_EOK.is_contiguous() else w_EOK.contiguous(), offs=offsets)
    dw_EOK = F.grouped_mm(dy_SO.t(), x_SK, offs=offsets)  # in the weight's own layout: no transposing copy
    return dx_SK, dw_EOK


@native_grouped_mm_backward.register_fake
def _(dy_SO, x_SK, w_EOK, offsets):
    return x_SK.new_empty(x_SK.shape), w_EOK.new_empty(w_EOK.shape)


def _setup_context(ctx, inputs, output):
    x_SK, w_EOK, offsets = inputs
    ctx.save_for_backward(x_SK, w_EOK, offsets)


def _backward(ctx, dy_SO):
    x_SK, w_EOK, offsets = ctx.saved_tensors
    dx_SK, dw_EOK = native_grouped_mm_backward(dy_SO, x_SK, w_EOK, offsets)
    return dx_SK, dw_EOK, None


native_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def grouped_mm_padded(x_SK: torch.Tensor, w_EOK: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
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
