"""Document masking in pretraining (`data.document_mask`): the run built as `hybridtron pretrain` builds it carries
seq_idx from the loader to the model, so a training step's loss is the model's loss under a document mask computed
by hand from the batch's bos tokens (and not the loss without one), and its validation the loss under the
validation batches' mask. The pipeline's inputs and the fault drill's corrupt batches keep seq_idx."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from hybridtron.data import DataConfig
from hybridtron.data.batch import TokenBatch
from hybridtron.model.lm import HybridLM
from hybridtron.train.config import RunConfig, TrainConfig
from hybridtron.train.monitor.config import MonitorConfig
from hybridtron.train.monitor.faults import CorruptingBatches, FaultInjector
from hybridtron.train.objectives import token_stage_inputs
from hybridtron.train.pretrain import build_pretraining


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory):
    """Short records, so that every 64-token row packs several documents."""
    root = tmp_path_factory.mktemp("documents")
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    lines = [json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(3 + i % 9))})
             for i in range(200)]
    (root / "short.jsonl").write_text("\n".join(lines))
    return root


def test_a_masked_pretraining_step_is_the_model_loss_under_a_hand_made_mask(short_documents, small_config,
                                                                          seq_idx_by_hand):
    data = DataConfig(source=str(short_documents / "short.jsonl"), vocab_size=512, seq_len=64, batch_size=2,
                      val_fraction=0.1, val_batches=1, document_mask=True, cache_dir=str(short_documents / "cache"))
    config = RunConfig(model=small_config(vocab_size=512), data=data,
                       train=TrainConfig(steps=1, warmup_steps=0, decay_fraction=0.0, val_every=1000,
                                         checkpoint_every=1000, threads=1),
                       monitor=MonitorConfig(enabled=False))
    out = short_documents / "run"
    out.mkdir()
    trainer = build_pretraining(config, out, None, quiet=True).trainer
    bos = trainer.batches.batches.loader.bos_id  # the loader under this rank's rows (DataParallelBatches)

    # the step's batch, read ahead and put back
    position = trainer.batches.state_dict()
    [batch] = trainer.batches.next_step()
    trainer.batches.load_state_dict(position)
    hand = seq_idx_by_hand(batch.input_ids, bos)
    assert torch.equal(batch.seq_idx, hand) and int(hand[:, -1].min()) >= 2  # every row holds 3+ documents
    assert all(val.seq_idx is not None for val in trainer.evaluators[0].batches)  # validation is masked too

    initial = copy.deepcopy(trainer.model)
    assert isinstance(initial, HybridLM)
    with torch.no_grad():
        masked = float(initial(batch.input_ids, batch.labels, seq_idx=hand).loss)
        unmasked = float(initial(batch.input_ids, batch.labels).loss)
        [val] = trainer.evaluators[0].batches
        val_loss = float(initial(val.input_ids, val.labels, seq_idx=val.seq_idx, mtp=False).loss)
    trainer.train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    [step] = [record for record in records if record.get("step") == 1 and "loss" in record]
    assert step["loss"] == pytest.approx(masked, rel=1e-5)
    assert abs(masked - unmasked) > 1e-3  # the mask changes the loss: it reached the model
    [start] = [record for record in records if record.get("step") == 0 and "val_loss" in record]
    assert start["val_loss"] == pytest.approx(val_loss, rel=1e-5)  # validation reads the mask as well


def test_pipeline_inputs_and_corrupt_batches_keep_seq_idx():
    ids = torch.arange(12).reshape(2, 6)
    seq_idx = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    batch = TokenBatch(ids, ids + 1, seq_idx)
    inputs = token_stage_inputs(batch)
    assert inputs.seq_idx is seq_idx and inputs.lookahead == 0 and inputs.tokens == 12
    share = TokenBatch(ids, torch.cat([ids, ids[:, :2]], 1), seq_idx, following_ids=ids[:, :2])  # a CP share
    inputs = token_stage_inputs(share)
    assert inputs.input_ids.shape == (2, 8) and inputs.lookahead == 2 and inputs.seq_idx is seq_idx

    class Source:
        def next_step(self):
            return [batch]

    injector = FaultInjector(MonitorConfig(inject_fault="corrupt_batch@1"), SimpleNamespace(write=lambda *a: None))
    [corrupt] = CorruptingBatches(Source(), injector, vocab_size=50, never_target_id=0).next_step()
    assert not torch.equal(corrupt.input_ids, ids) and (corrupt.labels == 0).all()
    assert corrupt.seq_idx is seq_idx  # the garbage keeps the batch's documents
