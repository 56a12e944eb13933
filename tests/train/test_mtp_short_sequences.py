"""MTP depths without targets on the training side: the pretraining objective (fused head and logits, one process,
data parallel, a context-parallel share) gives such a depth weight zero, SFT's token mean too, and the step's stats
leave the depth out (`StepStats.mtp_losses[d - 1]` None, no `mtp_loss_<d>` in metrics.jsonl) instead of logging a
NaN or a 0 that would pull its mean down."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from hybridtron.checkpoint.dcp import CheckpointManager
from hybridtron.data.batch import TokenBatch
from hybridtron.distributed.context_parallel import shard_sequence
from hybridtron.model.lm import HybridLM, mtp_targets
from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.post.sft import SFTObjective
from hybridtron.train import hooks as H
from hybridtron.train.config import TrainConfig
from hybridtron.train.loop import Trainer
from hybridtron.train.monitor.detectors import NonFinite
from hybridtron.train.objectives import BatchSource, PretrainObjective
from hybridtron.train.stats import StepStats

DEPTHS = 2


def token_batch(length: int, seed: int, vocab: int = 128) -> TokenBatch:
    """One row of `length` tokens, labelled with the next token (none at the last position)."""
    ids = torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))
    return TokenBatch(ids, F.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX))


def depth_ce(model, batch: TokenBatch, depth: int) -> float:
    """The depth's CE on the batch (0: the next token), computed directly."""
    with torch.no_grad():
        out = model(batch.input_ids)
    targets = mtp_targets(batch.labels, depth) if depth else batch.labels
    logits = (out.logits, *out.mtp_logits)[depth]
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX).item()


@pytest.fixture
def model(small_config):
    return HybridLM(small_config(mtp_num_depths=DEPTHS, mtp_loss_weight=0.3))


@pytest.mark.parametrize("fused_head", [True, False])
@pytest.mark.parametrize("data_parallel", [False, True])
def test_pretrain_objective_gives_an_empty_depth_weight_zero(model, fused_head, data_parallel):
    batch = token_batch(DEPTHS + 1, seed=1)  # depth 1 has one target, depth 2 none
    objective = PretrainObjective(mtp_depths=DEPTHS, fused_head=fused_head,
                                  data_sum=(lambda counts: counts) if data_parallel else None)  # a world of one
    objective.begin_step([batch])
    out = objective(model, batch)
    assert [float(share) for share in out.mtp_shares] == [1.0, 0.0]
    assert out.mtp_losses[1].item() == 0.0
    expected = depth_ce(model, batch, 0) + 0.3 / DEPTHS * depth_ce(model, batch, 1)
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_context_parallel_shares_of_a_short_sequence(model):
    """A 4-token sequence over cp = 2: one-token chunks, whose MTP targets are the labels after them; the share
    with no depth-2 target adds nothing there, and the ranks' shares of each depth sum to 1."""
    whole = token_batch(4, seed=2)
    shares = []
    for rank in (0, 1):
        ids, labels, following = shard_sequence(whole.input_ids, whole.labels, rank, 2, DEPTHS)
        shares.append(TokenBatch(ids, labels, following_ids=following))
    counts = [torch.stack([(mtp_targets(share.labels, d) if d else share.labels)[:, :1].ne(IGNORE_INDEX).sum()
                           for d in range(DEPTHS + 1)]).double() for share in shares]
    assert counts[1][2] == 0  # rank 1's chunks (positions 1 and 2) have no depth-2 target
    outputs = []
    for share in shares:
        objective = PretrainObjective(mtp_depths=DEPTHS, data_sum=lambda local: (counts[0] + counts[1])[None])
        objective.begin_step([share])
        out = objective(model, share)
        out.loss.backward()
        assert math.isfinite(out.loss.item())
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        outputs.append(out)
    assert [float(a + b) for a, b in zip(*(out.mtp_shares for out in outputs))] == [1.0, 1.0]
    assert float(outputs[1].mtp_losses[1]) == 0.0


def test_sft_objective_shares(model):
    batch = token_batch(DEPTHS + 1, seed=3)
    objective = SFTObjective(DEPTHS)
    objective.begin_step([batch])
    out = objective(model, batch)
    out.loss.backward()
    assert math.isfinite(out.loss.item())
    assert [float(share) for share in out.mtp_shares] == [1.0, 0.0]


class Fixed(BatchSource):
    def __init__(self, steps):
        self.steps, self.position = steps, 0

    def next_step(self):
        self.position += 1
        return self.steps[self.position - 1]

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_step_stats_leave_an_empty_depth_out(tmp_path, model):
    short, long = token_batch(DEPTHS + 1, seed=4), token_batch(8, seed=5)
    # before the steps change the weights: each micro-batch's depth losses
    short_1, long_1, long_2 = depth_ce(model, short, 1), depth_ce(model, long, 1), depth_ce(model, long, 2)
    config = TrainConfig(steps=2, lr=1e-3, warmup_steps=1, checkpoint_every=100, val_every=1000, grad_accum=2)
    trainer = Trainer(model, PretrainObjective(mtp_depths=DEPTHS), Fixed([[short, long], [short, short]]), config,
                      CheckpointManager(tmp_path / "checkpoints"), hooks=[H.MetricsLogger(tmp_path)])
    stats = trainer.forward_backward()
    # depth 2: the long micro-batch's loss alone, not halved by the short one's empty depth
    assert stats.mtp_losses == pytest.approx([(short_1 + long_1) / 2, long_2], rel=1e-5)
    trainer.optimizer.zero_grad(set_to_none=True)
    stats = trainer.forward_backward()
    assert stats.mtp_losses[1] is None and stats.mtp_losses[0] is not None
    assert "mtp_loss_2" not in stats.record() and "mtp_loss_1" in stats.record()
    stats.grad_norm = 1.0  # (the update sets it)
    assert NonFinite(None).check(stats) is None


def test_metrics_line_without_the_empty_depth(tmp_path, model):
    config = TrainConfig(steps=1, lr=1e-3, warmup_steps=1, checkpoint_every=100, val_every=1000)
    trainer = Trainer(model, PretrainObjective(mtp_depths=DEPTHS), Fixed([[token_batch(2, seed=6)]]), config,
                      CheckpointManager(tmp_path / "checkpoints"), hooks=[H.MetricsLogger(tmp_path)])
    trainer.train()
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert math.isfinite(line["loss"]) and math.isfinite(line["grad_norm"])
    assert not any(key.startswith("mtp_loss_") for key in line)  # T = 2: no MTP target at any depth


def test_record_of_a_depth_without_targets():
    stats = StepStats(step=1, lr=1.0, losses={"loss": 2.0}, tokens=4, expert_counts={}, mtp_losses=[1.5, None])
    assert stats.record()["mtp_loss_1"] == 1.5 and "mtp_loss_2" not in stats.record()
