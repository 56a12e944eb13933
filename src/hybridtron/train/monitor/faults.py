"""Fault injection, for tests and drills only (off by default): `monitor.inject_fault = "KIND@STEP[,KIND@STEP...]"`.

    lr_spike       the LR x inject_lr_factor for that step's update
    corrupt_batch  that step's batches replaced by random tokens whose labels are all one never-seen token (the padding
                   id: packed pretraining rows never predict it, so its probability keeps falling): a huge-loss batch.
                   Random labels alone cost only about log(vocab), within the noise of a small batch; the last
                   vocabulary id, used before, is an ordinary merge of some tokenizers
    nan_grad       a NaN in one element of the final norm's weight gradient (every token's gradient passes there)
    router_bias    after that step's update, the first router's bias of expert 0 raised by inject_router_bias, so
                   that expert takes every token

The injector wraps the training loop from outside, so the loop carries no drill code: the run's batch source is
wrapped once, when the run is built (`wrap_batches`); as a hook it installs a pre-hook on the optimizer's step (and,
for nan_grad, a gradient hook on the final norm's weight) when training starts, and moves the router bias when a step with an
applied update ends. Each fault fires once per run, even if a rollback re-runs its step (its `state_dict` is the
set of faults fired).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from hybridtron.data.batch import as_token_batch
from hybridtron.train.hooks import Hook
from hybridtron.train.monitor.config import MonitorConfig, parse_faults


class FaultInjector(Hook):
    def __init__(self, config: MonitorConfig, events):
        self.config = config
        self.events = events
        self.faults = parse_faults(config.inject_fault)
        self.fired: set[str] = set()
        self.trainer = None
        self.handles = []

    def current_step(self) -> int:
        """The step being computed (counted from 1): the trainer counts a step once its update is done."""
        return self.trainer.step + 1 if self.trainer is not None else 1

    def due(self, kind: str, step: int) -> bool:
        return kind in self.faults.get(step, []) and f"{kind}@{step}" not in self.fired

    def fire(self, kind: str, step: int) -> None:
        self.fired.add(f"{kind}@{step}")
        self.events.write(step, "inject", kind, "fault injected (monitor.inject_fault)")

    # ------------------------------------------------------------------------------------ installed hooks
    def on_train_start(self, trainer) -> None:
        self.trainer = trainer
        kinds = {kind for kinds in self.faults.values() for kind in kinds}
        self.handles = [trainer.optimizer.register_step_pre_hook(self._spike_lr)]
        if "nan_grad" in kinds:  # the final norm may be frozen (MTP boosting): hook it only for this fault
            self.handles.append(trainer.model.backbone.norm_f.weight.register_hook(self._poison_gradient))

    def on_train_end(self, trainer) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _poison_gradient(self, grad):
        step = self.current_step()
        if not self.due("nan_grad", step):
            return grad
        self.fire("nan_grad", step)
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    def _spike_lr(self, optimizer, args, kwargs) -> None:
        step = self.current_step()
        if self.due("lr_spike", step):  # the schedule sets every group's LR again before the next update
            self.fire("lr_spike", step)
            for group in optimizer.param_groups:
                group["lr"] *= self.config.inject_lr_factor

    @torch.no_grad()
    def on_step_end(self, trainer, stats, decision) -> None:
        """After the update and the routers' own balancing move (a dropped update is left alone)."""
        if decision.applies and self.due("router_bias", stats.step):
            self.fire("router_bias", stats.step)
            trainer.model.router_biases()[0][0] += self.config.inject_router_bias

    def wrap_batches(self, batches, vocab_size: int, never_target_id: int) -> "CorruptingBatches":
        return CorruptingBatches(batches, self, vocab_size, never_target_id)

    def state_dict(self) -> dict:
        return {"fired": sorted(self.fired)}

    def load_state_dict(self, state: dict) -> None:
        self.fired |= set(state["fired"])  # a rollback must not re-arm a fault that already fired


class CorruptingBatches:
    """A batch source of `TokenBatch` micro-batches whose corrupt_batch steps come back as garbage (the ids and
    labels replaced; the rest, seq_idx among it, kept)."""

    def __init__(self, batches, injector: FaultInjector, vocab_size: int, never_target_id: int):
        self.batches, self.injector, self.vocab_size = batches, injector, vocab_size
        self.never_target_id = never_target_id

    def next_step(self):
        micro_batches = self.batches.next_step()
        step = self.injector.current_step()
        if not self.injector.due("corrupt_batch", step):
            return micro_batches
        self.injector.fire("corrupt_batch", step)
        generator = torch.Generator().manual_seed(1234)
        return [replace(batch, input_ids=torch.randint(0, self.vocab_size, batch.input_ids.shape,
                                                       generator=generator).to(batch.input_ids.device),
                        labels=torch.full_like(batch.labels, self.never_target_id))
                for batch in map(as_token_batch, micro_batches)]

    def sync_weights(self, model, version: int, total_steps: int) -> None:
        self.batches.sync_weights(model, version, total_steps)

    def state_dict(self):
        return self.batches.state_dict()

    def load_state_dict(self, state):
        self.batches.load_state_dict(state)
