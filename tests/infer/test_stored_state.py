"""The SSM state stored in its format (`infer.cache.StoredMambaState`): int8 values with their fp32 block scales, or
fp16 / bf16 values, read back dequantized and written quantized by the update. It decodes bit for bit as the
reference does (`reference_quant`: fp32 buffers rounded in place, `state_quant.roundtrip`): logits, log-probs,
greedy and sampled tokens, plain and speculative (rewinds), eager and compiled; and it holds the bytes the memory
model and the engine's slots count."""

from __future__ import annotations

import shutil

import pytest
import torch

from hybridtron.config import parse_pattern
from hybridtron.infer import fastpath
from hybridtron.infer.cache import HybridCache, StoredMambaState
from hybridtron.infer.decoder import Decoder
from hybridtron.infer.memory import slot_bytes
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.speculative import SpeculativeDecoder
from hybridtron.infer.state_quant import MODES
from hybridtron.model.lm import HybridLM
from hybridtron.model.memory import mamba_state_bytes
from hybridtron.model.state import KVCache, MambaState

QUANTIZED = [mode for mode in MODES if mode != "fp32"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
SAMPLED = SamplingParams(temperature=1.0, top_k=20, max_tokens=12, seed=5)


@pytest.fixture(scope="module")
def model(small_config):
    torch.manual_seed(0)
    return HybridLM(small_config(ssm_state_size=200, max_position_embeddings=128)).eval()  # int8: a partial block


def as_reference(monkeypatch) -> None:
    """From here on every cache allocated is the reference (fp32 buffers rounded in place)."""
    allocate = HybridCache.allocate.__func__
    monkeypatch.setattr(HybridCache, "allocate",
                        classmethod(lambda cls, *args, **kwargs: allocate(cls, *args, reference_quant=True, **kwargs)))


def mamba_states(cache):
    return [layer for layer in cache.layers if isinstance(layer, MambaState)]


@pytest.mark.parametrize("mode", QUANTIZED)
def test_the_state_is_stored_in_its_format(model, mode):
    config = model.config
    cache = HybridCache.allocate(config, 3, 16, state_quant=mode)
    rows = (3, config.mamba_num_heads, config.mamba_head_dim)
    for state in mamba_states(cache):
        assert isinstance(state, StoredMambaState)
        assert state.ssm_BHPN.shape == (*rows, config.ssm_state_size)
        if mode.startswith("int8"):
            assert state.ssm_BHPN.dtype == torch.int8
            assert state.scales_BHPS.dtype == torch.float32 and state.scales_BHPS.shape == (*rows, 2)
        else:
            assert state.ssm_BHPN.dtype == {"fp16": torch.float16, "bf16": torch.bfloat16}[mode[:4]]
            assert state.scales_BHPS is None
    kv = sum(layer.k_BHTD.nbytes + layer.v_BHTD.nbytes for layer in cache.layers if isinstance(layer, KVCache))
    # the bytes held are the memory model's (`hybridtron memory --state-dtype`), scales included
    stored = mode.split("_")[0]
    assert cache.memory_bytes() == kv + 3 * mamba_state_bytes(config, stored, "fp32")
    assert cache.slot_bytes() == slot_bytes(config, 16, "fp32", stored, "fp32")
    assert cache.slot_bytes() < HybridCache.allocate(config, 3, 16).slot_bytes()


def prefill_and_decode(model, mode, reference_quant, steps=6, rewinds=()):
    """A prompt, then `steps` tokens one at a time; `rewinds`: (step, kept) where a recorded forward of 3 tokens
    keeps `kept` per row (speculative verification). Every forward's logits, and the final SSM states in fp32."""
    cache = HybridCache.allocate(model.config, 2, 64, state_quant=mode, quant_seed=7, reference_quant=reference_quant)
    ids = torch.randint(3, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    logits = []
    with torch.no_grad():
        # 20 tokens: the chunked scan (past fastpath's recurrence) through the model's own mixer
        logits.append(fastpath.forward(model, ids[:, :20], cache).logits)
        cache.store_states()
        position = 20
        for step in range(steps):
            kept = dict(rewinds).get(step)
            tokens = 3 if kept is not None else 1
            logits.append(fastpath.forward(model, ids[:, position:position + tokens], cache,
                                           record=kept is not None).logits)
            cache.store_states()
            if kept is not None:
                cache.rewind_to(torch.tensor(kept), tokens)
            position += tokens
    return logits, [state.read_ssm() for state in mamba_states(cache)], cache.lengths.tolist()


@pytest.mark.parametrize("mode", QUANTIZED)
def test_decoding_equals_the_reference_bit_for_bit(model, mode):
    rewinds = ((1, [1, 3]), (3, [2, 2]), (4, [3, 1]))
    got = prefill_and_decode(model, mode, False, rewinds=rewinds)
    want = prefill_and_decode(model, mode, True, rewinds=rewinds)
    assert got[2] == want[2]
    for mine, theirs in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(mine, theirs)
    fp32 = prefill_and_decode(model, "fp32", False, rewinds=rewinds)
    assert not all(torch.equal(a, b) for a, b in zip(got[1], fp32[1]))  # the format did round


def decode(model, params, speculative=False, **options):
    decoder = (SpeculativeDecoder(model, PROMPTS, params, draft_length=3, logprobs=True, **options) if speculative
               else Decoder(model, PROMPTS, params, logprobs=True, **options))
    for _ in decoder:
        pass
    return [(seq.tokens, seq.logprobs) for seq in decoder.sequences], decoder.prompt_logits


PROMPTS = [[5, 9, 2, 7, 1], [3] * 9, [11, 4]]


@pytest.mark.parametrize("mode", ["int8_sr", "fp16_sr"])
@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_decoders_equal_the_reference(model, monkeypatch, mode, speculative, params):
    stored = decode(model, params, speculative, state_quant=mode)
    as_reference(monkeypatch)
    reference = decode(model, params, speculative, state_quant=mode)
    assert stored[0] == reference[0] and torch.equal(stored[1], reference[1])


def test_row_copies_resets_and_resizes_carry_the_scales(model):
    cache = HybridCache.allocate(model.config, 2, 16, state_quant="int8_sr", quant_seed=1)
    with torch.no_grad():
        fastpath.forward(model, torch.randint(3, 100, (2, 5)), cache)
    states = [state.read_ssm() for state in mamba_states(cache)]
    cache.copy_row(1, [0])
    assert all(torch.equal(state.read_ssm()[0], want[1]) for state, want in zip(mamba_states(cache), states))
    grown = cache.resized(4)
    assert all(torch.equal(state.read_ssm()[:2], cache_state.read_ssm())
               for state, cache_state in zip(mamba_states(grown), mamba_states(cache)))
    view = grown.rows(1, 2)
    view.reset_rows(0, 1)
    assert all((state.read_ssm()[1] == 0).all() and (state.scales_BHPS[1] == 0).all() for state in mamba_states(grown))
    assert all(torch.equal(state.read_ssm()[0], want[1]) for state, want in zip(mamba_states(grown), states))


COMPILER = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@pytest.fixture(scope="module")
def small_model(small_config):
    torch.manual_seed(0)
    return HybridLM(small_config(layers_block_type=parse_pattern("M*E"), ssm_state_size=200)).eval()


@pytest.mark.slow  # it compiles two graphs: about 45 s on 2 cores
@pytest.mark.skipif(COMPILER is None, reason="torch.compile's CPU backend needs a C++ compiler (none on PATH)")
def test_compiled_decoding_equals_the_reference(small_model, monkeypatch):
    """The compiled step reads the stored state dequantized inside its graph and hands its new state out in fp32
    (`stage_writes`), quantized right after: the reference's tokens, log-probs and logits at every step."""
    runs = []
    for reference in (False, True):
        if reference:
            as_reference(monkeypatch)
        decoder = Decoder(small_model, PROMPTS, SAMPLED, logprobs=True, state_quant="int8_sr", compile=True)
        logits = []
        while not decoder.done:
            decoder.step()
            if decoder.batch.last_logits_BV is not None:  # the step ran the decode step (not only a first token)
                logits.append(decoder.batch.last_logits_BV.clone())
        runs.append(([(seq.tokens, seq.logprobs) for seq in decoder.sequences], logits))
    assert runs[0][0] == runs[1][0] and len(runs[0][1]) == len(runs[1][1]) > 5
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


@pytest.mark.slow  # it compiles four graphs: about two minutes on 2 cores
@pytest.mark.skipif(COMPILER is None, reason="torch.compile's CPU backend needs a C++ compiler (none on PATH)")
def test_compiled_speculative_decoding_equals_the_reference(small_model, monkeypatch):
    """Verification, acceptance and the rewind in one graph, on the stored state: the reference's tokens."""
    stored = decode(small_model, SAMPLED, True, state_quant="int8_sr", compile=True)
    as_reference(monkeypatch)
    assert stored[0] == decode(small_model, SAMPLED, True, state_quant="int8_sr", compile=True)[0]
