"""The static-shape steps (what compiled decoding runs), run eagerly against the model's reference forward: outputs,
caches and recorded states, the rollback, the drafter's catch-up and the whole speculative step."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridtron.infer import fastpath, steps
from hybridtron.infer.cache import HybridCache
from hybridtron.infer.sampling import SamplingParams, exponential_noise, stream_ids
from hybridtron.infer.speculative import STATIC, FastForms, SpeculativeDecoder, speculative_step
from hybridtron.model.lm import HybridLM
from hybridtron.model.state import KVCache, MambaState
from test_speculative import chain_model

FP32 = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def model(small_config):
    torch.manual_seed(0)
    return HybridLM(small_config(initializer_range=0.05)).eval()


def prefilled(model, prompts, max_len=64):
    """A cache holding `prompts` (rows of different lengths), by the reference forward."""
    cache = HybridCache.allocate(model.config, len(prompts), max_len)
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            model(torch.tensor([prompt]), cache=cache.select(b), mtp=False)
    return cache


def assert_same_states(got: HybridCache, want: HybridCache, rows=None):
    for b in rows if rows is not None else range(got.batch_size):
        n = int(want.lengths[b])
        assert int(got.lengths[b]) == n
        for mine, theirs in zip(got.layers, want.layers):
            if isinstance(mine, MambaState):
                torch.testing.assert_close(mine.conv_BCK[b], theirs.conv_BCK[b], **FP32)
                torch.testing.assert_close(mine.ssm_BHPN[b], theirs.ssm_BHPN[b], **FP32)
            elif isinstance(mine, KVCache):
                torch.testing.assert_close(mine.k_BHTD[b, :, :n], theirs.k_BHTD[b, :, :n], **FP32)
                torch.testing.assert_close(mine.v_BHTD[b, :, :n], theirs.v_BHTD[b, :, :n], **FP32)


@torch.no_grad()
def test_forward_tokens_matches_the_forward_and_rewinds_to_any_kept_token(model):
    """Rows at different lengths, 4 tokens each: the static forward's logits and hidden states equal the reference's;
    rewound to keep 1, 4 and 2 tokens, each row's states equal a cache that read only those."""
    prompts = [[3, 4, 5], [6], [7, 8, 9, 10, 11]]
    new = torch.tensor([[12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]])
    static, reference = prefilled(model, prompts), prefilled(model, prompts)
    recorded = []
    logits, hidden = steps.forward_tokens(model, new, static, recorded)
    out = [model(new[b:b + 1], cache=reference.select(b), mtp=False) for b in range(3)]
    torch.testing.assert_close(logits, torch.cat([o.logits for o in out]), **FP32)
    torch.testing.assert_close(hidden, torch.cat([o.hidden for o in out]), **FP32)
    assert_same_states(static, reference)
    kept = torch.tensor([1, 4, 2])
    steps.rewind(static, recorded, kept, 4)
    kept_only = prefilled(model, [p + new[b, :int(kept[b])].tolist() for b, p in enumerate(prompts)])
    assert_same_states(static, kept_only)


@torch.no_grad()
def test_decode_tokens_is_the_models_decode_step_with_its_hidden_state(model):
    prompts = [[3, 4, 5], [6]]
    mine, theirs = prefilled(model, prompts), prefilled(model, prompts)
    ids = torch.tensor([7, 8])
    logits, hidden = steps.decode_tokens(model, ids, mine)
    torch.testing.assert_close(logits, model.decode_step(ids, theirs), rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head(hidden), logits, rtol=0, atol=0)
    assert_same_states(mine, theirs)


@torch.no_grad()
def test_mtp_tokens_is_the_drafters_fast_forward(model):
    kinds = model.config.mtp_layers_block_type
    caches = [HybridCache.allocate(model.config, 2, 32, kinds=kinds) for _ in range(2)]
    for cache in caches:
        cache.lengths[:] = torch.tensor([0, 3])
    hidden, tokens = torch.randn(2, 3, model.config.hidden_size), torch.tensor([[3, 4, 5], [6, 7, 8]])
    static = steps.mtp_tokens(model, hidden, tokens, caches[0], caches[0].lengths)
    fast = fastpath.mtp_forward(model, hidden, model.backbone.embeddings(tokens), caches[1])
    torch.testing.assert_close(static, fast, **FP32)
    caches[0].lengths += 3
    assert_same_states(caches[0], caches[1])


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=30),
                                    SamplingParams(temperature=1.0, top_k=8, max_tokens=30, seed=4)],
                         ids=["greedy", "sampled"])
def test_the_static_speculative_step_is_the_eager_one(small_config, params):
    """From the same state, `speculative_step` with the static forms (what compiles, run eagerly) and with the fast
    paths catch up, draft, accept and roll back alike: same tokens, accepted counts, caches and catch-up buffers."""
    model = chain_model(small_config(vocab_size=32, initializer_range=0.1), mtp_noise=0.2)
    decoder = SpeculativeDecoder(model, [[3, 1, 4, 1, 5], [9, 2, 6]], params, draft_length=3)
    for _ in range(3):
        decoder.step()
    batch = decoder.batch
    rows, k, width = len(batch.sequences), 3, 4
    noise = None if params.greedy else exponential_noise(
        stream_ids(batch.keys[:rows], batch.generated_indices(k + 1)), model.config.vocab_size)
    results = []
    with torch.inference_mode():
        for forms in (FastForms(True), STATIC):
            cache, mtp = copy.deepcopy(batch.view(rows)), copy.deepcopy(batch.mtp_view(rows))
            buffers = [t.clone() for t in (batch.pending[:rows], batch.uncaught_hidden[:rows, :width],
                                           batch.uncaught_next[:rows, :width], batch.uncaught[:rows])]
            out = speculative_step(forms, model, cache, mtp, *buffers, noise, batch.sampling(), k)
            results.append((out, cache, mtp, buffers))
    (fast, fast_cache, fast_mtp, fast_buffers), (static, static_cache, static_mtp, static_buffers) = results
    assert torch.equal(fast[0], static[0]) and torch.equal(fast[1], static[1])  # tokens, accepted
    torch.testing.assert_close(fast[2], static[2], **FP32)
    assert_same_states(static_cache, fast_cache)
    assert_same_states(static_mtp, fast_mtp)
    for a, b in zip(fast_buffers, static_buffers):
        torch.testing.assert_close(a, b, **FP32)
    assert int(static[1].sum()) > 0  # some drafts were accepted
