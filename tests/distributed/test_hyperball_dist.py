"""The matrix optimizers (`train.optimizer` adamh, muonh, muon) on 2 gloo processes, under FSDP (dp_shard=2), TP 2
and EP 2 (each rank orthogonalizes its own experts): every sharded step equals the same optimizer stepping the gathered weights, gradients and state in one
process (norms reduced over the shards, Newton-Schulz on the gathered matrix); AdamH's weights after a few steps
equal one process's training on the same global batches; a DCP checkpoint of the sharded optimizer state (moments,
momentum, each matrix's radius) resumes to the same weights as the uninterrupted run. The trainer and batches are
layout_worker.py's.

Muon and MuonH are compared step by step rather than over a run: their Newton-Schulz runs in bf16 (torch's), so the
fp32 reduction order of the layouts' gradients (a 1e-7 relative change) flips bf16 roundings and moves the weights
by up to 1e-3 after 3 steps, as the same 1e-7 noise on the gradients does in one process."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from torch.distributed.tensor import DTensor
from gloo import differences
from layout_worker import BATCH, GRAD_ACCUM, SEED, SEQ, SyntheticBatches, model_config

from hybridtron.checkpoint.dcp import CheckpointManager
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.mesh import Parallel, init_parallel
from hybridtron.distributed.parallelize import parallelize
from hybridtron.distributed.step import DataParallelBatches, full_state_dict
from hybridtron.model.lm import HybridLM
from hybridtron.train.config import TrainConfig
from hybridtron.train.loop import Trainer
from hybridtron.train.objectives import PretrainObjective
from hybridtron.train.optimizers import MatrixOptimizer

WORLD, STEPS = 2, 3


def trainer(parallel, optimizer: str, checkpoints=None) -> Trainer:
    torch.manual_seed(SEED)
    config = model_config()
    model = parallelize(HybridLM(config) if parallel is None else HybridLM.on_meta(config),
                        Parallel.single_process() if parallel is None else parallel)
    batches, objective = SyntheticBatches(config.vocab_size), PretrainObjective()
    if parallel is not None:
        batches = DataParallelBatches(batches, parallel, config.mtp_depths)
        objective = PretrainObjective(parallel.sum_over_data, config.mtp_num_depths)
    train = TrainConfig(steps=STEPS, grad_accum=GRAD_ACCUM, lr=1e-2, adam_lr=3e-3, warmup_steps=1,
                        optimizer=optimizer, checkpoint_every=2)
    return Trainer(model, objective, batches, train, checkpoints, parallel=parallel)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone()
            for name, tensor in full_state_dict(trainer.model, trainer.parallel, everywhere=True).items()}


def compare(got: dict, want: dict, tolerance: float, what: str):
    for name, tensor in want.items():
        error = float((got[name] - tensor).abs().max())
        if not error <= tolerance:
            yield f"{what}: {name} differs by {error:.3g}"


def gathered(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def check_each_step_against_one_process(run: Trainer, found: list[str], what: str) -> None:
    """Before every step of `run`, a one-process twin of its optimizer over the gathered weights, gradients and
    state; after it, the sharded weights must equal the twin's (to the rounding of a sum over shards)."""
    sharded_step = run.optimizer.step

    def step(closure=None):
        optimizer = run.optimizer
        params = {p: torch.nn.Parameter(gathered(p)) for group in optimizer.param_groups for p in group["params"]}
        for p, twin in params.items():
            twin.grad = gathered(p.grad) if p.grad is not None else None
        twin = MatrixOptimizer([{**group, "params": [params[p] for p in group["params"]]}
                                for group in optimizer.param_groups], **{k: optimizer.defaults[k] for k in
                                                                         ("lr", "betas", "eps", "momentum")})
        for p, state in optimizer.state.items():
            twin.state[params[p]] = {key: gathered(value) for key, value in state.items()}
        sharded_step(closure)
        twin.step()
        for p, copy in params.items():
            error = float((gathered(p) - copy).abs().max())
            if not error <= 1e-6:
                found.append(f"{what}: a {tuple(p.shape)} weight differs from one process's step by {error:.3g}")

    run.optimizer.step = step


def _check(rank: int, directory: str):
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank))
    for optimizer in ("adamh", "muonh", "muon"):
        reference = trainer(None, optimizer)
        reference.train()
        want = weights(reference)
        for layout in (DistConfig(dp_shard=2, backend="gloo"), DistConfig(tp=2, backend="gloo"),
                       DistConfig(ep=2, backend="gloo")):
            parallel = init_parallel(layout, model_config(), batch_size=BATCH, grad_accum=GRAD_ACCUM, seq_len=SEQ)
            run, found = trainer(parallel, optimizer), []
            what = f"{optimizer} dp_shard={layout.dp_shard} tp={layout.tp} ep={layout.ep}"
            check_each_step_against_one_process(run, found, what)
            run.train()
            yield from found
            if optimizer == "adamh":
                yield from compare(weights(run), want, 2e-6, what)
    # the sharded state through DCP: stop at step 2 (a checkpoint), resume in a fresh trainer, finish
    parallel = init_parallel(DistConfig(dp_shard=2, backend="gloo"), model_config(), batch_size=BATCH,
                             grad_accum=GRAD_ACCUM, seq_len=SEQ)
    whole = trainer(parallel, "muonh")
    whole.train()
    checkpoints = CheckpointManager(os.path.join(directory, "checkpoints"), keep=3)
    first = trainer(parallel, "muonh", checkpoints)
    first.train(until=2)
    checkpoints.wait()
    second = trainer(parallel, "muonh", CheckpointManager(os.path.join(directory, "checkpoints"), keep=3))
    second.load_checkpoint(second.checkpoints.latest())
    radius = [state["radius"] for state in second.optimizer.state.values() if "radius" in state]
    if not radius or not all(isinstance(r, DTensor) for r in radius):
        yield "the radius is not kept as a DTensor in the sharded optimizer state"
    second.train()
    yield from compare(weights(second), weights(whole), 0.0, "resumed under dp_shard=2")


@pytest.mark.timeout(300)
def test_matrix_optimizers_under_fsdp_and_tp_match_one_process_and_resume(tmp_path):
    reported = differences(functools.partial(_check, directory=str(tmp_path)), WORLD)
    assert not reported, reported
