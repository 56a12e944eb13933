"""Detectors: each judges one step's signals against its own rolling history of the steps whose update was applied
(skipped and abandoned steps never enter it). `check` reads the step's typed `StepStats`; `observe` commits an
accepted step.

    nonfinite        NaN or Inf in a loss, grad_norm or any wgrad_norm/<group>
    loss_spike       lm_loss > mean + loss_spike_sigma * std of the last `window` steps, and > mean * (1 + min_rel)
    wgrad_growth     grad_norm or wgrad_norm/lm_head > wgrad_growth_factor x its rolling median
    mtp_leads        an MTP depth's loss degrades while the main loss does not (Divergence 1's signature): the gap
                     g_d = mtp_loss_d - lm_loss (same batch, so the batch's difficulty cancels) spikes above
                     mean + mtp_lead_sigma * std while lm_loss itself is not spiking; or the EMA of mtp_loss_d rises
                     more than mtp_lead_rise above its running minimum while the EMA of lm_loss rose less than half
                     as much; judged from step mtp_lead_after on
    maxvio           a router's MaxVio > maxvio_share x its bound E/K (the report: 4.8 -> 12 of 23.27 before
                     trouble), every router including the MTP block's; judged from step min_history on
    residual_spread  log10(max / min residual RMS across layers) > residual_spread_orders (the report saw 4)

Thresholds are `MonitorConfig` fields (hybridtron.train.monitor.config).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

import numpy as np

from hybridtron.train.monitor.config import MonitorConfig
from hybridtron.train.stats import StepStats


@dataclass
class Finding:
    detector: str
    message: str
    key: str
    value: float
    threshold: float


class Rolling:
    """The last `size` finite values of a signal."""

    def __init__(self, size: int):
        self.values: collections.deque[float] = collections.deque(maxlen=size)

    def add(self, value) -> None:
        if value is not None and math.isfinite(value):
            self.values.append(float(value))

    def __len__(self) -> int:
        return len(self.values)

    def mean_std(self) -> tuple[float, float]:
        array = np.asarray(self.values)
        return float(array.mean()), float(array.std())

    def median(self) -> float:
        return float(np.median(np.asarray(self.values)))


class Detector:
    """Judges one step's `StepStats` against the history of accepted steps. `check` reads, `observe` commits."""

    name = ""

    def __init__(self, config: MonitorConfig):
        self.config = config

    def check(self, stats: StepStats) -> Finding | None:
        raise NotImplementedError

    def observe(self, stats: StepStats) -> None: ...

    def state_dict(self) -> dict:
        """The Rolling histories by attribute name (detectors with other state override this)."""
        return {key: list(value.values) for key, value in vars(self).items() if isinstance(value, Rolling)}

    def load_state_dict(self, state: dict) -> None:
        for key, values in state.items():
            rolling = getattr(self, key)
            rolling.values.clear()
            rolling.values.extend(values)


def mtp_depth_losses(stats: StepStats) -> dict[str, float]:
    """`mtp_loss_<d>` -> the step's loss of MTP depth d (the names the metrics and the detectors' state use); a
    depth without targets this step is left out."""
    return stats.depth_losses()


class NonFinite(Detector):
    name = "nonfinite"

    def check(self, stats):
        values = {key: stats.losses[key] for key in ("loss", "lm_loss") if key in stats.losses}
        values.update(mtp_depth_losses(stats))
        values["grad_norm"] = stats.grad_norm
        values.update({f"wgrad_norm/{group}": norm for group, norm in stats.group_grad_norms.items()})
        bad = [key for key, value in values.items() if not math.isfinite(value)]
        if bad:
            return Finding(self.name, f"non-finite {', '.join(bad[:6])}{' ...' if len(bad) > 6 else ''}",
                           bad[0], values[bad[0]], float("inf"))
        return None


class LossSpike(Detector):
    name = "loss_spike"

    def __init__(self, config):
        super().__init__(config)
        self.history = Rolling(config.window)

    def check(self, stats):
        value = stats.losses.get("lm_loss")
        if value is None or len(self.history) < self.config.min_history:
            return None
        mean, std = self.history.mean_std()
        threshold = max(mean + self.config.loss_spike_sigma * std, mean * (1 + self.config.loss_spike_min_rel))
        if value > threshold:
            return Finding(self.name, f"lm_loss {value:.4g} > {threshold:.4g} (mean {mean:.4g} + "
                           f"{self.config.loss_spike_sigma:g} sigma {std:.3g})", "lm_loss", value, threshold)
        return None

    def observe(self, stats):
        self.history.add(stats.losses.get("lm_loss"))


class WgradGrowth(Detector):
    """The global gradient norm and the output layer's (`wgrad_norm/lm_head`), each against its rolling median."""

    name = "wgrad_growth"

    def __init__(self, config):
        super().__init__(config)
        self.histories = {key: Rolling(config.window) for key in ("grad_norm", "wgrad_norm/lm_head")}

    @staticmethod
    def _norms(stats) -> dict[str, float | None]:
        return {"grad_norm": stats.grad_norm, "wgrad_norm/lm_head": stats.group_grad_norms.get("lm_head")}

    def check(self, stats):
        for key, value in self._norms(stats).items():
            history = self.histories[key]
            if value is None or len(history) < self.config.min_history:
                continue
            threshold = self.config.wgrad_growth_factor * history.median()
            if value > threshold:
                return Finding(self.name, f"{key} {value:.4g} > {self.config.wgrad_growth_factor:g} x rolling "
                               f"median {history.median():.4g}", key, value, threshold)
        return None

    def observe(self, stats):
        for key, value in self._norms(stats).items():
            self.histories[key].add(value)

    def state_dict(self):
        return {"histories": {key: list(h.values) for key, h in self.histories.items()}}

    def load_state_dict(self, state):
        for key, values in state["histories"].items():
            self.histories[key].values.clear()
            self.histories[key].values.extend(values)


class MtpLeads(Detector):
    """An MTP depth's loss degrading while the main loss is not (see the module docstring): a spike of the per-step
    gap mtp_loss_d - lm_loss, or a rise of the smoothed mtp_loss_d above its own running minimum."""

    name = "mtp_leads"

    def __init__(self, config):
        super().__init__(config)
        self.gaps: dict[str, Rolling] = {}
        self.main = Rolling(config.window)
        self.ema: dict[str, float] = {}  # smoothed lm_loss and mtp_loss_<d>
        self.ema_min: dict[str, float] = {}
        self.seen = 0

    def _smoothed(self, key: str, value: float) -> float:
        beta = self.config.mtp_lead_ema
        return beta * self.ema[key] + (1 - beta) * value

    def check(self, stats):
        cfg, lm = self.config, stats.losses.get("lm_loss")
        if (lm is None or stats.step <= cfg.mtp_lead_after or self.seen < cfg.min_history
                or "lm_loss" not in self.ema_min):
            return None
        main_mean, main_std = self.main.mean_std()
        main_spiking = lm > main_mean + cfg.mtp_lead_sigma * main_std
        main_rise = self._smoothed("lm_loss", lm) / self.ema_min["lm_loss"] - 1
        for key, value in mtp_depth_losses(stats).items():
            if key not in self.ema_min:
                continue
            gap = value - lm
            mean, std = self.gaps[key].mean_std()
            threshold = mean + cfg.mtp_lead_sigma * std
            if gap > threshold and not main_spiking:
                return Finding(self.name, f"{key} - lm_loss = {gap:.4g} > {threshold:.4g} (mean {mean:.4g} + "
                               f"{cfg.mtp_lead_sigma:g} sigma) while lm_loss is not spiking", key, gap, threshold)
            rise = self._smoothed(key, value) / self.ema_min[key] - 1
            if rise > cfg.mtp_lead_rise and main_rise < rise / 2:
                return Finding(self.name, f"smoothed {key} {rise:.1%} above its minimum, lm_loss {main_rise:.1%}",
                               key, rise, cfg.mtp_lead_rise)
        return None

    def observe(self, stats):
        lm = stats.losses.get("lm_loss")
        if lm is None:
            return
        values = {"lm_loss": lm, **mtp_depth_losses(stats)}
        if not all(math.isfinite(v) for v in values.values()):
            return
        self.main.add(lm)
        for key, value in values.items():
            if key != "lm_loss":
                self.gaps.setdefault(key, Rolling(self.config.window)).add(value - lm)
            self.ema[key] = self._smoothed(key, value) if key in self.ema else value
            # the minimum counts once the first, fastest-learning steps are past
            if self.seen >= self.config.min_history:
                self.ema_min[key] = min(self.ema_min.get(key, math.inf), self.ema[key])
        self.seen += 1

    def state_dict(self):
        return {"main": list(self.main.values), "gaps": {k: list(v.values) for k, v in self.gaps.items()},
                "ema": dict(self.ema), "ema_min": dict(self.ema_min), "seen": self.seen}

    def load_state_dict(self, state):
        self.main.values.clear()
        self.main.values.extend(state["main"])
        self.gaps = {}
        for key, values in state["gaps"].items():
            self.gaps[key] = Rolling(self.config.window)
            self.gaps[key].values.extend(values)
        self.ema, self.ema_min, self.seen = dict(state["ema"]), dict(state["ema_min"]), state["seen"]


class MaxVio(Detector):
    """Every router's MaxVio (the report's max/mean definition, `StepStats.maxvio`) above a share of E/K."""

    name = "maxvio"

    def __init__(self, config, bound: float):
        super().__init__(config)
        self.bound = bound

    def check(self, stats):
        if stats.step <= self.config.min_history:  # the router biases have not had time to balance yet
            return None
        threshold = self.config.maxvio_share * self.bound
        for router, value in sorted(stats.maxvio.items()):
            if value > threshold:
                return Finding(self.name, f"maxvio/{router} {value:.3g} > {self.config.maxvio_share:g} x bound "
                               f"{self.bound:.4g}", f"maxvio/{router}", value, threshold)
        return None


class ResidualSpread(Detector):
    name = "residual_spread"

    def check(self, stats):
        values = [v for v in stats.residual_rms.values() if v > 0 and math.isfinite(v)]
        if len(values) < 2:
            return None
        orders = math.log10(max(values) / min(values))
        if orders > self.config.residual_spread_orders:
            return Finding(self.name, f"residual RMS spans {orders:.2f} orders of magnitude across layers "
                           f"(min {min(values):.3g}, max {max(values):.3g})", "residual_rms", orders,
                           self.config.residual_spread_orders)
        return None
