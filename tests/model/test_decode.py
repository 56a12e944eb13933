"""Decoding with a HybridCache reproduces the full forward under teacher forcing (KV cache and SSM state alike).

The model has every layer kind (Mamba-2, attention, LatentMoE with grouped routing, dense MLP). Logits of the
cached forwards must equal the full forward's at the same positions to float32 rounding: the chunked scan and the
one-token recurrence are the same sums in a different order, as are the cached and uncached attention.
"""

from __future__ import annotations

import pytest
import torch

from hybridtron.infer.cache import HybridCache, KVCache, MambaState
from hybridtron.model.lm import HybridLM

DECODE = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture
def model(small_config):
    """Weights at 5x the default init scale and a random router bias, so every layer moves the logits."""
    config = small_config(initializer_range=0.1, chunk_size=8)
    model = HybridLM(config).eval()
    with torch.no_grad():
        for bias in model.router_biases():
            bias.uniform_(-0.05, 0.05)
    return model


def full_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def cached_logits(model, cache, ids):
    with torch.no_grad():
        return model(ids, cache=cache).logits


def test_one_token_at_a_time_matches_full_forward(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 21))
    reference = full_logits(model, ids)
    cache = HybridCache.allocate(model.config, batch=2, max_len=32)
    steps = [cached_logits(model, cache, ids[:, t:t + 1]) for t in range(ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), reference, **DECODE)
    assert cache.lengths.tolist() == [21, 21]
    assert reference.abs().max() > 0.5  # the comparison is not between near-zero logits


@pytest.mark.parametrize("prefill_chunks", [[17], [7, 1, 9], [3, 8, 6]])  # chunk size is 8
def test_chunked_prefill_then_decode_matches_full_forward(model, prefill_chunks):
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    reference = full_logits(model, ids)
    cache = HybridCache.allocate(model.config, batch=2, max_len=24)
    pieces, start = [], 0
    for size in prefill_chunks:
        pieces.append(cached_logits(model, cache, ids[:, start:start + size]))
        start += size
    pieces += [cached_logits(model, cache, ids[:, t:t + 1]) for t in range(start, 24)]
    torch.testing.assert_close(torch.cat(pieces, 1), reference, **DECODE)


def test_batched_sequences_of_different_lengths(model):
    """Prompts of different lengths are prefilled one at a time through `cache.select(i)`, then decode together;
    each sequence's logits equal those of its own full forward."""
    vocab = model.config.vocab_size
    prompt_lengths, new_tokens = [5, 12], 6
    sequences = [torch.randint(0, vocab, (1, n + new_tokens)) for n in prompt_lengths]
    references = [full_logits(model, seq) for seq in sequences]
    cache = HybridCache.allocate(model.config, batch=2, max_len=20)
    for i, (seq, n) in enumerate(zip(sequences, prompt_lengths)):
        prefill = cached_logits(model, cache.select(i), seq[:, :n])
        torch.testing.assert_close(prefill, references[i][:, :n], **DECODE)
    assert cache.lengths.tolist() == prompt_lengths
    for step in range(new_tokens):
        next_ids = torch.cat([seq[:, n + step:n + step + 1] for seq, n in zip(sequences, prompt_lengths)])
        logits = cached_logits(model, cache, next_ids)
        for i, n in enumerate(prompt_lengths):
            torch.testing.assert_close(logits[i], references[i][0, n + step:n + step + 1], **DECODE)
    assert cache.lengths.tolist() == [n + new_tokens for n in prompt_lengths]


def prefill_each(model, sequences, max_len):
    cache = HybridCache.allocate(model.config, batch=len(sequences), max_len=max_len)
    for i, seq in enumerate(sequences):
        cached_logits(model, cache.select(i), seq)
    return cache


def test_record_steps_then_rewind_equals_recomputed_state(model):
    """Verify 4 drafted tokens in one recorded forward, keep 1 of them for sequence 0 and 3 for sequence 1: the
    rewound cache equals a cache prefilled from scratch with the kept tokens, and decodes the same next logits."""
    vocab, prompt, drafted, kept = model.config.vocab_size, 7, 4, [1, 3]
    ids = torch.randint(0, vocab, (2, prompt + drafted))
    cache = prefill_each(model, [ids[i:i + 1, :prompt] for i in range(2)], max_len=16)
    cache.set_record_steps(True)
    verify = cached_logits(model, cache, ids[:, prompt:])
    torch.testing.assert_close(verify, full_logits(model, ids)[:, prompt:], **DECODE)
    cache.rewind_to(torch.tensor(kept), drafted)
    cache.set_record_steps(False)

    fresh = prefill_each(model, [ids[i:i + 1, :prompt + k] for i, k in enumerate(kept)], max_len=16)
    assert cache.lengths.tolist() == fresh.lengths.tolist() == [prompt + k for k in kept]
    for layer, fresh_layer in zip(cache.layers, fresh.layers):
        if isinstance(layer, MambaState):
            torch.testing.assert_close(layer.conv_BCK, fresh_layer.conv_BCK, **DECODE)
            torch.testing.assert_close(layer.ssm_BHPN, fresh_layer.ssm_BHPN, **DECODE)
        elif isinstance(layer, KVCache):
            for b, length in enumerate(fresh.lengths.tolist()):
                torch.testing.assert_close(layer.k_BHTD[b, :, :length], fresh_layer.k_BHTD[b, :, :length], **DECODE)
                torch.testing.assert_close(layer.v_BHTD[b, :, :length], fresh_layer.v_BHTD[b, :, :length], **DECODE)
    next_ids = torch.randint(0, vocab, (2, 1))
    torch.testing.assert_close(cached_logits(model, cache, next_ids), cached_logits(model, fresh, next_ids), **DECODE)


def test_rewind_requires_a_recorded_forward_and_one_kept_token(model):
    cache = HybridCache.allocate(model.config, batch=2, max_len=8)
    cached_logits(model, cache, torch.randint(0, 128, (2, 3)))
    with pytest.raises(RuntimeError, match="record_steps"):
        cache.rewind_to(torch.tensor([1, 1]), 3)
    cache.set_record_steps(True)
    cached_logits(model, cache, torch.randint(0, 128, (2, 2)))
    with pytest.raises(ValueError, match="at least one"):
        cache.rewind_to(torch.tensor([0, 2]), 2)


def test_cache_bounds_are_checked(model):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        HybridCache.allocate(model.config, batch=1, max_len=model.config.max_position_embeddings + 1)
    cache = HybridCache.allocate(model.config, batch=1, max_len=4)
    cached_logits(model, cache, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="KV cache holds 4 positions"):
        cached_logits(model, cache, torch.zeros(1, 2, dtype=torch.long))


def test_cache_memory_is_kv_per_token_plus_constant_mamba_state(model):
    config = model.config
    sizes = [HybridCache.allocate(config, batch=2, max_len=n).memory_bytes() for n in (10, 20)]
    n_attention = config.layers_block_type.count("full_attention")
    per_token = n_attention * 2 * config.num_key_value_heads * config.head_dim * 4
    assert sizes[1] - sizes[0] == 2 * 10 * per_token
    conv_channels = config.mamba_inner_size + 2 * config.n_groups * config.ssm_state_size
    mamba = config.layers_block_type.count("linear_attention") * 4 * (
        conv_channels * (config.conv_kernel - 1)
        + config.mamba_num_heads * config.mamba_head_dim * config.ssm_state_size)
    assert sizes[0] == 2 * (10 * per_token + mamba)
