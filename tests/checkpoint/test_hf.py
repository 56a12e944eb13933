"""HF-layout checkpoints: parity with transformers' NemotronHForCausalLM both ways, round trips, and clear errors.

Parity: for three random configs (latent and plain MoE, grouped routing, routed_scaling_factor != 1, dense MLP
layers, MHA / GQA / MQA, random non-zero router bias) our checkpoint loads in transformers and theirs loads here;
fp32 logits agree to 1e-4 max abs and greedy generation of 32 tokens is identical.

transformers clamps dt at time_step_min in prefill (and not in decode); we follow time_step_limit (0, inf) as
NVIDIA's code does (docs/LOG.md, 2026-12-01, "dt clamp"). The parity weights therefore keep dt above time_step_min: dt_bias
is drawn in [0.5, 1.5] so softplus(dt_raw + dt_bias) stays far above 1e-3, and `track_min_dt` checks it on every
Mamba layer during the forwards compared.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hybridtron.checkpoint.hf import INDEX_FILE, SINGLE_FILE, CheckpointError, load_pretrained, save_pretrained
from hybridtron.infer.cache import HybridCache
from hybridtron.model.lm import HybridLM
from hybridtron.model.mamba2 import Mamba2Mixer

transformers = pytest.importorskip("transformers")

LOGITS_ATOL = 1e-4
NEW_TOKENS = 32

PARITY_CONFIGS = {
    "latent_grouped_gqa": dict(
        layers_block_type="M*E-ME", moe_latent_size=16, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        num_attention_heads=4, num_key_value_heads=2, num_nextn_predict_layers=1),
    "plain_moe_mha_unnormalised": dict(
        layers_block_type="ME*M-E*", moe_latent_size=None, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
        topk_group=1, norm_topk_prob=False, routed_scaling_factor=0.7, num_attention_heads=4, num_key_value_heads=4,
        num_nextn_predict_layers=0),
    "latent_mqa_three_groups": dict(
        layers_block_type="*MEM-ME", vocab_size=200, moe_latent_size=24, n_routed_experts=12, num_experts_per_tok=4,
        n_group=3, topk_group=2, routed_scaling_factor=5.0, num_attention_heads=6, num_key_value_heads=1,
        head_dim=8, mamba_num_heads=8, n_groups=4, chunk_size=4, num_nextn_predict_layers=1),
}


def parity_config(small_config, name):
    # eos_token_id=None: generation never stops early, so both sides emit exactly NEW_TOKENS tokens
    return small_config(initializer_range=0.1, eos_token_id=None, **PARITY_CONFIGS[name])


@torch.no_grad()
def randomise_for_parity(named_modules, dt_bias_range=(0.5, 1.5)):
    """Non-zero router biases, and dt_bias high enough that dt stays above time_step_min (see the module doc)."""
    for name, module in named_modules:
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.uniform_(-0.1, 0.1)
        if hasattr(module, "dt_bias"):
            module.dt_bias.uniform_(*dt_bias_range)
        if hasattr(module, "D") and hasattr(module, "A_log"):
            module.D.uniform_(0.5, 1.5)


@contextlib.contextmanager
def track_min_dt(model: HybridLM):
    """Record the smallest dt any Mamba layer of our model computes while the block runs."""
    seen = []

    def hook(mixer):
        def record(_module, _inputs, output):
            dt, _ = mixer.discretize(mixer.split_projection(output)[2])
            seen.append(float(dt.min()))
        return record

    handles = [m.in_proj.register_forward_hook(hook(m)) for m in model.modules() if isinstance(m, Mamba2Mixer)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def greedy_ours(model: HybridLM, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """A simple greedy loop: prefill the prompt into a HybridCache, then feed back one argmax token at a time."""
    cache = HybridCache.allocate(model.config, batch=prompt.shape[0], max_len=prompt.shape[1] + new_tokens)
    logits = model(prompt, cache=cache).logits[:, -1]
    tokens = []
    for step in range(new_tokens):
        tokens.append(logits.argmax(-1, keepdim=True))
        if step + 1 < new_tokens:
            logits = model(tokens[-1], cache=cache).logits[:, -1]
    return torch.cat(tokens, 1)


@torch.no_grad()
def greedy_theirs(hf_model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    out = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                            do_sample=False, pad_token_id=0)
    return out[:, prompt.shape[1]:]


def assert_parity(ours: HybridLM, theirs, config):
    ours.eval()
    theirs.eval()
    prompt = torch.randint(0, config.vocab_size, (2, 19))
    with torch.no_grad(), track_min_dt(ours) as dts:
        our_logits = ours(prompt).logits
        our_tokens = greedy_ours(ours, prompt, NEW_TOKENS)
    with torch.no_grad():
        their_logits = theirs(prompt).logits
    assert min(dts) > config.time_step_min, "parity weights must keep dt above time_step_min (module doc)"
    assert our_logits.abs().max() > 1.0  # logits with real spread, so the comparison means something
    assert (our_logits - their_logits).abs().max() <= LOGITS_ATOL
    their_tokens = greedy_theirs(theirs, prompt, NEW_TOKENS)
    assert our_tokens.shape == (2, NEW_TOKENS)
    assert torch.equal(our_tokens, their_tokens)
    assert len(set(our_tokens.flatten().tolist())) > 4  # not a degenerate repetition


def load_theirs(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_our_checkpoint_loads_in_transformers(small_config, name, tmp_path):
    config = parity_config(small_config, name)
    ours = HybridLM(config)
    randomise_for_parity(ours.named_modules())
    # one config is written in small shards with an index, which transformers must read too
    save_pretrained(ours, tmp_path, **({"max_shard_bytes": 40_000} if name == "latent_grouped_gqa" else {}))
    if name == "latent_grouped_gqa":
        assert (tmp_path / INDEX_FILE).is_file() and len(list(tmp_path.glob("model-*.safetensors"))) > 2
    theirs = load_theirs(tmp_path)
    # every weight transformers models came from our file (it ignores only mtp.*)
    their_state = theirs.state_dict()
    for our_name, tensor in ours.state_dict().items():
        if not our_name.startswith("mtp."):
            their_name = our_name.replace("backbone.", "model.", 1)
            assert torch.equal(their_state[their_name], tensor), our_name
    assert_parity(ours, theirs, config)


@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_transformers_checkpoint_loads_here(small_config, name, tmp_path):
    config = parity_config(small_config, name)
    hf_config = transformers.NemotronHConfig(**config.replace(num_nextn_predict_layers=0).to_hf())
    torch.manual_seed(1)
    theirs = transformers.NemotronHForCausalLM(hf_config)
    randomise_for_parity(theirs.named_modules())
    theirs.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert ours.config == config.replace(num_nextn_predict_layers=0)
    assert_parity(ours, theirs, ours.config)


# --------------------------------------------------------------------------------------------- round trips
def test_round_trip_is_bit_exact_including_mtp(small_config, tmp_path):
    config = small_config()
    model = HybridLM(config)
    randomise_for_parity(model.named_modules())
    save_pretrained(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    assert loaded.config == config
    original, restored = model.state_dict(), loaded.state_dict()
    assert original.keys() == restored.keys()
    assert any(name.startswith("mtp.") for name in original)
    for name, tensor in original.items():
        assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor), name
    ids = torch.randint(0, config.vocab_size, (1, 10))
    with torch.no_grad():
        a, b = model(ids), loaded(ids)
    assert torch.equal(a.logits, b.logits) and all(torch.equal(x, y) for x, y in zip(a.mtp_logits, b.mtp_logits))


def test_on_disk_names_are_nvidias(small_config, tmp_path):
    config = small_config()
    save_pretrained(HybridLM(config), tmp_path)
    with safe_open(tmp_path / SINGLE_FILE, framework="pt") as handle:
        names = set(handle.keys())
    expected_subset = {
        "backbone.embeddings.weight", "backbone.norm_f.weight", "lm_head.weight", "backbone.layers.0.norm.weight",
        "backbone.layers.0.mixer.in_proj.weight", "backbone.layers.0.mixer.conv1d.weight",
        "backbone.layers.0.mixer.dt_bias", "backbone.layers.0.mixer.A_log", "backbone.layers.0.mixer.D",
        "backbone.layers.0.mixer.norm.weight", "backbone.layers.1.mixer.q_proj.weight",
        "backbone.layers.2.mixer.gate.weight", "backbone.layers.2.mixer.gate.e_score_correction_bias",
        "backbone.layers.2.mixer.fc1_latent_proj.weight", "backbone.layers.2.mixer.fc2_latent_proj.weight",
        "backbone.layers.2.mixer.experts.7.up_proj.weight", "backbone.layers.2.mixer.experts.0.down_proj.weight",
        "backbone.layers.2.mixer.shared_experts.up_proj.weight", "backbone.layers.3.mixer.up_proj.weight",
        "mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.norm.weight", "mtp.layers.0.mixer.o_proj.weight", "mtp.layers.1.norm.weight",
        "mtp.layers.1.mixer.experts.3.up_proj.weight", "mtp.layers.1.final_layernorm.weight",
    }
    assert expected_subset <= names
    assert not any(name.endswith("experts.up_proj") or name.endswith("experts.down_proj") for name in names)
    config_json = json.loads((tmp_path / "config.json").read_text())
    assert config_json["model_type"] == "nemotron_h" and config_json["architectures"] == ["NemotronHForCausalLM"]


def test_bf16_save_keeps_router_fp32(small_config, tmp_path):
    model = HybridLM(small_config())
    with torch.no_grad():
        for bias in model.router_biases():
            bias.copy_(64.0 + torch.arange(bias.numel()) * 1e-3)
    save_pretrained(model, tmp_path, dtype=torch.bfloat16)
    tensors = load_file(tmp_path / SINGLE_FILE)
    for name, tensor in tensors.items():
        router = name.endswith("gate.weight") or name.endswith("e_score_correction_bias")
        assert tensor.dtype == (torch.float32 if router else torch.bfloat16), name
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_pretrained(tmp_path)
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(loaded.router_biases(), model.router_biases()))
    assert load_pretrained(tmp_path, dtype=torch.float32).lm_head.weight.dtype == torch.float32


def test_sharded_round_trip_and_overwrite(small_config, tmp_path):
    model = HybridLM(small_config())
    target = tmp_path / "ckpt"
    save_pretrained(model, target, max_shard_bytes=30_000)
    index = json.loads((target / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and shards == sorted(p.name for p in target.glob("model-*.safetensors"))
    assert set(index["weight_map"]) == set(load_all(target))
    loaded = load_pretrained(target)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    # saving again, unsharded, into the same directory leaves no stale shard or index behind
    save_pretrained(model, target, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["config.json", SINGLE_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging directories left


def load_all(directory):
    tensors = {}
    for path in directory.glob("*.safetensors"):
        tensors.update(load_file(path))
    return tensors


# ------------------------------------------------------------------------------------------ bad checkpoints
@pytest.fixture
def saved(small_config, tmp_path):
    save_pretrained(HybridLM(small_config()), tmp_path)
    return tmp_path


def rewrite_weights(directory, edit):
    tensors = load_file(directory / SINGLE_FILE)
    edit(tensors)
    save_file(tensors, directory / SINGLE_FILE)


def test_missing_unexpected_and_misshaped_are_listed_together(saved):
    def edit(tensors):
        del tensors["backbone.layers.1.mixer.k_proj.weight"]
        del tensors["backbone.norm_f.weight"]
        tensors["backbone.layers.0.mixer.extra.weight"] = torch.zeros(2)
        tensors["lm_head.weight"] = torch.zeros(3, 48)
    rewrite_weights(saved, edit)
    with pytest.raises(CheckpointError) as info:
        load_pretrained(saved)
    message = str(info.value)
    assert "missing (2): backbone.layers.1.mixer.k_proj.weight, backbone.norm_f.weight" in message
    assert "unexpected (1): backbone.layers.0.mixer.extra.weight" in message
    assert "mis-shaped (1): lm_head.weight: checkpoint (3, 48), model (128, 48)" in message
    assert "hint" not in message
    assert isinstance(info.value, ValueError)


def test_missing_expert_tensor_names_the_expert(saved):
    rewrite_weights(saved, lambda t: t.pop("backbone.layers.2.mixer.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"layers.2.mixer.experts.up_proj: expert tensors missing for "
                                              r"experts \[5\]"):
        load_pretrained(saved)


def test_checkpoint_without_mtp_hints_at_num_nextn_predict_layers(saved):
    """transformers drops mtp.* when it saves, but keeps num_nextn_predict_layers=1 in config.json."""
    rewrite_weights(saved, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("mtp.")]])
    with pytest.raises(CheckpointError, match=r"hint: the checkpoint has no MTP block .*num_nextn_predict_layers=0"):
        load_pretrained(saved)
    model = load_pretrained(saved, num_nextn_predict_layers=0)
    assert model.mtp is None


def test_missing_shards_are_listed(small_config, tmp_path):
    save_pretrained(HybridLM(small_config()), tmp_path, max_shard_bytes=30_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[0].unlink()
    shards[2].unlink()
    with pytest.raises(FileNotFoundError, match=f"missing: {shards[0].name}, {shards[2].name}"):
        load_pretrained(tmp_path)


def test_invalid_index_json(small_config, tmp_path):
    save_pretrained(HybridLM(small_config()), tmp_path, max_shard_bytes=30_000)
    (tmp_path / INDEX_FILE).write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: not a safetensors index"):
        load_pretrained(tmp_path)
    (tmp_path / INDEX_FILE).write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=r"expected JSON with a 'weight_map'"):
        load_pretrained(tmp_path)


def test_missing_or_invalid_config_json(saved, tmp_path):
    (saved / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        load_pretrained(saved)
    (saved / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_pretrained(saved)


def test_missing_weights_or_directory(small_config, tmp_path):
    (tmp_path / "config.json").write_text(small_config().to_json())
    with pytest.raises(FileNotFoundError, match=f"neither {SINGLE_FILE} nor {INDEX_FILE}"):
        load_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        load_pretrained(tmp_path / "nowhere")
