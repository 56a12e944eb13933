"""MTP self-speculative decoding: exactly plain greedy decoding, plain sampling's distribution, exact rollback."""

import pytest
import torch

from hybridtron.infer.decoder import Decoder
from hybridtron.infer.engine import generate_tokens
from hybridtron.infer.sampling import SamplingParams, probs_from_logits
from hybridtron.infer.speculative import AcceptanceStats, SpeculativeDecoder
from hybridtron.model.lm import HybridLM
from hybridtron.model.state import KVCache, MambaState

FP32 = dict(rtol=1e-5, atol=1e-5)


def chain_model(config, mtp_noise: float, head_scale: float = 1.0, seed: int = 0) -> HybridLM:
    """A random model whose drafts are often, but not always, right: the backbone's next token is mostly a fixed
    permutation of the current one (lm_head row pi(x) = embedding of x, the layers perturb it), and the MTP block
    sees the embedding of its input token through a noisy identity, so it predicts pi(next token) when the noise
    lets it. Drafts then get accepted for 0..k tokens, which exercises every rollback slot."""
    torch.manual_seed(seed)
    model = HybridLM(config).eval()
    hidden, vocab = config.hidden_size, config.vocab_size
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        embeddings = torch.randn(vocab, hidden, generator=g)
        model.backbone.embeddings.weight.copy_(embeddings)
        model.lm_head.weight.zero_()
        model.lm_head.weight[torch.randperm(vocab, generator=g)] = embeddings * head_scale / hidden ** 0.5
        eh_proj = model.mtp.layers[0].eh_proj.weight
        eh_proj.normal_(0, mtp_noise, generator=g)
        eh_proj[:, :hidden] += torch.eye(hidden)
    return model


def random_prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run(decoder):
    for _ in decoder:
        pass
    return [s.tokens for s in decoder.sequences]


# ------------------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("kind", ["random", "chain"])
def test_greedy_speculative_equals_plain_greedy(small_config, kind):
    """Every k in 1..7, a batch of prompts of different lengths and each prompt alone: token for token."""
    config = small_config(vocab_size=32, initializer_range=0.1 if kind == "chain" else 0.02)
    model = chain_model(config, mtp_noise=0.2) if kind == "chain" else HybridLM(config).eval()
    prompts = random_prompts(config.vocab_size, [5, 1, 12, 3, 8, 2])
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = generate_tokens(model, prompts, params)
    histogram = torch.zeros(8, dtype=torch.long)
    for k in range(1, 8):
        decoder = SpeculativeDecoder(model, prompts, params, draft_length=k)
        assert run(decoder) == plain, f"draft length {k}"
        histogram[:k + 1] += torch.tensor(decoder.stats.histogram)
    for prompt, expected in zip(prompts[:2], plain[:2]):
        assert generate_tokens(model, [prompt], params, speculative=True, draft_length=5) == [expected]
    # a chunked prefill fills the drafter's cache across chunk boundaries
    assert generate_tokens(model, prompts, params, speculative=True, draft_length=3, prefill_chunk=4) == plain
    if kind == "chain":  # every number of accepted drafts occurred, so every rollback slot was used
        assert (histogram > 0).all(), histogram


def test_greedy_speculative_at_the_context_limit_and_with_stops(small_config):
    config = small_config(vocab_size=32, initializer_range=0.1)
    model = chain_model(config, mtp_noise=0.2)
    prompts = random_prompts(config.vocab_size, [6, 2, 9])
    params = SamplingParams(temperature=0, max_tokens=40)
    plain = Decoder(model, prompts, params, max_context=20)
    speculative = SpeculativeDecoder(model, prompts, params, max_context=20, draft_length=6)
    assert run(speculative) == run(plain)
    assert [len(s.prompt) + len(s.tokens) for s in speculative.sequences] == [20, 20, 20]
    stop = run(plain)[0][5]
    params = SamplingParams(temperature=0, max_tokens=17, stop_token_ids=(stop,))
    assert generate_tokens(model, prompts, params, speculative=True, draft_length=4) == generate_tokens(model, prompts, params)


# ------------------------------------------------------------------------------------------------ sampling
def exact_plain_distribution(model, prompt, params, tokens=3):
    """P(first `tokens` tokens) of plain sampling, by enumerating every prefix: [V] * tokens."""
    vocab = model.config.vocab_size
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = torch.tensor([prompt])
    for _ in range(tokens):
        with torch.no_grad():
            logits = model(prefixes).logits[:, -1]
        probs = probs_from_logits(logits, params.temperature, params.top_k, params.top_p).double()
        joint = (joint[:, None] * probs).flatten()
        prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(len(prefixes))[:, None]],
                             dim=1)
    return joint.view(*[vocab] * tokens)


def chi_square_p_value(counts, probs):
    """Goodness of fit of `counts` to `probs`, cells with an expected count below 5 pooled into one; 0 when a cell
    of probability 0 was observed."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2))


@pytest.mark.parametrize("draft_length, params", [
    (1, SamplingParams(temperature=1.0, max_tokens=3, seed=11)),
    (3, SamplingParams(temperature=1.0, top_k=5, top_p=0.9, max_tokens=5, seed=12)),
])
def test_speculative_sampling_matches_plain_sampling(small_config, draft_length, params):
    """The first three tokens of 8,000 speculative samples (one batch, one row per sample) against the exact
    distribution of plain sampling over all 8^3 sequences (chi-square). With k = 1 a rejected draft sends the third
    token through a rollback; with k = 3 (and top-k, top-p) the first verification drafts all of them. The negative
    control shows the test's power: the distribution that accepting every draft would give fails it by far."""
    config = small_config(vocab_size=8, initializer_range=0.1)
    model = chain_model(config, mtp_noise=0.3, head_scale=0.3)
    prompt = [3, 1, 4, 1, 5]
    samples = 8_000
    decoder = SpeculativeDecoder(model, [prompt] * samples, params, draft_length=draft_length)
    tokens = torch.tensor([t[:3] for t in run(decoder)])
    counts = torch.zeros(8, 8, 8).index_put_((tokens[:, 0], tokens[:, 1], tokens[:, 2]),
                                             torch.ones(samples), accumulate=True)
    exact = exact_plain_distribution(model, prompt, params)
    stats = decoder.stats
    assert 0 < stats.accepted < stats.steps * draft_length  # drafts were both accepted and rejected
    assert counts[exact == 0].sum() == 0  # top-k / top-p: nothing outside the filtered support
    assert chi_square_p_value(counts, exact) > 1e-3
    # negative control: the second token drawn from the drafter (every draft accepted)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    first = probs_from_logits(logits, params.temperature, params.top_k, params.top_p).double()
    drafter_second = []
    for token in range(8):
        with torch.no_grad():
            mtp_logits = model(torch.tensor([prompt + [token]])).mtp_logits[0][0, -2]
        drafter_second.append(probs_from_logits(mtp_logits, params.temperature, params.top_k, params.top_p).double())
    third_given_two = exact / exact.sum(-1, keepdim=True).clamp(min=1e-300)
    drafted = first[:, None, None] * torch.stack(drafter_second)[:, :, None] * third_given_two
    assert 0.5 * (drafted - exact).abs().sum() > 0.05
    assert chi_square_p_value(counts, drafted) < 1e-6


# ------------------------------------------------------------------------------------------------ rollback
def test_rolled_back_state_equals_a_recomputed_one(small_config):
    """After each speculative step the backbone cache (Mamba conv and SSM states, KV rows) and the drafter's KV
    cache equal what a fresh prefill of the same tokens computes."""
    config = small_config(vocab_size=32, initializer_range=0.1)
    model = chain_model(config, mtp_noise=0.2)
    prompts = random_prompts(config.vocab_size, [7, 3])
    decoder = SpeculativeDecoder(model, prompts, SamplingParams(temperature=0, max_tokens=60), draft_length=4)
    for _ in range(8):
        decoder.step()
        for index, seq in enumerate(decoder.sequences):
            b = decoder.row(index)
            processed = seq.prompt + seq.tokens[:-1]  # the last token is pending: sampled, not yet fed
            assert int(decoder.cache.lengths[b]) == len(processed)
            fresh = SpeculativeDecoder(model, [processed], SamplingParams(temperature=0, max_tokens=1),
                                       draft_length=4)
            for got, want in zip(decoder.cache.layers, fresh.cache.layers):
                if isinstance(got, MambaState):
                    torch.testing.assert_close(got.conv_BCK[b], want.conv_BCK[0], **FP32)
                    torch.testing.assert_close(got.ssm_BHPN[b], want.ssm_BHPN[0], **FP32)
                elif isinstance(got, KVCache):
                    n = len(processed)
                    torch.testing.assert_close(got.k_BHTD[b, :, :n], want.k_BHTD[0, :, :n], **FP32)
                    torch.testing.assert_close(got.v_BHTD[b, :, :n], want.v_BHTD[0, :, :n], **FP32)
            n = int(decoder.mtp_cache.lengths[b])  # the entries caught up; the others wait in the buffer
            assert n + int(decoder.batch.uncaught[b]) == len(processed) and n <= int(fresh.mtp_cache.lengths[0])
            for got, want in zip(decoder.mtp_cache.layers, fresh.mtp_cache.layers):
                if isinstance(got, KVCache):
                    torch.testing.assert_close(got.k_BHTD[b, :, :n], want.k_BHTD[0, :, :n], **FP32)
                    torch.testing.assert_close(got.v_BHTD[b, :, :n], want.v_BHTD[0, :, :n], **FP32)
    assert decoder.stats.accepted > 0 and decoder.stats.histogram[0] > 0


def test_drafter_entries_match_training_depth_one(small_config):
    """The drafter's first depth is the training forward's MTP depth 1: its logits at the prompt's last position
    (drafting the token after the one sampled from the prompt) equal mtp_logits[0] of the full forward."""
    config = small_config(vocab_size=32)
    model = HybridLM(config).eval()
    prompt = random_prompts(32, [9])[0]
    decoder = SpeculativeDecoder(model, [prompt], SamplingParams(temperature=0, max_tokens=10), draft_length=1)
    first = decoder.step()[0][0]
    with torch.inference_mode():
        draft = int(model.lm_head(decoder.batch.catch_up(1)).argmax(-1)[0])
    with torch.no_grad():
        expected = model(torch.tensor([prompt + [first]])).mtp_logits[0][0, len(prompt) - 1].argmax()
    assert draft == int(expected)


def test_acceptance_stats_and_errors(small_config):
    stats = AcceptanceStats()
    for n, k in ((0, 2), (3, 3), (1, 3)):
        stats.record(n, k)
    assert stats.histogram == [1, 1, 0, 1] and stats.mean_acceptance_length == (4 + 3) / 3
    assert stats.draft_length == 3 and AcceptanceStats().mean_acceptance_length == 0.0
    assert stats.draft_lengths == {2: 1, 3: 2} and stats.drafted == 8  # the steps by the draft length they used
    model = HybridLM(small_config(num_nextn_predict_layers=0))
    with pytest.raises(ValueError, match="no MTP block|has none"):
        SpeculativeDecoder(model, [[1]], SamplingParams())
    with pytest.raises(ValueError, match="draft_length"):
        SpeculativeDecoder(HybridLM(small_config()), [[1]], SamplingParams(), draft_length=0)
    with pytest.raises(ValueError, match="Mamba"):
        SpeculativeDecoder(HybridLM(small_config(mtp_layers_block_type="M")), [[1]], SamplingParams())
