"""The monitor's own signals: what the report's divergences showed, beyond the losses and gradient norms that every
step records (`hybridtron.train.stats`) and MaxVio (`hybridtron.train.balance`).

    residual_rms/<i>           RMS of the residual stream after block i (forward hooks, sampled steps), averaged over
                               the step's micro-batches; evaluation forwards are not counted
    underflow/<module>         share of non-zero fprop operand values that quantization flushed to zero, per
                               quantized linear or grouped matmul (only when the model has any; sampled steps)
    update_ratio[/lm_head]     ||W_after - W_before|| / ||W_before|| of the step's update (sampled steps)
    router_bias_spread/<name>  max - min of each router's aux-loss-free balancing bias after the step

A signal is measured in two phases of a step: `measure` after the backward, before the update (what the detectors
judge), and `after_update` once the update is applied or dropped (what only exists then). `begin_step` arms the
sampled ones before the step's forwards.
"""

from __future__ import annotations

import math

import torch

from hybridtron.distributed.step import global_grad_norms
from hybridtron.numerics.linear import QuantizedGroupedMM, QuantLinear
from hybridtron.train.stats import StepStats, parameter_group


def sampled(step: int, every: int) -> bool:
    """Sampled signals are measured on step 1 (a baseline) and every `every`-th step (steps count from 1)."""
    return step == 1 or step % every == 0


class Signal:
    def attach(self, trainer) -> None:
        """At the start of training: find the modules to watch, register forward hooks."""

    def detach(self) -> None: ...

    def begin_step(self, trainer, step: int) -> None: ...

    def measure(self, trainer, stats: StepStats) -> dict[str, float]:
        return {}

    def after_update(self, trainer, stats: StepStats, applied: bool) -> dict[str, float]:
        return {}


class ResidualRMS(Signal):
    def __init__(self, every: int):
        self.every = every
        self.armed = False
        self.handles = []
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}

    def attach(self, trainer):
        for index, layer in enumerate(trainer.model.backbone.layers):
            self.handles.append(layer.register_forward_hook(self._record(index)))

    def detach(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _record(self, index: int):
        def hook(module, inputs, output):
            if self.armed and module.training:
                mean_square = output.detach().float().pow(2).mean()
                self.sums[index] = self.sums.get(index, 0.0) + mean_square
                self.counts[index] = self.counts.get(index, 0) + 1
        return hook

    def begin_step(self, trainer, step):
        self.armed = sampled(step, self.every)

    def measure(self, trainer, stats):
        keys = sorted(self.sums)
        # every rank of a stage holds as many of its own tokens: the mean of the ranks' means
        means = trainer.parallel.mean_over_tokens([float(self.sums[i]) / self.counts[i] for i in keys])
        self.sums, self.counts, self.armed = {}, {}, False
        stats.residual_rms = trainer.parallel.merge_over_stages({i: math.sqrt(v) for i, v in zip(keys, means)})
        return {}


def quantized_modules(model: torch.nn.Module) -> dict[str, object]:
    """Every emulated 4- or 8-bit GEMM of the model (the precision policy's NVFP4 and MXFP8 modules; its BF16
    ones flush next to nothing): name -> QuantLinear or the RoutedExperts' quantized grouped matmul (named
    `<experts>.grouped_mm`)."""

    found = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear) and module.recipe.format != "bf16":
            found[name] = module
        grouped = getattr(module, "grouped_mm", None)
        if isinstance(grouped, QuantizedGroupedMM) and grouped.recipe.format != "bf16":
            found[f"{name}.grouped_mm"] = grouped
    return found


class Underflow(Signal):
    """Reads the numerics' UnderflowStats, switched on only for the training forwards of sampled steps; a model
    without quantized modules reports nothing."""

    def __init__(self, every: int):
        self.every = every
        self.modules: dict[str, object] = {}
        self.armed = False

    def attach(self, trainer):
        self.modules = quantized_modules(trainer.model)

    def _enable(self, enabled: bool) -> None:
        for module in self.modules.values():
            module.stats.enabled = enabled

    def begin_step(self, trainer, step):
        self.armed = bool(self.modules) and sampled(step, self.every)
        self._enable(self.armed)

    def measure(self, trainer, stats):
        if not self.armed:
            return {}
        self._enable(False)
        self.armed = False
        values = {}
        for name, module in self.modules.items():
            values[f"underflow/{name}"] = module.stats.zero_fraction
            module.stats.reset()
        return values


class UpdateRatio(Signal):
    """Copies the weights before the update of a sampled step and compares them after it; a dropped update reports
    nothing."""

    def __init__(self, every: int):
        self.every = every
        self.before: list[tuple[str, torch.Tensor, torch.Tensor]] | None = None

    def measure(self, trainer, stats):
        self.before = None
        if stats.step % self.every == 0:
            self.before = [(name, p, p.detach().clone()) for name, p in trainer.model.named_parameters()
                           if p.grad is not None]
        return {}

    @torch.no_grad()
    def after_update(self, trainer, stats, applied):
        before, self.before = self.before, None
        if before is None or not applied:
            return {}
        if trainer.parallel.distributed:  # sharded weights on several meshes: norms from shards
            return self._distributed(trainer.parallel, before)
        # whole weights: float64 norms of the whole tensors (the sharded path's float32 result would round them)
        names = [name for name, _, _ in before]
        deltas = torch.stack(torch._foreach_norm(torch._foreach_sub([p for _, p, _ in before],
                                                                    [old for _, _, old in before]))).double()
        weights = torch.stack(torch._foreach_norm([old for _, _, old in before])).double()
        values = {"update_ratio": float(deltas.pow(2).sum().sqrt() / weights.pow(2).sum().sqrt().clamp_min(1e-30))}
        head = torch.tensor([parameter_group(name) == "lm_head" for name in names], device=deltas.device)
        if head.any():
            values["update_ratio/lm_head"] = float(deltas[head].pow(2).sum().sqrt()
                                                   / weights[head].pow(2).sum().sqrt().clamp_min(1e-30))
        return values


    @staticmethod
    def _distributed(parallel, before) -> dict[str, float]:

        def head_or_rest(name):
            return "lm_head" if parameter_group(name) == "lm_head" else "rest"

        delta, delta_groups = global_grad_norms([(name, p.detach() - old) for name, p, old in before], parallel,
                                                head_or_rest)
        weight, weight_groups = global_grad_norms([(name, old) for name, _, old in before], parallel, head_or_rest)
        values = {"update_ratio": float(delta / weight.clamp_min(1e-30))}
        if "lm_head" in delta_groups:
            values["update_ratio/lm_head"] = delta_groups["lm_head"] / max(weight_groups["lm_head"], 1e-30)
        return values


class RouterBiasSpread(Signal):
    def after_update(self, trainer, stats, applied):
        values = {f"router_bias_spread/{name}": float(moe.gate.e_score_correction_bias.max()
                                                      - moe.gate.e_score_correction_bias.min())
                  for name, moe in trainer.model.routers().items()}
        return trainer.parallel.merge_over_stages(values)  # under PP each stage holds its own routers
