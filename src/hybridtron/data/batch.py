"""`TokenBatch`: one micro-batch of a token objective (pretraining, SFT), as the loaders yield it and every trainer
path (data parallelism, context parallelism, the pipeline, evaluation, fault drills) carries it to the model.

Legend: B = rows, T = positions of the rows (under context parallelism: of this rank's share of them).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class TokenBatch:
    """input_ids [B, T] int64; labels [B, T] int64, already shifted (`labels[t]` is what position t predicts,
    IGNORE_INDEX where nothing is scored; under context parallelism [B, T + lookahead]: a share's labels run
    `lookahead` positions (the model's MTP depths) past its ids, `dist.context_parallel.shard_sequence`);
    seq_idx [B, T] int64 or None: the index of each position's document within its row (non-decreasing along a
    row, 0 at its first position, one more at each document start; mamba_ssm's meaning), which masks attention,
    the Mamba scan and its conv at document boundaries; None = no document mask, the row is one context;
    following_ids [B, lookahead] int64 or None: under context parallelism the ids after the share (PAST_END past
    the sequence's end), which the MTP depths embed."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    seq_idx: torch.Tensor | None = None
    following_ids: torch.Tensor | None = None

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword inputs of `HybridLM.forward` this batch sets (`seq_idx`, `following_ids`): those it has."""
        return {name: value for name, value in (("seq_idx", self.seq_idx), ("following_ids", self.following_ids))
                if value is not None}

    def to(self, device) -> "TokenBatch":
        return self.map(lambda tensor: tensor.to(device))

    def rows(self, start: int, stop: int) -> "TokenBatch":
        """Rows `start:stop` of every tensor (a data-parallel rank's rows, a batch of a longer list of rows)."""
        return self.map(lambda tensor: tensor[start:stop])

    def map(self, fn) -> "TokenBatch":
        """`fn` applied to every tensor that is there (None stays None)."""
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if getattr(self, f.name) is not None})


def as_token_batch(batch) -> TokenBatch:
    """A `TokenBatch` as it is; an `(input_ids, labels[, following_ids])` tuple, the form hand-built batches in
    tests and scripts may still take, as a TokenBatch without a document mask."""
    if isinstance(batch, TokenBatch):
        return batch
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3) and all(isinstance(t, torch.Tensor) for t in batch):
        return TokenBatch(batch[0], batch[1], following_ids=batch[2] if len(batch) == 3 else None)
    raise ValueError(f"expected a TokenBatch (or an (input_ids, labels) pair), got {type(batch).__name__}")
