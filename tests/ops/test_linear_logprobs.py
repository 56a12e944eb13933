"""`linear_logprobs` (lm_head and a per-row function of the logits, by blocks of rows, recomputed in the backward)
against `linear_logprobs_ref` (the function on the whole logits), forward and backward: the RL log-prob function
(`post.rl.objective.row_scores`: the sampled token's log-prob under temperature, top-k and top-p, the entropy, the
log-probs of given ids, the top K), blocks that do and do not divide the rows, one block, incoming gradients on
every output; on logits without a weight; under bf16 autocast."""

import functools

import pytest
import torch

from hybridtron.ops.linear_logprobs import linear_logprobs, linear_logprobs_ref
from hybridtron.post.rl.objective import row_scores

ROWS, WIDTH, VOCAB, K = 37, 16, 50, 4


def _inputs(dtype=torch.float32):
    hidden, weight = torch.randn(ROWS, WIDTH, dtype=dtype), torch.randn(VOCAB, WIDTH, dtype=dtype) / 2
    tokens = torch.randint(0, VOCAB, (ROWS,))
    tokens[::7] = -100  # ignored positions still get a finite value
    given = torch.randint(0, VOCAB, (ROWS, K))
    return hidden, weight, tokens, given


def _run(op, fn, hidden, weight, row_inputs, chunk, seed=1):
    """(outputs, d(a random weighting of every floating output) / (hidden, weight))."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    outputs = op(h, w, fn, *row_inputs, chunk=chunk)
    generator = torch.Generator().manual_seed(seed)
    floating = [out for out in outputs if out.is_floating_point()]
    loss = sum((out * torch.randn(out.shape, generator=generator)).sum() for out in floating)
    return outputs, torch.autograd.grad(loss, (h, w))


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.9, 5, 1.0), (1.3, 0, 0.8),
                                                       (0.8, 10, 0.9)])
@pytest.mark.parametrize("chunk", [1, 8, 37, 64])
def test_chunked_log_probs_equal_the_whole_logits_forward_and_backward(temperature, top_k, top_p, chunk):
    hidden, weight, tokens, given = _inputs()
    fn = functools.partial(row_scores, temperature=temperature, top_k=top_k, top_p=top_p, entropy=True, top=3)
    (outs, grads), (outs_ref, grads_ref) = (_run(op, fn, hidden, weight, (tokens, given), chunk)
                                            for op in (linear_logprobs, linear_logprobs_ref))
    assert [out.shape for out in outs] == [(ROWS,), (ROWS,), (ROWS, K), (ROWS, 3), (ROWS, 3)]
    for out, ref in zip(outs, outs_ref):
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    # the gradients against fp64: within twice the whole-logits path's own fp32 error (the weight's gradient sums
    # the rows block by block, and a block of one row is a matrix-vector product: other roundings, no larger)
    _, grads_64 = _run(linear_logprobs_ref, fn, hidden.double(), weight.double(), (tokens, given), 0)
    for grad, ref, exact in zip(grads, grads_ref, grads_64):
        error, budget = (grad - exact).abs().max(), (ref - exact).abs().max()
        assert error <= 2 * budget + 1e-7, (float(error), float(budget))
    if top_k or top_p < 1:  # a token the filter drops is floored, with no gradient
        assert (outs[0] >= -50).all()


def test_the_gradient_of_the_sampled_log_probs_is_bit_for_bit_with_one_block():
    """The recomputed block runs the whole-logits path's very ops, row by row: with one block (no change in the
    order the weight's gradient sums the rows) both gradients are the reference's to the bit; by blocks (of more
    than one row: one row is a matrix-vector product), the hidden states' still are, each row's own, and the
    weight's differs only by the order of its sum over the rows."""
    hidden, weight, tokens, _ = _inputs()
    fn = functools.partial(row_scores, temperature=0.9, top_k=0, top_p=0.95, entropy=False, top=0)
    _, (grad_h_ref, grad_w_ref) = _run(linear_logprobs_ref, fn, hidden, weight, (tokens,), 0)
    _, (grad_h, grad_w) = _run(linear_logprobs, fn, hidden, weight, (tokens,), ROWS)
    assert torch.equal(grad_h, grad_h_ref) and torch.equal(grad_w, grad_w_ref)
    _, (grad_h, grad_w) = _run(linear_logprobs, fn, hidden, weight, (tokens,), 8)
    assert torch.equal(grad_h, grad_h_ref)
    torch.testing.assert_close(grad_w, grad_w_ref, rtol=1e-6, atol=1e-6)


def test_on_logits_without_a_weight_the_blocks_are_the_whole_to_the_bit():
    """Without lm_head (a caller holding only the logits) there is no GEMM to round otherwise: every output and the
    logits' gradient are the whole-logits path's to the bit, whatever the blocks."""
    logits, _, tokens, given = _inputs()
    logits = logits @ torch.randn(WIDTH, VOCAB)
    fn = functools.partial(row_scores, temperature=0.8, top_k=10, top_p=0.9, entropy=True, top=3)
    results = []
    for op, chunk in ((linear_logprobs_ref, 0), (linear_logprobs, 1), (linear_logprobs, 8)):
        x = logits.clone().requires_grad_(True)
        outputs = op(x, None, fn, tokens, given, chunk=chunk)
        generator = torch.Generator().manual_seed(1)
        loss = sum((out * torch.randn(out.shape, generator=generator)).sum() for out in outputs
                   if out.is_floating_point())
        results.append((*outputs, *torch.autograd.grad(loss, x)))
    for blocks in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(blocks, results[0]))


def test_bf16_autocast_recomputes_the_forwards_logits():
    """Under autocast the backward runs the block's GEMM in the forward's dtype again: the same gradient as
    autograd through the bf16 logits."""
    hidden, weight, tokens, _ = _inputs()
    fn = functools.partial(row_scores, temperature=1.0, top_k=0, top_p=1.0, entropy=True, top=0)
    results = []
    for op in (linear_logprobs, linear_logprobs_ref):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_run(op, fn, hidden, weight, (tokens,), 8))
    (outs, grads), (outs_ref, grads_ref) = results
    for out, ref in zip(outs, outs_ref):
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for grad, ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, ref, rtol=1e-2, atol=1e-3)


def test_no_rows_and_bad_shapes():
    weight = torch.randn(VOCAB, WIDTH, requires_grad=True)
    fn = functools.partial(row_scores, temperature=1.0, top_k=0, top_p=1.0, entropy=True, top=2)
    logp, entropy, top_logp, top_ids = linear_logprobs(torch.randn(0, WIDTH), weight, fn,
                                                       torch.zeros(0, dtype=torch.long), chunk=4)
    assert logp.shape == entropy.shape == (0,) and top_logp.shape == top_ids.shape == (0, 2)
    assert top_ids.dtype == torch.int64 and not top_ids.requires_grad
    with pytest.raises(ValueError, match=r"hidden \(4, 8\) and weight \(50, 16\) do not match"):
        linear_logprobs(torch.randn(4, 8), weight, fn, torch.zeros(4, dtype=torch.long), chunk=4)
    with pytest.raises(ValueError, match=r"row inputs \[\(3,\)\] do not all have hidden's 4 rows"):
        linear_logprobs(torch.randn(4, WIDTH), weight, fn, torch.zeros(3, dtype=torch.long), chunk=4)
    with pytest.raises(ValueError, match="chunk must be >= 1 rows, got 0"):
        linear_logprobs(torch.randn(4, WIDTH), weight, fn, torch.zeros(4, dtype=torch.long), chunk=0)
