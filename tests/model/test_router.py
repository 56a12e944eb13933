"""The MoE router against the spec written out token by token, and its fp32 guarantees.

The nemotron_h router (as transformers and Megatron compute it): s = sigmoid(x W^T) in fp32; s' = s + e_score_correction_bias is used only to choose;
group score = sum of the top-2 s' of each of n_group groups, keep the topk_group best groups; idx = top-k of s'
among the kept groups; weights w = s[idx], divided by their sum (+1e-20) if norm_topk_prob, times
routed_scaling_factor.
"""

from __future__ import annotations

import pytest
import torch

from hybridtron.model.lm import HybridLM
from hybridtron.model.moe import Router


def route_one_token(scores, bias, *, top_k, n_group, topk_group, norm_topk_prob, scaling):
    """The spec in plain Python for one token: returns {expert: weight}."""
    num_experts = len(scores)
    per_group = num_experts // n_group
    choice = [float(s) + float(b) for s, b in zip(scores, bias)]
    group_score = [sum(sorted(choice[g * per_group:(g + 1) * per_group], reverse=True)[:2]) for g in range(n_group)]
    kept_groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
    candidates = [e for e in range(num_experts) if e // per_group in kept_groups]
    chosen = sorted(candidates, key=lambda e: -choice[e])[:top_k]
    weights = {e: float(scores[e]) for e in chosen}
    if norm_topk_prob:
        total = sum(weights.values()) + 1e-20
        weights = {e: w / total for e, w in weights.items()}
    return {e: w * scaling for e, w in weights.items()}


ROUTER_VARIANTS = {
    "grouped_normalised_scaled": dict(n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                                      norm_topk_prob=True, routed_scaling_factor=2.5),
    "grouped_unnormalised": dict(n_routed_experts=12, num_experts_per_tok=4, n_group=3, topk_group=2,
                                 norm_topk_prob=False, routed_scaling_factor=5.0),
    "one_group": dict(n_routed_experts=16, num_experts_per_tok=6, n_group=1, topk_group=1, norm_topk_prob=True,
                      routed_scaling_factor=1.0),
    "topk_equals_kept_experts": dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=1,
                                     norm_topk_prob=True, routed_scaling_factor=1.5),
}


@pytest.mark.parametrize("variant", list(ROUTER_VARIANTS))
def test_router_matches_spec_token_by_token(small_config, variant):
    config = small_config(**ROUTER_VARIANTS[variant])
    router = Router(config)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.3)
        router.e_score_correction_bias.uniform_(-0.2, 0.2)
    x = torch.randn(64, config.hidden_size)
    expert_ids, weights = router(x)
    assert expert_ids.shape == weights.shape == (64, config.num_experts_per_tok)
    assert weights.dtype == torch.float32
    scores = torch.sigmoid(x.double() @ router.weight.detach().double().T)
    for token in range(64):
        expected = route_one_token(scores[token], router.e_score_correction_bias, top_k=config.num_experts_per_tok,
                                   n_group=config.n_group, topk_group=config.topk_group,
                                   norm_topk_prob=config.norm_topk_prob, scaling=config.routed_scaling_factor)
        got = dict(zip(expert_ids[token].tolist(), weights[token].tolist()))
        assert sorted(got) == sorted(expected), f"token {token}"
        for e in expected:
            assert got[e] == pytest.approx(expected[e], rel=1e-6)


def test_bias_steers_selection_but_not_weights(small_config):
    config = small_config(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                          routed_scaling_factor=2.5)
    router = Router(config)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.3)
    x = torch.randn(32, config.hidden_size)
    scores = torch.sigmoid(x @ router.weight.T)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.tensor([0, 0, 0, 5.0, 0, 5.0, 0, 0]))
    expert_ids, weights = router(x)
    # a large bias forces experts 3 and 5 on every token ...
    assert (expert_ids.sort(-1).values == torch.tensor([3, 5])).all()
    # ... but their weights come from the unbiased scores
    chosen = scores[:, [3, 5]]
    torch.testing.assert_close(weights.sort(-1).values,
                               (chosen / chosen.sum(-1, keepdim=True) * 2.5).sort(-1).values, rtol=1e-6, atol=0)
    # without normalisation the weights are exactly the raw sigmoid scores, scaled
    router.norm_topk_prob = False
    _, raw_weights = router(x)
    torch.testing.assert_close(raw_weights.sort(-1).values, (chosen * 2.5).sort(-1).values, rtol=1e-6, atol=0)


def test_router_stays_fp32_bit_exact_under_dtype_casts(small_config):
    """model.to(bf16) / .half() / .bfloat16() cast everything except the router weight and bias, which keep their
    fp32 values bit for bit (the bias drifts to values near 2^6 where bf16 spacing, 0.25-0.5, erases the small
    differences that decide the selection)."""
    model = HybridLM(small_config())
    with torch.no_grad():
        for bias in model.router_biases():
            bias.copy_(64.0 + torch.arange(bias.numel()) * 1e-3)
    routers = [moe.gate for moe in model.moe_layers()] + [model.mtp.layers[1].mixer.gate]
    originals = [(r.weight.detach().clone(), r.e_score_correction_bias.clone()) for r in routers]
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.bfloat16(),
                 lambda m: m.to("cpu", torch.bfloat16), lambda m: m.float()):
        cast(model)
        for router, (weight, bias) in zip(routers, originals):
            assert router.weight.dtype == torch.float32 and router.e_score_correction_bias.dtype == torch.float32
            assert torch.equal(router.weight, weight) and torch.equal(router.e_score_correction_bias, bias)
            assert isinstance(router.weight, torch.nn.Parameter)
    model.to(torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.moe_layers()[0].experts.up_proj.dtype == torch.bfloat16
    # the bf16 model still runs, with fp32 routing, and its biases are the same objects the balancer updates
    ids = torch.randint(0, 128, (2, 9))
    assert model(ids).logits.dtype == torch.bfloat16
    assert all(b is moe.gate.e_score_correction_bias for b, moe in zip(model.router_biases(), model.moe_layers()))


def test_expert_counts_sum_to_tokens_times_k(small_config):
    config = small_config()
    model = HybridLM(config)
    ids = torch.randint(0, config.vocab_size, (3, 13))
    out = model(ids)
    n_moe = config.layers_block_type.count("moe")
    assert out.expert_counts.shape == (n_moe, config.n_routed_experts)
    assert out.expert_counts.dtype == torch.long
    assert (out.expert_counts.sum(-1) == 3 * 13 * config.num_experts_per_tok).all()
    # the counts are those of the routing each layer just did
    for layer_counts, moe in zip(out.expert_counts, model.moe_layers()):
        assert torch.equal(layer_counts, moe.last_expert_counts)


def test_counted_positions_keep_padding_out_of_the_expert_counts(small_config):
    """`forward(counted=...)`: rows padded with junk count what the unpadded rows count, the backbone at the real
    positions t and MTP depth k where t + k is real too; `counted_at_depth` by hand."""
    from hybridtron.model.lm import counted_at_depth

    counted = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert counted_at_depth(counted, 2, 5).int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert counted_at_depth(counted, 1, 3).int().tolist() == [[1, 1, 0], [1, 1, 1]]  # runs on past a window of 3
    config = small_config()
    assert config.has_mtp
    torch.manual_seed(0)
    model = HybridLM(config)
    ids = torch.randint(3, config.vocab_size, (2, 9))
    real = model(ids, counted=torch.ones(2, 9, dtype=torch.bool))
    padded = model(torch.cat([ids, torch.randint(3, config.vocab_size, (2, 4))], dim=1),
                   counted=torch.cat([torch.ones(2, 9), torch.zeros(2, 4)], dim=1).bool())
    assert torch.equal(real.expert_counts, padded.expert_counts)
    assert torch.equal(real.mtp_expert_counts, padded.mtp_expert_counts)
    assert not torch.equal(model(ids).mtp_expert_counts, real.mtp_expert_counts)  # past the end: counted by default


def test_every_router_is_named_and_balanced_mtp_included(small_config):
    """`routers()` covers the backbone's MoE layers and the MTP block's; `router_biases()` follows it, so the
    balancing update reaches the MTP router too (its bias once stayed 0 for a whole run)."""
    config = small_config()
    model = HybridLM(config)
    routers = model.routers()
    backbone = [str(i) for i, kind in enumerate(config.layers_block_type) if kind == "moe"]
    assert list(routers) == backbone + ["mtp.1"]
    assert routers["mtp.1"] is model.mtp.layers[1].mixer
    assert [b.data_ptr() for b in model.router_biases()] == \
        [moe.gate.e_score_correction_bias.data_ptr() for moe in routers.values()]


def test_mtp_expert_counts_sum_over_the_shared_depths(small_config):
    config = small_config()
    model = HybridLM(config)
    out = model(torch.randint(0, config.vocab_size, (3, 13)))
    assert out.mtp_expert_counts.shape == (1, config.n_routed_experts)
    assert int(out.mtp_expert_counts.sum()) == config.mtp_num_depths * 3 * 13 * config.num_experts_per_tok
    assert model(torch.randint(0, config.vocab_size, (3, 13)), mtp=False).mtp_expert_counts is None


def test_routing_replay_forces_the_experts_and_keeps_the_router_gradient(small_config):
    """R3: given the experts a rollout chose, the forward uses them (not its own top-k) and takes the weights from
    the current scores at those experts, so the router weight still gets a gradient through them."""
    config = small_config()
    model = HybridLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 9))
    free = model(ids, mtp=False)
    chosen = {name: moe.last_expert_ids.view(2, 9, -1).clone() for name, moe in model.routers().items()
              if not name.startswith("mtp")}
    replayed = model(ids, mtp=False, expert_ids=chosen)
    assert torch.equal(replayed.logits, free.logits)  # replaying its own choices changes nothing
    # force other experts in the first MoE layer: its choice is the forced one and the output changes
    name = next(iter(chosen))
    forced = {name: (chosen[name] + 1) % config.n_routed_experts}
    out = model(ids, ids, mtp=False, expert_ids=forced)
    moe = model.routers()[name]
    assert torch.equal(moe.last_expert_ids, forced[name].view(18, -1))
    assert not torch.allclose(out.logits, free.logits)
    out.loss.backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
