"""Every block against its pure-torch `_ref` twin, forward and backward (grads of the inputs and of every parameter).

fp32: the fast path and the reference agree to float32 rounding (tolerances below).
bf16: the fast path runs with bf16 weights and activations and is judged against the fp32 reference (fp32 weights)
by an error budget on ||fast_bf16 - ref_fp32|| / ||ref_fp32|| (bf16's epsilon is 2^-8 = 3.9e-3):
- outputs and input gradients: BF16_OUTPUT_BUDGET (measured: 0.4-0.8e-2);
- weight gradients, sums over every token: BF16_PARAM_GRAD_BUDGET (measured: up to 1.1e-2);
- the Mamba per-head scalars dt_bias, A_log, D: BF16_HEAD_PARAM_BUDGET. Their gradient is one sum over batch x time
  x head_dim of terms that largely cancel, so its relative error is amplified: over 20 seeds the fast path averages
  2.0e-2 on dt_bias and the reference run in bf16 1.7e-2, with tails of 5-17e-2 for both (a property of bf16, not
  of the fast path; the fast path's error on the weight matrices is lower than the bf16 reference's).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybridtron.model.attention import Attention, attention_ref
from hybridtron.model.mamba2 import Mamba2Mixer, mamba2_mixer_ref
from hybridtron.model.mlp import MLP, mlp_ref
from hybridtron.model.moe import MoE, RoutedExperts, moe_ref, routed_experts_ref
from hybridtron.model.norm import GatedGroupRMSNorm, RMSNorm
from hybridtron.model.state import MambaState

FP32 = dict(rtol=1e-4, atol=1e-5)
BF16_OUTPUT_BUDGET = 1.5e-2  # about 4 bf16 epsilons
BF16_PARAM_GRAD_BUDGET = 3e-2  # about 8 bf16 epsilons
BF16_HEAD_PARAM_BUDGET = 1e-1
HEAD_PARAMS = ("dt_bias", "A_log", "D")


def forward_backward(fn, module, *inputs):
    """Run `fn(module, *inputs)`, backpropagate a fixed random cotangent, return (output, {name: grad})."""
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    module.zero_grad(set_to_none=True)
    out = fn(module, *leaves)
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(1234))
    (out.float() * cotangent).sum().backward()
    grads = {f"input {i}": x.grad.float() for i, x in enumerate(leaves) if x.grad is not None}
    grads.update({name: p.grad.float() for name, p in module.named_parameters() if p.grad is not None})
    return out.detach().float(), grads


def assert_fp32_match(fast, ref):
    (out, grads), (out_ref, grads_ref) = fast, ref
    torch.testing.assert_close(out, out_ref, **FP32)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], **FP32, msg=lambda m: f"grad of {name}: {m}")


def relative_error(value, reference):
    return float((value - reference).norm() / reference.norm().clamp_min(1e-30))


def assert_bf16_within_budget(fast, ref):
    (out, grads), (out_ref, grads_ref) = fast, ref
    assert relative_error(out, out_ref) < BF16_OUTPUT_BUDGET
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        budget = BF16_OUTPUT_BUDGET if name.startswith("input") else \
            BF16_HEAD_PARAM_BUDGET if name in HEAD_PARAMS else BF16_PARAM_GRAD_BUDGET
        error = relative_error(grads[name], grads_ref[name])
        assert error < budget, f"grad of {name}: relative error {error:.3g} over the bf16 budget {budget}"


def check_against_ref(module, fast_fn, ref_fn, *inputs, dtype):
    """fp32: fast vs ref on the same module. bf16: fast on a bf16 copy vs ref in fp32 (same bf16-rounded inputs)."""
    if dtype == torch.float32:
        assert_fp32_match(forward_backward(fast_fn, module, *inputs), forward_backward(ref_fn, module, *inputs))
    else:
        low = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
        fast = forward_backward(fast_fn, copy.deepcopy(module).to(dtype), *low)
        ref = forward_backward(ref_fn, module, *[x.float() if x.is_floating_point() else x for x in low])
        assert_bf16_within_budget(fast, ref)


DTYPES = [torch.float32, torch.bfloat16]


# ----------------------------------------------------------------------------------------------------- norms
def test_rmsnorm_formula():
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16)
    expected = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x), expected, **FP32)


def test_rmsnorm_normalises_a_lower_precision_input_in_fp32():
    """An input in another dtype than the weight (bf16 activations, fp32 weight): normalised in fp32, rounded to
    the input's dtype, then scaled by the weight."""
    norm = RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16).bfloat16()
    x32 = x.float()
    expected = norm.weight * (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    torch.testing.assert_close(norm(x), expected, **FP32)


def test_gated_group_rmsnorm_gates_before_normalising_each_group():
    norm = GatedGroupRMSNorm(12, group_size=4, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    y, z = torch.randn(2, 3, 12), torch.randn(2, 3, 12)
    gated = (y * z * torch.sigmoid(z)).unflatten(-1, (3, 4))
    expected = norm.weight * (gated / torch.sqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-5)).flatten(-2)
    torch.testing.assert_close(norm(y, z), expected, **FP32)


# ------------------------------------------------------------------------------------------------------- MLP
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden, intermediate, bias, shape", [(32, 64, False, (2, 7)), (24, 40, True, (1, 33))])
def test_mlp_matches_ref(dtype, hidden, intermediate, bias, shape):
    mlp = MLP(hidden, intermediate, bias)
    x = torch.randn(*shape, hidden)
    check_against_ref(mlp, lambda m, x: m(x), mlp_ref, x, dtype=dtype)


# ------------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, batch, length",
    [(4, 4, 8, 2, 9), (4, 2, 16, 2, 17), (6, 2, 8, 1, 24), (8, 1, 8, 3, 5)],  # MHA, GQA 2:1, 3:1, MQA
)
def test_attention_matches_ref(small_config, dtype, heads, kv_heads, head_dim, batch, length):
    config = small_config(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    attention = Attention(config)
    x = torch.randn(batch, length, config.hidden_size)
    check_against_ref(attention, lambda m, x: m(x), attention_ref, x, dtype=dtype)


def test_attention_is_causal_and_has_no_positional_encoding(small_config):
    """Changing a later token leaves earlier outputs alone; with no position signal, a token's output only
    depends on the set of keys it sees, so permuting the prefix before the last token leaves its output unchanged."""
    attention = Attention(small_config())
    x = torch.randn(1, 10, small_config().hidden_size)
    changed = x.clone()
    changed[:, 7:] = torch.randn(1, 3, x.shape[-1])
    with torch.no_grad():
        out, out_changed = attention(x), attention(changed)
        torch.testing.assert_close(out[:, :7], out_changed[:, :7], rtol=0, atol=1e-6)
        permuted = torch.cat([x[:, torch.randperm(9)], x[:, 9:]], dim=1)
        torch.testing.assert_close(attention(permuted)[:, -1], out[:, -1], **FP32)


# --------------------------------------------------------------------------------------------------- Mamba-2
MAMBA_VARIANTS = {
    "groups2_chunk8_len21": dict(overrides=dict(n_groups=2, chunk_size=8), length=21),
    "groups1_chunk16_len16": dict(overrides=dict(n_groups=1, chunk_size=16), length=16),
    "groups4_kernel2_len5": dict(overrides=dict(mamba_num_heads=8, n_groups=4, conv_kernel=2, chunk_size=4),
                                 length=5),
    "biases_no_conv_bias": dict(overrides=dict(use_bias=True, use_conv_bias=False, chunk_size=8), length=19),
    "time_step_limit": dict(overrides=dict(time_step_limit=(0.02, 0.5), chunk_size=8), length=12),
    "groups2_chunk16_len29": dict(overrides=dict(chunk_size=16), length=29),
}


def mamba_mixer(small_config, overrides) -> Mamba2Mixer:
    """A mixer initialised as HybridLM does (A_log = log(1..H), dt in [time_step_min, time_step_max]), with biases
    and the gated norm's weight randomised so every parameter matters."""
    from hybridtron.model.lm import HybridLM

    config = small_config(layers_block_type=("linear_attention",), **overrides)
    mixer = HybridLM(config).backbone.layers[0].mixer
    with torch.no_grad():
        mixer.norm.weight.uniform_(0.5, 1.5)
        mixer.D.uniform_(0.5, 1.5)
        for bias in (mixer.in_proj.bias, mixer.out_proj.bias, mixer.conv1d.bias):
            if bias is not None:
                bias.normal_(0.0, 0.1)
        mixer.in_proj.weight.mul_(10)  # unit-scale activations, so the scan is exercised at realistic magnitude
    return mixer


def mamba_ref_output(mixer, x, state=None):
    return mamba2_mixer_ref(mixer, x, state)[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(MAMBA_VARIANTS))
def test_mamba_mixer_matches_ref(small_config, variant, dtype):
    spec = MAMBA_VARIANTS[variant]
    mixer = mamba_mixer(small_config, spec["overrides"])
    x = torch.randn(2, spec["length"], mixer.in_proj.in_features)
    check_against_ref(mixer, lambda m, x: m(x), mamba_ref_output, x, dtype=dtype)


def random_state(mixer, batch):
    kernel = mixer.conv1d.kernel_size[0]
    return (torch.randn(batch, mixer.conv_channels, kernel - 1),
            torch.randn(batch, mixer.num_heads, mixer.head_dim, mixer.state_size) * 0.5)


@pytest.mark.parametrize("length", [1, 6, 19, 40])  # one token, shorter than a chunk, several chunks
def test_mamba_mixer_continues_from_initial_state(small_config, length):
    """With a MambaState the forward (the chunked scan) continues from it and leaves the final conv and SSM state in
    it; the reference takes the same state explicitly. Outputs, states, and gradients agree."""
    mixer = mamba_mixer(small_config, dict(chunk_size=8))
    x = torch.randn(2, length, mixer.in_proj.in_features)
    conv, ssm = random_state(mixer, 2)

    def fast(m, x):
        state = MambaState(conv.clone(), ssm.clone())
        out = m(x, state)
        fast.final = (state.conv_BCK.detach(), state.ssm_BHPN.detach())
        return out

    def ref(m, x):
        out, final = mamba2_mixer_ref(m, x, (conv, ssm))
        ref.final = tuple(t.detach() for t in final)
        return out

    assert_fp32_match(forward_backward(fast, mixer, x), forward_backward(ref, mixer, x))
    torch.testing.assert_close(fast.final[0], ref.final[0], **FP32)
    torch.testing.assert_close(fast.final[1], ref.final[1], **FP32)


def test_mamba_mixer_state_passing_equals_one_pass(small_config):
    """Prefill in three calls through one MambaState equals a single call without state."""
    mixer = mamba_mixer(small_config, dict(chunk_size=8))
    x = torch.randn(2, 23, mixer.in_proj.in_features)
    conv, ssm = random_state(mixer, 2)
    state = MambaState(conv.zero_(), ssm.zero_())
    with torch.no_grad():
        whole = mixer(x)
        pieces = [mixer(x[:, a:b], state) for a, b in ((0, 9), (9, 10), (10, 23))]
    torch.testing.assert_close(torch.cat(pieces, 1), whole, **FP32)


def test_mamba_dt_follows_time_step_limit_only(small_config):
    """dt = clamp(softplus(dt_raw + dt_bias), time_step_limit). The default limit (0, inf) leaves a dt below
    time_step_min alone (transformers clamps it there in prefill; NVIDIA's code does not)."""
    raw = torch.linspace(-12.0, 6.0, 40)[:, None].expand(40, 4)
    for limit in [(0.0, float("inf")), (0.01, 0.5)]:
        mixer = mamba_mixer(small_config, dict(time_step_limit=limit, time_step_min=0.001))
        dt, A = mixer.discretize(raw)
        expected = torch.nn.functional.softplus(raw + mixer.dt_bias).clamp(*limit)
        torch.testing.assert_close(dt, expected, rtol=0, atol=0)
        torch.testing.assert_close(A, -torch.exp(mixer.A_log), rtol=0, atol=0)
        assert dt.dtype == torch.float32
    assert expected.min() == 0.01 and expected.max() == 0.5
    mixer = mamba_mixer(small_config, dict(time_step_min=0.001))
    assert mixer.discretize(raw)[0].min() < 0.001


# ------------------------------------------------------------------------------------------------------- MoE
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_experts, top_k, width, intermediate, tokens", [(8, 2, 16, 24, 13), (16, 4, 32, 8, 40),
                                                                            (6, 6, 8, 8, 3)])
def test_routed_experts_match_loop(dtype, num_experts, top_k, width, intermediate, tokens):
    experts = RoutedExperts(num_experts, width, intermediate)
    with torch.no_grad():
        experts.up_proj.normal_(0, width ** -0.5)
        experts.down_proj.normal_(0, intermediate ** -0.5)
    x = torch.randn(tokens, width)
    # distinct experts per token, drawn from the first half only when possible, so some experts get no token
    pool = num_experts // 2 if num_experts // 2 >= top_k else num_experts
    expert_ids = torch.stack([torch.randperm(pool)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    check_against_ref(experts, lambda m, x, w: m(x, expert_ids, w),
                      lambda m, x, w: routed_experts_ref(m, x, expert_ids, w), x, weights, dtype=dtype)


MOE_VARIANTS = {
    "latent_grouped_scaled": dict(moe_latent_size=16, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    "latent_unnormalised": dict(moe_latent_size=16, n_group=2, topk_group=1, num_experts_per_tok=2,
                                norm_topk_prob=False, routed_scaling_factor=5.0),
    "full_width_one_group": dict(moe_latent_size=None, n_group=1, topk_group=1, routed_scaling_factor=1.0),
    "full_width_unnormalised_grouped": dict(moe_latent_size=None, n_routed_experts=12, num_experts_per_tok=4,
                                            n_group=3, topk_group=2, norm_topk_prob=False,
                                            routed_scaling_factor=0.5),
}


def random_moe(config) -> MoE:
    from hybridtron.model.lm import HybridLM

    moe = HybridLM(config.replace(layers_block_type=("moe",), num_nextn_predict_layers=0)).moe_layers()[0]
    with torch.no_grad():
        moe.gate.weight.normal_(0.0, 0.5)
        moe.gate.e_score_correction_bias.uniform_(-0.1, 0.1)
    return moe


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_moe_matches_ref(small_config, variant, dtype):
    moe = random_moe(small_config(**MOE_VARIANTS[variant]))
    x = torch.randn(3, 11, moe.gate.weight.shape[1])
    check_against_ref(moe, lambda m, x: m(x), moe_ref, x, dtype=dtype)
