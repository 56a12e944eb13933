"""Ring attention for the head-and-tail context-parallel chunks (`dist.cp_attention = "ring"`).

The all-gather form (`context_parallel.ContextParallelAttention`) gives every cp rank the whole sequence's keys
and values, keeps them for the backward, and only then computes. Here the keys and values travel instead: at step
s of cp, rank r holds the chunks of rank r - s (its head and tail, two rows per sequence) and sends them on to
r + 1 while it computes with them, so each transfer overlaps a block's compute, and a rank holds two ranks'
keys and values at a time (the ones it computes with, the ones arriving), never the whole sequence's. Each of its
query chunks c reads a key chunk j fully if j < c, causally if j = c, and not at all if j > c; the partial outputs
merge by their log-sum-exps (the online softmax of flash attention), so the result is the causal attention over
the whole sequence, as the all-gather gives it (tested to 1e-5 in fp32, forward and backward).

The backward runs the ring again (Liu et al., "Ring Attention with Blockwise Transformers", 2023; the causal
zig-zag placement as in Megatron's and ring-flash-attention's): each step computes the block's query gradient here,
and the block's key and value gradients into accumulators that travel with the keys and values, arriving back at
their owner after cp shifts. Only q, this rank's k and v, the output and its log-sum-exp are saved.

A block is one query chunk over one key chunk, in fp32: on a CPU, torch's flash-attention kernel, which returns
the log-sum-exp the merge needs, and its backward (given the final output and log-sum-exp, as flash attention's
backward is); elsewhere `block_attention_ref`, explicit matmuls (scores [rows, heads, T, T]) that run on any
device and that the tests compare the kernel against. Departure from the papers: no striping inside a chunk,
since the head-and-tail pairs already balance the work.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def own_chunks(rank: int, size: int) -> tuple[int, int]:
    """The chunks of a sequence (of 2 x `size`) that cp rank `rank` holds: its head and its tail (the placement of
    `context_parallel`, which the ring follows)."""
    return rank, 2 * size - 1 - rank


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T / sqrt(d)) v, its log-sum-exp [R, H, T]) of one query chunk over one key chunk, in fp32:
    q [R, H, T, D], k and v [R, Hkv, S, D] (H / Hkv query heads per key head); `causal`: the chunks are the same
    positions (query t reads keys up to t). On a CPU, torch's flash-attention kernel; elsewhere the reference."""
    if q.device.type != "cpu":
        return block_attention_ref(q, k, v, causal)
    groups = q.shape[1] // k.shape[1]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), 0.0, causal)


def block_attention_backward(q, k, v, grad_out, out, lse, causal: bool):
    """(dq, dk, dv) of one block of attention, given the rows' final output `out` and log-sum-exp `lse` over every
    block (flash attention's backward reads only those); shapes and kernels as `block_attention`'s."""
    if q.device.type != "cpu":
        return block_attention_backward_ref(q, k, v, grad_out, out, lse, causal)
    groups = q.shape[1] // k.shape[1]
    grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), out, lse, 0.0, causal)
    return grad_q, *(g.unflatten(1, (k.shape[1], groups)).sum(2) for g in (grad_k, grad_v))


def block_attention_ref(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`block_attention` in explicit fp32 matmuls (scores [R, H, T, S]), on any device."""
    qg = q.unflatten(1, (k.shape[1], -1))  # [R, Hkv, g, T, D]
    scores = torch.einsum("rkgtd,rksd->rkgts", qg, k) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(_future(scores), float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.einsum("rkgts,rksd->rkgtd", (scores - lse[..., None]).exp(), v)
    return out.flatten(1, 2), lse.flatten(1, 2)


def block_attention_backward_ref(q, k, v, grad_out, out, lse, causal: bool):
    """`block_attention_backward` in explicit fp32 matmuls: P = exp(S - lse), dV = P^T dO, dS = P (dO V^T - D)
    with D the rows' dO . O, dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    qg, dog = (x.unflatten(1, (k.shape[1], -1)) for x in (q, grad_out))
    lse_g, delta = lse.unflatten(1, (k.shape[1], -1)), (grad_out * out).sum(-1).unflatten(1, (k.shape[1], -1))
    scores = torch.einsum("rkgtd,rksd->rkgts", qg, k) * scale
    if causal:
        scores = scores.masked_fill(_future(scores), float("-inf"))
    probs = (scores - lse_g[..., None]).exp()
    grad_v = torch.einsum("rkgts,rkgtd->rksd", probs, dog)
    grad_scores = probs * (torch.einsum("rkgtd,rksd->rkgts", dog, v) - delta[..., None])
    grad_q = torch.einsum("rkgts,rksd->rkgtd", grad_scores, k) * scale
    grad_k = torch.einsum("rkgts,rkgtd->rksd", grad_scores, qg) * scale
    return grad_q.flatten(1, 2), grad_k, grad_v


def _future(scores: torch.Tensor) -> torch.Tensor:
    t, s = scores.shape[-2:]
    return torch.ones(t, s, dtype=torch.bool, device=scores.device).triu(1)


def _pairs(rank: int, source: int, size: int) -> list[tuple[int, int, bool]]:
    """(query slot, key slot, causal) of every block rank `rank` computes with the chunks of rank `source`: its
    head (slot 0, chunk rank) and tail (slot 1, chunk 2 size - 1 - rank) against the source's, earlier or equal."""
    ours, theirs = own_chunks(rank, size), own_chunks(source, size)
    return [(qs, ks, c == j) for qs, c in enumerate(ours) for ks, j in enumerate(theirs) if j <= c]


class _Shift:
    """Send tensors to the next rank of the ring and receive the previous rank's, asynchronously."""

    def __init__(self, tensors: list[torch.Tensor], group: dist.ProcessGroup):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        send_to = dist.get_global_rank(group, (rank + 1) % size)
        receive_from = dist.get_global_rank(group, (rank - 1) % size)
        self.received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        operations = [dist.P2POp(dist.isend, t.contiguous(), send_to, group) for t in tensors] + \
            [dist.P2POp(dist.irecv, t, receive_from, group) for t in self.received]
        self.works = dist.batch_isend_irecv(operations)

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


def _by_slot(x: torch.Tensor) -> torch.Tensor:
    """[2B, H, T, D] (rows head, tail, head, tail, ...) -> [2 (slot), B, H, T, D], contiguous (it travels)."""
    return x.unflatten(0, (-1, 2)).transpose(0, 1).contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """The inverse of `_by_slot`."""
    return x.transpose(0, 1).flatten(0, 1)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        queries = _by_slot(q.float())  # [2 (head, tail), B, H, T, D]
        keys, values = _by_slot(k.float()), _by_slot(v.float())
        out = torch.zeros_like(queries)
        lse = torch.full(queries.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for step in range(size):
            shift = _Shift([keys, values], group) if step < size - 1 else None  # overlaps this step's blocks
            for qs, ks, causal in _pairs(rank, (rank - step) % size, size):
                block_out, block_lse = block_attention(queries[qs], keys[ks], values[ks], causal)
                merged = torch.logaddexp(lse[qs], block_lse)
                out[qs] = out[qs] * (lse[qs] - merged).exp()[..., None] + \
                    block_out * (block_lse - merged).exp()[..., None]
                lse[qs] = merged
            if shift is not None:
                keys, values = shift.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        return _rows(out).to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        with torch.autocast(grad.device.type, enabled=False):  # a pipeline schedule runs backwards under autocast
            return _RingAttention._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group = ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        queries, grad_out = _by_slot(q.float()), _by_slot(grad.float())
        keys, values = _by_slot(k.float()), _by_slot(v.float())
        grad_q, grad_keys, grad_values = torch.zeros_like(queries), torch.zeros_like(keys), torch.zeros_like(values)
        for step in range(size):
            for qs, ks, causal in _pairs(rank, (rank - step) % size, size):
                dq, dk, dv = block_attention_backward(queries[qs], keys[ks], values[ks], grad_out[qs], out[qs],
                                                      lse[qs], causal)
                grad_q[qs] += dq
                grad_keys[ks] += dk
                grad_values[ks] += dv
            if size > 1:  # the gradients travel on with the keys they belong to; after size shifts, home
                moving = [grad_keys, grad_values] + ([keys, values] if step < size - 1 else [])
                received = _Shift(moving, group).wait()
                grad_keys, grad_values = received[:2]
                if step < size - 1:
                    keys, values = received[2:]
        return _rows(grad_q).to(q.dtype), _rows(grad_keys).to(k.dtype), _rows(grad_values).to(v.dtype), None


@torch.compiler.disable  # point-to-point exchanges inside: a graph break under train.compile
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Causal attention of this cp rank's head and tail chunk rows (q [2B, H, T, D], k and v [2B, Hkv, T, D]) over
    their whole sequences, whose other chunks the ring brings in (module docstring); [2B, H, T, D] in q's dtype.
    The blocks and their merge run in fp32 under autocast too (the merge's rescaling would lose bf16's few bits)."""
    with torch.autocast(q.device.type, enabled=False):
        return _RingAttention.apply(q, k, v, group)
