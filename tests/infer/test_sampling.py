"""Sampling filters, SamplingParams validation, and the exactness of speculative (Leviathan) sampling."""

import math

import pytest
import torch

from hybridtron.infer.sampling import (
    ParamError, SamplingParams, greedy, inverse_cdf_sample, probs_from_logits, sample, speculative_accept,
    speculative_accept_batch, speculative_accept_greedy, speculative_accept_greedy_batch, speculative_accept_ref,
)

# A seeded chi-square goodness-of-fit test. A correct sampler fails it with probability ALPHA for a given seed;
# the negative controls below show the same number of trials rejects a wrong distribution by a wide margin.
ALPHA = 1e-4
TRIALS = 200_000


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """P-value of observed `counts` under `expected_probs` (cells with zero probability must have zero counts)."""
    counts, expected_probs = counts.double().flatten(), expected_probs.double().flatten()
    assert counts[expected_probs == 0].sum() == 0, "a token with zero probability was emitted"
    keep = expected_probs > 0
    expected = expected_probs[keep] * counts.sum()
    statistic = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2))


def dist(*values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


# ------------------------------------------------------------------------------------------ SamplingParams
def test_sampling_params_defaults_and_greedy():
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p, params.seed) == (1.0, 0, 1.0, None)
    assert not params.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[2]).stop_token_ids == (2,)
    assert params.generator() is None
    g1, g2 = SamplingParams(seed=7).generator(), SamplingParams(seed=7).generator()
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"), ("temperature", float("inf")),
    ("top_k", -1), ("top_k", 2.5), ("top_k", True), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2),
    ("max_tokens", -1), ("max_tokens", 3.0), ("seed", "42"), ("stop", [""]), ("stop", [3]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["x"]),
])
def test_sampling_params_errors_name_the_field(field, value):
    with pytest.raises(ParamError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and str(info.value).startswith(field)
    assert isinstance(info.value, ValueError)


def test_max_tokens_zero_is_allowed():
    assert SamplingParams(max_tokens=0).max_tokens == 0


# ------------------------------------------------------------------------------------------ filtering
def reference_filter(logits_row, temperature, top_k, top_p):
    """Per-row Python: temperature, keep the k largest, softmax, keep the nucleus, renormalise."""
    values = [float(v) / temperature for v in logits_row]
    order = sorted(range(len(values)), key=lambda i: -values[i])
    kept = order[:top_k] if top_k else order
    peak = max(values[i] for i in kept)
    weights = {i: math.exp(values[i] - peak) for i in kept}
    total = sum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    nucleus, mass = [], 0.0
    for i in sorted(kept, key=lambda i: -probs[i]):
        if mass >= top_p:
            break
        nucleus.append(i)
        mass += probs[i]
    out = [0.0] * len(values)
    nucleus_total = sum(probs[i] for i in nucleus)
    for i in nucleus:
        out[i] = probs[i] / nucleus_total
    return out


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.9), (0.8, 7, 0.5), (1.0, 1, 1.0), (2.0, 0, 0.05),
    (1.0, 50, 1.0),
])
def test_probs_from_logits_matches_reference(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 20) * 3
    probs = probs_from_logits(logits, temperature, top_k, top_p)
    expected = torch.tensor([reference_filter(row, temperature, top_k, top_p) for row in logits.tolist()])
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))
    if top_k:
        assert ((probs > 0).sum(-1) <= top_k).all()


def test_plain_softmax_and_nucleus_boundary():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    torch.testing.assert_close(probs_from_logits(logits), torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # mass before the 3rd token is 0.8: top_p = 0.8 stops there, top_p = 0.81 keeps it
    torch.testing.assert_close(probs_from_logits(logits, top_p=0.8), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    kept = probs_from_logits(logits, top_p=0.81)
    assert (kept > 0).tolist() == [[True, True, True, False]]
    # a tiny top_p still keeps the most likely token
    assert probs_from_logits(logits, top_p=1e-6).tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_temperature_zero_is_one_hot_argmax_and_leading_shapes():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(1))
    probs = probs_from_logits(logits, temperature=0, top_k=3, top_p=0.5)
    assert probs.shape == logits.shape
    assert torch.equal(probs.argmax(-1), greedy(logits)) and torch.equal(probs.sum(-1), torch.ones(2, 3))
    assert torch.equal(sample(probs, torch.Generator().manual_seed(0)), greedy(logits))


def test_filter_argument_errors():
    logits = torch.zeros(1, 4)
    for kwargs, field in [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0}, "top_p")]:
        with pytest.raises(ParamError, match=field):
            probs_from_logits(logits, **kwargs)


# ------------------------------------------------------------------------------------------ sampling
def test_inverse_cdf_never_returns_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(5, 5)
    uniforms = torch.tensor([0.0, 0.4999, 0.5, 0.99999994, 1.0 - 1e-9])
    assert inverse_cdf_sample(probs, uniforms).tolist() == [1, 1, 3, 3, 3]


def test_sample_matches_distribution_unnormalised():
    weights = torch.tensor([3.0, 0.0, 1.0, 6.0])  # unnormalised on purpose
    tokens = sample(weights.expand(TRIALS, 4), torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=4)
    assert chi_square_p_value(counts, weights / weights.sum()) > ALPHA


def test_sample_seeded_is_reproducible():
    probs = dist(1, 2, 3, 4).expand(50, 4)
    a = sample(probs, torch.Generator().manual_seed(3))
    b = sample(probs, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


# ------------------------------------------------------------------------------------- speculative decoding
# (p, q) pairs: q uniform; q with zeros where p is not; p with zeros where q is not; p == q; disjoint supports.
PAIRS = {
    "q_uniform": (dist(1, 2, 3, 4, 0), dist(1, 1, 1, 1, 1)),
    "q_zero_where_p_not": (dist(1, 1, 1, 1, 0), dist(2, 2, 0, 0, 0)),
    "p_zero_where_q_not": (dist(0, 0, 5, 5, 0), dist(1, 1, 1, 1, 1)),
    "p_equals_q": (dist(1, 3, 2, 2, 2), dist(1, 3, 2, 2, 2)),
    "disjoint": (dist(0, 0, 0, 1, 1), dist(1, 1, 0, 0, 0)),
    "peaked": (dist(90, 5, 3, 1, 1), dist(1, 1, 1, 1, 96)),
}


def draft(q: torch.Tensor, trials: int, generator) -> torch.Tensor:
    return sample(q.expand(trials, q.numel()), generator)


@pytest.mark.parametrize("name", list(PAIRS))
def test_speculative_single_position_distribution_equals_target(name):
    """k = 1: the first emitted token (accepted draft or the residual sample) is distributed as p."""
    p, q = PAIRS[name]
    generator = torch.Generator().manual_seed(11)
    drafts = draft(q, TRIALS, generator).unsqueeze(1)
    bonus = dist(1, 1, 1, 1, 1)  # the position after the draft: never the first emitted token
    n_accepted, next_token = speculative_accept_batch(
        drafts, q.expand(TRIALS, 1, 5), torch.stack([p, bonus]).expand(TRIALS, 2, 5), generator)
    first = torch.where(n_accepted > 0, drafts[:, 0], next_token)
    assert chi_square_p_value(torch.bincount(first, minlength=5), p) > ALPHA
    # the acceptance rate is sum_x min(p, q) (Leviathan et al., the expected alpha)
    alpha = torch.minimum(p, q).sum()
    accepted_share = n_accepted.double().mean()
    assert abs(accepted_share - alpha) < 5 * math.sqrt(max(alpha * (1 - alpha), 1e-12) / TRIALS) + 1e-9
    bonus_tokens = next_token[n_accepted == 1]  # every all-accepted row samples its bonus from the last target row
    if len(bonus_tokens) >= 1000:
        assert chi_square_p_value(torch.bincount(bonus_tokens, minlength=5), bonus) > ALPHA


def test_chi_square_test_has_power_negative_controls():
    """The same test at the same number of trials rejects the two classic bugs: always accepting (yields q) and
    resampling from p instead of the residual after a rejection (over-weights tokens where p > q only partially)."""
    p, q = PAIRS["peaked"]
    generator = torch.Generator().manual_seed(5)
    always_accept = draft(q, TRIALS, generator)
    assert chi_square_p_value(torch.bincount(always_accept, minlength=5), p) < 1e-12
    drafts = draft(q, TRIALS, generator)
    u = torch.rand(TRIALS, generator=generator)
    accept = u * q[drafts] < p[drafts]
    resampled_from_p = torch.where(accept, drafts, sample(p.expand(TRIALS, 5), generator))
    assert chi_square_p_value(torch.bincount(resampled_from_p, minlength=5), p) < 1e-12


def test_speculative_two_positions_joint_distribution():
    """k = 2 with position-dependent p_t, q_t: the first two emitted tokens are distributed as p_0 x p_1.

    A sequence rejected at position 0 emits one token; a second round drafting positions 1 and 2 supplies its
    second token, as a decoder would run it.
    """
    p_t = [dist(4, 3, 2, 1, 0), dist(0, 1, 1, 2, 6), dist(1, 1, 1, 1, 1), dist(2, 1, 1, 1, 1)]
    q_t = [dist(1, 1, 1, 1, 1), dist(3, 0, 1, 0, 1), dist(5, 1, 1, 1, 1)]
    generator = torch.Generator().manual_seed(21)

    def round_from(position, trials):
        drafts = torch.stack([draft(q_t[position + i], trials, generator) for i in range(2)], dim=1)
        draft_probs = torch.stack(q_t[position:position + 2]).expand(trials, 2, 5)
        target_probs = torch.stack(p_t[position:position + 3]).expand(trials, 3, 5)
        n, nxt = speculative_accept_batch(drafts, draft_probs, target_probs, generator)
        emitted = torch.cat([drafts, torch.zeros(trials, 1, dtype=torch.long)], dim=1)
        emitted[torch.arange(trials), n] = nxt
        return emitted, n + 1

    emitted, count = round_from(0, TRIALS)
    short = count < 2
    second, _ = round_from(1, int(short.sum()))
    emitted[short, 1] = second[:, 0]
    cells = emitted[:, 0] * 5 + emitted[:, 1]
    joint = torch.outer(p_t[0], p_t[1]).flatten()
    assert chi_square_p_value(torch.bincount(cells, minlength=25), joint) > ALPHA


def test_batched_equals_sequential_reference_on_the_same_uniforms():
    generator = torch.Generator().manual_seed(3)
    batch, k, vocab = 300, 4, 7
    # sparse random distributions so that accepts, rejects, zeros and bonus tokens all occur
    target = torch.rand(batch, k + 1, vocab, generator=generator) ** 4
    target = target * (torch.rand(batch, k + 1, vocab, generator=generator) > 0.3)
    target[..., 0] += 1e-3
    target = target / target.sum(-1, keepdim=True)
    draft_probs = torch.rand(batch, k, vocab, generator=generator) ** 4
    draft_probs = draft_probs / draft_probs.sum(-1, keepdim=True)
    drafts = sample(draft_probs, generator)
    uniforms = torch.rand(batch, k + 1, generator=generator)
    n, nxt = speculative_accept_batch(drafts, draft_probs, target, uniforms_BK=uniforms)
    for b in range(batch):
        assert (int(n[b]), int(nxt[b])) == speculative_accept_ref(drafts[b], draft_probs[b], target[b], uniforms[b])
    assert set(n.tolist()) == set(range(k + 1))  # every acceptance length was exercised


def test_speculative_accept_single_sequence_and_zero_drafts():
    p = torch.stack([dist(0, 1, 0), dist(0, 0, 1)])
    q = dist(0, 1, 0).unsqueeze(0)
    assert speculative_accept(torch.tensor([1]), q, p, torch.Generator().manual_seed(0)) == (1, 2)
    assert speculative_accept([], torch.zeros(0, 3), dist(1, 0, 0).unsqueeze(0)) == (0, 0)
    with pytest.raises(ValueError, match="target_probs"):
        speculative_accept(torch.tensor([1]), q, p[:1])


def test_sampled_verification_at_temperature_zero_is_greedy_verification():
    generator = torch.Generator().manual_seed(8)
    batch, k, vocab = 64, 5, 9
    target_logits = torch.randn(batch, k + 1, vocab, generator=generator)
    draft_logits = target_logits[:, :k] + 0.8 * torch.randn(batch, k, vocab, generator=generator)
    drafts = greedy(draft_logits)
    n_g, next_g = speculative_accept_greedy_batch(drafts, target_logits)
    n_s, next_s = speculative_accept_batch(drafts, probs_from_logits(draft_logits, 0),
                                           probs_from_logits(target_logits, 0), generator)
    assert torch.equal(n_g, n_s) and torch.equal(next_g, next_s)
    assert 0 < n_g.float().mean() < k


def test_greedy_verification_cases():
    vocab = 6
    target_tokens = torch.tensor([3, 1, 4, 1])  # the target's argmax at positions 0..3 (k = 3)
    logits = torch.nn.functional.one_hot(target_tokens, vocab).float() * 5 + 0.1
    assert speculative_accept_greedy(torch.tensor([3, 1, 4]), logits) == (3, 1)  # all accepted + bonus
    assert speculative_accept_greedy(torch.tensor([3, 1, 5]), logits) == (2, 4)
    assert speculative_accept_greedy(torch.tensor([0, 1, 4]), logits) == (0, 3)  # later matches do not count
    assert speculative_accept_greedy(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 3)
    with pytest.raises(ValueError, match="target_logits"):
        speculative_accept_greedy(torch.tensor([3, 1]), logits)


def test_greedy_speculative_decoding_emits_the_targets_greedy_tokens():
    """A toy target whose next token depends on the previous one; the drafter is right 70% of the time.
    Decoding with drafts and greedy verification reproduces plain greedy decoding token for token."""
    vocab, k, steps = 13, 4, 60
    generator = torch.Generator().manual_seed(2)
    table = torch.randn(vocab, vocab, generator=generator)  # logits of the next token given the previous

    def target_logits(tokens):
        return table[torch.tensor(tokens)]

    plain = [5]
    while len(plain) < steps:
        plain.append(int(target_logits(plain[-1:]).argmax()))

    out = [5]
    while len(out) < steps:
        proposal, previous = [], out[-1]
        for _ in range(k):
            guess = int(table[previous].argmax())
            if torch.rand(1, generator=generator) > 0.7:
                guess = (guess + 1) % vocab
            proposal.append(guess)
            previous = guess
        n, nxt = speculative_accept_greedy(torch.tensor(proposal), target_logits([out[-1]] + proposal))
        out.extend(proposal[:n] + [nxt])
    assert out[:steps] == plain
