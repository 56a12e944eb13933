"""Long rows in one process (issue 39, item 3): `train.recompute` reaches a single-process run as it reaches a torchrun
one, and pretraining's loss never holds [tokens, vocab] logits, for the main head or the MTP depths.

The recompute equality of the model's own loss is tests/distributed/test_parallel_pieces.py's; here the run is built as
`hybridtron pretrain` builds it (`assemble_trainer`, `PretrainObjective` with its fused lm_head + CE) and one
trainer step is compared, so a run command that skipped `parallelize`, or a wrapper that hid lm_head from the fused
loss, would show."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._python_dispatch import TorchDispatchMode

from hybridtron.data.batch import TokenBatch
from hybridtron.distributed.mesh import Parallel
from hybridtron.distributed.parallelize import parallelize
from hybridtron.model.lm import HybridLM
from hybridtron.ops import linear_cross_entropy as linear_cross_entropy_module
from hybridtron.train.config import TrainConfig
from hybridtron.train.hooks import Hook
from hybridtron.train.monitor.config import MonitorConfig
from hybridtron.train.objectives import BatchSource, PretrainObjective, local_head_weight
from hybridtron.train.run import assemble_trainer

VOCAB = 200  # a size no other dimension of the small model has: a tensor with it is made of logits
BATCH, LENGTH = 2, 64  # 128 tokens: their logits outnumber lm_head's weight (200 x 48) by far


class OneRow(BatchSource):
    """The same micro-batch every step: recompute changes nothing a step reads, only what it keeps."""

    def __init__(self, ids, labels):
        self.batch = TokenBatch(ids, labels)  # as pretraining's loader hands it over

    def next_step(self):
        return [self.batch]

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def rows():
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100  # the last position has no next token in the row
    return ids, labels


def pretraining_trainer(model, tmp_path, **train):
    """A single-process trainer as `hybridtron pretrain` assembles it (no monitor, no checkpoints)."""
    return assemble_trainer(model, PretrainObjective(), OneRow(*rows()), [],
                            train=TrainConfig(steps=1, warmup_steps=0, **train),
                            monitor_config=MonitorConfig(enabled=False), out=tmp_path, checkpoints=None, quiet=True,
                            parallel=Parallel.single_process())


def checkpointed_units(model) -> dict[str, bool]:
    """Whether each unit `parallelize` checkpoints (every backbone layer, the MTP block) is wrapped."""
    units = {f"backbone.layers.{i}": layer for i, layer in enumerate(model.backbone.layers)}
    units["mtp"] = model.mtp
    return {name: isinstance(unit, CheckpointWrapper) for name, unit in units.items()}


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_single_process_run_checkpoints_every_block_as_train_recompute_says(small_config, tmp_path, recompute):
    trainer = pretraining_trainer(HybridLM(small_config(vocab_size=VOCAB)), tmp_path, recompute=recompute)
    wrapped = checkpointed_units(trainer.model)
    assert len(wrapped) == len(small_config().layers_block_type) + 1
    assert set(wrapped.values()) == {recompute != "none"}, wrapped
    assert local_head_weight(trainer.model) is trainer.model.lm_head.weight  # the fused loss still applies lm_head


def one_step(trainer):
    """The step's losses, the gradients it stepped with (after clipping) and the weights after AdamW."""
    seen = {}

    def capture(optimizer, args, kwargs):
        seen["grads"] = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}

    trainer.optimizer.register_step_pre_hook(capture)
    losses = {}

    class Losses(Hook):  # the step's logged values, as the metrics hook reads them
        def on_step_end(self, trainer, stats, decision):
            losses.update(stats.losses, mtp=stats.mtp_losses[0], grad_norm=stats.grad_norm)

    trainer.hooks.append(Losses())
    trainer.train()
    weights = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return losses, seen["grads"], weights


def unwrapped_names(tensors: dict) -> dict:
    return {name.replace("._checkpoint_wrapped_module", ""): value for name, value in tensors.items()}


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_keeps_the_pretraining_step(small_config, tmp_path, recompute):
    """fp32: the recomputed forward runs the same kernels on the same inputs, so the step is the same to rounding
    (1e-6 relative; on this CPU bit for bit)."""
    model = HybridLM(small_config(vocab_size=VOCAB))
    reference = one_step(pretraining_trainer(copy.deepcopy(model), tmp_path / "none"))
    checkpointed = one_step(pretraining_trainer(model, tmp_path / recompute, recompute=recompute))
    (losses, grads, weights), (losses_ac, grads_ac, weights_ac) = reference, checkpointed
    assert losses.keys() == losses_ac.keys() and losses["mtp"] > 0
    assert all(losses_ac[key] == pytest.approx(losses[key], rel=1e-6) for key in losses)
    for ours, theirs in ((grads, unwrapped_names(grads_ac)), (weights, unwrapped_names(weights_ac))):
        assert ours.keys() == theirs.keys()
        mismatched = [name for name in ours if not torch.allclose(theirs[name], ours[name], rtol=1e-6, atol=1e-9)]
        assert mismatched == []


class LargestLogits(TorchDispatchMode):
    """Records the most elements of any tensor an op creates (forward, recompute and backward alike) that has a
    dimension of the vocabulary's size: the logits, a block of them, or their gradient."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and self.vocab in tensor.shape:
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("compile_loss", [False, True])
def test_pretraining_loss_never_holds_the_logits_of_a_row(small_config, monkeypatch, recompute, compile_loss):
    """One process, lm_head local: the main head and the MTP depths go through `linear_cross_entropy` a block of rows
    at a time, with `train.compile`'s objective too (its compiled CE is for logits the loss never makes here). The
    probe sees the whole logits when the loss reads them (fused_head=False): it would see them on any path."""
    block_rows = 16
    monkeypatch.setattr(linear_cross_entropy_module, "BLOCK_ELEMENTS", block_rows * VOCAB)
    ids, labels = rows()
    model = HybridLM(small_config(vocab_size=VOCAB))
    weight_elements = model.lm_head.weight.numel()  # [V, D]: its gradient has the vocab as a dimension too
    model = parallelize(model, Parallel.single_process(), recompute=recompute)
    for fused_head in (True, False):
        # the control reads the logits eagerly: compiling its CE would only slow the test
        objective = PretrainObjective(compile_loss=compile_loss and fused_head, fused_head=fused_head)
        objective.begin_step([(ids, labels)])
        probe = LargestLogits(VOCAB)
        with probe:
            out = objective(model, (ids, labels))
            out.loss.backward()
        model.zero_grad(set_to_none=True)
        assert len(out.mtp_losses) == model.config.mtp_num_depths >= 1
        if fused_head:
            assert probe.largest <= max(block_rows * VOCAB, weight_elements), \
                f"a tensor of {probe.largest} elements has the vocab as a dimension"
        else:
            assert probe.largest == BATCH * LENGTH * VOCAB  # the control: the logits of the row are seen
