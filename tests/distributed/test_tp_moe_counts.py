"""The RL learner under TP 2 on a model with MoE layers (backbone and MTP block): sequence parallelism gives each
rank's routers its share of the positions, and each rank counts its share of the rollouts' `counted` mask (the
completions) of the whole sequence (`tensor_parallel._count_sequence_share`). On 2 gloo processes a GRPO step and a
MOPD step give one process's losses, metrics, gradients of every parameter (1e-6, fp32), its expert counts of every
router (summed over the token ranks, as `ExpertBalance` sums them: exactly) and its router biases after the
balancing update."""

from __future__ import annotations

import os

import pytest
import torch
from gloo import differences
from layout_worker import SEED, _small_config
from test_head_blockwise import TOLERANCE, VOCAB, _objectives, _step

from hybridtron.config import parse_pattern
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.mesh import init_parallel
from hybridtron.distributed.parallelize import parallelize
from hybridtron.model.lm import HybridLM
from hybridtron.post.rl.batches import pack_micro_batches, shard_micro_batch
from hybridtron.train.balance import ExpertBalance, update_router_biases

WORLD, RATE = 2, 1e-3


class _Counting:
    """An RL objective that also sums its micro-batches' expert counts (`ObjectiveOutput.expert_counts`), as the
    trainer's `run_micro_batches` does."""

    def __init__(self, objective):
        self.objective, self.counts = objective, {}

    def begin_step(self, micro_batches):
        self.objective.begin_step(micro_batches)

    def __call__(self, model, mb):
        result = self.objective(model, mb)
        for name, routed in result.expert_counts.items():
            self.counts[name] = routed if name not in self.counts else self.counts[name] + routed
        return result


def _models(rank: int, world: int, layout: DistConfig):
    """(the config, the parallel layout, one process's model, the parallelized one) from the same initialization."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    config = _small_config(vocab_size=VOCAB, layers_block_type=parse_pattern("M*E-ME"),
                           mtp_layers_block_type=parse_pattern("*E"))
    parallel = init_parallel(layout, config, batch_size=8, grad_accum=2, seq_len=16)
    torch.manual_seed(SEED)
    single = HybridLM(config)
    torch.manual_seed(SEED)
    return config, parallel, single, parallelize(HybridLM.on_meta(config), parallel)


def _check(rank: int):
    config, parallel, single, model = _models(rank, WORLD, DistConfig(tp=2, backend="gloo"))
    routers = list(single.routers())
    for kind in ("grpo", "mopd"):
        (objective, batch), (reference, _) = _objectives(config, parallel)[kind], _objectives(config, None)[kind]
        objective, reference = _Counting(objective), _Counting(reference)
        micro_batches = pack_micro_batches(batch, 2)
        want, want_grads = _step(single, reference, micro_batches, None)
        shards = [shard_micro_batch(mb, parallel, lookahead=config.mtp_depths, min_chunk=config.conv_kernel - 1)
                  for mb in micro_batches]
        got, grads = _step(model, objective, shards, parallel)
        error = float((got - want).abs().max())
        if not error <= TOLERANCE * max(1.0, float(want.abs().max())):
            yield f"{kind}: losses and metrics differ by {error:.3g}"
        for name in want_grads:
            error = float((grads[name] - want_grads[name]).abs().max())
            if not error <= TOLERANCE * max(1.0, float(want_grads[name].abs().max())):
                yield f"{kind}: {name}'s gradient differs by {error:.3g}"

        want_counts = torch.stack([reference.counts[name] for name in routers])
        every_position = sum(mb.input_ids.numel() for mb in micro_batches) * config.num_experts_per_tok
        if not 0 < int(want_counts[0].sum()) < every_position:  # the completions only, not the prompts or padding
            yield f"{kind}: one process counted {int(want_counts[0].sum())} routings of {every_position}"
        balance = ExpertBalance(routers, RATE, window=1, group=parallel.group("tokens"))
        balance.measure(objective.counts)
        if not torch.equal(balance.step_counts, want_counts):
            yield f"{kind}: expert counts {balance.step_counts.tolist()} != one process's {want_counts.tolist()}"
        balance.update(model.router_biases())
        update_router_biases(single.router_biases(), want_counts, RATE)
        for name, got_bias, want_bias in zip(routers, model.router_biases(), single.router_biases()):
            if not torch.equal(got_bias, want_bias):
                yield f"{kind}: router {name}'s bias after the balancing update differs"


@pytest.mark.timeout(120)
def test_rl_learner_with_moe_under_tp_counts_and_balances_as_one_process():
    reported = differences(_check, WORLD)
    assert not reported, reported

