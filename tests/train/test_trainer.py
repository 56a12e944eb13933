"""`Trainer` with an objective and a batch source that are not pretraining's: the loop, checkpoints, resume, the
monitor and metrics are shared; only the two plugged-in pieces change."""

from __future__ import annotations

import json

import torch

from hybridtron.checkpoint.dcp import CheckpointManager
from hybridtron.model.lm import HybridLM
from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.train import hooks as H
from hybridtron.train.config import TrainConfig
from hybridtron.train.loop import Trainer
from hybridtron.train.objectives import BatchSource, ObjectiveOutput, router_counts


class CopyTask(BatchSource):
    """A batch source of its own: rows `prompt SEP prompt`, where only the copied half is a target (a toy SFT). The
    prompts use the first `alphabet` token ids: a few steps learn that much (the loss falls from ln(vocab) toward
    ln(alphabet)), where the copying itself would take hundreds."""

    def __init__(self, vocab: int, rows: int = 4, length: int = 6, micro_batches: int = 1, alphabet: int = 8):
        self.rows, self.length, self.micro_batches = rows, length, micro_batches
        self.ids_end = min(vocab, alphabet + 1)  # ids 1 .. alphabet (0 is the separator)
        self.position = 0

    def next_step(self):
        """The step's rows, a function of the step alone, split into `micro_batches` micro-batches."""
        generator = torch.Generator().manual_seed(1000 + self.position)
        self.position += 1
        prompt = torch.randint(1, self.ids_end, (self.rows, self.length), generator=generator)
        ids = torch.cat([prompt, torch.zeros(self.rows, 1, dtype=torch.long), prompt], dim=1)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, self.length:-1] = ids[:, self.length + 1:]  # predict the copy, not the prompt
        return list(zip(ids.chunk(self.micro_batches), labels.chunk(self.micro_batches)))

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class CopyObjective:
    """Token-mean CE over the step's valid targets, counted across its micro-batches in `begin_step`, so the
    gradient does not depend on how the step is split. No MTP loss: a second objective chooses its own terms."""

    headline = ("copy_ce", "copy ce")

    def begin_step(self, micro_batches):
        self.step_tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in micro_batches)

    def __call__(self, model, micro_batch):
        ids, labels = micro_batch
        out = model(ids)
        token_ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), labels.flatten(),
                                                     ignore_index=IGNORE_INDEX, reduction="sum")
        valid = int((labels != IGNORE_INDEX).sum())
        return ObjectiveOutput(token_ce / self.step_tokens, {"copy_ce": (token_ce / valid).detach()}, valid,
                               router_counts(model, out))


def make(tmp_path, small_config, *, steps, micro_batches=1, rows=4):
    model = HybridLM(small_config())
    config = TrainConfig(steps=steps, lr=3e-3, warmup_steps=2, checkpoint_every=4, val_every=1000,
                         grad_accum=micro_batches, maxvio_window=5)
    return Trainer(model, CopyObjective(), CopyTask(model.config.vocab_size, rows, micro_batches=micro_batches),
                   config, CheckpointManager(tmp_path / "checkpoints", keep=5), hooks=[H.MetricsLogger(tmp_path)])


def losses(path):
    return [json.loads(line)["copy_ce"] for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_a_second_objective_trains_checkpoints_and_resumes_bit_for_bit(tmp_path, small_config):
    torch.manual_seed(0)
    full = make(tmp_path / "full", small_config, steps=8)
    full.train()
    curve = losses(tmp_path / "full")
    assert len(curve) == 8 and curve[-1] < curve[0], curve
    assert [p.name for p in full.checkpoints.list()] == ["step_000004", "step_000008"]

    torch.manual_seed(0)
    first = make(tmp_path / "resumed", small_config, steps=8)
    first.train(until=4)
    first.checkpoints.wait()
    torch.manual_seed(123)  # the resumed run must not depend on the process's RNG
    second = make(tmp_path / "resumed", small_config, steps=8)
    second.load_checkpoint(second.checkpoints.latest())
    second.train()
    assert losses(tmp_path / "resumed") == curve


def test_the_token_mean_gradient_does_not_depend_on_grad_accum(tmp_path, small_config):
    grads = []
    for micro_batches in (1, 2, 4):
        torch.manual_seed(0)
        trainer = make(tmp_path / str(micro_batches), small_config, steps=1, micro_batches=micro_batches)
        trainer.objective.begin_step(step := trainer.batches.next_step())
        trainer.run_micro_batches(step)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads[2], grads[0], rtol=1e-5, atol=1e-7)
