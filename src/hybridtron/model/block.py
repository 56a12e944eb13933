"""A residual block `h = h + mixer(norm(h))`, the mixer chosen by the layer kind.

`Block.forward` runs any number of tokens (training, prefill; from a `model.state` layer state when given);
`Block.decode_step` one token per sequence with static shapes (the compiled decode step)."""

from __future__ import annotations

import torch
from torch import nn

from hybridtron.config import ATTENTION, MAMBA, MLP as MLP_KIND, MOE, ModelConfig
from hybridtron.model.attention import Attention
from hybridtron.model.mamba2 import Mamba2Mixer
from hybridtron.model.mlp import MLP
from hybridtron.model.moe import MoE
from hybridtron.model.norm import RMSNorm


def build_mixer(kind: str, config: ModelConfig, sliding_window: int | None = None) -> nn.Module:
    """`sliding_window`: an attention layer's window (`config.attention_window(layer)`); None for full attention."""
    if kind == MAMBA:
        return Mamba2Mixer(config)
    if kind == ATTENTION:
        return Attention(config, sliding_window)
    if kind == MOE:
        return MoE(config)
    if kind == MLP_KIND:
        return MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
    raise ValueError(f"unknown layer kind {kind!r}")


def run_mixer(kind: str, mixer: nn.Module, normed_BTD: torch.Tensor, layer_cache=None, lengths=None,
              expert_ids=None, seq_idx=None):
    """The mixer's forward: attention reads and writes a KV cache, Mamba its state; the MoE may replay given routing
    choices; attention and Mamba keep packed documents apart given `seq_idx` (`model.documents`). Blocks take
    another function of this signature as `mixer_fn` (decoders pass their fast paths, `hybridtron.infer.fastpath`)."""
    documents = {} if seq_idx is None else {"seq_idx": seq_idx}
    if kind == ATTENTION and (layer_cache is not None or documents):
        return mixer(normed_BTD, layer_cache, lengths, **documents)
    if kind == MAMBA and (layer_cache is not None or documents):
        return mixer(normed_BTD, layer_cache, **documents)
    if expert_ids is not None and kind == MOE:
        return mixer(normed_BTD, expert_ids=expert_ids)
    return mixer(normed_BTD)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, kind: str, sliding_window: int | None = None):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer = build_mixer(kind, config, sliding_window)

    def forward(self, hidden_BTD: torch.Tensor, layer_cache=None, lengths=None, expert_ids=None,
                mixer_fn=run_mixer, seq_idx=None) -> torch.Tensor:
        return hidden_BTD + mixer_fn(self.kind, self.mixer, self.norm(hidden_BTD), layer_cache, lengths, expert_ids,
                                     seq_idx)

    def decode_step(self, hidden_BD: torch.Tensor, layer_cache=None, lengths_B=None) -> torch.Tensor:
        """One token per sequence ([B, D]) with static shapes, for a compiled decode step (`HybridLM.decode_step`)."""
        return hidden_BD + decode_mixer(self.kind, self.mixer, self.norm(hidden_BD), layer_cache, lengths_B)


def decode_mixer(kind: str, mixer: nn.Module, normed_BD: torch.Tensor, layer_cache=None, lengths_B=None):
    """The mixer's static one-token step (`decode_step`), [B, D] -> [B, D]; the MLP's forward is already one."""
    if kind == ATTENTION:
        return mixer.decode_step(normed_BD, layer_cache, lengths_B)
    if kind == MAMBA:
        return mixer.decode_step(normed_BD, layer_cache)
    if kind == MOE:
        return mixer.decode_step(normed_BD)
    return mixer(normed_BD)
