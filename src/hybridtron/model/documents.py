"""Document masking for packed rows: `seq_idx` [B, T], the index of each position's document within its row.

A row packs several documents (pretraining's stream, SFT's conversations). Without a mask they share the context:
attention reads the earlier documents of the row and the Mamba state carries over. With `seq_idx` (mamba_ssm's
name and meaning: non-decreasing along a row, a change of value starts a document; the values themselves do not
matter) every document is computed as if it were alone in its row:

    attention    causal within a document (`attention.document_attention`: one SDPA call per document, so
                 nothing grows as T^2 with the row: no dense [T, T] mask)
    Mamba-2      the causal conv reads no input of an earlier document (`mamba2.document_conv`), and the scan
                 starts each document from a zero state (`ops.ssd.ssd_chunked(seq_idx_BT=...)`)
    MTP          depth k at position t uses t's document (its targets past the document are already masked by
                 the labels, `lm.mtp_targets`)

Norms, MLPs and MoE act position by position and need nothing. Under context parallelism each rank's chunk rows
carry their own seq_idx and the exchanges respect it (`dist.context_parallel`).
"""

from __future__ import annotations

import torch


def check_seq_idx(seq_idx_BT: torch.Tensor, input_ids_BT: torch.Tensor) -> None:
    """One clear line for a seq_idx the model cannot use: wrong shape or dtype, or decreasing within a row."""
    if not isinstance(seq_idx_BT, torch.Tensor):
        raise ValueError(f"seq_idx: expected a [B, T] integer tensor, got {type(seq_idx_BT).__name__}")
    if seq_idx_BT.shape != input_ids_BT.shape:
        raise ValueError(f"seq_idx: shape {tuple(seq_idx_BT.shape)} != input_ids shape {tuple(input_ids_BT.shape)}; "
                         "expected one document index per position")
    if seq_idx_BT.dtype.is_floating_point or seq_idx_BT.dtype == torch.bool:
        raise ValueError(f"seq_idx: expected an integer tensor, got {seq_idx_BT.dtype}")
    decreasing = seq_idx_BT[:, 1:] < seq_idx_BT[:, :-1]
    if bool(decreasing.any()):
        row, position = (int(i) for i in decreasing.nonzero()[0])
        raise ValueError(f"seq_idx: decreases in row {row} at position {position + 1} ({int(seq_idx_BT[row, position])}"
                         f" -> {int(seq_idx_BT[row, position + 1])}); expected each row's document indices "
                         "non-decreasing (a change of value starts a document)")


def document_spans(seq_idx_BT: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document, rows in order: where seq_idx changes along a row. One read back to the
    host per call."""
    length = seq_idx_BT.shape[1]
    changes = (seq_idx_BT[:, 1:] != seq_idx_BT[:, :-1]).nonzero().tolist()
    spans, row_starts = [], {row: [0] for row in range(seq_idx_BT.shape[0])}
    for row, position in changes:
        row_starts[row].append(position + 1)
    for row, starts in row_starts.items():
        spans += [(row, start, end) for start, end in zip(starts, starts[1:] + [length])]
    return spans


def same_document(seq_idx_BQ: torch.Tensor, seq_idx_BK: torch.Tensor) -> torch.Tensor:
    """[B, Q, K] bool: query q and key k in one document."""
    return seq_idx_BQ[:, :, None] == seq_idx_BK[:, None, :]
