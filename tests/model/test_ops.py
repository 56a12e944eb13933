"""Fast paths of `hybridtron.ops` against their pure-torch references, forward and backward.

- `ssd_chunked` (the Mamba-2 paper's chunked scan) vs `ssd_ref` (the naive per-token recurrence): outputs and
  final state, with and without an initial state, lengths that are and are not multiples of the chunk, in
  float64 (agreement to rounding) and float32. The decoding scans too: `ssd_step_` (one token, state in place),
  `ssd_step` (one token, out of place, for the compiled decode step) and `ssd_steps` (a few tokens, every state
  kept).
- `grouped_mm` (torch's native grouped GEMM where it applies) and `grouped_mm_padded` (padded batched GEMM) vs
  `grouped_mm_ref` (a loop over experts), including experts that receive no rows, all rows on one expert, and no
  rows at all; and expert matrices stored transposed, as decoding lays them out.
- `cross_entropy` (blockwise, no log-probability tensor) vs `F.cross_entropy`, loss and gradient.
- `linear_cross_entropy` (lm_head and the loss fused by blocks of rows; fp32, fp64, bf16) vs lm_head +
  `F.cross_entropy`: loss and the gradients of hidden and weight.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridtron.ops import cross_entropy as cross_entropy_module
from hybridtron.ops.cross_entropy import IGNORE_INDEX, cross_entropy, cross_entropy_ref
from hybridtron.ops import linear_cross_entropy as linear_cross_entropy_module
from hybridtron.ops.grouped_mm import grouped_mm, grouped_mm_padded, grouped_mm_ref, native_applies
from hybridtron.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_ref
from hybridtron.ops.ssd import ssd_chunked, ssd_ref, ssd_step, ssd_step_, ssd_steps

# float64 agreement is limited by rounding alone; float32 by accumulating a few hundred terms of size ~1.
SSD_TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=2e-4, atol=2e-5)}


def ssd_inputs(batch, length, heads, head_dim, groups, state_size, dtype, with_initial_state):
    """Inputs shaped as the Mamba-2 mixer produces them: x already scaled by dt, a = dt * A < 0."""
    dt = torch.nn.functional.softplus(torch.randn(batch, length, heads, dtype=dtype) - 1.0)
    A = -torch.exp(torch.linspace(0.0, math.log(8.0), heads, dtype=dtype))
    x = torch.randn(batch, length, heads, head_dim, dtype=dtype) * dt[..., None]
    B = torch.randn(batch, length, groups, state_size, dtype=dtype)
    C = torch.randn(batch, length, groups, state_size, dtype=dtype)
    initial = torch.randn(batch, heads, head_dim, state_size, dtype=dtype) if with_initial_state else None
    return [x, dt * A, B, C, initial]


def scan_and_grads(scan, inputs, chunk, cotangents):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in inputs]
    y, final = scan(*leaves[:4], chunk, leaves[4])
    ((y * cotangents[0]).sum() + (final * cotangents[1]).sum()).backward()
    return y.detach(), final.detach(), [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "batch, length, heads, head_dim, groups, state_size, chunk, with_initial_state",
    [
        (2, 32, 4, 8, 2, 16, 8, False),  # a multiple of the chunk
        (2, 37, 4, 8, 2, 16, 8, True),  # not a multiple, and an initial state
        (1, 5, 6, 4, 3, 8, 16, True),  # shorter than one chunk
        (3, 50, 8, 16, 1, 32, 16, True),  # one group shared by all heads
        (1, 64, 2, 8, 2, 4, 64, False),  # exactly one chunk
    ],
)
def test_ssd_chunked_matches_recurrence(dtype, batch, length, heads, head_dim, groups, state_size, chunk,
                                        with_initial_state):
    inputs = ssd_inputs(batch, length, heads, head_dim, groups, state_size, dtype, with_initial_state)
    cotangents = (torch.randn(batch, length, heads, head_dim, dtype=dtype),
                  torch.randn(batch, heads, head_dim, state_size, dtype=dtype))
    y, final, grads = scan_and_grads(ssd_chunked, inputs, chunk, cotangents)
    y_ref, final_ref, grads_ref = scan_and_grads(ssd_ref, inputs, chunk, cotangents)
    tolerance = SSD_TOLERANCE[dtype]
    assert y.dtype == dtype and final.dtype == dtype
    torch.testing.assert_close(y, y_ref, **tolerance)
    torch.testing.assert_close(final, final_ref, **tolerance)
    for name, grad, grad_ref in zip(["x", "a", "B", "C", "initial_state"], grads, grads_ref):
        if grad_ref is None:
            continue
        torch.testing.assert_close(grad, grad_ref, **tolerance, msg=lambda m: f"grad of {name}: {m}")


def test_ssd_chunked_carries_state_across_calls():
    """Scanning [0, T) in two calls, the second starting from the first's final state, equals one call."""
    x, a, B, C, _ = ssd_inputs(2, 40, 4, 8, 2, 16, torch.float64, False)
    y_whole, final_whole = ssd_chunked(x, a, B, C, 8)
    y_head, state = ssd_chunked(x[:, :13], a[:, :13], B[:, :13], C[:, :13], 8)
    y_tail, final = ssd_chunked(x[:, 13:], a[:, 13:], B[:, 13:], C[:, 13:], 8, state)
    torch.testing.assert_close(torch.cat([y_head, y_tail], 1), y_whole, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, final_whole, rtol=1e-10, atol=1e-10)


def test_ssd_chunked_fp32_error_with_strong_decays():
    """Heads with A down to -256 and dt up to 1 (chunk decays down to exp(-16000)): against the float64 recurrence,
    the fp32 chunked scan stays within 1e-4 relative (its decay is a difference of cumsums, as in mamba_ssm)."""
    batch, length, heads = 2, 256, 8
    dt = torch.exp(torch.empty(batch, length, heads, dtype=torch.float64).uniform_(math.log(1e-3), 0.0))
    A = -torch.exp(torch.linspace(0.0, math.log(256.0), heads, dtype=torch.float64))
    x = torch.randn(batch, length, heads, 16, dtype=torch.float64) * dt[..., None]
    B, C = torch.randn(2, batch, length, 2, 16, dtype=torch.float64)
    y_exact, final_exact = ssd_ref(x, dt * A, B, C)
    y, final = ssd_chunked(x.float(), (dt * A).float(), B.float(), C.float(), 128)
    assert (y.double() - y_exact).abs().max() <= 1e-4 * y_exact.abs().max()
    assert (final.double() - final_exact).abs().max() <= 1e-4 * final_exact.abs().max()


@pytest.mark.parametrize("batch, heads, groups", [(2, 4, 2), (1, 6, 3), (3, 8, 1)])
def test_ssd_step_advances_the_state_as_the_recurrence(batch, heads, groups):
    x, a, B, C, initial = ssd_inputs(batch, 1, heads, 8, groups, 16, torch.float64, True)
    y_ref, final_ref = ssd_ref(x, a, B, C, initial_state_BHPN=initial)
    state = initial.clone()
    y = ssd_step_(state, x[:, 0], a[:, 0], B[:, 0], C[:, 0])
    torch.testing.assert_close(y, y_ref[:, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, final_ref, rtol=1e-12, atol=1e-12)
    y_out, state_out = ssd_step(initial, x[:, 0], a[:, 0], B[:, 0], C[:, 0])  # out of place: initial unchanged
    torch.testing.assert_close(y_out, y_ref[:, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state_out, final_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("length, groups", [(1, 2), (4, 2), (8, 1)])
def test_ssd_steps_keeps_the_state_after_every_token(dtype, length, groups):
    """The few-token scan of speculative verification: outputs and each token's state equal the recurrence's."""
    x, a, B, C, initial = ssd_inputs(2, length, 4, 8, groups, 16, dtype, True)
    y, states = ssd_steps(x, a, B, C, initial)
    y_ref, _ = ssd_ref(x, a, B, C, initial_state_BHPN=initial)
    torch.testing.assert_close(y, y_ref, **SSD_TOLERANCE[dtype])
    for t in range(length):
        _, state_ref = ssd_ref(x[:, :t + 1], a[:, :t + 1], B[:, :t + 1], C[:, :t + 1], initial_state_BHPN=initial)
        torch.testing.assert_close(states[:, t], state_ref, **SSD_TOLERANCE[dtype])


GROUPED_MM_CASES = {
    "balanced": [5, 3, 7, 4],
    "experts_with_no_rows": [0, 6, 0, 0, 9, 0],
    "all_rows_on_one_expert": [0, 0, 11],
    "no_rows_at_all": [0, 0, 0],
    "one_row": [1],
}


@pytest.mark.parametrize("fast, dtype", [(grouped_mm, torch.float32), (grouped_mm_padded, torch.float32),
                                         (grouped_mm_padded, torch.float64)])
@pytest.mark.parametrize("case", list(GROUPED_MM_CASES))
def test_grouped_mm_matches_loop(case, fast, dtype):
    """Both fast paths (torch's native grouped GEMM, chosen by `grouped_mm` where it applies, and the padded batched
    GEMM) against the loop, forward and backward; the cotangent is an expanded (stride-0) tensor, as `.sum()` gives."""
    group_sizes = torch.tensor(GROUPED_MM_CASES[case])
    rows, in_features, out_features = int(group_sizes.sum()), 12, 8
    x = torch.randn(rows, in_features, dtype=dtype, requires_grad=True)
    w = torch.randn(len(group_sizes), out_features, in_features, dtype=dtype, requires_grad=True)
    if fast is grouped_mm and rows:
        assert native_applies(x, w)
    cotangent = torch.randn(1, out_features, dtype=dtype).expand(rows, out_features)

    y = fast(x, w, group_sizes)
    grad_x, grad_w = torch.autograd.grad((y * cotangent).sum(), [x, w], allow_unused=True, materialize_grads=True)
    y_ref = grouped_mm_ref(x, w, group_sizes)
    grad_x_ref, grad_w_ref = torch.autograd.grad((y_ref * cotangent).sum(), [x, w], allow_unused=True,
                                                 materialize_grads=True)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    assert y.shape == (rows, out_features)
    torch.testing.assert_close(y, y_ref, **tolerance)
    torch.testing.assert_close(grad_x, grad_x_ref, **tolerance)
    torch.testing.assert_close(grad_w, grad_w_ref, **tolerance)
    # an expert that received no rows gets an exactly-zero weight gradient
    for e in torch.nonzero(group_sizes == 0).flatten().tolist():
        assert torch.count_nonzero(grad_w[e]) == 0
    # the plain-sum cotangent of the loss functions (stride 0 everywhere)
    if rows:
        fast(x, w, group_sizes).sum().backward()


def test_grouped_mm_native_with_expert_matrices_stored_transposed():
    """Decoding stores each expert's matrix [in, out] in memory (`lay_out_for_decoding`); the native grouped GEMM
    still applies, forward and backward."""
    group_sizes = torch.tensor([3, 0, 5])
    x = torch.randn(8, 12, requires_grad=True)
    w = torch.randn(3, 12, 16).transpose(1, 2).requires_grad_(True)  # shape [E, out, in], strides of [E, in, out]
    assert not w.is_contiguous() and native_applies(x, w)
    y = grouped_mm(x, w, group_sizes)
    grads = torch.autograd.grad(y.sum(), [x, w])
    y_ref = grouped_mm_ref(x, w, group_sizes)
    grads_ref = torch.autograd.grad(y_ref.sum(), [x, w])
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for grad, grad_ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-5)


def test_grouped_mm_falls_back_where_the_native_kernel_does_not_apply():
    x, w = torch.randn(6, 12), torch.randn(2, 8, 12)
    assert native_applies(x, w)
    assert not native_applies(x.double(), w.double())  # no float64 kernel
    assert not native_applies(torch.randn(6, 10), torch.randn(2, 8, 10))  # 40-byte rows: not 16-byte aligned
    assert not native_applies(x[:0], w)  # no rows
    assert not native_applies(x.bfloat16(), torch.randn(2, 4, 12).bfloat16())  # bf16 needs multiples of 8


@pytest.mark.parametrize("fast", [grouped_mm, grouped_mm_padded])
def test_grouped_mm_bf16_within_budget_of_fp32(fast):
    """bf16 inputs: the fast path's error against the exact result stays within 2x the bf16 loop's own error."""
    group_sizes = torch.tensor([9, 0, 17, 4])
    x = torch.randn(int(group_sizes.sum()), 64)
    w = torch.randn(4, 32, 64) / 8
    exact = grouped_mm_ref(x.double(), w.double(), group_sizes)
    fast_error = (fast(x.bfloat16(), w.bfloat16(), group_sizes).double() - exact).abs().max()
    ref_error = (grouped_mm_ref(x.bfloat16(), w.bfloat16(), group_sizes).double() - exact).abs().max()
    assert fast_error <= 2 * ref_error + 1e-6


def test_grouped_mm_under_autocast_runs_the_native_kernel_in_the_autocast_dtype(monkeypatch):
    """bf16 autocast with bf16 rows and fp32 expert weights (what a MoE layer sees under `train.precision=bf16`):
    both operands are cast as autocast casts a matmul's, so the native kernel applies, not the padded GEMM (which
    reads its capacity back to Python and so breaks a compiled graph); the gradients reach the fp32 weights."""
    import hybridtron.ops.grouped_mm as module

    def no_padding(*args):
        raise AssertionError("the padded grouped GEMM ran")

    monkeypatch.setattr(module, "grouped_mm_padded", no_padding)
    group_sizes = torch.tensor([9, 0, 17, 4])
    x = torch.randn(int(group_sizes.sum()), 64).bfloat16().requires_grad_()
    w = (torch.randn(4, 32, 64) / 8).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = grouped_mm(x, w, group_sizes)
        y_ref = grouped_mm_ref(x, w, group_sizes)  # its matmuls autocast
    assert y.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_ref)
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    grads_ref = torch.autograd.grad(y_ref.float().sum(), [x, w])
    torch.testing.assert_close(x.grad, grads_ref[0])
    torch.testing.assert_close(w.grad, grads_ref[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows, vocab, block_elements", [(37, 50, 1 << 22), (300, 1000, 64 * 1000 + 5), (1, 7, 3)])
def test_cross_entropy_matches_torch(monkeypatch, dtype, rows, vocab, block_elements):
    """Loss and gradient of the blockwise cross entropy vs F.cross_entropy in fp32, with ignored targets and
    blocks that do not divide the rows; bf16 logits reduce in fp32 on both sides."""
    monkeypatch.setattr(cross_entropy_module, "BLOCK_ELEMENTS", block_elements)
    logits = (torch.randn(rows, vocab) * 3).to(dtype)
    targets = torch.randint(0, vocab, (rows,))
    targets[torch.rand(rows) < 0.2] = IGNORE_INDEX
    targets[0] = 3
    leaf = logits.clone().requires_grad_(True)
    loss = cross_entropy(leaf, targets)
    (grad,) = torch.autograd.grad(2.5 * loss, leaf)
    leaf_ref = logits.clone().requires_grad_(True)
    loss_ref = cross_entropy_ref(leaf_ref, targets)
    (grad_ref,) = torch.autograd.grad(2.5 * loss_ref, leaf_ref)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype != torch.bfloat16 else dict(rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(loss, loss_ref.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, grad_ref.to(dtype), **tolerance)
    assert (grad[targets == IGNORE_INDEX] == 0).all()


def test_cross_entropy_edge_cases():
    logits = torch.randn(4, 9)
    all_ignored = torch.full((4,), IGNORE_INDEX)
    assert torch.isnan(cross_entropy(logits, all_ignored)) and torch.isnan(cross_entropy_ref(logits, all_ignored))
    wide = torch.randn(6, 20)[:, ::2]  # a non-contiguous view
    targets = torch.randint(0, 10, (6,))
    torch.testing.assert_close(cross_entropy(wide, targets), cross_entropy_ref(wide, targets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab, block_elements", [(37, 50, 1 << 23), (300, 1000, 64 * 1000 + 5), (1, 7, 3)])
def test_linear_cross_entropy_matches_torch(monkeypatch, dtype, rows, vocab, block_elements):
    """Loss and both gradients of the fused lm_head + cross entropy vs lm_head + F.cross_entropy, with ignored
    targets, blocks that do not divide the rows, and an incoming gradient that is not 1; bf16 inputs reduce in
    fp32 (their logits copied into the fp32 block buffer)."""
    monkeypatch.setattr(linear_cross_entropy_module, "BLOCK_ELEMENTS", block_elements)
    hidden, weight = torch.randn(rows, 16, dtype=dtype), torch.randn(vocab, 16, dtype=dtype) / 2
    targets = torch.randint(0, vocab, (rows,))
    targets[torch.rand(rows) < 0.2] = IGNORE_INDEX
    targets[0] = 3
    results = []
    for loss_fn in (lambda h, w: linear_cross_entropy(h, w, targets),
                    lambda h, w: linear_cross_entropy_ref(h, w, targets)):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = loss_fn(h, w)
        results.append((loss, *torch.autograd.grad(2.5 * loss, (h, w))))
    (loss, grad_h, grad_w), (loss_ref, grad_h_ref, grad_w_ref) = results
    assert loss.dtype == torch.float32 and grad_h.dtype == grad_w.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype != torch.bfloat16 else dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(loss, loss_ref.float(), **tolerance)
    torch.testing.assert_close(grad_h, grad_h_ref, **tolerance)
    torch.testing.assert_close(grad_w, grad_w_ref, **tolerance)
    assert (grad_h[targets == IGNORE_INDEX] == 0).all()


def test_linear_cross_entropy_edge_cases():
    hidden, weight = torch.randn(4, 8), torch.randn(9, 8)
    all_ignored = torch.full((4,), IGNORE_INDEX)
    assert torch.isnan(linear_cross_entropy(hidden, weight, all_ignored))
    with pytest.raises(ValueError, match=r"hidden \(4, 8\), weight \(9, 7\) and targets \(4,\) do not match"):
        linear_cross_entropy(hidden, torch.randn(9, 7), torch.zeros(4, dtype=torch.long))
