"""The training loop: one `Trainer` for every objective (pretraining; SFT, GRPO, MOPD and MTP boosting in
hybridtron.post).

One optimizer step, as `Trainer.train` reads:

1. forward and backward of each of the step's micro-batches (the batch source gives them, the objective turns each
   into its share of the loss); the output layer's fp32/bf16 gradient accumulation is flushed;
2. the gradient norms before clipping (global and per parameter group), then clipping to `grad_clip`;
3. MaxVio of every router, from this step's globally reduced expert counts;
4. the stability monitor judges the step: apply, skip, or roll back (hybridtron.train.monitor);
5. if applied: the optimizer (`train.optimizer`, hybridtron.train.optimizers) with the warmup-stable-decay LR, then
   every router's bias moves toward balance;
6. evaluations that are due, then the hooks observe the finished step (metrics, progress bar);
7. a rollback is carried out here (`roll_back`), otherwise a checkpoint is written when due;
8. a stop that a signal asked for (Ctrl-C, SIGTERM) is carried out: a checkpoint, then `RunInterrupted`;
9. the batch source gets the weights the next batches are to be sampled with (`sync_weights`: in RL the rollout
   role's policy; a data loader ignores them).

Everything that decides what a step does is in this file; hooks only observe (hybridtron.train.hooks), and fault
drills install themselves from outside (hybridtron.train.monitor.faults).

Parallel (`parallel`, a `hybridtron.distributed.mesh.Parallel`; the model parallelized by `hybridtron.distributed.parallelize`,
the batch source giving this rank's rows): every rank runs this same loop, and a single process runs it as a world of
one (`Parallel.single_process`: no process group, every collective the identity). The objective's metrics and token
counts are summed over the data-parallel ranks, gradient norms are taken over the sharded gradients, expert
counts are reduced over the ranks of each pipeline stage, and global rank 0's monitor decision is the one every
rank carries out, so all ranks take the same step.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import signal
import time

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from hybridtron.checkpoint.dcp import CheckpointManager, saved_keys, step_of
from hybridtron.distributed.expert_parallel import dropped_shares
from hybridtron.distributed.mesh import Parallel
from hybridtron.distributed.parallelize import set_output_reduce_dtype
from hybridtron.distributed.state import checkpoint_state
from hybridtron.distributed.step import clip_grads_, global_grad_norms, merge_balance_states, step_metrics, step_ranges
from hybridtron.errors import RunInterrupted
from hybridtron.numerics.grad_accum import ACCUM_DTYPES, flush_main_grads, set_output_accumulation
from hybridtron.numerics.linear import load_sr_generator_states, sr_generator_states
from hybridtron.train.balance import ExpertBalance
from hybridtron.train.config import TrainConfig
from hybridtron.train.monitor import ANNEAL, RUN_EVENT, Decision, NoMonitor
from hybridtron.train.objectives import ObjectiveOutput
from hybridtron.train.optimizers import build_optimizer, set_learning_rate
from hybridtron.train.schedule import WSDSchedule
from hybridtron.train.stats import (StepStats, depth_mean, group_norms, merge_ranges, parameter_group,
                                    range_values)


class Trainer:
    """`objective` and `batches`: see hybridtron.train.objectives. `checkpoints`: None trains without saving (and
    so without rollbacks). `monitor`: from `hybridtron.train.monitor.build_monitor` (default: none). `hooks` observe
    (hybridtron.train.hooks); `evaluators` measure held-out data (hybridtron.train.evaluate)."""

    def __init__(self, model, objective, batches, config: TrainConfig, checkpoints: CheckpointManager | None, *,
                 hooks=(), evaluators=(), monitor=None, parallel=None):
        self.model, self.objective, self.batches, self.config = model, objective, batches, config
        # a trainer built without one (tests, tools) runs in a world of one on the model's device
        self.parallel = Parallel.single_process(self.device) if parallel is None else parallel
        self.checkpoints = checkpoints
        self.hooks, self.evaluators = list(hooks), list(evaluators)
        self.monitor = monitor or NoMonitor()
        self.optimizer = build_optimizer(model, config)
        self.schedule = self.new_schedule()
        self.balance = ExpertBalance(list(model.routers()), config.router_bias_rate, config.maxvio_window,
                                     group=self.parallel.group("tokens"))
        self.step = 0
        # what rollbacks changed: kept when a rollback restores an older checkpoint, restored on resume
        self.adjustments = {"lr_scale": 1.0, "grad_accum_dtype": None}
        self.stop_signal: int | None = None  # set by a signal handler (the run scaffold's): stop after this step

    def new_schedule(self) -> WSDSchedule:
        cfg = self.config
        return WSDSchedule(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.decay_fraction, cfg.min_lr_ratio)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def autocast(self):
        if self.config.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ---------------------------------------------------------------------------------------------- the loop
    def train(self, until: int | None = None) -> None:
        """Train to the schedule's end, or to step `until` (a branch continuing a checkpoint for a window)."""
        self.start()
        while self.step < self.last_step(until):
            stats = self.forward_backward()  # every micro-batch of the step: losses, tokens, expert counts
            self.clip_gradients(stats)  # norms before clipping, global and per parameter group
            stats.maxvio = self.balance.measure(stats.expert_counts)  # MaxVio of every router
            stats.maxvio = self.parallel.merge_over_stages(stats.maxvio)  # each pipeline stage measured its own
            decision = self.monitor.judge(self, stats)  # apply / skip / rollback / anneal
            decision = self.parallel.broadcast_object(decision)  # local signals may differ: rank 0 decides
            if decision.applies:
                self.apply_update(stats)  # the optimizer, then every router's bias toward balance
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            stats.seconds = time.perf_counter() - stats.seconds
            self.monitor.after_update(self, stats, decision)
            if not decision.rolls_back:
                self.mark_good_checkpoints()  # those `good_after` steps old now
            stats.evaluation = self.evaluate(due_only=True)
            for hook in self.hooks:
                hook.on_step_end(self, stats, decision)
            if decision.rolls_back:
                self.roll_back(decision, bad_step=stats.step)
            elif self.checkpoints is not None and self.step % self.config.checkpoint_every == 0 \
                    and self.step < self.schedule.total_steps:
                self.save_checkpoint()
            if self.stop_requested():  # Ctrl-C or SIGTERM during the step: it finished; save and stop
                self.interrupt()
            if self.step < self.last_step(until):  # RL: the next batches are sampled with the policy of this step
                self.batches.sync_weights(self.model, self.step, self.schedule.total_steps)
        self.finish()

    def last_step(self, until: int | None) -> int:
        return self.schedule.total_steps if until is None else until

    def forward_backward(self) -> StepStats:
        started, step = time.perf_counter(), self.step + 1
        self.monitor.begin_step(self, step)
        micro_batches = self.batches.next_step()
        self.objective.begin_step(micro_batches)
        outputs, tokens, counts = self.run_micro_batches(micro_batches)
        flush_main_grads(self.model)  # an output layer accumulating in grad_accum_dtype hands its gradient over
        # each micro-batch's metrics and MTP depth losses and shares (keyed by (kind, depth)), averaged over the
        # step's micro-batches
        shares = [{**out.metrics, **{("loss", d): loss for d, loss in enumerate(out.mtp_losses, start=1)},
                   **{("share", d): share for d, share in enumerate(out.mtp_shares, start=1)}} for out in outputs]
        values, tokens = step_metrics(self.parallel, shares, tokens)  # the global batch's values, on every rank
        depths = sorted(depth for kind, depth in (key for key in values if isinstance(key, tuple)) if kind == "loss")
        mtp_losses = [depth_mean(values.pop(("loss", d)), values.pop(("share", d))) for d in depths]
        ranges = merge_ranges([out.ranges for out in outputs])  # each statistic's [min, max] over the step
        ranges = step_ranges(self.parallel, ranges)
        stats = StepStats(step=step, lr=self.schedule.lr(self.step), losses=values, mtp_losses=mtp_losses,
                          tokens=tokens, expert_counts=counts, seconds=started, ranges=range_values(ranges))
        # capacity-limited expert parallelism: the share of rows it dropped
        stats.signals.update(self.parallel.merge_over_stages(dropped_shares(self.model, self.parallel.group("tokens"))))
        return stats

    def run_micro_batches(self, micro_batches) -> tuple[list[ObjectiveOutput], int, dict[str, torch.Tensor]]:
        """Forward and backward of each micro-batch: (their outputs, tokens, expert counts per router). Under PP the
        pipeline schedule runs them all (what its stages read of each: the objective's `stage_inputs`) and the
        objective's loss runs on the last stage, on the micro-batch the schedule names by index (the other stages
        have no outputs)."""
        outputs, tokens, counts = [], 0, {}
        pipeline = self.parallel.pipeline
        if pipeline is not None:
            def last_stage_loss(stage_outputs, index):
                out = self.objective.loss_from_outputs(self.model, stage_outputs, micro_batches[int(index)])
                outputs.append(out)
                return out.loss

            inputs = [self.objective.stage_inputs(micro_batch) for micro_batch in micro_batches]
            with self.autocast():
                counts = pipeline.step(inputs, last_stage_loss)
            return outputs, sum(mb.tokens for mb in inputs), counts
        for micro_batch in micro_batches:
            with self.autocast():
                out = self.objective(self.model, micro_batch)
            out.loss.backward()
            outputs.append(out)
            tokens += out.tokens
            for name, routed in out.expert_counts.items():
                counts[name] = routed if name not in counts else counts[name] + routed
        return outputs, tokens, counts

    def clip_gradients(self, stats: StepStats) -> None:
        """Record the global and per-group gradient norms, then clip to `grad_clip` by the global norm. A non-finite
        norm leaves the gradients untouched: scaling by NaN would smear one layer's NaN over every layer and hide
        where it began (the monitor names the groups whose gradients are not finite)."""
        grads = [(name, p.grad) for name, p in self.model.named_parameters() if p.grad is not None]
        if self.parallel.distributed:  # sharded gradients: norms from every rank's shards, one all-reduce
            norm, stats.group_grad_norms = global_grad_norms(grads, self.parallel, parameter_group)
        else:  # whole gradients: torch's own norm (its float32 arithmetic, which one process has always used)
            norm, stats.group_grad_norms = torch.nn.utils.get_total_norm([g for _, g in grads]), group_norms(grads)
        if self.config.grad_clip and torch.isfinite(norm):
            clip_grads_([g for _, g in grads], self.config.grad_clip, norm)
        stats.grad_norm = float(norm)

    def apply_update(self, stats: StepStats) -> None:
        set_learning_rate(self.optimizer, stats.lr)
        self.optimizer.step()
        self.balance.update(self.model.router_biases())

    def evaluate(self, due_only: bool) -> dict[str, float]:
        values = {}
        for evaluator in self.evaluators:
            if not due_only or evaluator.due(self.step, self.schedule.total_steps):
                values.update(evaluator.evaluate(self))
        return values

    # ---------------------------------------------------------------------------------------- start and end
    def start(self) -> None:
        self.model.train()
        self.monitor.attach(self)
        for hook in self.hooks:
            hook.on_train_start(self)
        fresh = self.step == 0 and (self.checkpoints is None or not self.checkpoints.list())
        if fresh and self.evaluators:
            initial = self.evaluate(due_only=False)
            for hook in self.hooks:
                hook.on_initial_evaluation(self, initial)
        if fresh and self.checkpoints is not None and self.monitor.config.enabled:
            self.save_checkpoint(blocking=True)  # the first rollback target
        elif not fresh and self.events is not None:
            self.events.abandon_after(self.step)  # a kill's unsaved steps run again: their events must not count twice
            self.events.write(self.step, RUN_EVENT, "resume", f"resumed at step {self.step}")
        self.mark_good_checkpoints()
        if self.step < self.schedule.total_steps:  # RL: the rollout role samples the first batches with these weights
            self.batches.sync_weights(self.model, self.step, self.schedule.total_steps)

    def finish(self) -> None:
        if self.checkpoints is not None:
            self.save_checkpoint(blocking=True)
        self.end_hooks()

    def end_hooks(self) -> None:
        self.monitor.detach()
        for hook in self.hooks:
            hook.on_train_end(self)

    @property
    def events(self):
        """The run's event log (events.jsonl), or None for a trainer without a run directory."""
        return self.monitor.events

    # -------------------------------------------------------------------------------------- interruption
    def stop_requested(self) -> bool:
        """Whether a signal asked the run to stop; under torchrun any rank's signal stops every rank at the same
        step (one all-reduce of a flag a step)."""
        self.stop_signal = self.parallel.max_over_world(self.stop_signal or 0) or None
        return self.stop_signal is not None

    def interrupt(self) -> None:
        """Stop after the finished step: write a checkpoint of it (unless one exists), record the interruption and
        raise `RunInterrupted`, which the command reports in one line."""
        checkpoint = None
        if self.checkpoints is not None:
            latest = self.checkpoints.latest()
            checkpoint = latest if latest is not None and step_of(latest) == self.step else \
                self.save_checkpoint().result()  # the written checkpoint's path, once it is complete
        name = signal.Signals(self.stop_signal).name
        if self.events is not None:
            self.events.write(self.step, RUN_EVENT, "interrupted", f"{name} received; stopped after step {self.step}"
                              + (f", checkpoint {checkpoint}" if checkpoint is not None else ""))
        self.end_hooks()
        raise RunInterrupted(self.stop_signal, self.step, checkpoint)

    def mark_good_checkpoints(self) -> None:
        if self.checkpoints is not None:
            self.monitor.mark_good(self.checkpoints, self.step)

    # ------------------------------------------------------------------------------------------- recovery
    def roll_back(self, decision: Decision, bad_step: int) -> None:
        """Carry out a rollback or anneal: restore the GOOD checkpoint, read on from the data after the window that
        caused the trouble (it is never seen again), then apply the decision's LR scale, gradient-accumulation
        dtype and anneal. Checkpoints newer than the target belong to the abandoned trajectory and are deleted
        (otherwise `--resume` would pick them)."""
        self.checkpoints.wait()
        position = copy.deepcopy(self.batches.state_dict())  # just past the batches that caused the trouble
        self.load_checkpoint(decision.target, rollback=True)
        self.batches.load_state_dict(position)
        discarded = self.checkpoints.remove_after(self.step)
        changes = []
        if decision.lr_scale != 1.0:
            self.adjustments["lr_scale"] *= decision.lr_scale
            changes.append(f"LR x{self.adjustments['lr_scale']:g}")
        if decision.grad_accum_dtype is not None:
            changes.append(f"grad_accum_dtype {self.config.grad_accum_dtype} -> {decision.grad_accum_dtype}")
            self.adjustments["grad_accum_dtype"] = decision.grad_accum_dtype
        if decision.action == ANNEAL:
            schedule = self.schedule
            decay = decision.anneal_steps or max(schedule.total_steps - schedule.decay_start, 1)
            schedule.anneal_now(self.step, min(self.step + decay, schedule.total_steps))
            changes.append(f"decay starts now, run ends at step {schedule.total_steps}")
        self.apply_adjustments()
        for hook in self.hooks:
            hook.on_rollback(self, bad_step, self.step, decision.rollback)
        self.events.write(
            bad_step, "monitor", "annealed" if decision.action == ANNEAL else "rolled_back",
            f"step {bad_step} -> {decision.target.name}; skipped the data of steps {self.step + 1}-{bad_step}"
            + (f"; {', '.join(changes)}" if changes else ""),
            target_step=self.step, rollback=decision.rollback, discarded_checkpoints=discarded,
            lr_scale=self.adjustments["lr_scale"], grad_accum_dtype=self.config.grad_accum_dtype,
            total_steps=self.schedule.total_steps)

    def apply_adjustments(self) -> None:
        self.schedule.peak_lr = self.config.lr * self.adjustments["lr_scale"]
        dtype = self.adjustments["grad_accum_dtype"]
        if dtype is not None and dtype != self.config.grad_accum_dtype:
            self.config = dataclasses.replace(self.config, grad_accum_dtype=dtype)
            if self.parallel.distributed:  # FSDP: the output layer's dtype is that of its gradient reduction
                set_output_reduce_dtype(self.model, ACCUM_DTYPES[dtype])
            else:
                set_output_accumulation(self.model, dtype)

    # ------------------------------------------------------------------------------------------ checkpoints
    def tensor_state(self) -> dict:
        """Model and optimizer state keyed by parameter name (DCP's form; it also gives a fresh optimizer the
        state tensors a load fills in). Distributed: sharded, in the single-process layout (hybridtron.distributed.state),
        so any world size and layout can load it."""
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def checkpoint_state(self, tensors: dict) -> dict:
        return checkpoint_state(tensors, self.model)

    def trainer_state(self) -> dict:
        """Everything but the tensors, as global rank 0 holds it (and so the same at any world size); under PP the
        per-stage parts (router loads, stochastic-rounding streams) gathered from every stage."""
        state = self._trainer_state()
        if self.parallel.layout.pp > 1:
            state["balance"] = merge_balance_states(self.parallel, state["balance"])
            state["rng"]["stochastic_rounding"] = self.parallel.merge_over_stages(state["rng"]["stochastic_rounding"])
        return state

    def _trainer_state(self) -> dict:
        return {
            "step": self.step,
            "schedule": self.schedule.state_dict(),
            "batches": self.batches.state_dict(),
            "balance": self.balance.state_dict(),
            "monitor": self.monitor.state_dict(),
            "adjustments": dict(self.adjustments),
            "hooks": {type(hook).__name__: hook.state_dict() for hook in self.hooks},
            "evaluators": {e.state_name: e.state_dict() for e in self.evaluators},
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                    "stochastic_rounding": sr_generator_states(self.model)},
        }

    def save_checkpoint(self, blocking: bool = False):
        return self.checkpoints.save(self.step, self.checkpoint_state(self.tensor_state()), self.trainer_state(),
                                     blocking=blocking)

    def load_checkpoint(self, path, *, rollback: bool = False) -> None:
        """Restore everything a checkpoint holds. `rollback`: keep what the run has been through (the monitor's
        history of rollbacks, the adjustments they made) instead of the checkpoint's older record of it."""
        if self.checkpoints is not None:
            self.checkpoints.wait()
        tensors = self.tensor_state()
        # AdamW holds no state for a parameter that never had a gradient (a part of the model the objective does
        # not train, e.g. the MTP block under SFT without its loss); keep those fresh rather than ask the
        # checkpoint for state it never saved
        saved = saved_keys(path)
        optimizer_state = tensors["optimizer"]["state"]
        for name in [name for name in optimizer_state if f"optimizer.state.{name}.step" not in saved]:
            del optimizer_state[name]
        own_groups = copy.deepcopy(tensors["optimizer"]["param_groups"])  # the load writes into these dicts
        state = CheckpointManager.load(path, self.checkpoint_state(tensors))  # loads in place into `tensors`
        # The groups' hyperparameters come from the config (lr from the schedule at every step), so this rank's own
        # groups stay: the checkpoint keys groups by index, and under PP every stage's group 0 is one key, which
        # holds one stage's parameter list (another stage would drop its hyperparameters, then fail in AdamW)
        tensors["optimizer"]["param_groups"] = own_groups
        set_state_dict(self.model, self.optimizer, model_state_dict=tensors["model"],
                       optim_state_dict=tensors["optimizer"],  # not strict: the fresh parameters above; a missing
                       options=StateDictOptions(strict=False))  # model tensor already failed in dcp.load
        self.step = state["step"]
        self.schedule.load_state_dict(state["schedule"])
        self.batches.load_state_dict(state["batches"])
        self.balance.load_state_dict(state["balance"])
        self.monitor.load_state_dict(state["monitor"], keep_history=rollback)
        if not rollback:  # a resumed run keeps what its rollbacks changed
            self.adjustments = dict(state["adjustments"])
            self.apply_adjustments()
        for item in self.hooks:
            if type(item).__name__ in state["hooks"]:
                item.load_state_dict(state["hooks"][type(item).__name__])
        for item in self.evaluators:
            if item.state_name in state["evaluators"]:
                item.load_state_dict(state["evaluators"][item.state_name])
        torch.set_rng_state(state["rng"]["torch"])
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        load_sr_generator_states(self.model, state["rng"]["stochastic_rounding"])
