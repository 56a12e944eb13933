"""Objectives and batch sources: the two pieces of `Trainer` that change from one training stage to the next.

An objective turns one micro-batch into its share of the step's loss, plus what to log. The trainer sums the
backward of every micro-batch of a step, so each objective scales its loss so that the sum is the step's loss:
pretraining divides each micro-batch's mean CE by the number of micro-batches; a token-mean objective (SFT, GRPO,
MOPD) divides its token sum by the step's total count of valid tokens, which `begin_step` sees before any forward.

A batch source hands the trainer one step's micro-batches at a time and has a `state_dict` (its position), so that
a resumed run reads exactly the batches it would have read, and a rollback can skip a window of them.

Pretraining (`PretrainObjective`, `LoaderBatches`): loss = CE + mtp_loss_weight x mean over the MTP depths of
their CE (hybridtron.model.lm), on packed rows of the data mixture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # this micro-batch's share of the step's loss (the trainer calls backward on it)
    metrics: dict[str, torch.Tensor]  # detached scalars; the trainer logs their mean over the micro-batches
    tokens: int  # tokens this micro-batch trained on
    expert_counts: dict[str, torch.Tensor] = field(default_factory=dict)  # router name -> tokens per expert


class Objective(Protocol):
    headline: tuple[str, str]  # (metric key, label): what the progress bar shows

    def begin_step(self, micro_batches: list[Any]) -> None:
        """See the whole step before its first forward (e.g. to count its valid tokens)."""

    def __call__(self, model, micro_batch: Any) -> ObjectiveOutput: ...


class BatchSource(Protocol):
    def next_step(self) -> list[Any]:
        """The micro-batches of the next optimizer step."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def router_counts(model, out) -> dict[str, torch.Tensor]:
    """Expert counts of an `LMOutput` keyed by router name (`HybridLM.routers()`): backbone rows, then MTP rows."""
    rows = []
    for counts in (out.expert_counts, out.mtp_expert_counts):
        if counts is not None:
            rows.extend(counts.unbind(0))
    return dict(zip(model.routers(), rows))


class PretrainObjective:
    """Next-token CE plus the MTP depths' CE (`HybridLM.forward`'s loss), each micro-batch weighted equally."""

    headline = ("lm_loss", "ce")

    def __init__(self):
        self.micro_batches = 1

    def begin_step(self, micro_batches):
        self.micro_batches = len(micro_batches)

    def __call__(self, model, micro_batch):
        input_ids, labels = micro_batch
        out = model(input_ids, labels)
        metrics = {"loss": out.loss.detach(), "lm_loss": out.lm_loss.detach(),
                   **{f"mtp_loss_{d}": m.detach() for d, m in enumerate(out.mtp_losses, start=1)}}
        return ObjectiveOutput(out.loss / self.micro_batches, metrics, input_ids.numel(), router_counts(model, out))


class LoaderBatches:
    """`grad_accum` micro-batches per step from a resumable loader of (input_ids, labels) pairs."""

    def __init__(self, loader, grad_accum: int):
        self.loader, self.grad_accum = loader, grad_accum

    def next_step(self):
        return [next(self.loader) for _ in range(self.grad_accum)]

    def state_dict(self):
        return self.loader.state_dict()

    def load_state_dict(self, state):
        self.loader.load_state_dict(state)
