"""The document mask (seq_idx) through every trainer path of a parallel layout: the data-parallel rows, the
context-parallel chunks (`dist.step.share_of_batch`) and the pipeline's stages and MTP block
(`MicroBatchInputs.seq_idx`) train on 2 gloo processes exactly as one process does on the same masked batches
(losses and gradient norms to 1e-5, fp32), and the mask changes the run (it reached the model). A share's seq_idx
is cut as its ids."""

from __future__ import annotations

import pytest
import torch

import layout_worker
from hybridtron.data.batch import TokenBatch
from hybridtron.distributed.context_parallel import chunk_rows, shard_sequence
from hybridtron.distributed.step import share_of_batch
from test_parallel_layouts import assert_same_run, run_layouts

STEPS = 3
LAYOUTS = [f"{layout},documents=1,steps={STEPS}" for layout in
           ["dp_shard=2", "pp=2", "pp=2,pp_schedule=interleaved-1f1b", "cp=2"]]


@pytest.mark.timeout(300)
def test_masked_layouts_on_two_processes_match_one_process(tmp_path):
    reference = layout_worker.train(None, STEPS, documents=True)
    unmasked = layout_worker.train(None, STEPS)
    assert all(abs(a["losses"]["loss"] - b["losses"]["loss"]) > 1e-4 for a, b in zip(reference, unmasked))
    results = run_layouts(tmp_path, 2, LAYOUTS, timeout=280)
    for layout in LAYOUTS:
        assert_same_run(results[layout], reference, layout)


def test_a_context_parallel_share_cuts_seq_idx_as_the_ids():
    ids = torch.arange(2 * 12).reshape(2, 12)
    labels = ids + 100
    seq_idx = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    batch = TokenBatch(ids, labels, seq_idx)
    for rank in range(3):
        share = share_of_batch(batch, rank, 3, lookahead=2)
        input_ids, labels_ahead, following = shard_sequence(ids, labels, rank, 3, 2)
        assert torch.equal(share.input_ids, input_ids) and torch.equal(share.labels, labels_ahead)
        assert torch.equal(share.following_ids, following)
        assert torch.equal(share.seq_idx, chunk_rows(seq_idx, rank, 3))  # each position keeps its document
        # a position's document is read off the same place as its id
        assert torch.equal(share.seq_idx, seq_idx.flatten()[share.input_ids])
        held_out = share_of_batch(batch, rank, 3, lookahead=0)
        assert held_out.following_ids is None and torch.equal(held_out.seq_idx, share.seq_idx)
    assert share_of_batch(TokenBatch(ids, labels), 0, 3, 2).seq_idx is None
