"""Fault injection, for tests and drills only (off by default): `monitor.inject_fault = "KIND@STEP[,KIND@STEP...]"`.

    lr_spike       the LR x inject_lr_factor for that step's update
    corrupt_batch  that step's batches replaced by random tokens whose labels are all one never-seen token (the last
                   vocabulary id, whose probability keeps falling): a huge-loss batch. Random labels alone cost only
                   about log(vocab), within the noise of a small batch
    nan_grad       a NaN in one element of the final norm's weight gradient (every token's gradient passes there)
    router_bias    after that step's update, the first router's bias of expert 0 raised by inject_router_bias, so
                   that expert takes every token

The trainer calls the injector where a fault enters (`lr_factor` before the update, `after_update` after it);
`attach` registers the gradient hook; the run's batch source is wrapped once, when the run is built
(`wrap_batches`). Each fault fires once per run, even if a rollback re-runs its step.
"""

from __future__ import annotations

import torch

from hybridtron.train.monitor.config import MonitorConfig, parse_faults


class FaultInjector:
    def __init__(self, config: MonitorConfig, events):
        self.config = config
        self.events = events
        self.faults = parse_faults(config.inject_fault)
        self.fired: set[str] = set()
        self.step = 0  # the step being computed (counted from 1)
        self.handle = None

    def due(self, kind: str, step: int) -> bool:
        return kind in self.faults.get(step, []) and f"{kind}@{step}" not in self.fired

    def fire(self, kind: str, step: int) -> None:
        self.fired.add(f"{kind}@{step}")
        self.events.write(step, "inject", kind, "fault injected (monitor.inject_fault)")

    def attach(self, model) -> None:
        self.handle = model.backbone.norm_f.weight.register_hook(self._poison)

    def detach(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def begin_step(self, step: int) -> None:
        self.step = step

    def _poison(self, grad):
        if not self.due("nan_grad", self.step):
            return grad
        self.fire("nan_grad", self.step)
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    def wrap_batches(self, batches, vocab_size: int) -> "CorruptingBatches":
        return CorruptingBatches(batches, self, vocab_size)

    def lr_factor(self) -> float:
        if self.due("lr_spike", self.step):
            self.fire("lr_spike", self.step)
            return self.config.inject_lr_factor
        return 1.0

    @torch.no_grad()
    def after_update(self, model) -> None:
        if self.due("router_bias", self.step):
            self.fire("router_bias", self.step)
            model.router_biases()[0][0] += self.config.inject_router_bias

    def state_dict(self) -> dict:
        return {"fired": sorted(self.fired)}

    def load_state_dict(self, state: dict) -> None:
        self.fired |= set(state["fired"])  # a rollback must not re-arm a fault that already fired


class CorruptingBatches:
    """A batch source of (input_ids, labels) micro-batches whose corrupt_batch steps come back as garbage."""

    def __init__(self, batches, injector: FaultInjector, vocab_size: int):
        self.batches, self.injector, self.vocab_size = batches, injector, vocab_size

    def next_step(self):
        micro_batches = self.batches.next_step()
        step = self.injector.step
        if not self.injector.due("corrupt_batch", step):
            return micro_batches
        self.injector.fire("corrupt_batch", step)
        generator = torch.Generator().manual_seed(1234)
        return [(torch.randint(0, self.vocab_size, ids.shape, generator=generator).to(ids.device),
                 torch.full_like(labels, self.vocab_size - 1)) for ids, labels in micro_batches]

    def state_dict(self):
        return self.batches.state_dict()

    def load_state_dict(self, state):
        self.batches.load_state_dict(state)
