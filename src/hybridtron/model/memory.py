"""What a model keeps per token and per sequence while it decodes: the one statement of KV cache and Mamba state
bytes, which the memory command and the engine's slots (`hybridtron.infer.memory`) and the serving planner
(`hybridtron.distributed.serving`) all read.

Attention layers cache one K and one V row per token: `attention layers * 2 * kv heads * head_dim * bytes`
per token, growing with the context, except a windowed layer's (`config.windowed_layers`), which holds at most its
last `sliding_window` tokens (`kv_cache_bytes`). Mamba-2 layers keep a constant state per sequence:
  - SSM state [heads, head_dim, ssm_state_size] (fp32 by default; the report's figure of 384 MiB for Ultra is
    this part only: 256 * 64 * 128 * 4 B * 48 layers),
  - conv state [conv_kernel - 1, inner + 2 * n_groups * ssm_state_size]: the last K-1 conv inputs (bf16 by default,
    the activation dtype), as vLLM and `hybridtron.infer.cache` keep it.
An int8 SSM state (`hybridtron.infer.state_quant`) also stores one fp32 scale per block of INT8_BLOCK along the
state axis. These are the bytes the serving cache holds in each format (`hybridtron.infer.cache.StoredMambaState`;
tests/infer/test_stored_state.py checks them against an allocated cache).
"""

from __future__ import annotations

import math

from hybridtron.config import ATTENTION, MAMBA, ModelConfig
from hybridtron.model.state import kv_slots

BYTES_PER_ELEMENT = {"fp8": 1, "int8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
KV_DTYPES = ("fp8", "bf16", "fp16", "fp32")
STATE_DTYPES = ("fp32", "fp16", "bf16", "int8")
CONV_DTYPES = ("fp32", "fp16", "bf16")
INT8_BLOCK = 128  # elements per fp32 scale of an int8 SSM state, along ssm_state_size (as state_quant stores it)
SCALE_BYTES = 4


def dtype_bytes(dtype: str, allowed: tuple[str, ...], field: str) -> int:
    """Bytes of one element of `dtype`, one of `allowed`; a ValueError naming `field` otherwise."""
    if dtype not in allowed:
        raise ValueError(f"{field}: unknown dtype {dtype!r}; expected one of {', '.join(allowed)}")
    return BYTES_PER_ELEMENT[dtype]


def count_layers(config: ModelConfig, kind: str, include_mtp: bool = False) -> int:
    """Layers of one kind in the backbone, plus those of the stored MTP block when `include_mtp`."""
    count = sum(k == kind for k in config.layers_block_type)
    if include_mtp and config.has_mtp:
        count += sum(k == kind for k in config.mtp_layers_block_type)
    return count


def kv_bytes_per_token(config: ModelConfig, dtype: str = "fp8", include_mtp: bool = False) -> int:
    """K and V of every attention layer for one token of one sequence (while the context is within every layer's
    window: a windowed layer stops growing there, see `kv_cache_bytes`).

    include_mtp adds the MTP block's attention layer: a speculative decoder caches its keys and values too (one
    cache for the stored block, shared by its depths, as vLLM lays it out).
    """
    return count_layers(config, ATTENTION, include_mtp) * kv_bytes_per_layer_token(config, dtype)


def kv_bytes_per_layer_token(config: ModelConfig, dtype: str = "fp8") -> int:
    """K and V of one attention layer for one token."""
    return 2 * config.num_key_value_heads * config.head_dim * dtype_bytes(dtype, KV_DTYPES, "kv dtype")


def kv_cache_bytes(config: ModelConfig, context: int, dtype: str = "fp8", include_mtp: bool = False) -> int:
    """K and V of every attention layer for one sequence of `context` tokens: `kv_bytes_per_token` x context, but a
    windowed layer counts only min(context, sliding_window) positions (the MTP block's attention is never windowed)."""
    per_layer = kv_bytes_per_layer_token(config, dtype)
    windowed = config.windowed_layers
    full_layers = count_layers(config, ATTENTION, include_mtp) - len(windowed)
    return per_layer * (full_layers * context + len(windowed) * kv_slots(context, config.sliding_window))


def ssm_state_bytes(config: ModelConfig, dtype: str = "fp32") -> int:
    """SSM state of every Mamba layer for one sequence (with the fp32 block scales when int8)."""
    element = dtype_bytes(dtype, STATE_DTYPES, "state dtype")
    rows = config.mamba_num_heads * config.mamba_head_dim
    per_layer = rows * config.ssm_state_size * element
    if dtype == "int8":
        per_layer += rows * math.ceil(config.ssm_state_size / INT8_BLOCK) * SCALE_BYTES
    return count_layers(config, MAMBA) * per_layer


def conv_state_bytes(config: ModelConfig, dtype: str = "bf16") -> int:
    """Conv state of every Mamba layer for one sequence: the last conv_kernel - 1 inputs of x, B and C."""
    element = dtype_bytes(dtype, CONV_DTYPES, "conv dtype")
    return count_layers(config, MAMBA) * (config.conv_kernel - 1) * config.conv_channels * element


def mamba_state_bytes(config: ModelConfig, dtype: str = "fp32", conv_dtype: str = "bf16") -> int:
    """SSM + conv state of every Mamba layer for one sequence; constant in the context length."""
    return ssm_state_bytes(config, dtype) + conv_state_bytes(config, conv_dtype)
