"""Reading a sequence piece by piece from layer states reproduces the full forward under teacher forcing (KV cache
and SSM state alike), through `forward(cache=...)` and through the static one-token `decode_step`.

The model has every layer kind (Mamba-2, attention, LatentMoE with grouped routing, dense MLP). Logits of the
cached forwards must equal the full forward's at the same positions to float32 rounding: the chunked scan and the
one-token recurrence are the same sums in a different order, as are the cached and uncached attention.
"""

from __future__ import annotations

import pytest
import torch

from hybridtron.model.moe import routed_experts_ref
from hybridtron.model.state import KVCache, LayerStates, MambaState

DECODE = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture
def model(small_config, decoding_model):
    """Weights at 5x the default init scale and a random router bias, so every layer moves the logits."""
    return decoding_model(small_config(initializer_range=0.1, chunk_size=8))


def full_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def cached_logits(model, states, ids):
    with torch.no_grad():
        return model(ids, cache=states).logits


def test_one_token_at_a_time_matches_full_forward(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 21))
    reference = full_logits(model, ids)
    states = LayerStates.allocate(model.config, batch=2, max_len=32)
    steps = [cached_logits(model, states, ids[:, t:t + 1]) for t in range(ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), reference, **DECODE)
    assert states.lengths.tolist() == [21, 21]
    assert reference.abs().max() > 0.5  # the comparison is not between near-zero logits


@pytest.mark.parametrize("prefill_chunks", [[17], [7, 1, 9], [3, 8, 6]])  # chunk size is 8
def test_chunked_prefill_then_decode_matches_full_forward(model, prefill_chunks):
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    reference = full_logits(model, ids)
    states = LayerStates.allocate(model.config, batch=2, max_len=24)
    pieces, start = [], 0
    for size in prefill_chunks:
        pieces.append(cached_logits(model, states, ids[:, start:start + size]))
        start += size
    pieces += [cached_logits(model, states, ids[:, t:t + 1]) for t in range(start, 24)]
    torch.testing.assert_close(torch.cat(pieces, 1), reference, **DECODE)


def test_batched_sequences_of_different_lengths(model):
    """Prompts of different lengths are read one at a time through `states.select(i)`, then continue together;
    each sequence's logits equal those of its own full forward."""
    vocab = model.config.vocab_size
    prompt_lengths, new_tokens = [5, 12], 6
    sequences = [torch.randint(0, vocab, (1, n + new_tokens)) for n in prompt_lengths]
    references = [full_logits(model, seq) for seq in sequences]
    states = LayerStates.allocate(model.config, batch=2, max_len=20)
    for i, (seq, n) in enumerate(zip(sequences, prompt_lengths)):
        prefill = cached_logits(model, states.select(i), seq[:, :n])
        torch.testing.assert_close(prefill, references[i][:, :n], **DECODE)
    assert states.lengths.tolist() == prompt_lengths
    for step in range(new_tokens):
        next_ids = torch.cat([seq[:, n + step:n + step + 1] for seq, n in zip(sequences, prompt_lengths)])
        logits = cached_logits(model, states, next_ids)
        for i, n in enumerate(prompt_lengths):
            torch.testing.assert_close(logits[i], references[i][0, n + step:n + step + 1], **DECODE)
    assert states.lengths.tolist() == [n + new_tokens for n in prompt_lengths]


def test_kv_cache_bound_is_checked(model):
    states = LayerStates.allocate(model.config, batch=1, max_len=4)
    cached_logits(model, states, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="KV cache holds 4 positions"):
        cached_logits(model, states, torch.zeros(1, 2, dtype=torch.long))


# --------------------------------------------------------------------------------------- the static decode step
def prefilled(model, prompts, max_len):
    states = LayerStates.allocate(model.config, len(prompts), max_len)
    for b, prompt in enumerate(prompts):
        cached_logits(model, states.select(b), torch.tensor([prompt]))
    return states


@torch.inference_mode()
def test_decode_step_matches_the_forward_on_states(model):
    """`HybridLM.decode_step` (run eagerly) against `forward` on layer states, rows at different lengths: same
    logits, same states afterwards (the KV rows past each length are never read)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 2, 9)]
    forward_states, step_states = prefilled(model, prompts, 16), prefilled(model, prompts, 16)
    ids = torch.tensor([7, 8, 9])
    for _ in range(3):
        eager = model(ids[:, None], cache=forward_states, mtp=False).logits[:, 0]
        static = model.decode_step(ids, step_states)
        torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
        ids = eager.argmax(-1)
    assert torch.equal(forward_states.lengths, step_states.lengths)
    for got, want in zip(step_states.layers, forward_states.layers):
        if isinstance(got, MambaState):
            torch.testing.assert_close(got.conv_BCK, want.conv_BCK, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.ssm_BHPN, want.ssm_BHPN, rtol=1e-5, atol=1e-5)
        elif isinstance(got, KVCache):
            for b, length in enumerate(forward_states.lengths.tolist()):
                torch.testing.assert_close(got.k_BHTD[b, :, :length], want.k_BHTD[b, :, :length], **DECODE)
                torch.testing.assert_close(got.v_BHTD[b, :, :length], want.v_BHTD[b, :, :length], **DECODE)


@torch.inference_mode()
def test_decode_step_one_token_at_a_time_matches_full_forward(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 13))
    reference = full_logits(model, ids)
    states = LayerStates.allocate(model.config, batch=2, max_len=16)
    steps = [model.decode_step(ids[:, t], states) for t in range(ids.shape[1])]
    torch.testing.assert_close(torch.stack(steps, 1), reference, **DECODE)


def test_expert_decode_step_matches_the_reference(model):
    moe = model.moe_layers()[0]
    x = torch.randn(3, moe.experts.up_proj.shape[-1])
    ids, weights = moe.gate(torch.randn(3, model.config.hidden_size))
    torch.testing.assert_close(moe.experts.decode_step(x, ids, weights),
                               routed_experts_ref(moe.experts, x, ids, weights), rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_mtp_decode_step_matches_its_forward_on_states(model):
    """The MTP block's static one-position step against its forward with caches (the drafter's), rows at different
    lengths: same outputs, same caches."""
    config = model.config
    kinds = config.mtp_layers_block_type
    g = torch.Generator().manual_seed(2)
    forward_states, step_states = (LayerStates.allocate(config, 2, 12, kinds=kinds) for _ in range(2))
    for states in (forward_states, step_states):
        for b, length in enumerate((3, 6)):
            g_b = torch.Generator().manual_seed(b)
            hidden, embedding = (torch.randn(1, length, config.hidden_size, generator=g_b) for _ in range(2))
            model.mtp(hidden, embedding, caches=states.select(b).layers, lengths=states.lengths[b:b + 1])
            states.lengths[b] += length
    for _ in range(3):
        hidden, embedding = (torch.randn(2, config.hidden_size, generator=g) for _ in range(2))
        want = model.mtp(hidden[:, None], embedding[:, None], caches=forward_states.layers,
                         lengths=forward_states.lengths)[:, 0]
        got = model.mtp.decode_step(hidden, embedding, step_states.layers, step_states.lengths)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        forward_states.lengths += 1
        step_states.lengths += 1
    for got, want in zip(step_states.layers, forward_states.layers):
        if isinstance(got, KVCache):
            for b, length in enumerate(forward_states.lengths.tolist()):
                torch.testing.assert_close(got.k_BHTD[b, :, :length], want.k_BHTD[b, :, :length], **DECODE)
