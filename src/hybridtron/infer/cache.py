"""The hybrid inference cache: a preallocated KV cache per attention layer, conv + SSM state per Mamba layer.

Attention layers grow with the context (one K and one V row per token); Mamba layers keep a constant-size state
per sequence: the last `conv_kernel - 1` conv inputs and the [heads, head_dim, state] SSM state. Each sequence of
the batch has its own length, so sequences of different prompt lengths can decode together.

For speculative decoding a Mamba state can record the state after every token of a multi-token forward
(`record_steps=True`); `HybridCache.rewind_to(accepted)` then restores each sequence's Mamba states to the slot of
its last accepted token and truncates the KV lengths: no recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridtron.config import ATTENTION, MAMBA, ModelConfig


@dataclass
class KVCache:
    k_BHTD: torch.Tensor  # [batch, kv heads, max_len, head_dim]
    v_BHTD: torch.Tensor


@dataclass
class MambaState:
    conv_BCK: torch.Tensor  # [batch, conv channels, kernel - 1]: the raw conv inputs of the last tokens
    ssm_BHPN: torch.Tensor  # [batch, heads, head_dim, state], fp32
    record_steps: bool = False
    # when record_steps: the state after each token of the last forward, [batch, T, ...]
    conv_steps: torch.Tensor | None = None
    ssm_steps: torch.Tensor | None = None


@dataclass
class HybridCache:
    layers: list  # one KVCache, MambaState or None per layer
    lengths: torch.Tensor  # [batch] tokens already in the cache, per sequence
    max_len: int
    extra: dict = field(default_factory=dict)  # e.g. the MTP block's own cache

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, max_len: int, *, dtype=torch.float32, device="cpu",
                 state_dtype=torch.float32, kinds: tuple[str, ...] | None = None) -> "HybridCache":
        if max_len > config.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the model's max_position_embeddings "
                             f"{config.max_position_embeddings}")
        layers = []
        conv_channels = config.mamba_inner_size + 2 * config.n_groups * config.ssm_state_size
        for kind in kinds or config.layers_block_type:
            if kind == ATTENTION:
                shape = (batch, config.num_key_value_heads, max_len, config.head_dim)
                layers.append(KVCache(torch.zeros(shape, dtype=dtype, device=device),
                                      torch.zeros(shape, dtype=dtype, device=device)))
            elif kind == MAMBA:
                layers.append(MambaState(
                    torch.zeros(batch, conv_channels, config.conv_kernel - 1, dtype=dtype, device=device),
                    torch.zeros(batch, config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size,
                                dtype=state_dtype, device=device)))
            else:
                layers.append(None)
        return cls(layers, torch.zeros(batch, dtype=torch.long, device=device), max_len)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def select(self, index: int) -> "HybridCache":
        """A view of one sequence (writes go through to this cache); used to prefill prompts one at a time."""
        def row(t):
            return t[index:index + 1]
        layers = []
        for layer in self.layers:
            if isinstance(layer, KVCache):
                layers.append(KVCache(row(layer.k_BHTD), row(layer.v_BHTD)))
            elif isinstance(layer, MambaState):
                layers.append(MambaState(row(layer.conv_BCK), row(layer.ssm_BHPN)))
            else:
                layers.append(None)
        return HybridCache(layers, row(self.lengths), self.max_len)

    def set_record_steps(self, on: bool) -> None:
        for layer in self.layers:
            if isinstance(layer, MambaState):
                layer.record_steps = on
                layer.conv_steps = layer.ssm_steps = None

    def rewind_to(self, kept_new_tokens: torch.Tensor, new_tokens: int) -> None:
        """After a recorded forward of `new_tokens` tokens, keep only the first `kept_new_tokens[b]` of them."""
        batch = torch.arange(self.batch_size, device=self.lengths.device)
        slot = kept_new_tokens - 1
        if (kept_new_tokens < 1).any():
            raise ValueError("rewind_to keeps at least one of the recorded tokens per sequence")
        for layer in self.layers:
            if isinstance(layer, MambaState):
                if layer.ssm_steps is None:
                    raise RuntimeError("rewind_to needs a forward with record_steps on")
                layer.conv_BCK.copy_(layer.conv_steps[batch, slot])
                layer.ssm_BHPN.copy_(layer.ssm_steps[batch, slot])
        self.lengths -= new_tokens - kept_new_tokens

    def memory_bytes(self) -> int:
        total = 0
        for layer in self.layers:
            if isinstance(layer, KVCache):
                total += layer.k_BHTD.nbytes + layer.v_BHTD.nbytes
            elif isinstance(layer, MambaState):
                total += layer.conv_BCK.nbytes + layer.ssm_BHPN.nbytes
        return total
