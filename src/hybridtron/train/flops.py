"""Model FLOPs of a training step, counted one way for every user: bench/pretrain.py's MFU and `hybridtron
ladder`'s compute budgets.

Per token of a training step (forward + backward): 6 x the active matmul parameters (the embedding table excluded:
it is a lookup; the lm_head included), plus 6 x T x (query heads x head_dim) per attention layer for the causal
score and value products, plus 3 x the FLOPs of the chunked Mamba scan's matmuls (forward 1x, backward 2x), plus
each MTP depth's block and lm_head again.
"""

from __future__ import annotations

from hybridtron.config import ModelConfig
from hybridtron.model.lm import HybridLM


def model_flops_per_token(model: HybridLM, seq_len: int) -> float:
    """Training FLOPs per token of `model` on rows of `seq_len` tokens (a model on the meta device works too)."""
    cfg = model.config
    matmul_params = model.num_parameters(active=True)  # excludes the embedding table
    attention_layers = cfg.layers_block_type.count("full_attention")
    attention = 6 * attention_layers * seq_len * cfg.num_attention_heads * cfg.head_dim
    # chunked SSD per token and head: C.B^T and the masked product over a chunk (2 x chunk x (N + P)), chunk states
    # and their read-out (2 x 2 x P x N)
    chunk = min(cfg.chunk_size, seq_len)
    ssd = cfg.layers_block_type.count("linear_attention") * cfg.mamba_num_heads * (
        2 * chunk * (cfg.ssm_state_size + cfg.mamba_head_dim) + 4 * cfg.mamba_head_dim * cfg.ssm_state_size)
    mtp = 0
    if model.mtp is not None:  # each depth runs the MTP block and the lm_head again
        mtp_params = sum(p.numel() for n, p in model.mtp.named_parameters() if ".experts." not in n)
        mtp_params += model.mtp.layers[-1].mixer.experts.up_proj[0].numel() * 2 * cfg.num_experts_per_tok
        mtp = cfg.mtp_num_depths * 6 * (mtp_params + model.lm_head.weight.numel())
    return 6 * matmul_params + attention + 3 * ssd + mtp


def config_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """`model_flops_per_token` of the model `config` describes, counted on its meta-device structure (no memory)."""
    return model_flops_per_token(HybridLM.on_meta(config), seq_len)
