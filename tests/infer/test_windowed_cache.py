"""A sliding-window layer's KV cache is a ring of its window: decoding past the window reproduces the full forward's
logits (teacher forcing) through every cached path (`forward(cache=...)`, the static `decode_step`, the decoders'
fast and static mixers, rows at different lengths, row copies and resizes); the cache and the memory model count
only the window for those layers."""

from __future__ import annotations

import pytest
import torch

from hybridtron.config import ATTENTION
from hybridtron.distributed.costs import core_flops_per_token, mean_keys_per_query
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.infer.cache import HybridCache
from hybridtron.infer.engine import HybridEngine
from hybridtron.infer.fastpath import forward as fast_forward
from hybridtron.infer.memory import memory_report, slot_bytes
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.speculative import check_drafter
from hybridtron.infer.steps import static_mixer
from hybridtron.model.lm import HybridLM
from hybridtron.model.memory import kv_bytes_per_layer_token, kv_cache_bytes
from hybridtron.model.state import KVCache, LayerStates

DECODE = dict(rtol=1e-4, atol=1e-5)
WINDOW = 5


@pytest.fixture
def windowed_config(small_config):
    """Two attention layers, the first windowed, the second full (`sliding_window_layers`), every option on."""
    return small_config(layers_block_type="M*E*ME", sliding_window=WINDOW, sliding_window_layers=[1],
                        moe_latent_norm=True, moe_output_norm=True, initializer_range=0.1, chunk_size=8)


@pytest.fixture
def model(windowed_config, decoding_model):
    return decoding_model(windowed_config)


def full_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_the_ring_holds_only_the_window(windowed_config):
    states = LayerStates.allocate(windowed_config, 2, 40)
    kv = [layer for layer in states.layers if isinstance(layer, KVCache)]
    assert [(layer.window, layer.k_BHTD.shape[2]) for layer in kv] == [(WINDOW, WINDOW), (None, 40)]
    short = LayerStates.allocate(windowed_config, 1, 3)  # fewer positions than the window: never wraps
    assert [layer.k_BHTD.shape[2] for layer in short.layers if isinstance(layer, KVCache)] == [3, 3]


@pytest.mark.parametrize("pieces", [(9, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1), (2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1),
                                    (23,)])
def test_cached_forward_and_decode_step_equal_the_full_forward(model, pieces):
    """Prefill pieces longer and shorter than the window (read before write), then one token at a time through
    the static decode_step: 23 positions, more than four windows."""
    ids = torch.randint(0, 128, (2, sum(pieces)))
    states = LayerStates.allocate(model.config, 2, 40)
    got, start = [], 0
    with torch.no_grad():
        for piece in pieces:
            if piece == 1 and start > 0:
                got.append(model.decode_step(ids[:, start], states)[:, None])
            else:
                got.append(model(ids[:, start:start + piece], cache=states, mtp=False).logits)
            start += piece
    torch.testing.assert_close(torch.cat(got, 1), full_logits(model, ids), **DECODE)


@pytest.mark.parametrize("fast", [True, False])
def test_decoder_paths_equal_the_full_forward(model, fast):
    """The decoders' forward (fast paths, or their static multi-token mixer) on a HybridCache."""
    ids = torch.randint(0, 128, (2, 21))
    cache = HybridCache.allocate(model.config, 2, 32)
    got = []
    with torch.no_grad():
        for start, stop in ((0, 7), (7, 10), *((t, t + 1) for t in range(10, 21))):
            if fast:
                got.append(fast_forward(model, ids[:, start:stop], cache).logits)
            else:
                got.append(model(ids[:, start:stop], cache=cache, mtp=False, mixer_fn=static_mixer).logits)
    torch.testing.assert_close(torch.cat(got, 1), full_logits(model, ids), **DECODE)


def test_rows_at_different_lengths_decode_together(model):
    ids = torch.randint(0, 128, (2, 19))
    prompt = [11, 4]  # row 0 has wrapped its ring twice, row 1 not yet
    cache = HybridCache.allocate(model.config, 2, 32)
    with torch.no_grad():
        for row, length in enumerate(prompt):
            model(ids[row:row + 1, :length], cache=cache.select(row), mtp=False)
        steps = [model.decode_step(torch.stack([ids[0, prompt[0] + i], ids[1, prompt[1] + i]]), cache)
                 for i in range(8)]
    full = full_logits(model, ids)
    for row, length in enumerate(prompt):
        torch.testing.assert_close(torch.stack([s[row] for s in steps]), full[row, length:length + 8], **DECODE)


def test_row_copies_and_resizes_keep_a_wrapped_ring(model):
    ids = torch.randint(0, 128, (1, 17))
    cache = HybridCache.allocate(model.config, 1, 20)
    with torch.no_grad():
        model(ids[:, :12], cache=cache, mtp=False)
        bigger = cache.resized(3, 32)
        bigger.copy_row(0, [2])
        assert [layer.k_BHTD.shape[2] for layer in bigger.layers if isinstance(layer, KVCache)] == [WINDOW, 32]
        steps = [model.decode_step(ids[0, t].repeat(3), bigger) for t in range(12, 17)]
    want = full_logits(model, ids)[0, 12:]
    for row in (0, 2):
        torch.testing.assert_close(torch.stack([s[row] for s in steps]), want, **DECODE)


def test_a_ring_shorter_than_its_window_never_wraps(model):
    states = LayerStates.allocate(model.config, 1, 3)
    with pytest.raises(ValueError, match="the KV cache holds 3 positions; this forward needs 4"):
        model(torch.randint(0, 128, (1, 4)), cache=states, mtp=False)


def test_a_ring_refuses_to_rewind_so_the_engine_decodes_plainly(model, windowed_config):
    cache = HybridCache.allocate(model.config, 1, 16)
    with pytest.raises(ValueError, match="rewind_to: a sliding_window layer's KV cache is a ring"):
        cache.rewind_to(torch.tensor([1]), 2)
    with pytest.raises(ValueError, match="sliding_window 5: speculative decoding rewinds the KV caches"):
        check_drafter(model, 2)
    # the engine's default (speculative when it can) decodes a windowed model plainly, as the full forward would
    tokenizer = Tokenizer.train(["a windowed model decodes plainly " * 40], 600)
    engine = HybridEngine(HybridLM(windowed_config.replace(vocab_size=600)).eval(), tokenizer, model_name="windowed")
    assert not engine.speculative
    completion = engine.generate([engine.encode("a windowed")], SamplingParams(max_tokens=3, temperature=0.0))[0][0]
    assert 1 <= len(completion.token_ids) <= 3


# ------------------------------------------------------------------------------------------------ memory
@pytest.mark.parametrize("context", [3, WINDOW, 40])
def test_memory_model_counts_the_window_only(windowed_config, context):
    per_layer_token = kv_bytes_per_layer_token(windowed_config, "fp32")
    assert per_layer_token == 2 * 2 * 12 * 4
    want = per_layer_token * (context + min(context, WINDOW))  # the full layer, the windowed one
    assert kv_cache_bytes(windowed_config, context, "fp32") == want
    # include_mtp: the MTP block's attention is full
    assert kv_cache_bytes(windowed_config, context, "fp32", include_mtp=True) == want + per_layer_token * context
    cache = HybridCache.allocate(windowed_config, 2, context)
    assert cache.memory_bytes() == 2 * slot_bytes(windowed_config, context, "fp32", "fp32", "fp32")
    report = memory_report(windowed_config, context, 3, "fp32", "fp32", "fp32")
    assert report.kv_total == 3 * want and report.windowed_attention_layers == 1 and report.attention_layers == 2


def test_crossover_counts_the_window(windowed_config, small_config):
    """The shortest context whose KV cache reaches the Mamba state, found by walking the contexts."""
    for config in (windowed_config, windowed_config.replace(sliding_window_layers=[1, 3]),
                   windowed_config.replace(sliding_window=1000)):
        report = memory_report(config, 10, 1, "fp8", "fp32", "bf16")
        state = report.mamba_state_per_sequence
        walked = next((c for c in range(0, 10 ** 5) if kv_cache_bytes(config, c, "fp8") >= state), None)
        assert report.crossover_tokens == walked
    only_windowed = windowed_config.replace(sliding_window_layers=[1, 3])
    assert memory_report(only_windowed, 10, 1, "fp8", "fp32", "bf16").crossover_tokens is None  # stops at 2 windows


def test_planner_attention_flops_count_the_window(windowed_config):
    for seq_len, window in ((64, 5), (64, 64), (64, 100), (7, 3)):
        mean = sum(min(t + 1, window) for t in range(seq_len)) / seq_len
        assert mean_keys_per_query(seq_len, window) == pytest.approx(mean if window < seq_len else seq_len / 2)
    full = core_flops_per_token(windowed_config, ATTENTION, 4096)
    assert full == 2.0 * 4096 * 4 * 12  # unchanged without a window
    assert core_flops_per_token(windowed_config, ATTENTION, 4096, WINDOW) < full / 100
