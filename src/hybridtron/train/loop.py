"""The training loop. `Trainer.train` fits on one screen; the rest of a run is hooks (see hooks.py).

One optimizer step: `grad_accum` micro-batches (gradients summed in fp32), loss = CE + MTP, clip, AdamW with the
warmup-stable-decay schedule, then the aux-loss-free router-bias update from this step's global expert loads.
"""

from __future__ import annotations

import contextlib
import random
import time

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hybridtron.checkpoint.dcp import CheckpointManager
from hybridtron.model.lm import HybridLM
from hybridtron.numerics.linear import load_sr_generator_states, sr_generator_states
from hybridtron.numerics.grad_accum import flush_main_grads
from hybridtron.train.balance import update_router_biases
from hybridtron.train.config import TrainConfig
from hybridtron.train.hooks import Hooks
from hybridtron.train.schedule import WSDSchedule


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (norm weights, biases and Mamba's per-head A, D, dt_bias are exempt)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                             foreach=True)


class Trainer:
    def __init__(self, model: HybridLM, loader, config: TrainConfig, hooks: list, checkpoints: CheckpointManager):
        self.model, self.loader, self.config = model, loader, config
        self.optimizer = build_optimizer(model, config)
        self.schedule = self.new_schedule()
        self.hooks = Hooks(hooks)
        self.checkpoints = checkpoints
        self.step = 0
        self.moe_layer_ids = [i for i, layer in enumerate(model.backbone.layers) if layer.kind == "moe"]
        self.logger = None  # the MetricsLogger hook, if any, for lines outside the step (step-0 validation)

    def new_schedule(self) -> WSDSchedule:
        cfg = self.config
        return WSDSchedule(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.decay_fraction, cfg.min_lr_ratio)

    def autocast(self):
        if self.config.precision == "bf16":
            return torch.autocast("cpu" if not torch.cuda.is_available() else "cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train(self, until: int | None = None) -> None:
        """Train to the schedule's end, or to step `until` (a branch continuing a checkpoint for a window)."""
        cfg, model = self.config, self.model
        model.train()
        self.hooks.on_train_start(self)
        while self.step < (self.schedule.total_steps if until is None else until):
            started, lr = time.perf_counter(), self.schedule.lr(self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            losses, counts = [], None
            for _ in range(cfg.grad_accum):
                input_ids, labels = next(self.loader)
                with self.autocast():
                    out = model(input_ids, labels)
                (out.loss / cfg.grad_accum).backward()
                losses.append([out.loss.detach(), out.lm_loss.detach(), *[m.detach() for m in out.mtp_losses]])
                counts = out.expert_counts if counts is None else counts + out.expert_counts
            flush_main_grads(model)  # an output layer accumulating in grad_accum_dtype hands its gradient over
            loss, lm_loss, *mtp = torch.tensor(losses).mean(0).tolist()
            grad_norm = self.clip_gradients()
            metrics = {"step": self.step + 1, "loss": loss, "lm_loss": lm_loss, "lr": lr, "grad_norm": grad_norm,
                       **{f"mtp_loss_{d}": v for d, v in enumerate(mtp, start=1)}}
            if self.hooks.after_backward(self, metrics):
                self.optimizer.step()
                if counts is not None:
                    update_router_biases(model.router_biases(), counts.clone(), cfg.router_bias_rate)
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            metrics["tokens_per_s"] = cfg.grad_accum * input_ids.numel() / (time.perf_counter() - started)
            metrics["expert_counts"] = counts
            self.hooks.on_step_end(self, metrics)
        self.hooks.on_train_end(self)

    def clip_gradients(self) -> float:
        """Clip to `grad_clip` by the global norm; returns the norm before clipping. A non-finite norm leaves the
        gradients untouched: scaling by NaN would smear one layer's NaN over every layer and hide where it began
        (the monitor names the groups whose gradients are not finite)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if self.config.grad_clip and torch.isfinite(norm):
            torch.nn.utils.clip_grads_with_norm_(params, self.config.grad_clip, norm)
        return float(norm)

    def log(self, metrics: dict) -> None:
        if self.logger is not None:
            self.logger.write(metrics)

    # ------------------------------------------------------------------------------------------ checkpoints
    def tensor_state(self) -> dict:
        """Model and optimizer state keyed by parameter name (DCP's form; it also gives a fresh optimizer the
        state tensors a load fills in)."""
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "schedule": self.schedule.state_dict(),
            "loader": self.loader.state_dict(),
            "hooks": self.hooks.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                    "stochastic_rounding": sr_generator_states(self.model)},
        }

    def save_checkpoint(self, blocking: bool = False):
        return self.checkpoints.save(self.step, self.tensor_state(), self.trainer_state(), blocking=blocking)

    def load_checkpoint(self, path) -> None:
        self.checkpoints.wait()
        tensors = self.tensor_state()
        state = self.checkpoints.load(path, tensors)
        set_state_dict(self.model, self.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict=tensors["optimizer"])
        self.step = state["step"]
        self.schedule.load_state_dict(state["schedule"])
        self.loader.load_state_dict(state["loader"])
        self.hooks.load_state_dict(state["hooks"])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        load_sr_generator_states(self.model, state["rng"]["stochastic_rounding"])
