"""The Marin architecture options (docs/model.md "Architecture options (Marin)"): the MoE latent and output norms and
sliding-window attention, each against its `_ref` twin forward and backward; a window is never exceeded (the
gradient of output t with respect to input s is zero once t - s >= window); bad values are one line naming the
field; with every option off the model has the parameters it always had."""

from __future__ import annotations

import pytest
import torch

from hybridtron.config import ATTENTION, ModelConfig, tiny
from hybridtron.model.attention import WINDOW_QUERY_BLOCK, Attention, attention_ref
from hybridtron.model.lm import HybridLM
from hybridtron.model.moe import moe_ref
from test_blocks import check_against_ref, random_moe

DTYPES = [torch.float32, torch.bfloat16]


# ----------------------------------------------------------------------------------------------------- config
def test_defaults_are_off_and_keep_the_parameter_names(small_config):
    config = small_config()
    assert (config.moe_latent_norm, config.moe_output_norm, config.sliding_window) == (False, False, None)
    assert config.windowed_layers == ()
    plain = set(HybridLM.on_meta(config).state_dict())
    assert not any("latent_norm" in name or "output_norm" in name for name in plain)
    normed = set(HybridLM.on_meta(config.replace(moe_latent_norm=True, moe_output_norm=True)).state_dict())
    moe_mixers = ["backbone.layers.2.mixer", "mtp.layers.1.mixer"]  # "M*E-ME" has its MoE at 2 and 5, MTP at 1
    moe_mixers.insert(1, "backbone.layers.5.mixer")
    added = {f"{mixer}.{norm}.weight" for mixer in moe_mixers for norm in ("latent_norm", "output_norm")}
    assert normed - plain == added and plain <= normed
    # the config.json of a model without the options is the one written before they existed
    assert not {"moe_latent_norm", "moe_output_norm", "sliding_window", "sliding_window_layers"} & set(config.to_hf())


def test_default_window_layers_are_three_of_every_four_attention_layers():
    config = tiny(layers_block_type="*M*M*M*M*M*", sliding_window=16, num_nextn_predict_layers=0)
    attention = [i for i, kind in enumerate(config.layers_block_type) if kind == ATTENTION]
    assert attention == [0, 2, 4, 6, 8, 10]
    assert config.windowed_layers == (0, 2, 4, 8, 10)  # the 4th attention layer (6) stays full
    model = HybridLM.on_meta(config)
    windows = [layer.mixer.sliding_window for layer in model.backbone.layers if layer.kind == ATTENTION]
    assert windows == [16, 16, 16, None, 16, 16]
    explicit = config.replace(sliding_window_layers=[6])
    assert explicit.windowed_layers == (6,) and explicit.attention_window(6) == 16
    assert explicit.attention_window(0) is None
    assert model.mtp is None or all(getattr(layer.mixer, "sliding_window", None) is None for layer in model.mtp.layers)


@pytest.mark.parametrize("overrides, message", [
    (dict(sliding_window=0), "sliding_window must be a positive number of tokens or None, got 0"),
    (dict(sliding_window=-3), "sliding_window must be a positive number of tokens or None, got -3"),
    (dict(sliding_window=2.5), "sliding_window must be a positive number of tokens or None, got 2.5"),
    (dict(sliding_window=8, sliding_window_layers=[9]), r"sliding_window_layers: 9 is not a layer index in \[0, 6\)"),
    (dict(sliding_window=8, sliding_window_layers=[-1]), r"sliding_window_layers: -1 is not a layer index"),
    (dict(sliding_window=8, sliding_window_layers=[0]), "sliding_window_layers: layer 0 is 'linear_attention', not "
                                                        "an attention layer"),
    (dict(sliding_window=8, sliding_window_layers=[1, 1]), r"sliding_window_layers: \[1, 1\] names a layer twice"),
    (dict(sliding_window_layers=[1]), r"sliding_window_layers is \[1\] but sliding_window is None"),
    (dict(sliding_window=8, sliding_window_layers="1"), "sliding_window_layers must be a list of layer indices"),
    (dict(moe_latent_norm=True, moe_latent_size=None), "moe_latent_norm: normalises the LatentMoE latent, but "
                                                       "moe_latent_size is None"),
    (dict(moe_output_norm="yes"), "moe_output_norm must be true or false, got 'yes'"),
])
def test_bad_values_are_one_line_naming_the_field(small_config, overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        small_config(**overrides)
    assert "\n" not in str(error.value)


def test_eight_queries_per_kv_head_builds_and_matches_the_reference(small_config):
    """The query-to-KV ratio is num_attention_heads / num_key_value_heads: 8:1 as Marin ran it."""
    config = small_config(num_attention_heads=8, num_key_value_heads=1, head_dim=8)
    attention = Attention(config)
    assert attention.k_proj.weight.shape == (8, config.hidden_size) and attention.q_proj.weight.shape == (64, 48)
    check_against_ref(attention, lambda m, x: m(x), attention_ref, torch.randn(2, 13, 48), dtype=torch.float32)
    HybridLM(config)(torch.randint(0, 128, (1, 9)))


# ---------------------------------------------------------------------------------------------------- MoE norms
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("latent_norm, output_norm, latent_size", [
    (True, False, 16), (False, True, 16), (True, True, 16), (False, True, None)])
def test_moe_norms_match_ref(small_config, dtype, latent_norm, output_norm, latent_size):
    moe = random_moe(small_config(moe_latent_norm=latent_norm, moe_output_norm=output_norm,
                                  moe_latent_size=latent_size))
    with torch.no_grad():  # weights away from 1, so a norm applied twice or not at all shows
        for norm in (moe.latent_norm, moe.output_norm):
            if norm is not None:
                norm.weight.uniform_(0.5, 1.5)
    check_against_ref(moe, lambda m, x: m(x), moe_ref, torch.randn(3, 11, 48), dtype=dtype)


def test_moe_norms_normalise_what_they_say(small_config):
    moe = random_moe(small_config(moe_latent_norm=True, moe_output_norm=True))
    x = torch.randn(5, 48) * 7
    latent = moe.expert_input(x)
    torch.testing.assert_close(latent.pow(2).mean(-1), torch.ones(5), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(moe(x[None]).pow(2).mean(-1), torch.ones(1, 5), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(moe.decode_step(x), moe(x[None])[0], rtol=1e-5, atol=1e-5)


def test_moe_norm_weights_are_initialised_to_one_and_trained(small_config):
    model = HybridLM(small_config(moe_latent_norm=True, moe_output_norm=True))
    norms = {name: p for name, p in model.named_parameters() if "latent_norm" in name or "output_norm" in name}
    assert norms and all(bool((p == 1).all()) for p in norms.values())
    ids = torch.randint(0, 128, (2, 12))
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in norms.values())


# ------------------------------------------------------------------------------------------------- windows
def windowed_attention(config: ModelConfig, window: int) -> Attention:
    attention = Attention(config, sliding_window=window)
    with torch.no_grad():  # larger weights: sharper softmax, so a key let in or left out moves the output
        for linear in (attention.q_proj, attention.k_proj):
            linear.weight.mul_(2)
    return attention


# a window of one token in fp32 only: q_proj and k_proj then get no gradient, which a bf16 relative error cannot judge
WINDOW_CASES = [(torch.float32, 1, 9)] + [(dtype, window, length) for dtype in DTYPES for window, length in
                                          [(4, 17), (7, 7), (30, 12), (5, WINDOW_QUERY_BLOCK + 37)]]


@pytest.mark.parametrize("dtype, window, length", WINDOW_CASES)
def test_windowed_attention_matches_ref(small_config, dtype, window, length):
    """Fast (blocks of queries over the keys their windows reach) vs the dense-mask reference, including a window
    of one token, one equal to the sequence, one past it, and a sequence of more than one query block."""
    attention = windowed_attention(small_config(), window)
    check_against_ref(attention, lambda m, x: m(x), attention_ref, torch.randn(2, length, 48), dtype=dtype)


@pytest.mark.parametrize("window", [3, 6])
def test_windowed_attention_within_documents_matches_ref(small_config, window):
    """seq_idx and the window together: each query sees its own document's last `window` positions."""
    attention = windowed_attention(small_config(), window)
    seq_idx = torch.tensor([[0] * 5 + [1] * 11 + [2] * 4, [0] * 20])
    check_against_ref(attention, lambda m, x: m(x, seq_idx=seq_idx), lambda m, x: attention_ref(m, x, seq_idx),
                      torch.randn(2, 20, 48), dtype=torch.float32)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_a_token_never_attends_beyond_its_window(small_config, window):
    """d out[t] / d in[s] is zero exactly when s > t or t - s >= window (the fast path, also across query blocks)."""
    attention = windowed_attention(small_config(), window)
    length = 2 * 8 + 5
    x = torch.randn(1, length, 48)
    jacobian = torch.autograd.functional.jacobian(lambda h: attention(h).sum(-1), x)[0, :, 0]  # [t, s, D]
    reaches = jacobian.abs().sum(-1) > 0
    t, s = torch.meshgrid(torch.arange(length), torch.arange(length), indexing="ij")
    assert torch.equal(reaches, (s <= t) & (t - s < window))


def test_windowed_training_forward_holds_no_dense_mask(small_config, monkeypatch):
    """Every SDPA call of a windowed layer sees at most block + window - 1 keys, whatever the sequence length."""
    import torch.nn.functional as F

    calls = []
    real_sdpa = F.scaled_dot_product_attention

    def counting_sdpa(q, k, v, **kwargs):
        calls.append((q.shape[2], k.shape[2]))
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    window, length = 16, 3 * WINDOW_QUERY_BLOCK + 5
    windowed_attention(small_config(), window)(torch.randn(1, length, 48))
    assert len(calls) == 4 and max(keys for _, keys in calls) <= WINDOW_QUERY_BLOCK + window - 1


def test_windowed_model_logits_and_losses_match_the_reference_mixers(small_config):
    """The whole model with every option on: forward through the blocks equals forward with every attention and
    MoE mixer replaced by its reference."""
    from hybridtron.config import MOE
    from hybridtron.model.block import run_mixer

    config = small_config(layers_block_type="M*E*ME", sliding_window=3, moe_latent_norm=True, moe_output_norm=True)
    model = HybridLM(config)
    assert config.windowed_layers == (1, 3)

    def ref_mixer(kind, mixer, normed, *args, **kwargs):
        if kind == ATTENTION:
            return attention_ref(mixer, normed)
        if kind == MOE:
            return moe_ref(mixer, normed)
        return run_mixer(kind, mixer, normed, *args, **kwargs)

    ids = torch.randint(0, 128, (2, 14))
    torch.testing.assert_close(model(ids, mixer_fn=ref_mixer).logits, model(ids).logits, rtol=1e-4, atol=1e-5)


def test_context_parallelism_refuses_a_windowed_model(small_config):
    from hybridtron.distributed.context_parallel import apply_context_parallel

    model = HybridLM.on_meta(small_config(sliding_window=4))
    for form in ("all-gather", "ring"):
        with pytest.raises(ValueError, match=f"sliding_window is not supported with dist.cp_attention = '{form}'"):
            apply_context_parallel(model, None, form)
