"""Context parallelism (`dist.cp`): each of the cp ranks of a group holds a head and a tail chunk of every sequence.

A sequence of L positions is cut into 2 x cp chunks of L / (2 cp); rank r holds chunks r and 2 cp - 1 - r, as two
rows of its micro-batch (`shard_sequence`: [B, L] -> [2B, L / (2 cp)], each sequence's head chunk then its tail
chunk). Causal attention's work grows with a chunk's place in the sequence, so the pairs even it out: every rank's
queries read 2 cp + 1 chunks of keys (contiguous shares would give the last rank cp times the first's work, and
2 cp / (cp + 1) times the mean that every step waits on; bench/cp_balance.py).

Everything that acts token by token (norms, MLPs, MoE, the loss) runs on the rows unchanged. Only the three places
where a position reads earlier positions exchange data over the cp group, and `apply_context_parallel` swaps those
modules' classes for the forms below (their parameters and names stay):

- Attention (`ContextParallelAttention`): the keys and values of the whole sequence are all-gathered and put back
  in sequence order (`sequence_chunks`); each chunk's queries attend to the keys up to its own end under the
  causal mask shifted by its offset (what torchtitan's allgather CP rotation does). With `dist.cp_attention =
  "ring"` the keys and values pass from rank to rank instead, each transfer overlapping a block's compute, and no
  rank holds the whole sequence's (`ring_attention.py`); both are exact.
- Mamba-2 (`ContextParallelMamba2Mixer`): the scan is linear in its state, so each chunk scans from a zero state,
  then the chunks' final states and total decays are all-gathered and each chunk adds what the state entering it
  contributes: y_t += exp(sum of a up to t) C_t . S_in, with S_in the earlier chunks' states carried through their
  decays. The causal conv reads the previous chunk's last K-1 inputs (also all-gathered). This is the
  sequence-parallel scan of Mamba-2's paper (section 8), with the states passed by one all-gather.
- Packed documents (`seq_idx`, `model.documents`): each rank's chunk rows carry their own seq_idx, and the
  exchanges respect it. Attention runs per document over the gathered keys (a document that started in an earlier
  chunk reads its keys from there; `chunk_document_attention`); the conv reads the previous chunk's inputs only
  where they are in the same document; the incoming state reaches a chunk only from earlier chunks whose last
  document is still the one open at the chunk's start (a document that crosses a share boundary gets its state;
  one that starts inside a share does not). Ring attention refuses them (use the all-gather form).
- MTP reads the embedding of token t+k: the data loader hands each chunk the ids that follow it (`shard_sequence`;
  `PAST_END` past the sequence's end, which the model embeds as zeros, as it pads the end of an unsharded
  sequence), and the model embeds them itself (`HybridLM.forward(following_ids=...)`).

Under TP as well, these forms are swapped in first and TP then runs them on its local shards
(`tensor_parallel.LocalShardParallel`): each TP rank's mixer sees whole chunks of its own heads and Mamba groups,
and exchanges them with the cp ranks of its TP coordinate (the cp group is the mesh's cp dimension). Under PP each
pipeline is one cp coordinate's, and carries its chunks' following ids (`pipeline.Pipeline.step`).

The all-gathers (`collectives.gather_shares`) sum their gradient over the ranks in the backward; every rank uses
every gathered tensor in its graph, so every rank runs every backward collective, in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridtron.distributed.collectives import gather_shares
from hybridtron.distributed.ring_attention import own_chunks, ring_attention
from hybridtron.model.attention import Attention, causal_suffix_attention
from hybridtron.model.documents import document_spans
from hybridtron.model.lm import PAST_END
from hybridtron.model.mamba2 import Mamba2Mixer
from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.ops.ssd import ssd_chunked


def _own_of_each_row(chunks: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """[B, 2 size, ...] -> [2B, ...]: rank `rank`'s two of each row's chunks, head then tail."""
    return chunks[:, list(own_chunks(rank, size))].flatten(0, 1)


def chunk_rows(x: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s chunks of each row of `x` [B, L, ...] (positions on dim 1) as rows [2B, L / (2 size), ...]:
    each row's head chunk, then its tail chunk."""
    return _own_of_each_row(x.unflatten(1, (2 * size, -1)), rank, size)


def sequence_chunks(rows: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's chunk rows (`chunk_rows`'s [2B, ...], this rank's) gathered over the cp group, in sequence
    order: [2 cp, B, ...]. Differentiable: the backward sums each rank's gradient and returns this rank's rows'."""
    gathered = gather_shares(rows[None], 0, group).unflatten(1, (-1, 2))  # [cp, B, 2 (head, tail), ...]
    return torch.cat([gathered[:, :, 0], gathered[:, :, 1].flip(0)])  # heads in rank order, tails in reverse


def own_rows(chunks: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The inverse of `sequence_chunks` for one rank: its two chunks of `chunks` [2 cp, B, ...] as rows [2B, ...]."""
    return chunks[list(own_chunks(rank, size))].transpose(0, 1).flatten(0, 1)


class _ContextParallel:
    """The cp group a swapped module exchanges over, and its place in it."""

    cp_group: dist.ProcessGroup
    cp_rank: int
    cp_size: int
    cp_attention: str = "all-gather"  # attention only: or "ring"

    def _check_training_forward(self, cache) -> None:
        if cache is not None:
            raise ValueError(f"{type(self).__name__}: context parallelism runs training forwards only (no cache); "
                             "decode with the unsharded model (the HF export)")


class ContextParallelAttention(_ContextParallel, Attention):
    def forward(self, hidden_BTD: torch.Tensor, kv=None, lengths=None, seq_idx=None) -> torch.Tensor:
        self._check_training_forward(kv)
        q, k, v = self.project(hidden_BTD)  # [2B, heads, T, head_dim]: (head, tail) chunk rows
        if self.cp_attention == "ring":
            if seq_idx is not None:
                raise ValueError("context parallelism: dist.cp_attention = 'ring' does not mask packed documents "
                                 "(seq_idx); use dist.cp_attention = 'all-gather' or turn the document mask off")
            out = ring_attention(q, k, v, self.cp_group)
        else:  # the whole sequence's keys and values [B, heads, L, head_dim]
            keys, values = (sequence_chunks(t, self.cp_group).movedim(0, 2).flatten(2, 3) for t in (k, v))
            chunks = own_chunks(self.cp_rank, self.cp_size)
            if seq_idx is None:
                out = chunk_attention(q, keys, values, chunks)
            else:
                documents_BL = sequence_chunks(seq_idx, self.cp_group).movedim(0, 1).flatten(1, 2)
                out = chunk_document_attention(q, keys, values, chunks, documents_BL)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


def chunk_attention(q_RHTD: torch.Tensor, keys_BHLD: torch.Tensor, values_BHLD: torch.Tensor,
                    chunks: tuple[int, ...]) -> torch.Tensor:
    """Causal attention of chunk rows over their whole sequences' keys and values: row b x len(chunks) + s of
    `q_RHTD` holds the queries of chunk `chunks[s]` (T positions from chunks[s] x T) of sequence b. Each chunk's
    queries read the keys up to its own end only, so a chunk's cost grows with its place in the sequence (what the
    head-and-tail pairs balance: bench/cp_balance.py)."""
    length, per_sequence = q_RHTD.shape[2], len(chunks)
    outputs = []
    for slot, chunk in enumerate(chunks):
        end = (chunk + 1) * length
        positions_T = chunk * length + torch.arange(length, device=q_RHTD.device)
        visible_TS = torch.arange(end, device=q_RHTD.device)[None, :] <= positions_T[:, None]
        outputs.append(F.scaled_dot_product_attention(q_RHTD[slot::per_sequence], keys_BHLD[:, :, :end],
                                                      values_BHLD[:, :, :end], attn_mask=visible_TS, enable_gqa=True))
    return torch.stack(outputs, 1).flatten(0, 1)  # back to the rows' order


# Eager also in a compiled block, as `attention.document_attention`: the documents' spans are read back to the host.
@torch.compiler.disable
def chunk_document_attention(q_RHTD: torch.Tensor, keys_BHLD: torch.Tensor, values_BHLD: torch.Tensor,
                             chunks: tuple[int, ...], documents_BL: torch.Tensor) -> torch.Tensor:
    """`chunk_attention` within packed documents (`documents_BL`: the whole sequences' seq_idx): each document of
    a chunk attends to its own keys from where it starts, which may be an earlier chunk."""
    length, per_sequence = q_RHTD.shape[2], len(chunks)
    outputs = []
    for row in range(q_RHTD.shape[0]):
        sequence, chunk = divmod(row, per_sequence)
        offset = chunks[chunk] * length
        own_documents = documents_BL[sequence:sequence + 1, offset:offset + length]
        pieces = []
        for _, start, end in document_spans(own_documents):
            # the document's first position in the sequence: seq_idx is non-decreasing along it
            first = int((documents_BL[sequence] < own_documents[0, start]).sum())
            pieces.append(causal_suffix_attention(q_RHTD[row:row + 1, :, start:end],
                                                  keys_BHLD[sequence:sequence + 1, :, first:offset + end],
                                                  values_BHLD[sequence:sequence + 1, :, first:offset + end]))
        outputs.append(torch.cat(pieces, dim=2))
    return torch.cat(outputs)


class ContextParallelMamba2Mixer(_ContextParallel, Mamba2Mixer):
    def forward(self, hidden_BTD: torch.Tensor, state=None, seq_idx=None) -> torch.Tensor:
        self._check_training_forward(state)
        z, xBC, dt_raw = self.split_projection(self.in_proj(hidden_BTD))
        previous_inputs, previous_documents = self._previous_conv_inputs(xBC, seq_idx)
        conv_input_BCT = torch.cat([previous_inputs.transpose(1, 2), xBC.transpose(1, 2)], dim=-1)
        conv_documents = None if seq_idx is None else torch.cat([previous_documents, seq_idx], dim=1)
        x, B, C = self.split_xbc(F.silu(self.conv(conv_input_BCT, conv_documents)).transpose(1, 2))
        dt, A = self.discretize(dt_raw)
        x_dt, a = x.float() * dt[..., None], dt * A
        y, final = ssd_chunked(x_dt, a, B.float(), C.float(), self.chunk_size, seq_idx_BT=seq_idx)
        y = y + self._incoming_state_output(final, a, C.float(), seq_idx)
        return self.finish(y, x, z)

    def _previous_conv_inputs(self, xBC_BTC: torch.Tensor, seq_idx_BT: torch.Tensor | None
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last K-1 conv inputs of the chunk before each row's [2B, K-1, C] (zeros for the first chunk), and
        with packed documents their seq_idx [2B, K-1] (the first chunk's: its own first document)."""
        taps = self.conv1d.kernel_size[0] - 1
        if xBC_BTC.shape[1] < taps:
            raise ValueError(f"context parallelism: a chunk of {xBC_BTC.shape[1]} positions is shorter than the conv's "
                             f"{taps} previous inputs; use a longer data.seq_len or a smaller dist.cp")
        tails = sequence_chunks(xBC_BTC[:, -taps:], self.cp_group)  # [2 cp, B, K-1, C]
        previous = torch.cat([torch.zeros_like(tails[:1]), tails[:-1]])
        if seq_idx_BT is None:
            return own_rows(previous, self.cp_rank, self.cp_size), None
        document_tails = sequence_chunks(seq_idx_BT[:, -taps:], self.cp_group)  # [2 cp, B, K-1]
        first = sequence_chunks(seq_idx_BT[:, :1], self.cp_group)[:1].expand(-1, -1, taps)
        previous_documents = torch.cat([first, document_tails[:-1]])
        return (own_rows(previous, self.cp_rank, self.cp_size),
                own_rows(previous_documents, self.cp_rank, self.cp_size))

    def _incoming_state_output(self, final_BHPN: torch.Tensor, a_BTH: torch.Tensor, C_BTGN: torch.Tensor,
                               seq_idx_BT: torch.Tensor | None = None) -> torch.Tensor:
        """exp(cumsum a)_t * C_t . S_in [2B, T, H, P]: the output of the state entering each row's chunk c,
        S_in = sum over earlier chunks j of exp(the decays of chunks j+1 .. c-1) * final_j. With packed documents
        final_j (the state of chunk j's last document) is carried only if that document is still open at chunk c's
        start (seq_idx non-decreasing: no document starts in between), and reaches only that document's
        positions."""
        finals_JBHPN = sequence_chunks(final_BHPN, self.cp_group)
        decays_JBH = sequence_chunks(a_BTH.sum(1), self.cp_group)  # each chunk's total log-decay
        chunks_J = torch.arange(decays_JBH.shape[0], device=a_BTH.device)
        own_S = torch.tensor(own_chunks(self.cp_rank, self.cp_size), device=a_BTH.device)
        # the log-decay from the end of chunk j to the start of own chunk c: the sum over the chunks in between (a
        # masked sum, not a difference of prefix sums, which would round away small carries next to large ones)
        after_j_JI = chunks_J[:, None] < chunks_J[None, :]
        between_SJI = after_j_JI[None] & (chunks_J[None, None, :] < own_S[:, None, None])
        log_carry_SJBH = torch.einsum("sji,ibh->sjbh", between_SJI.to(decays_JBH.dtype), decays_JBH)
        earlier_SJB1 = (chunks_J[None, :] < own_S[:, None])[..., None, None]
        if seq_idx_BT is not None:
            lasts_JB = sequence_chunks(seq_idx_BT[:, -1], self.cp_group)
            firsts_SB = seq_idx_BT[:, 0].unflatten(0, (-1, len(own_S))).T  # rows are (sequence, own chunk) pairs
            earlier_SJB1 = earlier_SJB1 & (lasts_JB[None] == firsts_SB[:, None])[..., None]
        carry_SJBH = torch.exp(torch.where(earlier_SJB1, log_carry_SJBH, float("-inf")))
        incoming_SBHPN = torch.einsum("sjbh,jbhpn->sbhpn", carry_SJBH, finals_JBHPN)
        incoming_BHPN = incoming_SBHPN.transpose(0, 1).flatten(0, 1)  # the rows' order
        heads, groups = a_BTH.shape[2], C_BTGN.shape[2]
        incoming_BGJPN = incoming_BHPN.unflatten(1, (groups, heads // groups))
        out_BTGJP = torch.einsum("btgn,bgjpn->btgjp", C_BTGN, incoming_BGJPN)
        entering_decay_BTH = torch.exp(a_BTH.cumsum(1))
        if seq_idx_BT is not None:  # the positions of the document open at the chunk's start
            entering_decay_BTH = entering_decay_BTH * (seq_idx_BT == seq_idx_BT[:, :1])[..., None]
        return out_BTGJP.flatten(2, 3) * entering_decay_BTH[..., None]


CONTEXT_PARALLEL_FORMS = {Attention: ContextParallelAttention, Mamba2Mixer: ContextParallelMamba2Mixer}


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup, attention: str = "all-gather") -> None:
    """Swap every attention and Mamba-2 mixer of `model` (the MTP block's too) for its context-parallel form over
    `group` (its class only: the parameters and their names stay); `attention`: how attention exchanges its keys
    and values, "all-gather" or "ring" (`dist.cp_attention`)."""
    windowed = [name for name, module in model.named_modules()
                if isinstance(module, Attention) and module.sliding_window is not None]
    if windowed:  # neither form masks a window: refuse rather than attend in full
        raise ValueError(f"context parallelism: sliding_window is not supported with dist.cp_attention = "
                         f"{attention!r} (windowed: {', '.join(windowed)}); use cp = 1 or sliding_window None")
    for module in model.modules():
        form = CONTEXT_PARALLEL_FORMS.get(type(module))
        if form is not None:
            module.__class__ = form
            module.cp_group, module.cp_rank, module.cp_size = group, dist.get_rank(group), dist.get_world_size(group)
            if form is ContextParallelAttention:
                module.cp_attention = attention


def shard_sequence(input_ids_BT: torch.Tensor, labels_BT: torch.Tensor, rank: int, size: int, lookahead: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank` of `size`'s part of a micro-batch, its two chunks of each row as rows (`chunk_rows`): (their ids
    [2B, T], their labels and the `lookahead` labels after them [2B, T + lookahead], the `lookahead` ids after them
    [2B, lookahead]), T = L / (2 size). Past the sequence's end the labels are IGNORE_INDEX and the ids PAST_END,
    which the objective and the model treat as the end of an unsharded sequence. `lookahead` is the model's MTP
    depths: depth k at position t reads token t+k and is scored against label t+k."""
    length = input_ids_BT.shape[1]
    if length % (2 * size):
        raise ValueError(f"context parallelism: a sequence of {length} positions does not split into the 2 x cp = "
                         f"{2 * size} chunks of cp {size}")
    chunk = length // (2 * size)
    ids = chunk_rows_ahead(input_ids_BT, rank, size, lookahead, PAST_END)
    labels = chunk_rows_ahead(labels_BT, rank, size, lookahead, IGNORE_INDEX)
    return ids[:, :chunk], labels, ids[:, chunk:]


def chunk_rows_ahead(x_BT: torch.Tensor, rank: int, size: int, lookahead: int, fill) -> torch.Tensor:
    """`chunk_rows` with the `lookahead` positions after each chunk: [2B, L / (2 size) + lookahead], `fill` past the
    sequence's end."""
    chunk = x_BT.shape[1] // (2 * size)
    padded = F.pad(x_BT, (0, lookahead), value=fill)
    return _own_of_each_row(padded.unfold(1, chunk + lookahead, chunk), rank, size)
