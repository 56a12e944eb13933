"""Warmup-stable-decay (WSD) learning-rate schedule, with `anneal_now` to start the decay early.

    lr(step) = peak * step / warmup                                   during warmup
             = peak                                                   while stable
             = peak * (min_ratio + (1 - min_ratio) * remaining/decay)  linearly to min_ratio over the decay

`anneal_now(step, total)` is what the Ultra report did at 15T tokens after its second divergence: start the decay at
once and cut the total budget. The schedule is a pure function of the step plus those two numbers, which are its
state_dict.
"""

from __future__ import annotations


class WSDSchedule:
    def __init__(self, peak_lr: float, total_steps: int, warmup_steps: int, decay_fraction: float,
                 min_lr_ratio: float = 0.0):
        self.peak_lr, self.warmup_steps, self.min_lr_ratio = peak_lr, warmup_steps, min_lr_ratio
        self.total_steps = total_steps
        self.decay_start = total_steps - round(decay_fraction * total_steps)

    def lr(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        if step < self.decay_start:
            return self.peak_lr
        decay_steps = max(self.total_steps - self.decay_start, 1)
        remaining = max(self.total_steps - step, 0) / decay_steps
        return self.peak_lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * remaining)

    def anneal_now(self, step: int, total_steps: int) -> None:
        """Begin the decay at `step` and end the run at `total_steps` (<= the planned total)."""
        if not step <= total_steps:
            raise ValueError(f"anneal_now: total_steps {total_steps} is before the current step {step}")
        self.decay_start, self.total_steps = step, total_steps

    def state_dict(self) -> dict:
        return {"decay_start": self.decay_start, "total_steps": self.total_steps}

    def load_state_dict(self, state: dict) -> None:
        self.decay_start, self.total_steps = state["decay_start"], state["total_steps"]
