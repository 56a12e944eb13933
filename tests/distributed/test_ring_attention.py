"""Ring attention (`dist.cp_attention = "ring"`): a block's kernel (torch's CPU flash attention with its
log-sum-exp, and its backward from the final output) equals the explicit reference; on 4 gloo processes, every cp
rank's output rows and the gradients of its own query, key and value rows equal those of one process's causal
attention over the whole sequences (GQA: 2 query heads per key head), to 1e-5 in fp32. The whole model under ring
CP: test_parallel_layouts.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gloo import differences

from hybridtron.distributed.context_parallel import chunk_rows
from hybridtron.distributed.ring_attention import (block_attention, block_attention_backward, block_attention_backward_ref,
                                            block_attention_ref, ring_attention)

WORLD = 4


@pytest.mark.parametrize("causal", [True, False], ids=["same_chunk", "earlier_chunk"])
def test_a_blocks_kernel_and_its_backward_equal_the_reference(causal):
    g = torch.Generator().manual_seed(1)
    q, k, v, grad_out = (torch.randn(3, h, 5, 8, generator=g) for h in (4, 2, 2, 4))
    out, lse = block_attention(q, k, v, causal)
    want_out, want_lse = block_attention_ref(q, k, v, causal)
    assert torch.allclose(out, want_out, atol=1e-6) and torch.allclose(lse, want_lse, atol=1e-6)
    # the backward of a block whose rows also read other blocks: the final output and log-sum-exp differ from its own
    final_out, final_lse = out * 0.7, lse + 0.3
    got = block_attention_backward(q, k, v, grad_out, final_out, final_lse, causal)
    want = block_attention_backward_ref(q, k, v, grad_out, final_out, final_lse, causal)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
    # and with the block's own output and log-sum-exp, autograd's gradient of plain causal attention
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=True).backward(grad_out)
    got = block_attention_backward_ref(q, k, v, grad_out, want_out, want_lse, causal)
    assert all(torch.allclose(a, t.grad, atol=1e-5) for a, t in zip(got, (q_, k_, v_)))


def _whole_sequences(seed: int = 0):
    """q [B, H, L, D], k and v [B, Hkv, L, D], the gradient of the output, and one process's attention."""
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, L, D = 2, 4, 2, 2 * WORLD * 3, 8
    q, k, v = (torch.randn(B, h, L, D, generator=g, dtype=torch.float64).float().requires_grad_()
               for h in (H, Hkv, Hkv))
    grad_out = torch.randn(B, H, L, D, generator=g)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(grad_out)
    return q, k, v, grad_out, out


def _rows(x: torch.Tensor, rank: int) -> torch.Tensor:
    """A rank's head and tail chunk rows of [B, H, L, D] (positions on dim 2)."""
    return chunk_rows(x.detach().transpose(1, 2), rank, WORLD).transpose(1, 2)


def _check(rank: int):
    q, k, v, grad_out, want = _whole_sequences()
    mine = [_rows(t, rank).requires_grad_() for t in (q, k, v)]
    got = ring_attention(*mine, dist.group.WORLD)
    got.backward(_rows(grad_out, rank))
    checks = {"out": (got, _rows(want, rank))}
    checks.update({f"grad_{name}": (mine[i].grad, _rows(t.grad, rank)) for i, (name, t) in
                   enumerate(zip("qkv", (q, k, v)))})
    for name, (a, b) in checks.items():
        error = float((a - b).abs().max())
        if not error < 1e-5:
            yield f"{name} differs by {error}"


@pytest.mark.timeout(120)
def test_ring_attention_on_four_ranks_is_the_whole_sequences_causal_attention():
    reported = differences(_check, WORLD)
    assert not reported, reported
