"""Compiled decoding (`Decoder(compile=True)`): the static-shape decode step against eager decoding, token for token.

The static pieces are checked eagerly (no compile, fast); the compiled decoder once, on a 3-layer model (Mamba,
attention, LatentMoE with grouped routing), batch 3 with prompts of different lengths and a stop token.
"""

import shutil

import pytest
import torch

from hybridtron.config import parse_pattern
from hybridtron.infer.cache import HybridCache
from hybridtron.infer.generate import COMPILED_CACHE_MIN, Decoder, compiled_cache_length, generate
from hybridtron.infer.sampling import SamplingParams
from hybridtron.model.lm import HybridLM
from hybridtron.model.moe import routed_experts_ref

COMPILER = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def random_prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def model(small_config):
    return HybridLM(small_config(layers_block_type=parse_pattern("M*E"))).eval()


def test_gathered_experts_match_the_reference(small_config):
    moe = HybridLM(small_config()).moe_layers()[0]
    x = torch.randn(3, moe.experts.up_proj.shape[-1])
    ids, weights = moe.gate(torch.randn(3, small_config().hidden_size))
    torch.testing.assert_close(moe.experts.forward_gathered(x, ids, weights),
                               routed_experts_ref(moe.experts, x, ids, weights), rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_static_decode_step_matches_the_eager_forward(small_config):
    """`HybridLM.decode_step` (run eagerly) against `forward` on a cache, rows at different lengths: same logits,
    same caches afterwards (the KV rows past each length are never read)."""
    model = HybridLM(small_config()).eval()
    config, prompts = model.config, random_prompts(model.config.vocab_size, [5, 2, 9])
    caches = [HybridCache.allocate(config, 3, 16) for _ in range(2)]
    for cache in caches:
        for b, prompt in enumerate(prompts):
            model(torch.tensor([prompt]), cache=cache.select(b), mtp=False)
    ids = torch.tensor([7, 8, 9])
    for _ in range(3):
        eager = model(ids[:, None], cache=caches[0], mtp=False).logits[:, 0]
        static = model.decode_step(ids, caches[1])
        torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
        ids = eager.argmax(-1)
    assert torch.equal(caches[0].lengths, caches[1].lengths)
    for eager_layer, static_layer in zip(caches[0].layers, caches[1].layers):
        if eager_layer is None:
            continue
        for name, tensor in vars(eager_layer).items():
            if isinstance(tensor, torch.Tensor):
                torch.testing.assert_close(getattr(static_layer, name), tensor, rtol=1e-5, atol=1e-5)


def test_compiled_cache_length_is_a_bucket():
    assert compiled_cache_length(34, 8192) == compiled_cache_length(97, 8192) == COMPILED_CACHE_MIN
    assert compiled_cache_length(300, 8192) == 512
    assert compiled_cache_length(300, 400) == 400


@pytest.mark.skipif(COMPILER is None, reason="torch.compile's CPU backend needs a C++ compiler (none on PATH)")
def test_compiled_greedy_decode_emits_the_eager_tokens(model):
    """Batch 3, prompts of 6, 1 and 13 tokens, a stop token that ends one row early: the compiled decoder emits
    exactly the eager tokens and finish reasons, with logits within 1e-4 at every step; then batch 1 (a second
    graph)."""
    prompts = random_prompts(model.config.vocab_size, [6, 1, 13])
    eager_run = Decoder(model, prompts, SamplingParams(temperature=0, max_tokens=10))
    for _ in eager_run:
        pass
    stop = eager_run.sequences[1].tokens[3]  # ends row 1 at its 4th token (and any row that emits it before)
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=(stop,))
    eager, compiled = (Decoder(model, prompts, params, compile=flag) for flag in (False, True))
    for _ in range(10):
        assert compiled.step() == eager.step()
        torch.testing.assert_close(compiled.next_logits_BV, eager.next_logits_BV, rtol=1e-4, atol=1e-4)
    assert compiled.done and eager.done
    assert [s.tokens for s in compiled.sequences] == [s.tokens for s in eager.sequences]
    assert [s.finish_reason for s in compiled.sequences] == [s.finish_reason for s in eager.sequences]
    assert compiled.sequences[1].finish_reason == "stop" and compiled.sequences[1].tokens[-1] == stop
    assert any(s.finish_reason == "length" for s in compiled.sequences)
    assert compiled.cache.max_len == COMPILED_CACHE_MIN
    # another batch size is another graph; the new decoder's first step checks every guard and picks it
    single = SamplingParams(temperature=0, max_tokens=6)
    assert generate(model, prompts[2:], single, compile=True) == generate(model, prompts[2:], single)


def test_speculative_decoding_rejects_compile(small_config):
    from hybridtron.infer.speculative import SpeculativeDecoder
    model = HybridLM(small_config()).eval()
    with pytest.raises(ValueError, match="plain decoding"):
        SpeculativeDecoder(model, [[3, 4]], SamplingParams(temperature=0, max_tokens=4), compile=True)
