"""Evaluators: what the trainer measures on held-out data at step 0, every `every` steps and at the end.

An evaluator returns named values for the step's metrics line and keeps its history (its `state_dict`), so the
first and last values of a resumed run are those of the whole run. `ValidationLoss` is the held-out next-token CE
(no MTP) that pretraining and SFT report.
"""

from __future__ import annotations

import torch

from hybridtron.ops.cross_entropy import cross_entropy_sum_and_count


class Evaluator:
    every: int

    def evaluate(self, trainer) -> dict[str, float]:
        raise NotImplementedError

    def due(self, step: int, total_steps: int) -> bool:
        return step % self.every == 0 or step == total_steps

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


class ValidationLoss(Evaluator):
    """Mean `lm_loss` (CE of the next token, the MTP depths apart) over fixed validation batches.

    `sum_over_shares` (context parallelism: each rank holds a share of every batch's positions): sums a tensor
    over the ranks sharing the batches, so each batch's CE is the mean over all its shares' targets."""

    key = "val_loss"

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], every: int, sum_over_shares=None):
        self.batches, self.every, self.sum_over_shares = batches, every, sum_over_shares
        self.history: list[tuple[int, float]] = []

    @torch.no_grad()
    def evaluate(self, trainer) -> dict[str, float]:
        model = trainer.model
        was_training = model.training
        model.eval()
        total = 0.0
        parallel = getattr(trainer, "parallel", None)
        pipeline = parallel.pipeline if parallel is not None else None  # pp > 1: stage by stage
        for input_ids, labels in self.batches:
            with trainer.autocast():
                if pipeline is not None:
                    total += pipeline.lm_loss(input_ids, labels, self.sum_over_shares)
                elif self.sum_over_shares is not None:
                    total += self._shared_lm_loss(model, input_ids, labels)
                else:
                    total += float(model(input_ids, labels, mtp=False).lm_loss)
        model.train(was_training)
        value = total / len(self.batches)
        self.history.append((trainer.step, value))
        return {self.key: value}

    def _shared_lm_loss(self, model, input_ids, labels) -> float:
        ce_sum, count = self.sum_over_shares(cross_entropy_sum_and_count(model(input_ids, mtp=False).logits,
                                                                         labels)).tolist()
        return ce_sum / count

    def state_dict(self):
        return {"history": list(self.history)}

    def load_state_dict(self, state):
        self.history = [tuple(x) for x in state["history"]]
