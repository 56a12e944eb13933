"""What an RL command (`grpo`, `mopd`) does around its objective: the learner's layout checks, the policy and its
tokenizer, the role pipeline (rollout and scoring roles, inline or in processes or Ray actors) behind a
`RolloutBatches` batch source, the held-out evaluation, and the trainer. A command says which roles it runs, which
objective learns and what it evaluates (`RolloutRunCommand`'s three methods); the run scaffold does the rest
(hybridtron.train.run).

Under torchrun every rank trains on its rows of each micro-batch; the roles split their work over the ranks (inline
roles: each rank generates and scores its share, on the full weights every rank gathers) or run on global rank 0
(roles in processes or Ray actors, whose batch rank 0 broadcasts).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.data.chat import load_chat_tokenizer
from hybridtron.distributed.mesh import Layout, check_run_layout, world_from_env
from hybridtron.post.rl.batches import RolloutBatches, rollout_pipeline_factory, sharded_length
from hybridtron.post.rl.config import RolloutConfig
from hybridtron.post.rl.engines.vllm import check_vllm
from hybridtron.post.rl.roles import WorkShare
from hybridtron.train.run import BuiltRun, RunCommand, assemble_trainer, pass_at_1_line, prepare_process, \
    start_parallel


def learner_layout(dist_config, model_config, learner_config: RolloutConfig, *, rows: int, seq_len: int,
                   grad_accum: int) -> dict:
    """The `start_parallel` arguments of an RL learner whose steps hold `grad_accum` micro-batches of `rows`
    rollouts of up to `seq_len` positions, after the checks of `dist.mesh.check_run_layout` (rows and positions are
    padded to whole shares, so only the structural rules apply, and under PP the micro-batches to one shape:
    `uniform_micro_batches`) and the RL learner's own: no routing replay under TP, and under CP only the token-level
    loss (a sequence-level aggregation or correction needs each whole sequence on one rank). A ValueError names the
    setting; no process group is built. Several optimizer steps a rollout batch (its old log-probs from a no-grad
    forward of the learner) are not run under PP."""
    world = world_from_env()[0]
    layout = Layout(**dist_config.degrees(world))
    section = learner_config.SECTION
    if layout.tp > 1 and learner_config.routing_replay:
        raise ValueError(f"dist.tp={layout.tp}: routing replay is not supported under tensor parallelism; set "
                         f"{section}.routing_replay=false or dist.tp=1")
    if layout.pp > 1 and learner_config.steps_per_rollout > 1:
        raise ValueError(f"dist.pp={layout.pp}: {section}.global_batch={learner_config.global_batch} / "
                         f"{section}.epochs={learner_config.epochs} train a rollout batch over several optimizer "
                         f"steps, whose old log-probs need a forward outside the pipeline schedule; use one step a "
                         f"rollout batch ({section}.global_batch=0, {section}.epochs=1) or dist.pp=1")
    if layout.cp > 1:
        for name in ("aggregation", "correction_level"):
            value = getattr(learner_config, name)
            if value.startswith("sequence"):
                raise ValueError(f"dist.cp={layout.cp}: {section}.{name}={value} needs each whole sequence on one "
                                 f"rank, and under context parallelism a rank holds a share of its positions; use "
                                 f"the token-level default or dist.cp=1")
    sizes = dict(batch_size=-(-rows // layout.dp) * layout.dp, grad_accum=grad_accum, context_parallel=True,
                 seq_len=sharded_length(seq_len, layout.cp, layout.tp, model_config.conv_kernel - 1))
    check_run_layout(dist_config, model_config, world, **sizes)
    return sizes


class RolloutRunCommand(RunCommand):
    """A training command on rollouts. Subclasses set `section` (the name of their RolloutConfig section) and
    define `role_specs`, `objective` and `evaluators` (and `check_inputs`, `policy_dir` where they need to)."""

    section = ""
    summary_what = "held-out pass@1"

    def rollout_config(self, config) -> RolloutConfig:
        return getattr(config, self.section)

    def policy_dir(self, config, out: Path) -> Path:
        """The checkpoint the learner starts from."""
        return Path(getattr(config, config.MODEL_FROM))

    # ------------------------------------------------------------------------------ declared by each command
    def role_specs(self, config, policy_dir: Path, backend: str, share: WorkShare | None) -> list:
        """The roles before the learner, rollout role first (`hybridtron.post.rl.roles.RoleSpec`s)."""
        raise NotImplementedError

    def objective(self, config, parallel):
        raise NotImplementedError

    def evaluators(self, config, tokenizer) -> tuple[list, list]:
        """(the run's evaluators, what to close when it ends)."""
        raise NotImplementedError

    def check_inputs(self, config) -> None:
        """The command's own inputs usable (environments build, teachers match the student)."""

    # ---------------------------------------------------------------------------------------------- shared
    def check(self, config) -> None:
        section = self.rollout_config(config)
        if "corrupt_batch" in config.monitor.inject_fault:
            raise ValueError(f"monitor.inject_fault: corrupt_batch garbles token rows, and {self.name}'s batches are "
                             "rollouts; inject lr_spike, nan_grad or router_bias instead")
        rows, seq_len = section.micro_batch_shape(config.train.grad_accum, config.model.max_position_embeddings)
        learner_layout(config.dist, config.model, section, rows=rows, seq_len=seq_len,
                       grad_accum=config.train.grad_accum)
        load_chat_tokenizer(getattr(config, config.MODEL_FROM), vocab_size=config.model.vocab_size,
                            require_template=True)
        if section.engine == "vllm":  # before anything trains: vLLM installed, and able to run this model here
            check_vllm(section, config.model, getattr(config, config.MODEL_FROM))
        if section.max_new_tokens + 2 > config.model.max_position_embeddings:
            raise ValueError(f"{section.SECTION}.max_new_tokens={section.max_new_tokens} leaves no room for a prompt "
                             f"in the model's {config.model.max_position_embeddings} positions")
        self.check_inputs(config)

    def build(self, config, out, checkpoints, *, quiet):
        stream = sys.stderr
        section, train, model_config = self.rollout_config(config), config.train, config.model
        policy_dir = self.policy_dir(config, out)
        rows, seq_len = section.micro_batch_shape(train.grad_accum, model_config.max_position_embeddings)
        parallel = start_parallel(config.dist, model_config, **learner_layout(
            config.dist, model_config, section, rows=rows, seq_len=seq_len, grad_accum=train.grad_accum))
        quiet = quiet or not parallel.is_main
        tokenizer = load_chat_tokenizer(policy_dir, vocab_size=model_config.vocab_size)
        prepare_process(train, model_config, rows * seq_len, stream, config.dist)
        model = load_pretrained(policy_dir, config=model_config, dtype=torch.float32)
        staleness = section.staleness if section.async_rollouts else 0
        backend = section.rollout_backend if section.async_rollouts else "inline"
        # every rank generates its share of each step (a single process, with no ranks to share with, all of it)
        shared = parallel.distributed and backend == "inline"
        specs = self.role_specs(config, policy_dir, backend, WorkShare() if shared else None)
        objective = self.objective(config, parallel)

        def old_logprobs(micro_batches):  # the learner as it stands (the trainer, built below, holds it)
            with trainer.autocast():
                return [objective.old_logprobs(trainer.model, mb) for mb in micro_batches]

        rollouts = RolloutBatches(rollout_pipeline_factory(specs, backend, staleness), staleness=staleness,
                                  grad_accum=train.grad_accum, pad_id=model_config.pad_token_id or 0,
                                  parallel=parallel, shared=shared, mtp_depths=model_config.mtp_depths,
                                  min_chunk=model_config.conv_kernel - 1, mini_batches=section.mini_batches,
                                  epochs=section.epochs, old_logprobs=old_logprobs)
        evaluators, closers = self.evaluators(config, tokenizer)
        trainer = assemble_trainer(model, objective, rollouts, evaluators, train=train,
                                   monitor_config=config.monitor, out=out, checkpoints=checkpoints, quiet=quiet,
                                   stream=stream, parallel=parallel)
        return BuiltRun(trainer, tokenizer, closers=[rollouts.close, *closers])

    def summary_line(self, history) -> str:
        return pass_at_1_line(history, self.summary_what)
