"""The decoding fast paths (`hybridtron.infer.fastpath`) against the model's reference forward: outputs and states.

Each path is checked where it applies and where it falls back; then the whole model on a cache (backbone and MTP
block), fast against reference, and decoders built on a caller's model leave that model exactly as it was.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybridtron.infer import fastpath
from hybridtron.infer.cache import HybridCache
from hybridtron.infer.decoder import Decoder
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.speculative import SpeculativeDecoder
from hybridtron.model.lm import HybridLM
from hybridtron.model.moe import RoutedExperts, routed_experts_ref
from hybridtron.model.state import KVCache, MambaState

FP32 = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def model(small_config):
    """Weights at 5x the default init scale and random router biases, so every layer moves the logits."""
    model = HybridLM(small_config(initializer_range=0.1, chunk_size=8)).eval()
    with torch.no_grad():
        for bias in model.router_biases():
            bias.uniform_(-0.05, 0.05)
    return model


def assert_states_equal(got_layers, want_layers, lengths):
    for got, want in zip(got_layers, want_layers):
        if isinstance(got, MambaState):
            torch.testing.assert_close(got.conv_BCK, want.conv_BCK, **FP32)
            torch.testing.assert_close(got.ssm_BHPN, want.ssm_BHPN, **FP32)
        elif isinstance(got, KVCache):
            for b, length in enumerate(lengths):
                torch.testing.assert_close(got.k_BHTD[b, :, :length], want.k_BHTD[b, :, :length], **FP32)
                torch.testing.assert_close(got.v_BHTD[b, :, :length], want.v_BHTD[b, :, :length], **FP32)


# ---------------------------------------------------------------------------------------------------- Mamba
def random_mamba_state(mixer, batch, generator):
    kernel = mixer.conv1d.kernel_size[0]
    return MambaState(torch.randn(batch, mixer.conv_channels, kernel - 1, generator=generator),
                      torch.randn(batch, mixer.num_heads, mixer.head_dim, mixer.state_size, generator=generator) / 2)


@pytest.mark.parametrize("length", [1, 5, fastpath.CONV_TAPS_MAX_TOKENS, fastpath.CONV_TAPS_MAX_TOKENS + 1, 30])
@pytest.mark.parametrize("record", [False, True])
@torch.no_grad()
def test_mamba_fast_paths_match_the_forward(model, length, record):
    """One-token step (state in place), conv taps, the recorded scan: same output and final state as the model's
    forward; recorded, the state after each token equals the forward's after that token alone."""
    mixer = model.backbone.layers[0].mixer
    g = torch.Generator().manual_seed(length)
    x = torch.randn(2, length, model.config.hidden_size, generator=g)
    initial = random_mamba_state(mixer, 2, g)
    reference, fast = copy.deepcopy(initial), copy.deepcopy(initial)
    want = mixer(x, reference)
    cache = HybridCache([fast], torch.zeros(2, dtype=torch.long), length) if record else None
    got = fastpath.mamba_forward(mixer, x, fast, cache)
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(fast.conv_BCK, reference.conv_BCK, **FP32)
    torch.testing.assert_close(fast.ssm_BHPN, reference.ssm_BHPN, **FP32)
    if record:
        steps, state = cache.recorded[0], copy.deepcopy(initial)
        for t in range(length):
            mixer(x[:, t:t + 1], state)
            torch.testing.assert_close(steps.conv_BTCK[:, t], state.conv_BCK, **FP32)
            torch.testing.assert_close(steps.ssm_BTHPN[:, t], state.ssm_BHPN, **FP32)


# ------------------------------------------------------------------------------------------------ attention
@pytest.mark.parametrize("starts, new", [([6, 6], 1), ([6, 6], 4), ([0, 0], 5), ([3, 9], 1), ([3, 9], 3)])
@torch.no_grad()
def test_attention_fast_path_matches_the_forward(model, starts, new):
    """Rows at one length take the slice write (and no mask for one token); rows at different lengths fall back."""
    attention = model.backbone.layers[1].mixer
    config = model.config
    g = torch.Generator().manual_seed(sum(starts) + new)
    kv = KVCache(torch.randn(2, config.num_key_value_heads, 16, config.head_dim, generator=g),
                 torch.randn(2, config.num_key_value_heads, 16, config.head_dim, generator=g))
    reference, fast = copy.deepcopy(kv), copy.deepcopy(kv)
    x = torch.randn(2, new, config.hidden_size, generator=g)
    lengths = torch.tensor(starts)
    torch.testing.assert_close(fastpath.attention_forward(attention, x, fast, lengths),
                               attention(x, reference, lengths), **FP32)
    assert_states_equal([fast], [reference], [s + new for s in starts])
    with pytest.raises(ValueError, match="KV cache holds 16 positions"):
        fastpath.attention_forward(attention, torch.randn(2, 17 - starts[0], config.hidden_size), fast,
                                   torch.tensor([starts[0]] * 2))


# -------------------------------------------------------------------------------------------------- experts
@pytest.mark.parametrize("num_experts, top_k, tokens", [(8, 2, 1), (8, 2, 4), (16, 4, 3), (6, 6, 1), (8, 3, 5)])
def test_expert_pair_loop_matches_the_reference(monkeypatch, num_experts, top_k, tokens):
    """No more (token, expert) pairs than experts and no gradient: the pair loop; else the grouped GEMM."""
    experts = RoutedExperts(num_experts, 16, 24)
    with torch.no_grad():
        experts.up_proj.normal_(0, 0.25)
        experts.down_proj.normal_(0, 0.2)
    x = torch.randn(tokens, 16)
    expert_ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    grouped = []
    forward = RoutedExperts.forward
    monkeypatch.setattr(RoutedExperts, "forward", lambda *args: grouped.append(1) or forward(*args))
    with torch.no_grad():
        out = fastpath.experts_forward(experts, x, expert_ids, weights)
    assert bool(grouped) == (tokens * top_k > num_experts)
    torch.testing.assert_close(out, routed_experts_ref(experts, x, expert_ids, weights), **FP32)
    grouped.clear()
    fastpath.experts_forward(experts, x, expert_ids, weights)  # with gradient: the grouped GEMM
    assert grouped


def test_expert_pair_loop_leaves_a_swapped_in_gemm_alone():
    """A grouped GEMM a precision converter swapped in must see every row: no pair loop then."""
    experts = RoutedExperts(8, 16, 24)
    calls = []
    experts.grouped_mm = lambda x, w, sizes: calls.append(1) or fastpath.grouped_mm(x, w, sizes)
    with torch.no_grad():
        fastpath.experts_forward(experts, torch.randn(1, 16), torch.tensor([[0, 3]]), torch.rand(1, 2))
    assert calls


# --------------------------------------------------------------------------------------------- whole model
@pytest.mark.parametrize("prompt_lengths", [[7, 7], [4, 11]])
@torch.inference_mode()
def test_fast_forward_matches_the_reference_on_a_cache(model, prompt_lengths):
    """Prefill (chunks of 5 and 2 tokens), one-token steps and a recorded 4-token forward: fast and reference give
    the same logits and leave the same cache."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (1, n), generator=g) for n in prompt_lengths]
    caches = {fast: HybridCache.allocate(model.config, 2, 24) for fast in (True, False)}
    logits = {fast: [] for fast in caches}
    for fast, cache in caches.items():
        for b, prompt in enumerate(prompts):
            for start in range(0, prompt.shape[1], 5):
                chunk = prompt[:, start:start + 5]
                logits[fast].append(fastpath.forward(model, chunk, cache.select(b), fast=fast).logits)
    ids = torch.randint(0, vocab, (2, 6), generator=g)
    for fast, cache in caches.items():
        for t in range(2):
            logits[fast].append(fastpath.forward(model, ids[:, t:t + 1], cache, fast=fast).logits)
        logits[fast].append(fastpath.forward(model, ids[:, 2:], cache, fast=fast, record=True).logits)
    for got, want in zip(logits[True], logits[False]):
        torch.testing.assert_close(got, want, **FP32)
    fast, reference = caches[True], caches[False]
    assert fast.lengths.tolist() == reference.lengths.tolist() == [n + 6 for n in prompt_lengths]
    assert_states_equal(fast.layers, reference.layers, fast.lengths.tolist())
    assert fast.recorded.keys() == reference.recorded.keys() and fast.recorded
    for i in fast.recorded:
        torch.testing.assert_close(fast.recorded[i].conv_BTCK, reference.recorded[i].conv_BTCK, **FP32)
        torch.testing.assert_close(fast.recorded[i].ssm_BTHPN, reference.recorded[i].ssm_BTHPN, **FP32)


@torch.inference_mode()
def test_fast_mtp_forward_matches_the_reference(model):
    config = model.config
    caches = {fast: HybridCache.allocate(config, 2, 12, kinds=config.mtp_layers_block_type) for fast in (True, False)}
    g = torch.Generator().manual_seed(1)
    for hidden_len in (5, 1, 1):
        hidden = torch.randn(2, hidden_len, config.hidden_size, generator=g)
        embedding = torch.randn(2, hidden_len, config.hidden_size, generator=g)
        outs = [fastpath.mtp_forward(model, hidden, embedding, caches[fast], fast=fast) for fast in (True, False)]
        torch.testing.assert_close(outs[0], outs[1], **FP32)
    assert caches[True].lengths.tolist() == [7, 7]
    assert_states_equal(caches[True].layers, caches[False].layers, [7, 7])


def test_fast_and_reference_decoders_emit_the_same_tokens(model):
    prompts = [[5, 6, 7], [8] * 9, [5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=10)
    for decoder_class, kwargs in ((Decoder, {}), (SpeculativeDecoder, {"draft_length": 3})):
        runs = []
        for fast in (True, False):
            decoder = decoder_class(model, prompts, params, fast_paths=fast, **kwargs)
            assert decoder.fast_paths == fast
            for _ in decoder:
                pass
            runs.append([s.tokens for s in decoder.sequences])
        assert runs[0] == runs[1]
    assert Decoder(model, [[3]], params).fast_paths  # the default on a CPU


# ------------------------------------------------------------------------------------- the caller's model
def storage_of(model):
    return {name: (p.stride(), p.data_ptr(), p.is_contiguous()) for name, p in model.named_parameters()}


def test_decoders_leave_the_callers_model_unchanged(small_config):
    """Building and running a decoder (plain, speculative, reference or fast) changes no parameter of the model it
    was given: same strides, same storage, same values (the weight layout is an engine's explicit step)."""
    model = HybridLM(small_config()).eval()
    before, values = storage_of(model), {k: v.clone() for k, v in model.state_dict().items()}
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=0)
    for decoder in (Decoder(model, [[3, 4, 5]], params), Decoder(model, [[3, 4]], params, fast_paths=False),
                    SpeculativeDecoder(model, [[3, 4, 5], [6]], params, draft_length=2)):
        for _ in decoder:
            pass
    assert storage_of(model) == before
    assert all(torch.equal(v, values[k]) for k, v in model.state_dict().items())
    assert all(p.is_contiguous() for p in model.parameters())

