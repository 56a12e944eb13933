"""Held-out cross entropy: the one computation behind every validation loss (pretraining's, SFT's, the pipeline's
stage evaluation), and the `Evaluator` protocol the trainer runs at step 0, every `every` steps and at the end.

An evaluator returns named values for the step's metrics line and keeps its history (its `state_dict`), so the
first and last values of a resumed run are those of the whole run. `HeldOutLoss` is the next-token CE of fixed
held-out batches (the MTP depths apart), over their labelled tokens: packed pretraining rows (labels masked at
document boundaries) and SFT conversations (labels only on the assistant's tokens) alike.
"""

from __future__ import annotations

import contextlib

import torch

from hybridtron.data.batch import as_token_batch
from hybridtron.ops.cross_entropy import IGNORE_INDEX, cross_entropy_sum_and_count


class Evaluator:
    key: str
    every: int

    def __init__(self):
        self.history: list[tuple[int, float]] = []  # (step, the value under `key`)

    def evaluate(self, trainer) -> dict[str, float]:
        raise NotImplementedError

    def due(self, step: int, total_steps: int) -> bool:
        return step % self.every == 0 or step == total_steps

    @property
    def state_name(self) -> str:
        """Its name in a checkpoint (one name per evaluator of a run)."""
        return type(self).__name__

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history = [tuple(x) for x in state["history"]]


@torch.no_grad()
def held_out_ce(model, batches, *, autocast=contextlib.nullcontext, pipeline=None, sum_over_shares=None,
                device=None) -> list[tuple[float, float]]:
    """(CE summed over the labelled next-token targets, their count) of each batch (a `TokenBatch`: its seq_idx, if
    any, goes to the model), the MTP depths apart; `model` is put in eval mode for the duration. `labels` are
    already shifted (labels[t] is what position t predicts) and IGNORE_INDEX where nothing is scored.

    `pipeline` (pp > 1): the batch runs stage by stage and its mean comes back to every stage. `sum_over_shares`
    (context parallelism: each rank holds a share of every batch's positions): sums a tensor over the ranks sharing
    the batches, so the sum and the count are those of the whole batch. `device`: where the batches go first."""
    was_training = model.training
    model.eval()
    share_sum = sum_over_shares or (lambda tensor: tensor)
    results = []
    for batch in map(as_token_batch, batches):
        if device is not None:
            batch = batch.to(device)
        labels = batch.labels
        with autocast():
            if pipeline is not None:  # the mean over the batch (all its shares), known to every stage
                count = float(share_sum((labels != IGNORE_INDEX).sum().double()))
                ce = pipeline.lm_loss(batch.input_ids, labels, sum_over_shares, seq_idx=batch.seq_idx)
                results.append((ce * count, count))
            else:
                logits = model(batch.input_ids, mtp=False, **batch.model_inputs()).logits
                ce_sum, count = share_sum(cross_entropy_sum_and_count(logits, labels)).tolist()
                results.append((ce_sum, count))
    model.train(was_training)
    return results


class HeldOutLoss(Evaluator):
    """`val_loss`: the held-out next-token CE over the labelled tokens of fixed batches, summed and divided by
    their count (an SFT batch holds as many assistant tokens as its conversations have, so batches weigh by their
    tokens). `per_batch_mean`: instead the mean of each batch's own mean, pretraining's definition since its first
    run (its figures in BENCHMARKS.md and the golden curve's step-0 loss are of that kind).

    `sum_over_shares` (context parallelism): see `held_out_ce`. `key`: the metric's name (a run with several
    held-out sets names the others; the first evaluator's `val_loss` is the one the monitor and summary read)."""

    def __init__(self, batches, every: int, sum_over_shares=None, *, per_batch_mean: bool = False,
                 key: str = "val_loss"):
        super().__init__()
        self.key = key
        self.batches, self.every, self.sum_over_shares = batches, every, sum_over_shares
        self.per_batch_mean = per_batch_mean

    @property
    def state_name(self) -> str:
        return "HeldOutLoss" if self.key == "val_loss" else f"HeldOutLoss:{self.key}"

    def evaluate(self, trainer) -> dict[str, float]:
        parallel = trainer.parallel
        results = held_out_ce(trainer.model, self.batches, autocast=trainer.autocast,
                              pipeline=parallel.pipeline, sum_over_shares=self.sum_over_shares,
                              device=parallel.device)
        if self.per_batch_mean:
            value = sum(ce_sum / count for ce_sum, count in results) / len(results)
        else:
            value = sum(ce_sum for ce_sum, _ in results) / sum(count for _, count in results)
        self.history.append((trainer.step, value))
        return {self.key: value}
