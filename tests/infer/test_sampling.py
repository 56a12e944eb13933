"""Sampling: SamplingParams validation, the filters, per-row sampling, the counter-based noise and the exactness of
the exponential race and of verification under shared noise."""

import math

import pytest
import torch

from hybridtron.infer.sampling import (
    ParamError, RowSampling, SamplingParams, choose_tokens, exponential_noise, exponential_noise_ref, greedy,
    noise_key, probs_from_logits, row_logprobs, row_probs, stream_id, stream_ids,
)

# A seeded chi-square goodness-of-fit test. A correct sampler fails it with probability ALPHA for a given seed;
# the negative controls below show the same number of trials rejects a wrong distribution by a wide margin.
ALPHA = 1e-4
TRIALS = 100_000


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """P-value of observed `counts` under `expected_probs` (cells with zero probability must have zero counts)."""
    counts, expected_probs = counts.double().flatten(), expected_probs.double().flatten()
    assert counts[expected_probs == 0].sum() == 0, "a token with zero probability was emitted"
    keep = expected_probs > 0
    expected = expected_probs[keep] * counts.sum()
    statistic = ((counts[keep] - expected) ** 2 / expected).sum()
    dof = int(keep.sum()) - 1
    if dof == 0:  # one possible token, and every draw was it
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2))


def dist(*values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


def keys_of(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.tensor([list(noise_key(seed, b)) for b in range(rows)])


# ------------------------------------------------------------------------------------------ SamplingParams
def test_sampling_params_defaults_and_greedy():
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p, params.seed) == (1.0, 0, 1.0, None)
    assert not params.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[2]).stop_token_ids == (2,)


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


def test_filter_argument_errors():
    logits = torch.zeros(1, 4)
    for kwargs, field in [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0}, "top_p")]:
        with pytest.raises(ParamError, match=field):
            probs_from_logits(logits, **kwargs)




# ------------------------------------------------------------------------------------------ per-row sampling
MIXED = [SamplingParams(temperature=0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=5),
         SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.8, top_k=7, top_p=0.5),
         SamplingParams(temperature=2.0, top_k=1)]


def test_row_probs_are_each_rows_probs_from_logits():
    """Each row's own temperature, top-k and top-p, exactly as `probs_from_logits` filters that row alone; a greedy
    row gets the plain softmax (for its log-probs)."""
    logits = torch.randn(len(MIXED), 3, 20, generator=torch.Generator().manual_seed(0)) * 3
    rows = RowSampling.of(MIXED)
    probs = row_probs(logits, rows)
    for b, params in enumerate(MIXED):
        expected = probs_from_logits(logits[b], 1.0) if params.greedy else \
            probs_from_logits(logits[b], params.temperature, params.top_k, params.top_p)
        torch.testing.assert_close(probs[b], expected, rtol=0, atol=0)
    logprobs = row_logprobs(logits, rows, probs)
    torch.testing.assert_close(logprobs[0], torch.log_softmax(logits[0], -1))
    torch.testing.assert_close(logprobs[2], probs[2].log())
    padded = rows.pad(8)
    assert padded.greedy_B.tolist() == [True, False, False, False, False, False, True, True]


def test_noise_is_exponential_and_a_function_of_key_index_and_token_only():
    """The tensors match the plain-integer reference; values are Exp(1) (mean, variance, the CDF at 1); a row's
    noise does not depend on the rows beside it; different keys and indices give different noise."""
    key = noise_key(5, 2)
    indices = torch.tensor([[0, 1, 2 ** 31 + 7]])
    noise = exponential_noise(stream_ids(torch.tensor([list(key)]), indices), 50)
    for t, index in enumerate(indices[0].tolist()):
        torch.testing.assert_close(noise[0, t], torch.tensor(exponential_noise_ref(key, index, 50)), rtol=1e-5,
                                   atol=1e-6)
    assert stream_ids(torch.tensor([list(key)]), indices)[0, 1] == stream_id(key, 1) - (1 << 32) * \
        (stream_id(key, 1) >= 1 << 31)
    many = exponential_noise(stream_ids(keys_of(4), torch.arange(5000).expand(4, -1)), 64)
    assert abs(float(many.mean()) - 1) < 0.01 and abs(float(many.var()) - 1) < 0.02
    assert abs(float((many < 1).double().mean()) - (1 - math.exp(-1))) < 0.005
    alone = exponential_noise(stream_ids(keys_of(4)[2:3], torch.arange(8)[None]), 64)
    torch.testing.assert_close(alone[0], many[2, :8], rtol=0, atol=0)
    assert not torch.equal(many[0, :8], many[1, :8]) and not torch.equal(many[0, 0], many[0, 1])
    assert noise_key(5, 2) == key and noise_key(5, 3) != key and noise_key(6, 2) != key


def test_exponential_race_draws_the_filtered_distribution():
    """argmax p / E over many (key, index) pairs: each row's tokens follow its filtered distribution (chi-square),
    greedy rows take the argmax, and nothing outside top-k / top-p is drawn."""
    logits = torch.randn(len(MIXED), 12, generator=torch.Generator().manual_seed(3)) * 2
    rows = RowSampling.of(MIXED)
    draws = 2_000
    per_batch = logits[:, None].expand(-1, draws, -1)
    tokens, probs = choose_tokens(per_batch, rows, exponential_noise(
        stream_ids(keys_of(len(MIXED), seed=11), torch.arange(draws).expand(len(MIXED), -1)), 12))
    assert (tokens[0] == logits[0].argmax()).all()
    for b, params in enumerate(MIXED[1:], start=1):
        expected = probs_from_logits(logits[b], params.temperature, params.top_k, params.top_p)
        counts = torch.bincount(tokens[b], minlength=12)
        assert chi_square_p_value(counts, expected) > ALPHA, params


def test_chi_square_test_has_power_negative_control():
    """At the same number of draws the test rejects a sampler that ignores the temperature."""
    logits = torch.randn(12, generator=torch.Generator().manual_seed(3)) * 2
    tokens, _ = choose_tokens(logits.expand(1, 2_000, -1), RowSampling.of([SamplingParams(temperature=1.0)]),
                              exponential_noise(stream_ids(keys_of(1, seed=11), torch.arange(2_000)[None]), 12))
    wrong = probs_from_logits(logits, temperature=0.7)
    assert chi_square_p_value(torch.bincount(tokens[0], minlength=12), wrong) < 1e-6


# (p, q) pairs: q uniform; q with zeros where p is not; p with zeros where q is not; p == q; disjoint; peaked.
PAIRS = {
    "q_uniform": (dist(1, 2, 3, 4, 0), dist(1, 1, 1, 1, 1)),
    "q_zero_where_p_not": (dist(1, 1, 1, 1, 0), dist(2, 2, 0, 0, 0)),
    "p_zero_where_q_not": (dist(0, 0, 5, 5, 0), dist(1, 1, 1, 1, 1)),
    "p_equals_q": (dist(1, 3, 2, 2, 2), dist(1, 3, 2, 2, 2)),
    "disjoint": (dist(0, 0, 0, 1, 1), dist(1, 1, 0, 0, 0)),
    "peaked": (dist(90, 5, 3, 1, 1), dist(1, 1, 1, 1, 96)),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_shared_noise_verification_emits_the_target_distribution(name):
    """A draft from q and the target's token from p under the same noise: the emitted token is the target's whatever
    the draft, so it follows p exactly; the draft is accepted iff the two agree, at least (1 - TV) / (1 + TV) of the
    time (the Gumbel-max coupling's bound; Leviathan's rejection sampling reaches 1 - TV)."""
    p, q = PAIRS[name]
    noise = exponential_noise(stream_ids(keys_of(1, seed=7), torch.arange(TRIALS)[None]), 5)[0]
    target, draft = (p / noise).argmax(-1), (q / noise).argmax(-1)
    assert chi_square_p_value(torch.bincount(target, minlength=5), p) > ALPHA
    assert chi_square_p_value(torch.bincount(draft, minlength=5), q) > ALPHA
    tv = 0.5 * float((p - q).abs().sum())
    agreement = float((target == draft).double().mean())
    assert agreement >= (1 - tv) / (1 + tv) - 0.01
    if name == "p_equals_q":
        assert agreement == 1.0
