"""Causal grouped-query attention with no positional encoding (the Mamba layers carry position).

With a `KVCache`, the new tokens' keys and values are written at each sequence's current length and the
queries attend to everything cached so far (sequences of the batch may have different lengths). `decode_step` is
the one-token form for a compiled decode step: every shape is fixed by the preallocated cache. With `seq_idx`
(packed rows, `model.documents`) each document attends only to itself (`document_attention`).

Sliding window (`config.sliding_window`, on the layers of `config.windowed_layers`): query t sees keys s with
t - window < s <= t. Training runs it a block of queries at a time over only the keys their window reaches
(`windowed_suffix_attention`: memory grows as T x (block + window), never T^2); with a cache, the layer's KV cache is
a ring of `window` slots (`windowed_cache_attention`: position p lives in slot p % window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridtron.config import ModelConfig
from hybridtron.model.documents import document_spans, same_document
from hybridtron.model.state import KVCache


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, sliding_window: int | None = None):
        """`sliding_window`: the tokens each query sees, itself included (None: every earlier token)."""
        super().__init__()
        self.sliding_window = sliding_window
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)

    def project(self, hidden_BTD: torch.Tensor):
        q = self.q_proj(hidden_BTD).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_proj(hidden_BTD).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(hidden_BTD).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2)
        return q, k, v

    def forward(self, hidden_BTD: torch.Tensor, kv: KVCache | None = None,
                lengths: torch.Tensor | None = None, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.project(hidden_BTD)
        if seq_idx is not None:
            if kv is not None:
                raise ValueError("attention: seq_idx (packed documents) is for training forwards, not a KV cache")
            out = document_attention(q, k, v, seq_idx, self.sliding_window)
        elif kv is None:
            out = causal_suffix_attention(q, k, v, self.sliding_window)
        elif self.sliding_window is not None:
            slots, needed = kv.k_BHTD.shape[2], int(lengths.max()) + hidden_BTD.shape[1]
            if slots < self.sliding_window and needed > slots:  # a ring shorter than its window must never wrap
                raise ValueError(f"the KV cache holds {slots} positions; this forward needs {needed}")
            out = windowed_cache_attention(q, k, v, kv, lengths, self.sliding_window)
        else:
            k, v, mask = write_and_read(kv, k, v, lengths)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(-2))

    def decode_step(self, hidden_BD: torch.Tensor, kv: KVCache, lengths_B: torch.Tensor) -> torch.Tensor:
        """One token per sequence, [B, D] -> [B, D], with shapes that never depend on the lengths (for a compiled
        decode step): the new key and value are written at each row's length by tensor indexing, and the query
        reads the whole preallocated cache with the positions past its length masked out. Nothing is read back
        to Python, so one compiled graph serves every step; the cost is reading the unused tail of the cache."""
        q, k, v = self.project(hidden_BD[:, None])  # [B, heads, 1, head_dim]
        if self.sliding_window is not None:  # static shapes too: the query reads every slot of the ring
            out = windowed_cache_attention(q, k, v, kv, lengths_B, self.sliding_window)
            return self.o_proj(out[:, :, 0].flatten(-2))
        rows_B = torch.arange(hidden_BD.shape[0], device=hidden_BD.device)
        kv.k_BHTD[rows_B, :, lengths_B] = k[:, :, 0].to(kv.k_BHTD.dtype)
        kv.v_BHTD[rows_B, :, lengths_B] = v[:, :, 0].to(kv.v_BHTD.dtype)
        visible_BT = torch.arange(kv.k_BHTD.shape[2], device=hidden_BD.device) <= lengths_B[:, None]
        out = F.scaled_dot_product_attention(q, kv.k_BHTD.to(q.dtype), kv.v_BHTD.to(q.dtype),
                                             attn_mask=visible_BT[:, None, None], enable_gqa=True)
        return self.o_proj(out[:, :, 0].flatten(-2))


def write_and_read(kv: KVCache, k_BHTD, v_BHTD, lengths: torch.Tensor):
    """Write new keys/values at each sequence's length; return the cached keys/values up to the longest sequence
    and the mask [B, 1, new, visible] that lets each new token see its own sequence's positions up to itself."""
    batch, _, new, _ = k_BHTD.shape
    max_len = kv.k_BHTD.shape[2]
    visible = int(lengths.max()) + new
    if visible > max_len:
        raise ValueError(f"the KV cache holds {max_len} positions; this forward needs {visible}")
    positions_BT = lengths[:, None] + torch.arange(new, device=lengths.device)
    rows = torch.arange(batch, device=lengths.device)[:, None]
    kv.k_BHTD[rows, :, positions_BT] = k_BHTD.transpose(1, 2).to(kv.k_BHTD.dtype)
    kv.v_BHTD[rows, :, positions_BT] = v_BHTD.transpose(1, 2).to(kv.v_BHTD.dtype)
    mask = (torch.arange(visible, device=lengths.device)[None, None, :] <= positions_BT[:, :, None])[:, None]
    return kv.k_BHTD[:, :, :visible].to(k_BHTD.dtype), kv.v_BHTD[:, :, :visible].to(v_BHTD.dtype), mask


def windowed_cache_attention(q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, kv: KVCache,
                             lengths_B: torch.Tensor, window: int) -> torch.Tensor:
    """T new tokens per row at positions lengths..lengths+T-1 over a ring KV cache of C slots (C = window, or fewer
    when the cache holds fewer positions, and then it never wraps): slot s holds the latest position p < length with
    p % C == s. The new tokens attend to the ring and to each other (read before write: a prompt longer than the
    ring still sees all of its window), then the last min(T, C) of them are written to their slots. Every shape
    follows from T and C, nothing is read back to Python: the compiled decode step runs it as is."""
    batch, _, new, _ = k_BHTD.shape
    capacity = kv.k_BHTD.shape[2]
    device = lengths_B.device
    last_B1 = lengths_B[:, None] - 1
    cached_positions_BC = last_B1 - (last_B1 - torch.arange(capacity, device=device)) % capacity  # < 0: empty
    new_positions_BT = lengths_B[:, None] + torch.arange(new, device=device)
    # the new keys and values as the cache stores them, so that a token reads itself as later tokens will
    k_stored, v_stored = k_BHTD.to(kv.k_BHTD.dtype), v_BHTD.to(kv.v_BHTD.dtype)
    keys = torch.cat([kv.k_BHTD, k_stored], dim=2).to(q_BHTD.dtype)
    values = torch.cat([kv.v_BHTD, v_stored], dim=2).to(q_BHTD.dtype)
    key_positions_B1K = torch.cat([cached_positions_BC, new_positions_BT], dim=1)[:, None]
    distance_BTK = new_positions_BT[:, :, None] - key_positions_B1K
    visible_BTK = (key_positions_B1K >= 0) & (distance_BTK >= 0) & (distance_BTK < window)
    out = F.scaled_dot_product_attention(q_BHTD, keys, values, attn_mask=visible_BTK[:, None], enable_gqa=True)
    kept = min(new, capacity)  # distinct slots: an indexed write with repeated indices keeps an arbitrary one
    rows_B1 = torch.arange(batch, device=device)[:, None]
    slots_BT = new_positions_BT[:, new - kept:] % capacity
    kv.k_BHTD[rows_B1, :, slots_BT] = k_stored[:, :, new - kept:].transpose(1, 2)
    kv.v_BHTD[rows_B1, :, slots_BT] = v_stored[:, :, new - kept:].transpose(1, 2)
    return out


def causal_suffix_attention(q_BHQD: torch.Tensor, k_BHKD: torch.Tensor, v_BHKD: torch.Tensor,
                            window: int | None = None) -> torch.Tensor:
    """Causal attention of queries that are the last Q of the K key positions (Q <= K): query i sees keys up to
    K - Q + i (and, with a `window`, none `window` or more positions before it). Q == K is plain causal attention;
    otherwise the [Q, K] mask is built (a context-parallel chunk's queries over their document's keys, bounded by
    that document's length)."""
    queries, keys = q_BHQD.shape[2], k_BHKD.shape[2]
    if window is not None and window < keys:
        return windowed_suffix_attention(q_BHQD, k_BHKD, v_BHKD, window)
    if queries == keys:
        return F.scaled_dot_product_attention(q_BHQD, k_BHKD, v_BHKD, is_causal=True, enable_gqa=True)
    positions_Q = torch.arange(keys - queries, keys, device=q_BHQD.device)
    visible_QK = torch.arange(keys, device=q_BHQD.device)[None, :] <= positions_Q[:, None]
    return F.scaled_dot_product_attention(q_BHQD, k_BHKD, v_BHKD, attn_mask=visible_QK, enable_gqa=True)


WINDOW_QUERY_BLOCK = 256  # queries per SDPA call of a windowed layer at least; keys per call: block + window - 1


def windowed_suffix_attention(q_BHQD: torch.Tensor, k_BHKD: torch.Tensor, v_BHKD: torch.Tensor,
                              window: int) -> torch.Tensor:
    """`causal_suffix_attention` with a window, one SDPA call per block of max(window, WINDOW_QUERY_BLOCK) queries
    over the keys that block's windows reach, with the banded mask of that block only: memory grows as
    T x (block + window), never T^2."""
    queries, keys = q_BHQD.shape[2], k_BHKD.shape[2]
    block = max(window, WINDOW_QUERY_BLOCK)
    outputs = []
    for start in range(0, queries, block):
        end = min(start + block, queries)
        first_position, end_position = keys - queries + start, keys - queries + end  # of the block's queries
        key_start = max(0, first_position - window + 1)
        distance_QK = (torch.arange(first_position, end_position, device=q_BHQD.device)[:, None]
                       - torch.arange(key_start, end_position, device=q_BHQD.device)[None, :])
        visible_QK = (distance_QK >= 0) & (distance_QK < window)
        outputs.append(F.scaled_dot_product_attention(q_BHQD[:, :, start:end], k_BHKD[:, :, key_start:end_position],
                                                      v_BHKD[:, :, key_start:end_position], attn_mask=visible_QK,
                                                      enable_gqa=True))
    return torch.cat(outputs, dim=2)


# Eager also in a compiled block (`train.compile`): the documents' spans are read back to the host and each gets
# its own call, whose shapes would otherwise recompile the block for every new packing.
@torch.compiler.disable
def document_attention(q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor,
                       seq_idx_BT: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Causal attention within each document of packed rows (`model.documents`): one SDPA call per document, so
    memory and work grow with the documents' lengths squared, never the row's (no [T, T] mask); with a `window`,
    windowed within each document (blocks of queries: `windowed_suffix_attention`)."""
    spans = document_spans(seq_idx_BT)
    if len(spans) == q_BHTD.shape[0]:  # one document per row: the whole batch in one call
        return causal_suffix_attention(q_BHTD, k_BHTD, v_BHTD, window)
    rows: list[list[torch.Tensor]] = [[] for _ in range(q_BHTD.shape[0])]
    for row, start, end in spans:
        rows[row].append(causal_suffix_attention(*(t[row:row + 1, :, start:end] for t in (q_BHTD, k_BHTD, v_BHTD)),
                                                 window))
    return torch.cat([torch.cat(pieces, dim=2) for pieces in rows])


def attention_ref(attn: Attention, hidden_BTD: torch.Tensor, seq_idx_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Explicit softmax(QK^T / sqrt(hd) + causal mask) V with K and V repeated per query group; with `seq_idx_BT`
    the mask is also same-document, with the layer's sliding window also t - s < window (a dense [T, T] mask: the
    reference only)."""
    q, k, v = attn.project(hidden_BTD)
    repeat = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = (q @ k.transpose(-1, -2)) * attn.head_dim ** -0.5
    length = hidden_BTD.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=hidden_BTD.device).tril()
    if attn.sliding_window is not None:
        causal = causal.triu(-(attn.sliding_window - 1))
    if seq_idx_BT is not None:
        causal = causal & same_document(seq_idx_BT, seq_idx_BT)[:, None]
    weights = torch.softmax(scores.float().masked_fill(~causal, float("-inf")), dim=-1).to(q.dtype)
    return attn.o_proj((weights @ v).transpose(1, 2).flatten(-2))
