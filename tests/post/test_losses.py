"""GRPO and MOPD losses against values worked out by hand, and the gradient invariances they promise."""

import math

import pytest
import torch

from hybridtron.post.losses import (
    GRPOLossConfig, MOPDLossConfig, clipped_policy_loss, group_advantages, grpo_loss, icepop_mask,
    importance_weights, k3_kl, masked_mean, mismatch_metrics, mopd_loss, policy_ratio, rollout_correction,
    sequence_geometric_mean, sequence_mean, tis_weights, token_entropy, token_mean, topk_reverse_kl,
)

LN2, LN3 = math.log(2.0), math.log(3.0)
EXACT = dict(rtol=1e-6, atol=1e-6)
NO_CORRECTION = GRPOLossConfig(correction="none")


def t(*rows):
    return torch.tensor(rows if len(rows) > 1 else rows[0], dtype=torch.float32)


# --------------------------------------------------------------------------------------------- advantages
def test_group_zscore_advantages_by_hand():
    rewards = t([1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 1])
    # group 0: mean 0.5, Bessel std sqrt((4 * 0.25) / 3) = sqrt(1/3); A = +-0.5 / (sqrt(1/3) + 1e-6) = +-0.86602
    # group 1: all agree -> 0
    # group 2: mean 0.25, deviations -0.25 x3 and 0.75, std sqrt(0.75 / 3) = 0.5; A = -0.25/0.5 = -0.5, 0.75/0.5 = 1.5
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = t([a, -a, -a, a], [0, 0, 0, 0], [-0.25 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001, 0.75 / 0.500001])
    torch.testing.assert_close(group_advantages(rewards), expected, **EXACT)
    # flat rewards with a group size: the same numbers, the same flat shape
    torch.testing.assert_close(group_advantages(rewards.flatten(), group_size=4), expected.flatten(), **EXACT)


def test_leave_one_out_and_mean_only_advantages_by_hand():
    rewards = t([1, 0, 0, 1], [0, 0, 0, 1])
    # leave one out: r_i - mean of the other three. Group 0: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3.
    # Group 1: 0 - 1/3 = -1/3 for the zeros, 1 - 0 = 1 for the one.
    torch.testing.assert_close(group_advantages(rewards, mode="leave_one_out"),
                               t([2 / 3, -2 / 3, -2 / 3, 2 / 3], [-1 / 3, -1 / 3, -1 / 3, 1.0]), **EXACT)
    # mean only (Dr.GRPO): r_i - mean; group 0 mean 0.5, group 1 mean 0.25
    torch.testing.assert_close(group_advantages(rewards, mode="mean_only"),
                               t([0.5, -0.5, -0.5, 0.5], [-0.25, -0.25, -0.25, 0.75]), **EXACT)


@pytest.mark.parametrize("mode", ["zscore", "leave_one_out", "mean_only"])
def test_zero_variance_groups_get_exactly_zero(mode):
    """16 rewards of 0.1 or 0.7 do not survive the mean's rounding exactly: without the explicit test the z-score
    would give (r - mean) / (std + 1e-6) = 0.007 and 0.056."""
    rewards = torch.stack([torch.full((16,), 0.1), torch.full((16,), 0.7), torch.tensor([0.3] * 15 + [0.9])])
    advantages = group_advantages(rewards, mode=mode)
    assert torch.equal(advantages[:2], torch.zeros(2, 16))
    assert advantages[2].abs().sum() > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(rewards=torch.ones(6), group_size=4), "cannot be split into groups of group_size=4"),
    (dict(rewards=torch.ones(6), group_size=1), "group_size >= 2"),
    (dict(rewards=torch.ones(6)), r"rewards must be \[prompts, group >= 2\]"),
    (dict(rewards=torch.ones(3, 1)), r"rewards must be \[prompts, group >= 2\]"),
    (dict(rewards=torch.tensor([[0.0, float("nan")]])), "NaN or inf"),
    (dict(rewards=torch.ones(2, 2), mode="rloo"), "mode must be one of zscore, leave_one_out, mean_only"),
])
def test_group_advantages_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(**kwargs)


# --------------------------------------------------------------------------------------------- per-token terms
def test_policy_ratio_by_hand_with_its_clamp():
    logp = t([0.0, LN2, -LN2, 30.0, -30.0])
    # exp(0) = 1, exp(ln 2) = 2, exp(-ln 2) = 0.5; +-30 clamp to +-20
    torch.testing.assert_close(policy_ratio(logp, torch.zeros(5)), t([1, 2, 0.5, math.exp(20), math.exp(-20)]))


def test_clipped_policy_loss_on_both_sides():
    ratio = t([1.5, 0.5, 0.5, 1.5, 1.1, 4.0])
    advantages = t([1.0, 1.0, -1.0, -1.0, 2.0, 0.0])
    logp = ratio.log().requires_grad_()
    loss, clipped = clipped_policy_loss(logp, torch.zeros(6), advantages)
    # max(-r A, -clip(r, 0.8, 1.28) A):
    # A=1,  r=1.5: max(-1.5, -1.28) = -1.28 clipped (the gain above 1 + 0.28 is not rewarded)
    # A=1,  r=0.5: max(-0.5, -0.8)  = -0.5  not clipped (the pessimistic side keeps the gradient)
    # A=-1, r=0.5: max(0.5, 0.8)    = 0.8   clipped
    # A=-1, r=1.5: max(1.5, 1.28)   = 1.5   not clipped
    # A=2,  r=1.1: inside the range: -2.2
    # A=0: 0
    torch.testing.assert_close(loss, t([-1.28, -0.5, 0.8, 1.5, -2.2, 0.0]), **EXACT)
    assert clipped.tolist() == [True, False, True, False, False, False]
    loss.sum().backward()
    # d/dlogp of -r A is -r A where unclipped; clipped tokens get none
    torch.testing.assert_close(logp.grad, t([0.0, -0.5, 0.0, 1.5, -2.2, 0.0]), **EXACT)


def test_dual_clip_caps_the_loss_of_negative_advantages_only():
    ratio, advantages = t([4.0, 4.0, 2.0]), t([-1.0, 1.0, -1.0])
    logp = ratio.log().requires_grad_()
    loss, clipped = clipped_policy_loss(logp, torch.zeros(3), advantages, dual_clip=3.0)
    # A=-1, r=4: max(4, 1.28) = 4 -> min(4, -3 * -1 = 3) = 3, clipped
    # A=1,  r=4: -1.28 (clipped by the upper bound; dual clip is for A < 0 only)
    # A=-1, r=2: max(2, 1.28) = 2 < 3: untouched, gradient -r A = 2
    torch.testing.assert_close(loss, t([3.0, -1.28, 2.0]), **EXACT)
    assert clipped.tolist() == [True, True, False]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([0.0, 0.0, 2.0]), **EXACT)
    without, _ = clipped_policy_loss(ratio.log(), torch.zeros(3), advantages)
    assert without[0].item() == pytest.approx(4.0)


def test_k3_kl_by_hand_with_its_clamp():
    ref = t([0.0, LN2, -LN2, 5.0, -30.0])
    # d = ref - lp; k3 = e^d - 1 - d: 0; 2 - 1 - ln 2 = 0.306853; 0.5 - 1 + ln 2 = 0.193147;
    # e^5 - 6 = 142.4 -> 10; d = -30 clamps to -20: e^-20 + 19 = 19.0 -> 10
    torch.testing.assert_close(k3_kl(torch.zeros(5), ref), t([0.0, 1 - LN2, LN2 - 0.5, 10.0, 10.0]), **EXACT)
    logp = torch.zeros(2, requires_grad=True)
    k3_kl(logp, t([LN2, 0.0])).sum().backward()
    # d k3 / d lp = 1 - e^(ref - lp): 1 - 2 = -1, 0 at equality
    torch.testing.assert_close(logp.grad, t([-1.0, 0.0]))


def test_token_entropy_by_hand_and_against_categorical():
    logits = t([0.0, 0.0, -1e9], [0.0, LN3, -1e9], [float("-inf"), 0.0, float("-inf")], [1000.0, 1000.0, -1e9])
    # uniform over 2: ln 2; p = (1/4, 3/4): 0.25 ln 4 + 0.75 ln(4/3) = 0.562335; one-hot: 0; logit offset: ln 2
    expected = t([LN2, 0.25 * math.log(4) + 0.75 * math.log(4 / 3), 0.0, LN2])
    torch.testing.assert_close(token_entropy(logits), expected, **EXACT)
    random_logits = torch.randn(2, 3, 11) * 4
    torch.testing.assert_close(token_entropy(random_logits),
                               torch.distributions.Categorical(logits=random_logits).entropy(), **EXACT)
    assert token_entropy(random_logits.bfloat16()).dtype == torch.float32
    # a vocabulary entry masked to -inf changes neither the entropy nor the gradient of the others (and is not NaN)
    finite = torch.tensor([[0.5, -1.0, 2.0]], requires_grad=True)
    masked = torch.tensor([[0.5, -1.0, 2.0, float("-inf")]], requires_grad=True)
    torch.testing.assert_close(token_entropy(masked), token_entropy(finite))
    token_entropy(finite).sum().backward()
    token_entropy(masked).sum().backward()
    torch.testing.assert_close(masked.grad, torch.cat([finite.grad, torch.zeros(1, 1)], dim=1))


# --------------------------------------------------------------------------------------------- rollout correction
def test_importance_weights_tis_and_icepop_by_hand():
    # old - rollout = 0, ln 2, -ln 4 -> w = 1, 2, 0.25
    w = importance_weights(t([0.0, LN2, -2 * LN2]), torch.zeros(3))
    torch.testing.assert_close(w, t([1.0, 2.0, 0.25]), **EXACT)
    w = t([0.1, 0.5, 1.0, 3.0, 10.0])
    assert tis_weights(w).tolist() == pytest.approx([0.1, 0.5, 1.0, 2.0, 2.0])          # miles: clamp(w, 0, 2)
    assert tis_weights(w, 0.2, 5.0).tolist() == pytest.approx([0.2, 0.5, 1.0, 3.0, 5.0])  # NeMo-RL: [0.2, 5]
    assert icepop_mask(w).tolist() == [False, True, True, False, False]                  # [0.5, 2], inclusive
    assert icepop_mask(w, 0.2, 5.0).tolist() == [False, True, True, True, False]


def test_sequence_geometric_mean_by_hand():
    w = t([2.0, 0.5, 8.0, 100.0], [4.0, 4.0, 0.0, 0.0], [3.0, 3.0, 3.0, 3.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    # row 0: exp((ln 2 - ln 2 + 3 ln 2) / 3) = 2 (the padded 100 ignored); row 1: 4; row 2 has no token: 1
    torch.testing.assert_close(sequence_geometric_mean(w, mask), t([2.0, 4.0, 1.0]), **EXACT)


def test_rollout_correction_token_and_sequence_level():
    old = t([LN3, 0.0, 0.0], [-LN2, -LN2, 0.0])      # w = [3, 1, (pad)], [0.5, 0.5, (pad)]
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    coefficient, out = rollout_correction(old, rollout, mask, "tis", 0.0, 2.0)
    torch.testing.assert_close(coefficient[:, :2], t([2.0, 1.0], [0.5, 0.5]), **EXACT)
    assert out[:, :2].tolist() == [[True, False], [False, False]]
    coefficient, out = rollout_correction(old, rollout, mask, "icepop", 0.6, 2.0)
    # IcePop keeps w inside [0.6, 2] (weighted by w) and drops the rest: 3 and 0.5 go
    torch.testing.assert_close(coefficient[:, :2], t([0.0, 1.0], [0.0, 0.0]), **EXACT)
    # sequence level: geometric means sqrt(3) = 1.732 and 0.5, every token of a sequence shares it
    coefficient, out = rollout_correction(old, rollout, mask, "icepop", 0.6, 2.0, level="sequence")
    torch.testing.assert_close(coefficient, t([3 ** 0.5] * 3, [0.0] * 3), **EXACT)
    assert out.tolist() == [[False] * 3, [True] * 3]


def test_mismatch_metrics_by_hand():
    old, rollout = t([LN2, -LN2, 3 * LN2, 7.0]), torch.zeros(4)
    mask = torch.tensor([1, 1, 1, 0])
    out = torch.tensor([False, False, True, True])
    metrics = mismatch_metrics(old, rollout, mask, out)
    # mean |log w| over the 3 valid tokens: (ln2 + ln2 + 3 ln2) / 3 = 1.155245; 1 of 3 out of bounds
    assert metrics["is_mismatch"].item() == pytest.approx(5 * LN2 / 3)
    assert metrics["is_out_of_bounds_share"].item() == pytest.approx(1 / 3)


# --------------------------------------------------------------------------------------------- aggregation
def test_token_mean_and_sequence_mean_by_hand():
    values = t([1.0, 2.0, 3.0], [4.0, 5.0, float(1e30)])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    # valid: 1, 2, 4. Token mean over this micro-batch alone: 7/3; as a share of a 10-token step: 0.7
    assert token_mean(values, mask, 3).item() == pytest.approx(7 / 3)
    assert token_mean(values, mask, 10).item() == pytest.approx(0.7)
    # sequence mean: (1.5 + 4) / 2 sequences = 2.75
    assert sequence_mean(values, mask, 2).item() == pytest.approx(2.75)
    assert masked_mean(values, mask).item() == pytest.approx(7 / 3)
    assert masked_mean(values, torch.zeros(2, 3)).item() == 0.0
    with pytest.raises(ValueError, match="global_count must be > 0"):
        token_mean(values, mask, 0)


# --------------------------------------------------------------------------------------------- grad_accum invariance
def _policy_batch(B=8, T=6, D=5, V=7):
    """A tiny linear policy and a batch of completions of different lengths (so micro-batches differ in tokens)."""
    weight = torch.randn(D, V, requires_grad=True)
    features, tokens = torch.randn(B, T, D), torch.randint(0, V, (B, T))
    lengths = torch.tensor([6, 1, 3, 6, 2, 5, 4, 1])
    mask = torch.arange(T) < lengths[:, None]
    with torch.no_grad():
        logp0 = torch.log_softmax(features @ weight, -1).gather(-1, tokens[..., None])[..., 0]
    batch = dict(features=features, tokens=tokens, mask=mask, advantages=torch.randn(B),
                 old_logp=logp0 + 0.3 * torch.randn(B, T), rollout_logp=logp0 + 0.3 * torch.randn(B, T),
                 ref_logp=logp0 + 0.3 * torch.randn(B, T), teacher_logp=logp0 + torch.randn(B, T))
    return weight, batch


def _accumulated_grad(weight, batch, micro_batches, loss_name, config, per_micro_batch_count=False):
    weight.grad, metrics = None, []
    B = batch["mask"].shape[0]
    sequence_level = config.aggregation == "sequence_mean"
    global_count = B if sequence_level else int(batch["mask"].sum())
    for rows in torch.arange(B).chunk(micro_batches):
        mb = {k: v[rows] for k, v in batch.items()}
        logits = mb["features"] @ weight
        logp = torch.log_softmax(logits, -1).gather(-1, mb["tokens"][..., None])[..., 0]
        count = global_count
        if per_micro_batch_count:  # the bug: each micro-batch its own mean, then averaged over micro-batches
            count = (len(rows) if sequence_level else int(mb["mask"].sum())) * micro_batches
        if loss_name == "grpo":
            loss, step_metrics = grpo_loss(logp, mb["old_logp"], mb["advantages"], mb["mask"], count, config,
                                rollout_logp=mb["rollout_logp"], ref_logp=mb["ref_logp"], entropy=token_entropy(logits))
        else:
            loss, step_metrics = mopd_loss(logp, mb["old_logp"], mb["teacher_logp"], mb["mask"], count, config,
                                behav_logp=mb["rollout_logp"])
        loss.backward()
        metrics.append(step_metrics)
    return weight.grad.clone(), metrics


CONFIGS = {
    "grpo": GRPOLossConfig(kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0),
    "grpo-icepop-sequence-mean": GRPOLossConfig(correction="icepop", correction_level="sequence", icepop_low=0.9,
                                                icepop_high=1.1, kl_coef=0.1, aggregation="sequence_mean"),
    "mopd": MOPDLossConfig(icepop_low=0.7, icepop_high=1.5),  # narrow bounds, so that some tokens are dropped
}


@pytest.mark.parametrize("name", CONFIGS)
def test_grad_accum_does_not_change_the_gradient(name):
    weight, batch = _policy_batch()
    config = CONFIGS[name]
    whole, (metrics,) = _accumulated_grad(weight, batch, 1, name[:4], config)
    assert whole.abs().max() > 1e-2
    # every mechanism is at work in this batch: clipping, and a correction that truncates or drops tokens
    assert metrics["clip_fraction"] > 0.1 and metrics["is_out_of_bounds_share"] > 0.1
    for micro_batches in (2, 4):
        grad, _ = _accumulated_grad(weight, batch, micro_batches, name[:4], config)
        torch.testing.assert_close(grad, whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "mopd"])
def test_per_micro_batch_normalisation_would_change_the_gradient(name):
    """The bug class the global count avoids: with 4 micro-batches of 7, 9, 7 and 5 tokens, each micro-batch's own
    token mean weights the tokens of the short ones more."""
    weight, batch = _policy_batch()
    whole, _ = _accumulated_grad(weight, batch, 1, name, CONFIGS[name])
    buggy, _ = _accumulated_grad(weight, batch, 4, name, CONFIGS[name], per_micro_batch_count=True)
    assert (buggy - whole).abs().max() > 1e-2 * whole.abs().max()


# --------------------------------------------------------------------------------------------- composed losses
def _grpo_case():
    # two sequences of two tokens; old log-probs 0, so r = exp(logp): [[1.5, 1], [0.5, 1]]; A = [1, -1]
    logp = t([math.log(1.5), 0.0], [math.log(0.5), 0.0]).requires_grad_()
    return logp, torch.zeros(2, 2), t([1.0, -1.0]), torch.ones(2, 2, dtype=torch.bool)


def test_grpo_loss_by_hand():
    logp, old, advantages, mask = _grpo_case()
    loss, metrics = grpo_loss(logp, old, advantages, mask, 4, NO_CORRECTION)
    # tokens: (r=1.5, A=1) -> -1.28 clipped; (1, 1) -> -1; (0.5, -1) -> 0.8 clipped; (1, -1) -> 1. Sum -0.48, / 4
    assert loss.item() == pytest.approx(-0.12)
    assert metrics["clip_fraction"].item() == pytest.approx(0.5)
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)   # (1.5 + 1 + 0.5 + 1) / 4
    assert not any(m.requires_grad for m in metrics.values())

    # TIS: rollout log-probs give w = old / rollout = [[3, 1], [1, 0.5]] -> clamp(w, 0, 2) = [[2, 1], [1, 0.5]]
    rollout = t([-LN3, 0.0], [0.0, LN2])
    loss, metrics = grpo_loss(logp, old, advantages, mask, 4, GRPOLossConfig(), rollout_logp=rollout)
    # (2 * -1.28 - 1 + 0.8 + 0.5 * 1) / 4 = -2.26 / 4
    assert loss.item() == pytest.approx(-0.565)
    assert metrics["is_mismatch"].item() == pytest.approx((LN3 + LN2) / 4)
    assert metrics["is_out_of_bounds_share"].item() == pytest.approx(0.25)   # only w = 3 exceeds 2

    # IcePop [0.5, 2]: w = 3 dropped, the others weighted by w: (0 - 1 + 0.8 + 0.5) / 4 = 0.075
    loss, _ = grpo_loss(logp, old, advantages, mask, 4, GRPOLossConfig(correction="icepop"), rollout_logp=rollout)
    assert loss.item() == pytest.approx(0.075)

    # KL to a reference at 0: k3 with d = ref - lp = -ln 1.5 -> 2/3 - 1 + ln 1.5 = 0.072132; d = ln 2 -> 0.306853;
    # mean over 4 tokens 0.094746. Entropy [[1, 2], [3, 4]] mean 2.5.
    kl = (2 / 3 - 1 + math.log(1.5) + 1 - LN2) / 4
    config = GRPOLossConfig(correction="none", kl_coef=0.1, entropy_coef=0.01)
    loss, metrics = grpo_loss(logp, old, advantages, mask, 4, config, ref_logp=torch.zeros(2, 2),
                              entropy=t([1.0, 2.0], [3.0, 4.0]))
    assert loss.item() == pytest.approx(-0.12 + 0.1 * kl - 0.01 * 2.5)
    assert metrics["kl"].item() == pytest.approx(kl)
    assert metrics["entropy"].item() == pytest.approx(2.5)


def test_grpo_loss_at_ratio_one_is_the_plain_policy_gradient():
    """r = w = 1: d loss / d logp_bt = -A_b m_bt / N, i.e. the REINFORCE gradient of the token mean."""
    old = torch.randn(3, 4)
    logp = old.clone().requires_grad_()
    advantages, mask = t([0.5, -2.0, 1.0]), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    loss, _ = grpo_loss(logp, old, advantages, mask, 9, GRPOLossConfig(), rollout_logp=old)
    loss.backward()
    torch.testing.assert_close(logp.grad, -advantages[:, None] * mask / 9, **EXACT)
    # and through a policy's parameters: the same as autograd of sum(-A logp m) / N
    weight, batch = _policy_batch(B=3, T=4)
    logits = batch["features"] @ weight
    logp = torch.log_softmax(logits, -1).gather(-1, batch["tokens"][..., None])[..., 0]
    loss, _ = grpo_loss(logp, logp.detach(), advantages, mask, 9, NO_CORRECTION)
    (grad,) = torch.autograd.grad(loss, weight, retain_graph=True)
    (expected,) = torch.autograd.grad((-advantages[:, None] * logp * mask).sum() / 9, weight)
    torch.testing.assert_close(grad, expected, **EXACT)


def test_mopd_loss_by_hand():
    prox = t([-2.0, -2.0], [-2.0, -1.0])
    teacher = t([-1.0, -3.0], [-2.0, -2.0])                  # A = teacher - prox = [[1, -1], [0, -1]]
    logp = (prox + t([math.log(1.5), -LN2], [0.0, 0.0]))    # r = [[1.5, 0.5], [1, 1]]
    mask = torch.ones(2, 2)
    loss, metrics = mopd_loss(logp, prox, teacher, mask, 4, MOPDLossConfig(correction="none"))
    # (A=1, r=1.5) -> -1.28; (A=-1, r=0.5) -> 0.8; (A=0) -> 0; (A=-1, r=1) -> 1. Sum 0.52, / 4 = 0.13
    assert loss.item() == pytest.approx(0.13)
    assert metrics["reverse_kl"].item() == pytest.approx(0.25)   # mean(prox - teacher) = (-1 + 1 + 0 + 1) / 4
    assert metrics["clip_fraction"].item() == pytest.approx(0.5)
    # the last token out of the mask, 3 tokens in the step: -0.48 / 3; reverse KL (-1 + 1 + 0) / 3 = 0
    loss, metrics = mopd_loss(logp, prox, teacher, t([1.0, 1.0], [1.0, 0.0]), 3, MOPDLossConfig(correction="none"))
    assert loss.item() == pytest.approx(-0.16)
    assert metrics["reverse_kl"].item() == pytest.approx(0.0, abs=1e-7)
    # behaviour policy 3x less likely on the first token: c = prox / behav = 3 there, 1 elsewhere
    behav = prox - t([LN3, 0.0], [0.0, 0.0])
    loss, _ = mopd_loss(logp, prox, teacher, mask, 4, MOPDLossConfig(correction="tis"), behav_logp=behav)
    assert loss.item() == pytest.approx((2 * -1.28 + 0.8 + 0 + 1) / 4)      # TIS clamps 3 to 2: -0.19
    loss, metrics = mopd_loss(logp, prox, teacher, mask, 4, MOPDLossConfig(), behav_logp=behav)
    assert loss.item() == pytest.approx((3 * -1.28 + 0.8 + 0 + 1) / 4)      # IcePop [0.2, 5] keeps w = 3: -0.51
    loss, metrics = mopd_loss(logp, prox, teacher, mask, 4, MOPDLossConfig(icepop_high=2.0), behav_logp=behav)
    assert loss.item() == pytest.approx((0.8 + 0 + 1) / 4)                  # IcePop [0.2, 2] drops it: 0.45
    assert metrics["is_out_of_bounds_share"].item() == pytest.approx(0.25)


def test_mopd_advantage_stops_the_gradient_and_is_reverse_kl_policy_gradient():
    prox = torch.randn(2, 5)
    teacher, prox_leaf = (prox + torch.randn(2, 5)).requires_grad_(), prox.clone().requires_grad_()
    logp = prox.clone().requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    loss, _ = mopd_loss(logp, prox_leaf, teacher, mask, 6, MOPDLossConfig(), behav_logp=prox)
    loss.backward()
    assert teacher.grad is None and prox_leaf.grad is None
    # r = c = 1: d loss / d logp = -(log pi_T - log pi_prox) m / N
    torch.testing.assert_close(logp.grad, -(teacher.detach() - prox) * mask / 6, **EXACT)


def _log(*probs):
    return torch.tensor(probs, dtype=torch.float64).log().float()


def test_topk_reverse_kl_by_hand():
    """Student p = (0.5, 0.3, 0.2), teacher q = (0.6, 0.2, 0.2) over a 3-token vocabulary, the teacher's top K
    tokens first: K = 1 compares (0.5, rest 0.5) with (0.6, rest 0.4); K = 2 compares (0.5, 0.3, rest 0.2) with
    (0.6, 0.2, rest 0.2), whose rest term is 0; K = 3 is the whole vocabulary, the full KL."""
    p, q = _log(0.5, 0.3, 0.2), _log(0.6, 0.2, 0.2)
    expected = {1: 0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4),      # 0.5 ln(25/24) = 0.02041
                2: 0.5 * math.log(0.5 / 0.6) + 0.3 * math.log(0.3 / 0.2),      # 0.03048
                3: 0.5 * math.log(0.5 / 0.6) + 0.3 * math.log(0.3 / 0.2)}      # the last token agrees: the same
    for k, value in expected.items():
        kl = topk_reverse_kl(p[:k].view(1, 1, k), q[:k].view(1, 1, k))
        assert kl.shape == (1, 1) and kl.item() == pytest.approx(value, abs=1e-6), k
    full = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=p),
                                             torch.distributions.Categorical(logits=q))
    assert topk_reverse_kl(p.view(1, 1, 3), q.view(1, 1, 3)).item() == pytest.approx(full.item(), abs=1e-6)
    # coarsening never raises the KL: K = 1 <= K = 2 <= the full KL; equal distributions give 0
    assert expected[1] < expected[2] <= full.item() + 1e-6
    assert topk_reverse_kl(q.view(1, 1, 3), q.view(1, 1, 3)).item() == pytest.approx(0.0, abs=1e-6)


def test_topk_reverse_kl_gradient_is_the_full_kls_when_k_is_the_vocabulary():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(2, 3, 7), -1)
    kl = topk_reverse_kl(torch.log_softmax(logits, -1), teacher)
    (grad,) = torch.autograd.grad(kl.sum(), logits)
    full = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=logits),
                                             torch.distributions.Categorical(logits=teacher))
    (expected,) = torch.autograd.grad(full.sum(), logits)
    torch.testing.assert_close(kl, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)
    # top-2 of the teacher: a finite gradient on the top tokens and on the rest (through the rest bin's mass)
    order = teacher.argsort(-1, descending=True)[..., :2]
    kl2 = topk_reverse_kl(torch.log_softmax(logits, -1).gather(-1, order), teacher.gather(-1, order))
    (grad2,) = torch.autograd.grad(kl2.sum(), logits)
    assert torch.isfinite(grad2).all() and (grad2 != 0).all() and (kl2 <= full + 1e-6).all()


def test_mopd_topk_loss_by_hand():
    """Two positions of one sequence; the per-token loss is c_t * the top-1 KL, with no ratio and no clip, and the
    gradient reaches the student's top-K log-probs through it."""
    student = torch.stack([_log(0.5, 0.5), _log(0.6, 0.4)])[None, :, :1]       # [1, 2, K=1]: p of the top token
    teacher = torch.stack([_log(0.6, 0.4), _log(0.6, 0.4)])[None, :, :1]
    kl = [0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4), 0.0]          # the second position agrees
    logp = t([[-1.0, -2.0]])
    sampled_teacher = t([[-1.5, -2.0]])
    mask = torch.ones(1, 2)
    config = MOPDLossConfig(kl_top_k=1, correction="none")
    topk_kl = topk_reverse_kl(student, teacher)
    loss, metrics = mopd_loss(logp, logp, sampled_teacher, mask, 2, config, topk_kl=topk_kl)
    assert loss.item() == pytest.approx(sum(kl) / 2, abs=1e-7)
    assert metrics["topk_reverse_kl"].item() == pytest.approx(sum(kl) / 2, abs=1e-7)
    assert metrics["reverse_kl"].item() == pytest.approx(0.25)     # the sampled estimate, logged beside it
    assert "clip_fraction" not in metrics
    # d loss / d log p = p (log(p / q) - log((1 - p) / (1 - q))) / 2 at the first position, 0 where they agree; the
    # sampled token's log-prob gets none
    leaf, sampled = student.clone().requires_grad_(), logp.clone().requires_grad_()
    loss, _ = mopd_loss(sampled, logp, sampled_teacher, mask, 2, config, topk_kl=topk_reverse_kl(leaf, teacher))
    loss.backward()
    expected = 0.5 * (math.log(0.5 / 0.6) - math.log(0.5 / 0.4)) / 2
    torch.testing.assert_close(leaf.grad, torch.tensor([[[expected], [0.0]]]), rtol=1e-5, atol=1e-7)
    assert sampled.grad is None or not sampled.grad.any()
    # behaviour 3x less likely on the first token: IcePop [0.2, 5] weighs it by c = 3; [0.2, 2] drops it
    behav = logp - t([[LN3, 0.0]])
    loss, _ = mopd_loss(logp, logp, sampled_teacher, mask, 2, MOPDLossConfig(kl_top_k=1), behav_logp=behav,
                        topk_kl=topk_kl)
    assert loss.item() == pytest.approx(3 * kl[0] / 2, rel=1e-5)
    loss, metrics = mopd_loss(logp, logp, sampled_teacher, mask, 2, MOPDLossConfig(kl_top_k=1, icepop_high=2.0),
                              behav_logp=behav, topk_kl=topk_kl)
    assert loss.item() == pytest.approx(0.0, abs=1e-7) and metrics["is_out_of_bounds_share"].item() == 0.5
    with pytest.raises(ValueError, match=r"kl_top_k=1 needs topk_kl \[batch, tokens\]"):
        mopd_loss(logp, logp, sampled_teacher, mask, 2, config)
    with pytest.raises(ValueError, match=r"topk_kl has shape \(1, 1\); expected \(1, 2\)"):
        mopd_loss(logp, logp, sampled_teacher, mask, 2, config, topk_kl=topk_kl[:, :1])
    with pytest.raises(ValueError, match=r"must both be \[batch, tokens, K\]"):
        topk_reverse_kl(student, teacher[..., 0])
    with pytest.raises(ValueError, match="kl_top_k must be >= 0"):
        MOPDLossConfig(kl_top_k=-1)


@pytest.mark.parametrize("call, message", [
    (lambda l, o, a, m: grpo_loss(l, o, a, m, 4), r"correction='tis' needs the rollout engine's log-probs"),
    (lambda l, o, a, m: grpo_loss(l, o[:, :1], a, m, 4, NO_CORRECTION), r"old_logp has shape \(2, 1\)"),
    (lambda l, o, a, m: grpo_loss(l, o, a[:1], m, 4, NO_CORRECTION), r"advantages must be \[batch\] or"),
    (lambda l, o, a, m: grpo_loss(l, o, a, m, 4, GRPOLossConfig(correction="none", kl_coef=0.1)), "ref_logp"),
    (lambda l, o, a, m: grpo_loss(l, o, a, m, 4, GRPOLossConfig(correction="none", entropy_coef=0.1)), "entropy"),
    (lambda l, o, a, m: grpo_loss(l, o, a, m, 0, NO_CORRECTION), "global_count must be > 0"),
    (lambda l, o, a, m: mopd_loss(l, o, o, m, 4), r"correction='icepop' needs .* \(behav_logp\)"),
    (lambda l, o, a, m: grpo_loss(l[0], o[0], a, m[0], 4, NO_CORRECTION), r"logp must be \[batch, tokens\]"),
])
def test_composed_losses_reject_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call(*_grpo_case())


@pytest.mark.parametrize("kwargs, message", [
    (dict(eps_clip=1.0), r"eps_clip must be in \[0, 1\)"),
    (dict(eps_clip_high=-0.1), "eps_clip_high must be >= 0"),
    (dict(dual_clip=1.0), "dual_clip must be None or > 1"),
    (dict(kl_coef=-1.0), "kl_coef must be >= 0"),
    (dict(correction="is"), "correction must be one of tis, icepop, none"),
    (dict(correction_level="batch"), "correction_level must be one of token, sequence"),
    (dict(aggregation="seq-mean-token-sum"), "aggregation must be one of token_mean, sequence_mean"),
    (dict(advantage_mode="grpo"), "advantage_mode must be one of"),
    (dict(tis_low=2.0, tis_high=2.0), "tis_low / tis_high must satisfy 0 <= low < high"),
    (dict(icepop_low=-0.5), "icepop_low / icepop_high must satisfy"),
])
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GRPOLossConfig(**kwargs)


def test_config_defaults_are_the_recipes():
    grpo, mopd = GRPOLossConfig(), MOPDLossConfig()
    assert (grpo.eps_clip, grpo.eps_clip_high, grpo.dual_clip) == (0.2, 0.28, None)
    assert (grpo.kl_coef, grpo.entropy_coef, grpo.aggregation) == (0.0, 0.0, "token_mean")
    assert (grpo.correction, grpo.tis_low, grpo.tis_high, grpo.advantage_mode) == ("tis", 0.0, 2.0, "zscore")
    assert (mopd.correction, mopd.icepop_low, mopd.icepop_high, mopd.eps_clip_high) == ("icepop", 0.2, 5.0, 0.28)
    assert mopd.kl_top_k == 0  # the report's sampled estimator
    with pytest.raises(TypeError):
        MOPDLossConfig(dual_clip=3.0)
