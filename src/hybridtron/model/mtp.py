"""Multi-token prediction: one stored block (attention + MoE by default), applied D times with shared weights.

Depth k at position t combines the previous depth's hidden state with the embedding of token t+k and predicts
token t+k+1 through the shared lm_head (Megatron / vLLM semantics; h_0 is the backbone's normed output):

    u   = eh_proj([enorm(embed(x_{t+k})) ; hnorm(h_{k-1})])      embedding first
    u   = u + mixer_i(norm_i(u))  for each layer of the block
    h_k = final_layernorm(u)
"""

from __future__ import annotations

import torch
from torch import nn

from hybridtron.config import ModelConfig
from hybridtron.model.block import build_mixer, decode_mixer, run_mixer
from hybridtron.model.norm import RMSNorm


class MTPLayer(nn.Module):
    def __init__(self, config: ModelConfig, kind: str, first: bool, last: bool):
        super().__init__()
        self.kind = kind
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        if first:
            self.enorm = RMSNorm(hidden, eps)
            self.hnorm = RMSNorm(hidden, eps)
            self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.norm = RMSNorm(hidden, eps)
        self.mixer = build_mixer(kind, config)
        if last:
            self.final_layernorm = RMSNorm(hidden, eps)


class MTPBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        kinds = config.mtp_layers_block_type
        self.layers = nn.ModuleList(
            MTPLayer(config, kind, first=i == 0, last=i == len(kinds) - 1) for i, kind in enumerate(kinds))

    def forward(self, previous_hidden_BTD: torch.Tensor, next_embedding_BTD: torch.Tensor,
                caches: list | None = None, lengths: torch.Tensor | None = None, mixer_fn=run_mixer,
                seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        """One depth: h_{k-1} [B, T, H] and embed(x_{t+k}) [B, T, H] -> h_k [B, T, H]. `caches` (one layer state
        per layer of the block) and `lengths`: continue from them, as the drafter does. `mixer_fn`: how each layer's
        mixer runs (`block.run_mixer`'s signature; decoders pass their fast paths, MTP boosting its chain attention).
        `seq_idx`: packed documents (`model.documents`), position t's document."""
        u = self.combine(previous_hidden_BTD, next_embedding_BTD)
        for i, layer in enumerate(self.layers):
            u = u + mixer_fn(layer.kind, layer.mixer, layer.norm(u), caches[i] if caches else None, lengths, None,
                             seq_idx)
        return self.layers[-1].final_layernorm(u)

    def decode_step(self, previous_hidden_BD: torch.Tensor, next_embedding_BD: torch.Tensor, caches: list,
                    lengths_B: torch.Tensor) -> torch.Tensor:
        """`forward` of one position per sequence ([B, H]) with static shapes (every mixer's `decode_step`), for a
        compiled drafting step; the caches are written at `lengths_B`, which the caller advances."""
        u = self.combine(previous_hidden_BD, next_embedding_BD)
        for layer, layer_cache in zip(self.layers, caches):
            u = u + decode_mixer(layer.kind, layer.mixer, layer.norm(u), layer_cache, lengths_B)
        return self.layers[-1].final_layernorm(u)

    def combine(self, previous_hidden: torch.Tensor, next_embedding: torch.Tensor) -> torch.Tensor:
        """u = eh_proj([enorm(embed(x_{t+k})) ; hnorm(h_{k-1})])."""
        first = self.layers[0]
        return first.eh_proj(torch.cat([first.enorm(next_embedding), first.hnorm(previous_hidden)], dim=-1))
