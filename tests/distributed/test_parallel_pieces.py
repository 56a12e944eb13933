"""The pieces of the layouts that run in one process: packed TP layouts, the EP permutation, row sharding, norms of
sharded gradients, activation checkpointing and compile (the multi-process runs: test_parallel_layouts.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridtron.distributed.context_parallel import shard_sequence
from hybridtron.distributed.expert_parallel import expert_major_order
from hybridtron.distributed.mesh import Parallel
from hybridtron.distributed.parallelize import parallelize
from hybridtron.distributed.ring_attention import own_chunks
from hybridtron.distributed.state import canonical_name
from hybridtron.distributed.step import global_grad_norms
from hybridtron.distributed.tensor_parallel import Packing
from hybridtron.model.lm import PAST_END, HybridLM
from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.train.stats import group_norms, parameter_group


@pytest.mark.parametrize("parts, tp", [((8, 8, 4, 4, 2), 2), ((12, 6, 6), 3), ((4,), 4)])
def test_packing_rank_major_layout_round_trips_and_maps_every_row(parts, tp):
    packing = Packing(parts, tp)
    canonical = torch.arange(sum(parts) * 3, dtype=torch.float32).view(sum(parts), 3)
    rank_major = packing.rank_major(canonical)
    assert torch.equal(packing.canonical(rank_major), canonical)
    block = sum(parts) // tp
    for rank in range(tp):  # rank r's block holds its chunk of every part, in part order
        expected = torch.cat([part.chunk(tp)[rank] for part in canonical.split(list(parts))])
        assert torch.equal(rank_major[rank * block:(rank + 1) * block], expected)
    for start, stop in [(0, sum(parts)), (1, block + 1), (block - 1, sum(parts) - 1)]:  # any row range, as FSDP cuts
        for canonical_row, offset, length in packing.canonical_runs(start, stop):
            assert torch.equal(rank_major[start + offset:start + offset + length],
                               canonical[canonical_row:canonical_row + length])
        assert sum(length for _, _, length in packing.canonical_runs(start, stop)) == stop - start


def test_expert_major_order_regroups_received_rows_by_local_expert():
    counts_RE = torch.tensor([[2, 0, 1], [1, 3, 0]])  # rows from 2 source ranks for 3 local experts
    labels = [(rank, expert) for rank in range(2) for expert in range(3) for _ in range(int(counts_RE[rank, expert]))]
    order = expert_major_order(counts_RE)
    regrouped = [labels[i] for i in order.tolist()]
    assert regrouped == sorted(labels, key=lambda label: (label[1], label[0]))


def test_global_grad_norms_in_one_process_are_torchs(small_config):
    model = HybridLM(small_config())
    ids = torch.randint(3, 128, (2, 16))
    model(ids, torch.roll(ids, -1, 1)).loss.backward()
    named = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    total, groups = global_grad_norms(named, Parallel.single_process(), parameter_group)
    assert torch.allclose(total, torch.nn.utils.get_total_norm([g for _, g in named]), rtol=1e-6)
    reference = group_norms(named)
    assert groups.keys() == reference.keys()
    assert all(abs(groups[k] - reference[k]) <= 1e-6 * max(reference[k], 1e-6) for k in groups)


def loss_and_grads(model, ids):
    out = model(ids, torch.roll(ids, -1, 1))
    out.loss.backward()
    return float(out.loss.detach()), {canonical_name(n): p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None}


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_activation_checkpointing_keeps_the_loss_and_gradients(small_config, recompute):
    torch.manual_seed(0)
    model = HybridLM(small_config())
    checkpointed = parallelize(copy.deepcopy(model), Parallel.single_process(), recompute=recompute)
    ids = torch.randint(3, 128, (2, 16))
    loss, grads = loss_and_grads(model, ids)
    loss_ac, grads_ac = loss_and_grads(checkpointed, ids)
    assert loss_ac == loss
    assert grads.keys() == grads_ac.keys()
    assert all(torch.equal(grads[name], grads_ac[name]) for name in grads)


def test_a_meta_built_model_is_materialized_with_the_weights_one_process_draws(small_config):
    """`parallelize` fills a meta-built model (here: one process, blocks checkpointed, so the names are wrapped)
    with the weights and generator state of building it on the CPU from the same seed; the multi-process layouts,
    which build on the meta device too (layout_worker.py), check the sharded case against one process's losses."""
    torch.manual_seed(5)
    built = HybridLM(small_config())
    after_build = torch.get_rng_state()
    torch.manual_seed(5)
    materialized = parallelize(HybridLM.on_meta(small_config()), Parallel.single_process(), recompute="full")
    assert torch.equal(torch.get_rng_state(), after_build)
    weights = {canonical_name(name): tensor for name, tensor in materialized.state_dict().items()}
    assert weights.keys() == built.state_dict().keys()
    assert all(torch.equal(weights[name], tensor) for name, tensor in built.state_dict().items())


def test_materializing_a_tensor_without_an_initializer_is_refused(small_config):
    model = HybridLM.on_meta(small_config())
    model.backbone.layers[0].extra = torch.nn.Linear(4, 4, device="meta")
    with pytest.raises(ValueError, match=r"no initializer for backbone\.layers\.0\.extra\.bias, "
                                         r"backbone\.layers\.0\.extra\.weight"):
        parallelize(model, Parallel.single_process())


def test_compile_traces_every_layer_kind_in_fp32(small_config):
    """Every block kind (Mamba, attention, LatentMoE, MLP) and the MTP block, compiled in place: the MoE's native
    grouped GEMM traces under fake tensors (in fp32 too), and names and values stay those of eager."""
    torch.manual_seed(0)
    model = HybridLM(small_config())
    assert set(model.config.layers_block_type) == {"linear_attention", "full_attention", "moe", "mlp"}
    compiled = parallelize(copy.deepcopy(model), Parallel.single_process(), compile=True, compile_backend="aot_eager")
    ids = torch.randint(3, 128, (2, 16))
    loss, grads = loss_and_grads(model, ids)
    loss_c, grads_c = loss_and_grads(compiled, ids)
    assert abs(loss_c - loss) <= 1e-5
    assert grads.keys() == grads_c.keys()
    assert all(torch.allclose(grads[name], grads_c[name], atol=1e-5, rtol=1e-4) for name in grads)


def test_compiled_loss_is_the_models_loss(small_config, monkeypatch):
    """`train.compile`'s objective: the cross entropies compiled outside the model's forward, same loss, same
    gradients; the pipeline's last stage computes the same loss from lm_head's inputs (`loss_from_outputs`). Traced with
    aot_eager (the fake-tensor pass a compile runs, without code generation)."""
    import functools

    from hybridtron.train.objectives import PretrainObjective

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch.manual_seed(0)
    model = HybridLM(small_config())
    ids = torch.randint(3, 128, (2, 16))
    labels = torch.roll(ids, -1, 1)
    labels[0, 5] = -100
    results = []
    for objective in (PretrainObjective(), PretrainObjective(compile_loss=True)):
        objective.begin_step([(ids, labels)])
        out = objective(model, (ids, labels))
        out.loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        results.append((out, grads))
    (eager, eager_grads), (compiled, compiled_grads) = results
    assert eager.metrics.keys() == compiled.metrics.keys()
    assert all(abs(float(eager.metrics[k]) - float(compiled.metrics[k])) <= 1e-5 for k in eager.metrics)
    assert all(torch.allclose(eager_grads[n], compiled_grads[n], atol=1e-6) for n in eager_grads)
    assert {k: v.tolist() for k, v in eager.expert_counts.items()} == \
        {k: v.tolist() for k, v in compiled.expert_counts.items()}
    with torch.no_grad():
        out = model(ids, logits=False)
        last_stage = PretrainObjective().loss_from_outputs(model, (out.hidden, *out.mtp_hidden), (ids, labels))
    assert abs(float(last_stage.loss) - float(eager.loss.detach())) <= 1e-6


def test_a_context_parallel_rank_holds_a_head_and_a_tail_chunk_with_what_follows_each():
    ids = torch.arange(24).reshape(2, 12)
    labels = ids + 100
    first = shard_sequence(ids, labels, 0, 3, 2)  # chunks 0 and 5 of 6, each sequence's two as two rows
    assert first[0].tolist() == [[0, 1], [10, 11], [12, 13], [22, 23]]
    assert first[1].tolist() == [[100, 101, 102, 103], [110, 111, IGNORE_INDEX, IGNORE_INDEX],
                                 [112, 113, 114, 115], [122, 123, IGNORE_INDEX, IGNORE_INDEX]]
    assert first[2].tolist() == [[2, 3], [PAST_END] * 2, [14, 15], [PAST_END] * 2]  # nothing follows the last
    middle = shard_sequence(ids, labels, 1, 3, 2)  # chunks 1 and 4
    assert middle[0].tolist() == [[2, 3], [8, 9], [14, 15], [20, 21]]
    assert middle[2].tolist() == [[4, 5], [10, 11], [16, 17], [22, 23]]
    # every rank's rows put back in sequence order are the whole sequence
    shares = [shard_sequence(ids, labels, rank, 3, 0)[0] for rank in range(3)]
    heads = [share[0::2] for share in shares]
    tails = [share[1::2] for share in reversed(shares)]
    assert torch.equal(torch.cat(heads + tails, dim=1), ids)
    with pytest.raises(ValueError, match="12 positions does not split into the 2 x cp = 8 chunks of cp 4"):
        shard_sequence(ids, labels, 0, 4, 2)


@pytest.mark.parametrize("cp", [2, 4, 32])
def test_head_and_tail_chunks_give_every_rank_the_same_causal_attention_work(cp):
    # a chunk c's queries read c + 1 chunks of keys (context_parallel.chunk_attention): 2 cp + 1 on every rank
    held = [own_chunks(rank, cp) for rank in range(cp)]
    assert sorted(c for chunks in held for c in chunks) == list(range(2 * cp))
    assert {sum(c + 1 for c in chunks) for chunks in held} == {2 * cp + 1}
