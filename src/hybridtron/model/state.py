"""The model's recurrent state: what a forward continues from when a sequence is read piece by piece.

An attention layer keeps the keys and values of every position so far (`KVCache`, preallocated to `max_len`
positions), a windowed one (`config.windowed_layers`) only those of its last `sliding_window` positions, in a ring
(`attention.windowed_cache_attention`); a Mamba layer keeps a state of constant size (`MambaState`): the raw conv
inputs of the last `conv_kernel - 1` tokens and the [heads, head_dim, state] SSM state, fp32 by default.
`LayerStates` holds one of them (or None, for MoE and MLP layers) per layer, and each sequence's length: the number
of positions already in it. Sequences of one batch may have different lengths.

`HybridLM.forward(ids, cache=states)` and `HybridLM.decode_step(ids, states)` read and advance a `LayerStates` in
place. What serving adds on top (rewinding after speculative verification, SSM state stored in lower precision,
memory accounting) is `hybridtron.infer.cache.HybridCache`, a subclass.

Shapes: B batch, H heads, T positions, D head dim, C conv channels, K conv kernel - 1, P Mamba head dim, N state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from hybridtron.config import ATTENTION, MAMBA, ModelConfig


@dataclass
class KVCache:
    k_BHTD: torch.Tensor  # [batch, kv heads, max_len, head_dim]; a windowed layer's: min(max_len, window) slots
    v_BHTD: torch.Tensor
    window: int | None = None  # the layer's sliding window: position p is in slot p % slots


def kv_slots(max_len: int, window: int | None) -> int:
    """Positions an attention layer's cache holds for sequences of `max_len`: all, or a windowed layer's last
    `window` (fewer slots than the window only when no sequence outgrows them: such a ring never wraps)."""
    return max_len if window is None else min(max_len, window)


@dataclass
class MambaState:
    """A Mamba layer's state. The SSM update reads the SSM state with `read_ssm` and stores its result with
    `write_ssm` (a state stored in another format, `hybridtron.infer.cache.StoredMambaState`, converts there)."""

    conv_BCK: torch.Tensor  # [batch, conv channels, kernel - 1]: the raw conv inputs of the last tokens
    ssm_BHPN: torch.Tensor  # [batch, heads, head_dim, state]

    def read_ssm(self) -> torch.Tensor:
        """The SSM state in fp32 (the buffer itself when it is fp32)."""
        return self.ssm_BHPN.float()

    def write_ssm(self, ssm_BHPN: torch.Tensor) -> None:
        self.ssm_BHPN.copy_(ssm_BHPN)

    @property
    def ssm_dtype(self) -> torch.dtype:
        """The dtype of the SSM states a recorded forward keeps for a rewind."""
        return self.ssm_BHPN.dtype

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state by field name, each with the batch first (what row copies and resizes move)."""
        return {"conv_BCK": self.conv_BCK, "ssm_BHPN": self.ssm_BHPN}

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "MambaState":
        """A state of the same kind whose every tensor is `fn` of this one's (a view of some rows, a resize)."""
        return replace(self, **{name: fn(tensor) for name, tensor in self.tensors().items()})


def allocate_layers(config: ModelConfig, batch: int, max_len: int, *, dtype=torch.float32, device="cpu",
                    state_dtype=torch.float32, kinds: tuple[str, ...] | None = None) -> list:
    """Zero states, one per layer of `kinds` (default: the backbone's layers, whose windowed attention layers get a
    ring of their window; other kinds, e.g. the MTP block's, attend in full): KVCache, MambaState or None."""
    layers = []
    windows = [config.attention_window(i) for i in range(config.num_hidden_layers)] if kinds is None else \
        [None] * len(kinds)
    for kind, window in zip(kinds or config.layers_block_type, windows):
        if kind == ATTENTION:
            shape = (batch, config.num_key_value_heads, kv_slots(max_len, window), config.head_dim)
            layers.append(KVCache(torch.zeros(shape, dtype=dtype, device=device),
                                  torch.zeros(shape, dtype=dtype, device=device), window))
        elif kind == MAMBA:
            layers.append(MambaState(
                torch.zeros(batch, config.conv_channels, config.conv_kernel - 1, dtype=dtype, device=device),
                torch.zeros(batch, config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size,
                            dtype=state_dtype, device=device)))
        else:
            layers.append(None)
    return layers


def select_layers(layers: list, rows: slice) -> list:
    """Views of some rows of every layer's state (writes go through)."""
    selected = []
    for layer in layers:
        if isinstance(layer, KVCache):
            selected.append(KVCache(layer.k_BHTD[rows], layer.v_BHTD[rows], layer.window))
        elif isinstance(layer, MambaState):
            selected.append(layer.map_rows(lambda tensor: tensor[rows]))
        else:
            selected.append(None)
    return selected


@dataclass
class LayerStates:
    layers: list  # one KVCache, MambaState or None per layer
    lengths: torch.Tensor  # [batch] positions already in the states, per sequence

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, max_len: int, **kwargs) -> "LayerStates":
        """Zero states for `batch` sequences of up to `max_len` positions; kwargs as for `allocate_layers`."""
        device = kwargs.get("device", "cpu")
        return cls(allocate_layers(config, batch, max_len, **kwargs),
                   torch.zeros(batch, dtype=torch.long, device=device))

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def select(self, index: int) -> "LayerStates":
        """A view of one sequence (writes go through); used to read prompts of different lengths one at a time."""
        rows = slice(index, index + 1)
        return LayerStates(select_layers(self.layers, rows), self.lengths[rows])
