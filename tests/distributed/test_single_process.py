"""One process is a world of one: `Parallel.single_process` starts no process group, its collectives are
identities, and the trainer's one clipping call scales gradients exactly as torch's own clipping does."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridtron.distributed.mesh import Parallel
from hybridtron.distributed.step import clip_grads_, full_state_dict
from hybridtron.model.lm import HybridLM


def test_a_world_of_one_has_identity_collectives_and_no_process_group():
    parallel = Parallel.single_process()
    assert (parallel.world, parallel.rank, parallel.is_main, parallel.distributed) == (1, 0, True, False)
    assert (parallel.layout.world, parallel.layout.dp, parallel.data_rank, parallel.pp_rank) == (1, 1, 0, 0)
    assert parallel.group("tokens") is None and parallel.pipeline is None
    values = torch.tensor([1.5, 2.5])
    assert parallel.sum_over_data(values) is values and parallel.sum_over_context(values) is values
    assert parallel.broadcast_object({"a": 1}) == {"a": 1} and parallel.gather_objects("x") == ["x"]
    assert parallel.merge_over_stages({"r": 1.0}) == {"r": 1.0} and parallel.max_over_world(3) == 3
    assert parallel.mean_over_tokens([0.25, 4.0]) == [0.25, 4.0]
    with parallel.main_first():
        parallel.barrier()
    parallel.close()
    assert "1 process on cpu (no process group)" in parallel.describe()
    assert not dist.is_initialized()


def test_the_export_gathers_a_single_process_model_without_copying_it(small_config):
    model = HybridLM(small_config())
    state = full_state_dict(model, Parallel.single_process())
    assert state.keys() == model.state_dict().keys()
    assert all(state[name].data_ptr() == tensor.data_ptr() for name, tensor in model.state_dict().items())


def test_the_one_clipping_call_matches_torchs_clipping_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in ((7, 5), (5,), (3, 4, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 3
    theirs = [p.grad.clone() for p in params]
    norm = torch.nn.utils.get_total_norm(theirs)
    reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in theirs]
    for r, g in zip(reference, theirs):
        r.grad = g.clone()
    torch.nn.utils.clip_grads_with_norm_(reference, 1.0, norm)
    clip_grads_([p.grad for p in params], 1.0, norm)
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(params, reference))
