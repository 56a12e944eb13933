"""ModelConfig: validation errors that name the field and the rule, the HF config.json interchange, and presets."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from hybridtron.config import (
    PRESETS, ULTRA3_ATTENTION_LAYERS, ModelConfig, nano3, parse_pattern, preset, super3, tiny, ultra3)
from hybridtron.model.lm import HybridLM
from hybridtron.train.balance import max_violation_bound


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("overrides, message", [
    (dict(layers_block_type=("linear_attention", "conv")), r"layers_block_type\[1\]: unknown layer kind 'conv'"),
    (dict(layers_block_type="M*X"), r"unknown layer character 'X' at position 2"),
    (dict(mtp_layers_block_type=("full_attention", "rnn")), r"mtp_layers_block_type\[1\]: unknown layer kind"),
    (dict(layers_block_type=()), "layers_block_type must name at least one layer"),
    (dict(mamba_num_heads=6, n_groups=4), r"mamba_num_heads \(6\) must be divisible by n_groups \(4\)"),
    (dict(num_attention_heads=6, num_key_value_heads=4),
     r"num_attention_heads \(6\) must be divisible by num_key_value_heads \(4\)"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) must be <= n_routed_experts \(8\)"),
    (dict(n_group=3, topk_group=1), r"n_routed_experts \(8\) must be divisible by n_group \(3\)"),
    (dict(n_group=2, topk_group=4), r"topk_group \(4\) must be <= n_group \(2\)"),
    (dict(n_group=8, topk_group=2), "fewer than 2 experts per group"),
    (dict(n_group=4, topk_group=1), r"topk_group \(1\) groups of 2 experts hold fewer than num_experts_per_tok \(3\)"),
    (dict(num_nextn_predict_layers=2), "num_nextn_predict_layers must be 0 or 1"),
    (dict(mlp_hidden_act="gelu"), "mlp_hidden_act: only 'relu2'"),
    (dict(mamba_hidden_act="relu"), "mamba_hidden_act: only 'silu'"),
    (dict(time_step_limit=(0.5, 0.1)), "time_step_limit must be"),
    (dict(time_step_min=0.2, time_step_max=0.1), r"time_step_min \(0.2\) must be in"),
    (dict(mtp_loss_weight=-0.1), "mtp_loss_weight must be >= 0"),
    (dict(tie_word_embeddings=True), "tie_word_embeddings"),
])
def test_bad_config_names_field_and_rule(small_config, overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(**overrides)


SIZE_FIELDS = ["vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel",
               "chunk_size", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
               "moe_shared_expert_intermediate_size", "moe_latent_size", "mtp_num_depths", "max_position_embeddings",
               "routed_scaling_factor", "layer_norm_epsilon"]


@pytest.mark.parametrize("field", SIZE_FIELDS)
@pytest.mark.parametrize("value", [0, -4])
def test_non_positive_sizes_are_rejected(small_config, field, value):
    with pytest.raises(ValueError, match=rf"{field} must be a positive number, got {value}"):
        small_config(**{field: value})


def test_config_is_frozen_and_keyword_only(small_config):
    config = small_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.hidden_size = 7
    with pytest.raises(TypeError):
        ModelConfig(128)  # noqa
    assert config.replace(hidden_size=96).hidden_size == 96 and config.hidden_size == 48


def test_pattern_and_derived_sizes(small_config):
    config = small_config(layers_block_type="M*E-")
    assert config.layers_block_type == ("linear_attention", "full_attention", "moe", "mlp")
    assert config.hybrid_override_pattern == "M*E-" and config.num_hidden_layers == 4
    assert config.mamba_inner_size == 4 * 8 and config.expert_width == 16
    assert small_config(moe_latent_size=None).expert_width == 48
    assert parse_pattern("") == ()
    assert ModelConfig(layers_block_type=["mamba", "attention"]).layers_block_type == (
        "linear_attention", "full_attention")


# --------------------------------------------------------------------------------------------- HF interchange
@pytest.mark.parametrize("name", list(PRESETS))
def test_to_hf_from_hf_round_trip(name, tmp_path):
    config = preset(name)
    assert ModelConfig.from_hf(config.to_hf()) == config
    (tmp_path / "config.json").write_text(config.to_json())
    assert ModelConfig.from_hf(tmp_path) == config  # a directory
    assert ModelConfig.from_hf(tmp_path / "config.json") == config  # a file
    assert ModelConfig.from_hf(str(tmp_path)) == config  # a str
    assert json.loads(config.to_json())["time_step_limit"] == [0.0, math.inf]


def test_from_hf_reads_legacy_spellings(small_config):
    config = small_config()
    legacy = config.to_hf()
    del legacy["layers_block_type"], legacy["mtp_layers_block_type"]
    legacy["hybrid_override_pattern"] = "M*E-ME"
    legacy["mtp_hybrid_override_pattern"] = "*E"
    aliases = {"n_groups": "mamba_n_groups", "conv_kernel": "mamba_d_conv", "time_step_min": "mamba_dt_min",
               "time_step_max": "mamba_dt_max", "time_step_limit": "mamba_dt_limit",
               "time_step_floor": "mamba_dt_init_floor", "use_conv_bias": "mamba_conv_bias",
               "chunk_size": "mamba_chunk_size", "ssm_state_size": "mamba_d_state"}
    for name, alias in aliases.items():
        legacy[alias] = legacy.pop(name)
    legacy["eos_token_id"] = [2, 11]  # NVIDIA configs sometimes list several
    legacy["mamba_dt_limit"] = [0.0, {"__float__": "Infinity"}]  # as transformers serialises inf
    assert ModelConfig.from_hf(legacy) == config
    # the layer list wins over the pattern when both are given
    both = config.to_hf() | {"hybrid_override_pattern": "MMMMMM"}
    assert ModelConfig.from_hf(both).layers_block_type == config.layers_block_type
    # the legacy names of the kinds
    named = config.to_hf() | {"layers_block_type": ["mamba", "attention", "moe", "mlp", "mamba", "moe"]}
    assert ModelConfig.from_hf(named) == config


def test_transformers_reads_ours_and_we_read_theirs(small_config, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = small_config()
    theirs = transformers.NemotronHConfig(**config.to_hf())
    for name in ("layers_block_type", "mtp_layers_block_type", "n_groups", "mamba_num_heads", "n_group",
                 "topk_group", "routed_scaling_factor", "moe_latent_size", "num_nextn_predict_layers"):
        value = getattr(config, name)
        assert getattr(theirs, name) == (list(value) if isinstance(value, tuple) else value), name
    assert ModelConfig.from_hf(theirs.to_dict()) == config  # to_dict adds generic keys such as id2label
    theirs.save_pretrained(tmp_path)
    assert ModelConfig.from_hf(tmp_path) == config


@pytest.mark.parametrize("source, message", [
    ({"model_type": "llama", "layers_block_type": ["moe"]}, "model_type is 'llama', expected 'nemotron_h'"),
    ({"hidden_size": 64}, "neither layers_block_type nor hybrid_override_pattern"),
    ({"hybrid_override_pattern": "M?"}, r"unknown layer character '\?'"),
    ({"hybrid_override_pattern": "M", "hiden_size": 64}, r"unknown nemotron_h fields \['hiden_size'\]"),
    ({"hybrid_override_pattern": "M", "mamba_num_heads": 6, "n_groups": 4}, "mamba_num_heads"),
])
def test_from_hf_rejects_bad_configs(source, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(source)


def test_from_hf_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        ModelConfig.from_hf(tmp_path)


# ------------------------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds(name):
    config = preset(name)
    if name in ("tiny", "bench22m"):
        model = HybridLM(config)  # real memory
        ids = torch.randint(0, config.vocab_size, (1, 8))
        assert model(ids).logits.shape == (1, 8, config.vocab_size)
    else:
        model = HybridLM.on_meta(config)
        assert all(p.is_meta for p in model.parameters())
    assert len(model.backbone.layers) == config.num_hidden_layers


def test_tiny_has_every_layer_kind_latent_moe_and_mtp():
    config = tiny()
    assert set(config.layers_block_type) == {"linear_attention", "full_attention", "moe", "mlp"}
    assert config.moe_latent_size is not None and config.has_mtp
    assert 1e6 < HybridLM(config).num_parameters() < 10e6


def test_bench22m_is_the_spec_benchmark_config():
    assert HybridLM(preset("bench22m")).num_parameters() == pytest.approx(22.6e6, rel=0.01)


@pytest.mark.parametrize("build, counts, layers", [(nano3, (23, 23, 6), 52), (super3, (40, 40, 8), 88),
                                                   (ultra3, (48, 48, 12), 108)])
def test_published_layouts(build, counts, layers):
    config = build()
    kinds = config.layers_block_type
    assert len(kinds) == layers
    assert (kinds.count("linear_attention"), kinds.count("moe"), kinds.count("full_attention")) == counts


def test_ultra3_numbers_the_report_quotes():
    config = ultra3()
    attention = tuple(i for i, kind in enumerate(config.layers_block_type) if kind == "full_attention")
    assert attention == ULTRA3_ATTENTION_LAYERS
    assert max_violation_bound(config.n_routed_experts, config.num_experts_per_tok) == pytest.approx(23.27, abs=0.01)
    mamba_layers = config.layers_block_type.count("linear_attention")
    state_bytes = config.mamba_num_heads * config.mamba_head_dim * config.ssm_state_size * 4 * mamba_layers
    assert state_bytes == 384 * 2 ** 20
    fp8_kv_bytes_per_token = 12 * config.num_key_value_heads * config.head_dim * 2
    assert fp8_kv_bytes_per_token == 6144
    assert super3().has_mtp and ultra3().has_mtp and not nano3().has_mtp


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'mega'; expected one of tiny"):
        preset("mega")
