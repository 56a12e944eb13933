"""Compiled decoding (`Decoder(compile=True)`): the compiled decode step against eager decoding, token for token.

The static-shape step itself is checked eagerly against the forward in tests/model/test_decode.py; here the
compiled decoder once, on a 3-layer model (Mamba, attention, LatentMoE with grouped routing), batch 3 with prompts
of different lengths and a stop token.
"""

import shutil

import pytest
import torch

from hybridtron.config import parse_pattern
from hybridtron.infer.decoder import Decoder
from hybridtron.infer.steps import COMPILED_CACHE_MIN, compiled_cache_length
from hybridtron.infer.engine import generate_tokens
from hybridtron.infer.sampling import SamplingParams
from hybridtron.model.lm import HybridLM

COMPILER = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def random_prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture
def model(small_config):
    return HybridLM(small_config(layers_block_type=parse_pattern("M*E"))).eval()


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
    torch.testing.assert_close(compiled.prompt_logits, eager.prompt_logits, rtol=0, atol=0)  # prefill is eager
    for _ in range(10):
        assert compiled.step() == eager.step()
        if eager.batch.last_logits_BV is not None:  # the same rows, in the same order, ran the step
            torch.testing.assert_close(compiled.batch.last_logits_BV, eager.batch.last_logits_BV, rtol=1e-4,
                                       atol=1e-4)
    assert compiled.done and eager.done
    assert [s.tokens for s in compiled.sequences] == [s.tokens for s in eager.sequences]
    assert [s.finish_reason for s in compiled.sequences] == [s.finish_reason for s in eager.sequences]
    assert compiled.sequences[1].finish_reason == "stop" and compiled.sequences[1].tokens[-1] == stop
    assert any(s.finish_reason == "length" for s in compiled.sequences)
    assert compiled.cache.max_len == COMPILED_CACHE_MIN
    # another batch size is another graph; the new decoder's first step checks every guard and picks it
    single = SamplingParams(temperature=0, max_tokens=6)
    assert generate_tokens(model, prompts[2:], single, compile=True) == generate_tokens(model, prompts[2:], single)


@pytest.mark.slow  # it compiles four graphs: about a minute on 2 cores
@pytest.mark.skipif(COMPILER is None, reason="torch.compile's CPU backend needs a C++ compiler (none on PATH)")
def test_compiled_speculative_decode_emits_the_plain_tokens(small_config):
    """The compiled catch-up and speculative step (drafts, recorded verification, acceptance, rollback in one graph),
    batch 2 with prompts of different lengths, greedy and sampled: the plain tokens, and drafts were accepted."""
    from hybridtron.infer.speculative import SpeculativeDecoder
    from test_speculative import chain_model

    model = chain_model(small_config(vocab_size=32, initializer_range=0.1), mtp_noise=0.2)
    prompts = random_prompts(32, [5, 9])
    for params in (SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=1.0, max_tokens=12,
                                                                                 seed=1)):
        decoder = SpeculativeDecoder(model, prompts, params, draft_length=2, compile=True)
        for _ in decoder:
            pass
        assert [s.tokens for s in decoder.sequences] == generate_tokens(model, prompts, params)
        assert decoder.stats.accepted > 0


def test_expert_ids_reject_compile(small_config):
    model = HybridLM(small_config()).eval()
    with pytest.raises(ValueError, match="expert_ids"):
        Decoder(model, [[3, 4]], SamplingParams(temperature=0, max_tokens=4), compile=True, expert_ids=True)
