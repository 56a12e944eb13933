"""The RL learner under PP 2 x TP 2 on a model with MoE layers: each pipeline stage counts its routers' routing
over its TP rank's share of the rollouts' `counted` mask (`Pipeline.count` hands the routers the whole sequence's
mask, `tensor_parallel._count_sequence_share` cuts it); on 4 gloo processes a GRPO step's expert counts of every
router, summed over each stage's token ranks and merged over the stages, are one process's (exactly)."""

from __future__ import annotations

import pytest
from gloo import differences
from test_head_blockwise import _objectives, _step
from test_tp_moe_counts import RATE, _Counting, _models

from hybridtron.distributed.config import DistConfig
from hybridtron.post.rl.batches import pack_micro_batches, shard_micro_batch, uniform_micro_batches
from hybridtron.train.balance import ExpertBalance

WORLD = 4


def _check_pipeline(rank: int):
    """PP 2 x TP 2: each stage counts its routers' share of the mask (`Pipeline.count`), a GRPO step's."""
    config, parallel, single, model = _models(rank, WORLD, DistConfig(pp=2, tp=2, backend="gloo"))
    (objective, batch), (reference, _) = _objectives(config, parallel)["grpo"], _objectives(config, None)["grpo"]
    micro_batches = uniform_micro_batches(pack_micro_batches(batch, 2), 2)  # the stages exchange one shape
    reference = _Counting(reference)
    _step(single, reference, micro_batches, None)
    shards = [shard_micro_batch(mb, parallel, lookahead=config.mtp_depths, min_chunk=config.conv_kernel - 1)
              for mb in micro_batches]
    objective.begin_step(shards)
    counts = parallel.pipeline.step([objective.stage_inputs(mb) for mb in shards],
                                    lambda outputs, index: objective.loss_from_outputs(model, outputs,
                                                                                       shards[int(index)]).loss)
    balance = ExpertBalance(list(model.routers()), RATE, window=1, group=parallel.group("tokens"))
    balance.measure(counts)
    got = parallel.merge_over_stages(dict(zip(balance.names, balance.step_counts.tolist())))
    want = {name: routed.tolist() for name, routed in reference.counts.items()}
    if got != want:
        yield f"expert counts {got} != one process's {want}"


@pytest.mark.timeout(120)
def test_rl_pipeline_stages_under_tp_count_as_one_process():
    reported = differences(_check_pipeline, WORLD)
    assert not reported, reported
