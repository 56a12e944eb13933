"""What speculative decoding's eager step was made cheaper by: the dense form of the routed experts for a few tokens
(verification, catch-up, small batches) and the rollback skipped when every drafted token was kept."""

from __future__ import annotations

import pytest
import torch

from hybridtron.config import deep, parse_pattern
from hybridtron.infer import fastpath
from hybridtron.infer.cache import HybridCache
from hybridtron.infer.engine import generate_tokens
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.speculative import FastForms, SpeculativeDecoder
from hybridtron.model.lm import HybridLM
from hybridtron.model.moe import RoutedExperts, routed_experts_ref

FP32 = dict(rtol=1e-5, atol=1e-5)


def random_experts(num_experts: int, width: int, intermediate: int) -> RoutedExperts:
    experts = RoutedExperts(num_experts, width, intermediate)
    with torch.no_grad():
        experts.up_proj.normal_(0, 0.25)
        experts.down_proj.normal_(0, 0.2)
    return experts


@pytest.mark.parametrize("num_experts, top_k, tokens", [(8, 2, 1), (8, 2, 4), (8, 2, 7), (16, 4, 3), (6, 6, 2)])
def test_dense_experts_match_the_reference(num_experts, top_k, tokens):
    experts = random_experts(num_experts, 16, 24)
    fastpath.lay_out_for_decoding(torch.nn.Sequential(experts))  # the engine's layout, which the dense form reads
    x = torch.randn(tokens, 16)
    expert_ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    with torch.no_grad():
        got = fastpath.experts_dense(experts, x, expert_ids, weights)
    torch.testing.assert_close(got, routed_experts_ref(experts, x, expert_ids, weights), **FP32)


def test_dense_experts_are_chosen_for_a_few_tokens_of_small_experts():
    small = random_experts(8, 16, 24)
    with torch.no_grad():
        assert [fastpath.dense_experts_pay(small, t) for t in (1, 2, 16, 17)] == [False, True, True, False]
        large = RoutedExperts(8, 256, 256)  # 2 MiB per stacked matrix
        assert not fastpath.dense_experts_pay(large, 4)
        swapped = random_experts(8, 16, 24)
        swapped.grouped_mm = lambda x, w, sizes: fastpath.grouped_mm(x, w, sizes)  # a converter's GEMM sees every row
        assert not fastpath.dense_experts_pay(swapped, 4)
    assert not fastpath.dense_experts_pay(small, 4)  # with gradient: training's grouped GEMM


def test_a_recorded_forward_runs_the_dense_experts_and_matches_the_reference(small_config, monkeypatch):
    """A 4-token verification goes through `experts_dense` in every MoE layer and gives the reference's logits."""
    model = HybridLM(small_config(initializer_range=0.1)).eval()
    moe_layers = sum(kind == "moe" for kind in model.config.layers_block_type)
    calls = []
    dense = fastpath.experts_dense
    monkeypatch.setattr(fastpath, "experts_dense", lambda *args: calls.append(1) or dense(*args))
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    logits = {}
    with torch.inference_mode():
        for fast in (True, False):
            cache = HybridCache.allocate(model.config, 2, 16)
            fastpath.forward(model, ids[:, :5], cache, fast=fast)
            logits[fast] = fastpath.forward(model, ids[:, 5:], cache, fast=fast, record=True).logits
    assert len(calls) == 2 * moe_layers  # the 5-token prefill of 2 rows and the 4-token verification of 2 rows
    torch.testing.assert_close(logits[True], logits[False], **FP32)


@pytest.mark.parametrize("kept", [[4, 4], [4, 2], [1, 4]])
def test_rollback_skipped_only_when_every_token_is_kept(small_config, kept):
    """Skipping the rollback when every row kept all its tokens leaves the cache as `rewind_to` does."""
    model = HybridLM(small_config(initializer_range=0.1)).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    kept_B = torch.tensor(kept)
    caches = []
    with torch.inference_mode():
        for skip in (True, False):
            cache = HybridCache.allocate(model.config, 2, 16)
            fastpath.forward(model, ids[:, :5], cache)
            fastpath.forward(model, ids[:, 5:], cache, record=True)
            FastForms(True).rewind(cache, None, kept_B, 4) if skip else cache.rewind_to(kept_B, 4)
            caches.append(cache)
    assert not caches[0].recorded
    assert caches[0].lengths.tolist() == [5 + k for k in kept]
    for got, want in zip(caches[0].layers, caches[1].layers):
        for name in ("conv_BCK", "ssm_BHPN", "k_BHTD", "v_BHTD"):
            if hasattr(got, name):
                assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_deep_preset_shape():
    """Tens of backbone layers, mostly Mamba and MoE with a few attention layers, against one MTP block of two."""
    config = deep()
    kinds = config.layers_block_type
    assert len(kinds) == 39 and kinds.count("full_attention") == 3
    assert kinds.count("linear_attention") == kinds.count("moe") == 18
    assert config.num_nextn_predict_layers == 1 and len(config.mtp_layers_block_type) == 2
    assert config.vocab_size == 4096  # the default data's tokenizer


def test_greedy_speculative_equals_plain_on_a_deep_narrow_model(small_config):
    """A deeper backbone (the `deep` preset's pattern, narrow): speculative greedy is plain greedy, every k."""
    config = small_config(vocab_size=64, layers_block_type=parse_pattern("MEMEM*EMEMEME"), initializer_range=0.1)
    model = HybridLM(config).eval()
    prompts = [[3, 9, 4, 1, 7], [5, 2]]
    params = SamplingParams(temperature=0, max_tokens=16)
    plain = generate_tokens(model, prompts, params)
    for k in (1, 3, 6):
        decoder = SpeculativeDecoder(model, prompts, params, draft_length=k)
        for _ in decoder:
            pass
        assert [s.tokens for s in decoder.sequences] == plain, f"draft length {k}"
