"""fp32 islands: code whose matmuls must stay fp32 inside a caller's `torch.autocast` region.

Autocast decides an op's dtype by its name, not by its inputs: under a bf16 autocast region `F.linear(x.float(), w)`
and every `@` / `bmm` of the SSD scan run in bf16 even when handed fp32 tensors. The router's scores (which decide
the top-k, and whose bias drifts to values near 2^6) and the scan (a recurrence that accumulates over thousands of
tokens) are specified in fp32, so they switch autocast off for their own body.
"""

from __future__ import annotations

import functools

import torch


def autocast_off(device_type: str):
    """A context in which autocast is off for `device_type`; a no-op (and ~free) when it is not on."""
    return torch.autocast(device_type, enabled=False)


def fp32_island(fn):
    """Decorator: run `fn` with autocast off on the device of its first tensor argument."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        device_type = next(a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        if not torch.is_autocast_enabled(device_type):  # the common case, without entering a context
            return fn(*args, **kwargs)
        with autocast_off(device_type):
            return fn(*args, **kwargs)
    return run
