"""The RL learner's log-prob passes under torchrun apply lm_head themselves by blocks of rows
(`distributed.head.apply_head` over `ops.linear_logprobs`), never through the model's [tokens, vocab] logits: on 2
gloo processes with FSDP (dp_shard=2, lm_head's weight gathered by its own hooks), TP 2 (lm_head
vocabulary-parallel, each block's logits gathered over the TP ranks), CP 2 (where a rank's share may hold no target
of an MTP depth and still applies the head: each call's backward reduce-scatters) and EP 2, a GRPO step (the
rollout's top-p filter, the entropy bonus, the MTP loss) and a MOPD step (the top-K reverse KL: the learner's
log-probs of the teacher's K tokens, the MTP loss) give one process's losses, metrics and gradients of every
parameter (1e-6, fp32), also where a data rank holds only padding; so do they under PP 2 (on 2 processes, and on 4
with FSDP over each stage's 2 data ranks), whose last stage hands the loss lm_head's inputs. lm_head's own
forward (which would make the whole logits) never runs, and no tensor over the vocabulary has more than
`logprob_chunk` rows, forward or backward. In one process, a head converted for `train.grad_accum_dtype`
(`MainGradLinear`) takes the same blocks, its gradient accumulated in its main_grad."""

from __future__ import annotations

import copy
import functools
import os
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from gloo import differences
from layout_worker import SEED, _small_config

from hybridtron.config import parse_pattern
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.mesh import init_parallel
from hybridtron.distributed.parallelize import parallelize
from hybridtron.distributed.state import canonical_name
from hybridtron.model.lm import HybridLM
from hybridtron.numerics.grad_accum import MainGradLinear
from hybridtron.ops import linear_cross_entropy as linear_cross_entropy_module
from hybridtron.ops.linear_logprobs import linear_logprobs
from hybridtron.post.grpo import GRPOObjective
from hybridtron.post.mopd import MOPDObjective
from hybridtron.post.rl.batches import pack_micro_batches, shard_micro_batch, uniform_micro_batches

sys.path.insert(0, str(Path(__file__).parents[1] / "post"))
from test_logprob_chunk import CHUNK, _batch, _grpo, _mopd  # noqa: E402

WORLD, VOCAB = 2, 1030  # no other dimension of the model is the vocabulary or its half
TOLERANCE = 1e-6


class _LargestPerVocabulary(TorchDispatchMode):
    """The most rows of any tensor an op makes whose last dimension is the vocabulary's (views left out: lm_head's
    weight transposed is [D, V]; FSDP's gathered storage is read through views)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor) and tensor.ndim and tensor.shape[-1] == self.vocab:
                    self.rows = max(self.rows, tensor.numel() // self.vocab)
        return out


def _objectives(config, parallel):
    """GRPO with a filter, the entropy bonus and the MTP loss; MOPD with the top-K KL and the MTP loss (routing
    replay off: TP does not take it)."""
    grpo = _grpo(temperature=0.8, top_p=0.9, entropy_coef=0.01, mtp_loss_weight=0.3, logprob_chunk=CHUNK,
                 routing_replay=False)
    mopd = _mopd(kl_top_k=4, temperature=0.7, mtp_loss_weight=0.2, logprob_chunk=CHUNK, routing_replay=False)
    return {"grpo": (GRPOObjective(grpo, config.mtp_depths, parallel), _batch(config, ["toy"] * 8,
                                                                             [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0],
                                                                             seed=1)),
            "mopd": (MOPDObjective(mopd, ["a", "b"], config.mtp_depths, parallel=parallel),
                     _batch(config, ["a", "b"] * 4, [0.0] * 8, seed=2, top=8))}


def _totals(results, parallel):
    """The micro-batches' losses and metrics, [micro-batch, loss then each metric], summed over the data ranks."""
    totals = torch.stack([torch.stack([result.loss.detach(), *(result.metrics[k].float()
                                                               for k in sorted(result.metrics))])
                          for result in results])
    return totals if parallel is None else parallel.sum_over_data(totals)


def _step(model, objective, micro_batches, parallel):
    """(losses and metrics summed over the data ranks, each parameter's whole gradient) of one step."""
    model.zero_grad()
    objective.begin_step(micro_batches)
    results = []
    for mb in micro_batches:
        results.append(objective(model, mb))
        results[-1].loss.backward()
    return _totals(results, parallel), _grads(model)


def _pipeline_step(model, objective, micro_batches, parallel):
    """`_step` through the pipeline's schedule, the loss on the last stage from its outputs (lm_head's inputs):
    (the losses and metrics on the last stage, None on the others; the gradients of this rank's parameters)."""
    model.zero_grad()
    objective.begin_step(micro_batches)
    results = {}

    def last_stage_loss(outputs, index):
        results[int(index)] = objective.loss_from_outputs(model, outputs, micro_batches[int(index)])
        return results[int(index)].loss

    parallel.pipeline.step([objective.stage_inputs(mb) for mb in micro_batches], last_stage_loss)
    return _totals([results[i] for i in sorted(results)], parallel) if results else None, _grads(model)


def _grads(model):
    """Each parameter's whole gradient, by its single-process name."""
    packings = getattr(model, "_tp_packings", {})
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:  # a converted head's gradient is in its main_grad
            continue
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        name = canonical_name(name)
        grads[name] = packings[name].canonical(grad) if name in packings else grad
    return grads


def _whole_logits(*args, **kwargs):
    raise AssertionError("lm_head's own forward ran: the whole [tokens, vocab] logits")


def _by_blocks(model, step):
    """`step()` with lm_head's own forward failing (`apply_head` swaps it for its call) and no tensor over the
    vocabulary of more than a block; (its result, the most rows of such a tensor)."""
    if model.lm_head is None:  # a pipeline stage without the head
        return step(), 0
    own = model.lm_head.__dict__.get("forward")  # TP's, on the instance
    model.lm_head.forward = _whole_logits
    try:
        with _LargestPerVocabulary(model.config.vocab_size) as seen:
            return step(), seen.rows
    finally:
        if own is None:
            del model.lm_head.forward
        else:
            model.lm_head.forward = own


def _check(rank: int):
    os.environ.update(WORLD_SIZE=str(WORLD), RANK=str(rank), LOCAL_RANK=str(rank))
    linear_cross_entropy_module.BLOCK_ELEMENTS = CHUNK * VOCAB  # the MTP loss's blocks: CHUNK rows too
    config = _small_config(vocab_size=VOCAB, layers_block_type=parse_pattern("M*E-ME"),
                           mtp_layers_block_type=parse_pattern("*E"))
    for layout in (DistConfig(dp_shard=2, backend="gloo"), DistConfig(tp=2, backend="gloo"),
                   DistConfig(cp=2, backend="gloo"), DistConfig(ep=2, backend="gloo")):
        parallel = init_parallel(layout, config, batch_size=8, grad_accum=2, seq_len=16, context_parallel=True)
        torch.manual_seed(SEED)
        single = HybridLM(config)
        torch.manual_seed(SEED)
        model = parallelize(HybridLM.on_meta(config), parallel)
        # the last: 3 micro-batches of one rollout each, so that under data parallelism a rank holds padding only
        # (no scored token, no MTP target) and still applies the head as often as the other
        for kind, rollouts, count in (("grpo", 8, 2), ("mopd", 8, 2), ("grpo", 3, 3)):
            (objective, batch), (reference, _) = _objectives(config, parallel)[kind], _objectives(config, None)[kind]
            what = f"{kind} of {rollouts} rows in {count} micro-batches, dp={parallel.layout.dp} " \
                   f"tp={parallel.layout.tp} cp={parallel.layout.cp} ep={parallel.layout.ep}"
            batch.rollouts = batch.rollouts[:rollouts]
            micro_batches = pack_micro_batches(batch, count)
            want, want_grads = _step(single, reference, micro_batches, None)
            shards = [shard_micro_batch(mb, parallel, lookahead=config.mtp_depths, min_chunk=config.conv_kernel - 1)
                      for mb in micro_batches]
            (got, grads), rows = _by_blocks(model, lambda: _step(model, objective, shards, parallel))
            if rows > CHUNK or not rows and rollouts == 8:  # (a rank of padding only makes none)
                yield f"{what}: a tensor over the vocabulary of {rows} rows (a block is {CHUNK})"
            error = float((got - want).abs().max())
            if not error <= TOLERANCE * max(1.0, float(want.abs().max())):
                yield f"{what}: losses and metrics differ by {error:.3g}"
            if grads.keys() != want_grads.keys():
                yield f"{what}: gradients of {sorted(grads.keys() ^ want_grads.keys())} on one side only"
            for name in grads.keys() & want_grads.keys():
                error = float((grads[name] - want_grads[name]).abs().max())
                if not error <= TOLERANCE * max(1.0, float(want_grads[name].abs().max())):
                    yield f"{what}: {name}'s gradient differs by {error:.3g}"


def _check_pipeline(rank: int, world: int):
    """PP 2 (on 4 processes with FSDP over each stage's 2 data ranks): the last stage hands the loss lm_head's
    inputs, and GRPO's and MOPD's steps apply the stage's head by blocks as one process does."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    linear_cross_entropy_module.BLOCK_ELEMENTS = CHUNK * VOCAB
    config = _small_config(vocab_size=VOCAB, layers_block_type=parse_pattern("M*E-ME"),
                           mtp_layers_block_type=parse_pattern("*E"))
    parallel = init_parallel(DistConfig(pp=2, backend="gloo"), config, batch_size=8, grad_accum=2, seq_len=16)
    torch.manual_seed(SEED)
    single = HybridLM(config)
    torch.manual_seed(SEED)
    model = parallelize(HybridLM.on_meta(config), parallel)
    last = parallel.pipeline.holds_loss
    for kind in ("grpo", "mopd"):
        (objective, batch), (reference, _) = _objectives(config, parallel)[kind], _objectives(config, None)[kind]
        what = f"{kind} under pp=2 dp={parallel.layout.dp}, {'last' if last else 'first'} stage"
        micro_batches = uniform_micro_batches(pack_micro_batches(batch, 2), 2)  # the stages exchange one shape
        want, want_grads = _step(single, reference, micro_batches, None)
        shards = [shard_micro_batch(mb, parallel, lookahead=config.mtp_depths, min_chunk=config.conv_kernel - 1)
                  for mb in micro_batches]
        (got, grads), rows = _by_blocks(model, lambda: _pipeline_step(model, objective, shards, parallel))
        if last and not 0 < rows <= CHUNK:
            yield f"{what}: a tensor over the vocabulary of {rows} rows (a block is {CHUNK})"
        if last:
            error = float((got - want).abs().max())
            if not error <= TOLERANCE * max(1.0, float(want.abs().max())):
                yield f"{what}: losses and metrics differ by {error:.3g}"
        if not grads or ("lm_head.weight" in grads) != last or grads.keys() - want_grads.keys():
            yield f"{what}: gradients of {sorted(grads)}"
        for name in grads.keys() & want_grads.keys():
            error = float((grads[name] - want_grads[name]).abs().max())
            if not error <= TOLERANCE * max(1.0, float(want_grads[name].abs().max())):
                yield f"{what}: {name}'s gradient differs by {error:.3g}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_rl_learner_under_pp_applies_the_last_stages_lm_head_by_blocks_as_one_process(world):
    reported = differences(functools.partial(_check_pipeline, world=world), world)
    assert not reported, reported


@pytest.mark.timeout(300)
def test_rl_learner_under_fsdp_tp_cp_ep_applies_lm_head_by_blocks_as_one_process():
    reported = differences(_check, WORLD)
    assert not reported, reported


def test_a_converted_head_takes_the_blocks_and_accumulates_their_gradient_in_its_main_grad(small_config, monkeypatch):
    monkeypatch.setattr(linear_cross_entropy_module, "BLOCK_ELEMENTS", CHUNK * VOCAB)
    config = small_config(vocab_size=VOCAB)
    model = HybridLM(config)
    converted = copy.deepcopy(model)
    converted.lm_head = MainGradLinear(converted.lm_head, "fp32")
    converted.lm_head.recorder = []
    (objective, batch), = [_objectives(config, None)["grpo"]]
    micro_batches = pack_micro_batches(batch, 2)
    want, want_grads = _step(model, objective, micro_batches, None)
    (got, grads), rows = _by_blocks(converted, lambda: _step(converted, objective, micro_batches, None))
    assert 0 < rows <= CHUNK
    torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
    assert grads.keys() == want_grads.keys() - {"lm_head.weight"}
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=TOLERANCE, atol=TOLERANCE, msg=name)
    torch.testing.assert_close(converted.lm_head.main_grad, want_grads["lm_head.weight"], rtol=TOLERANCE,
                               atol=TOLERANCE)
    # each micro-batch applied the head once for the sampled log-probs and once per MTP depth
    assert len(converted.lm_head.recorder) == len(micro_batches) * (1 + config.mtp_depths)


def test_a_vocabulary_group_without_a_weight_is_a_clear_error():
    with pytest.raises(ValueError, match="a vocab_group splits lm_head's weight, and no weight was given"):
        linear_logprobs(torch.randn(4, 8), None, lambda logits: (logits.sum(-1),), chunk=2, vocab_group=object())
