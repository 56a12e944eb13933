"""Shared fixtures: every test starts from the same seed, and `small_config` builds a model config with all four
layer kinds that runs in milliseconds on a CPU."""

from __future__ import annotations

import pytest
import torch

from hybridtron.config import ModelConfig, parse_pattern

# Tests run tiny tensors, where intra-op threads cost more in synchronisation than they save; on a busy CPU the
# OpenMP barriers of 2 threads turn a 5 us matmul into 5 ms. One thread is also the more reproducible setting.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _small_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=128, hidden_size=48, layers_block_type=parse_pattern("M*E-ME"),
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, intermediate_size=64,
        mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=8,
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, moe_shared_expert_intermediate_size=32,
        moe_latent_size=16, routed_scaling_factor=2.5, n_group=4, topk_group=2,
        num_nextn_predict_layers=1, max_position_embeddings=256,
    )
    base.update(overrides)
    return ModelConfig(**base)


@pytest.fixture
def small_config():
    """`small_config(**overrides)`: Mamba, attention, LatentMoE (grouped routing) and dense layers, with MTP."""
    return _small_config
