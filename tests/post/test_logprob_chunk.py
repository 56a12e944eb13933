"""The RL log-prob passes by blocks of rows (`logprob_chunk`, hybridtron.post.rl.objective.token_scores over
ops.linear_logprobs), through lm_head's weight and through the model's logits (a quantized head), against the
whole-logits path they replaced: GRPO's and MOPD's losses, metrics and gradients, the reference's and the teachers'
scores; no [tokens, vocab] tensor beyond one block through the weight; the setting's checks."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridtron.checkpoint import save_pretrained
from hybridtron.model.lm import HybridLM
from hybridtron.ops import linear_cross_entropy as linear_cross_entropy_module
from hybridtron.post.grpo import GRPOConfig, GRPOObjective
from hybridtron.post.losses import group_advantages
from hybridtron.post.mopd import MOPDConfig, MOPDObjective
from hybridtron.post.reference import REFERENCE_SCORE, score_reference
from hybridtron.post.rl.batches import pack_micro_batches
from hybridtron.post.rl.objective import HeadOutputs, sampled_logprobs
from hybridtron.post.rl.rollout import Rollout, RolloutBatch
from hybridtron.post.teachers import TEACHER_SCORE, TEACHER_TOPK_IDS, TEACHER_TOPK_LOGP, TeacherScoringRole

CHUNK = 5  # rows per block: never divides a micro-batch's completion tokens here, so the last block is short
WHOLE = 1 << 30  # one block of every position: the logits path before `logprob_chunk`
LOOSE = dict(rtol=1e-6, atol=1e-6)


def _batch(config, domains, rewards, seed=0, top=0) -> RolloutBatch:
    """Rollouts of random tokens (prompt 3-6, completion 2-9 tokens) with the rollout's experts, engine log-probs,
    GRPO advantages (groups of 4) and a teacher's scores (and its top `top` tokens)."""
    g = torch.Generator().manual_seed(seed)
    k, E, V = config.num_experts_per_tok, config.n_routed_experts, config.vocab_size
    moe = [str(i) for i, kind in enumerate(config.layers_block_type) if kind == "moe"]
    advantages = group_advantages(torch.tensor(rewards).view(-1, 4), mode="zscore").flatten().tolist()
    rollouts = []
    for domain, reward, advantage in zip(domains, rewards, advantages):
        P, C = (int(torch.randint(low, high, (1,), generator=g)) for low, high in ((3, 7), (2, 10)))
        ids = {name: torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(P + C - 1)]).to(torch.int16)
               for name in moe}
        rollout = Rollout(task_id=f"t{len(rollouts) // 4}", domain=domain, difficulty=1,
                          prompt_ids=torch.randint(0, V, (P,), generator=g).tolist(),
                          completion_ids=torch.randint(0, V, (C,), generator=g).tolist(),
                          logprobs=-torch.rand(C, generator=g) * 3, finish_reason="stop", reward=reward,
                          advantage=advantage, expert_ids=ids)
        rollout.scores[TEACHER_SCORE] = -torch.rand(C, generator=g) * 4
        if top:
            top_logp, top_ids = torch.log_softmax(torch.randn(C, V, generator=g), -1).topk(top, dim=-1)
            rollout.scores[TEACHER_TOPK_IDS], rollout.scores[TEACHER_TOPK_LOGP] = top_ids.to(torch.int32), top_logp
        rollouts.append(rollout)
    return RolloutBatch(index=1, policy_version=0, group_size=4, rollouts=rollouts, stats={})


def _step(model, objective, micro_batches, logits: bool):
    """(losses, metrics, gradients) of a step: through lm_head's weight, or (`logits`) from the model's logits as a
    quantized head's `HeadOutputs` hand them over."""
    model.zero_grad()
    objective.begin_step(micro_batches)
    losses, metrics = [], []
    for mb in micro_batches:
        if logits:
            replay = mb.expert_ids if objective.config.routing_replay else None
            out = model(mb.input_ids, expert_ids=replay, mtp=objective.mtp_depths > 0, counted=mb.counted)
            result = objective.loss_from_outputs(model, HeadOutputs((out.logits, *out.mtp_logits)), mb)
        else:
            result = objective(model, mb)
        result.loss.backward()
        losses.append(result.loss.detach())
        metrics.append(result.metrics)
    return losses, metrics, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _same_step(model, objective_with_chunk, micro_batches):
    """The step by blocks of CHUNK rows, through lm_head's weight and through the logits (a quantized head),
    equals the one on the whole logits (the path before `logprob_chunk`): losses, metrics and gradients to 1e-6. (Not to the bit: a block's GEMMs have fewer rows than the whole micro-batch's, and BLAS may
    round a product of one or two rows differently; lm_head's gradient sums the rows block by block.
    tests/ops/test_linear_logprobs.py has where the bits agree.)"""
    whole = _step(model, objective_with_chunk(WHOLE), micro_batches, True)
    for blocks in (_step(model, objective_with_chunk(CHUNK), micro_batches, flag) for flag in (False, True)):
        for loss, expected in zip(blocks[0], whole[0]):
            torch.testing.assert_close(loss, expected, **LOOSE)
        for metrics, expected in zip(blocks[1], whole[1]):
            assert metrics.keys() == expected.keys()
            for key in metrics:
                torch.testing.assert_close(metrics[key].float(), expected[key].float(), **LOOSE, msg=key)
        assert blocks[2].keys() == whole[2].keys()
        for name, grad in blocks[2].items():
            torch.testing.assert_close(grad, whole[2][name], **LOOSE, msg=name)
    return blocks


def _grpo(**overrides) -> GRPOConfig:
    return GRPOConfig(**{**dict(group_size=4, prompts_per_step=2, eval_tasks=0), **overrides})


@pytest.mark.parametrize("overrides", [
    dict(mtp_loss_weight=0.0),
    dict(mtp_loss_weight=0.0, temperature=0.7, top_k=20, top_p=0.9),
    dict(mtp_loss_weight=0.3, temperature=1.3, entropy_coef=0.01, correction="icepop"),
])
def test_grpo_by_blocks_of_rows_is_the_whole_logits_loss(small_config, overrides):
    """With the rollout's filters, and with the entropy bonus (a second differentiated output) and the MTP loss
    (pretraining's fused lm_head + CE)."""
    config = small_config(vocab_size=300)
    model = HybridLM(config)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0]
    micro_batches = pack_micro_batches(_batch(config, ["toy"] * 8, rewards, seed=1), 2)
    _same_step(model, lambda chunk: GRPOObjective(_grpo(**overrides, logprob_chunk=chunk), config.mtp_depths),
               micro_batches)


def _mopd(**overrides) -> MOPDConfig:
    return MOPDConfig(**{**dict(envs=("a", "b"), prompts_per_step=2, eval_tasks=0, warmup_steps=0), **overrides})


@pytest.mark.parametrize("overrides", [
    dict(mtp_loss_weight=0.0, temperature=0.8, top_p=0.95),
    dict(mtp_loss_weight=0.0, kl_top_k=6, temperature=0.6),
    dict(mtp_loss_weight=0.2, kl_top_k=4),
])
def test_mopd_by_blocks_of_rows_is_the_whole_logits_loss(small_config, overrides):
    """The sampled reverse KL and the top-K one (the student's log-probs of the teacher's K tokens and its
    log-normaliser, by blocks too)."""
    config = small_config(vocab_size=300)
    model = HybridLM(config)
    domains = ["a", "b", "a", "b", "a", "a", "b", "b"]
    micro_batches = pack_micro_batches(_batch(config, domains, [0.0] * 8, seed=2, top=8), 2)
    (_, metrics, _) = _same_step(
        model, lambda chunk: MOPDObjective(_mopd(**overrides, logprob_chunk=chunk), ["a", "b"], config.mtp_depths),
        micro_batches)
    if overrides.get("kl_top_k"):
        assert all(m["topk_reverse_kl"] > 0 for m in metrics)


class _LargestPerVocabulary(TorchDispatchMode):
    """Records the most rows of any tensor an op makes whose last dimension is the vocabulary's (views of an input
    left out: lm_head's weight transposed is [D, V])."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {arg.untyped_storage().data_ptr() for arg in args if isinstance(arg, torch.Tensor)}
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.ndim and tensor.shape[-1] == self.vocab \
                    and tensor.untyped_storage().data_ptr() not in inputs:
                self.rows = max(self.rows, tensor.numel() // self.vocab)
        return out


def test_no_pass_makes_a_tensor_over_the_vocabulary_beyond_one_block(small_config, tmp_path, monkeypatch):
    """The learner's step (forward and backward, with the MTP loss and the top-K KL), the reference's scoring and
    the teachers' make no [rows, vocab] tensor of more than `logprob_chunk` rows (the whole-logits path makes one
    of every position). The MTP loss goes through pretraining's fused lm_head + CE, whose blocks are counted in
    elements (32 MiB of logits: 64 rows at Ultra's vocabulary); here set to CHUNK rows too."""
    monkeypatch.setattr(linear_cross_entropy_module, "BLOCK_ELEMENTS", CHUNK * 1031)
    config = small_config(vocab_size=1031)  # no other dimension of the model is this
    model = HybridLM(config)
    domains = ["a", "b"] * 4
    batch = _batch(config, domains, [0.0] * 8, seed=3, top=4)
    micro_batches = pack_micro_batches(batch, 1)
    positions = micro_batches[0].input_ids.numel()
    objective = MOPDObjective(_mopd(kl_top_k=4, top_p=0.9, logprob_chunk=CHUNK), ["a", "b"], config.mtp_depths)
    for logits, bound in ((False, CHUNK), (True, positions)):
        with _LargestPerVocabulary(config.vocab_size) as seen:
            _step(model, objective, micro_batches, logits)
        assert seen.rows == bound, (logits, seen.rows)
    save_pretrained(model, tmp_path / "teacher")
    teachers = TeacherScoringRole(teachers={"a": str(tmp_path / "teacher")}, general=str(tmp_path / "teacher"),
                                  top_k=3, logprob_chunk=CHUNK)
    with _LargestPerVocabulary(config.vocab_size) as seen:
        score_reference(model, batch.rollouts, temperature=0.9, top_p=0.8, chunk=CHUNK)
        teachers.score(teachers.models[str(tmp_path / "teacher")], batch.rollouts)
    assert seen.rows == CHUNK


def test_reference_and_teacher_scores_by_blocks_are_the_whole_logits_ones(small_config, tmp_path):
    """The reference's filtered log-probs and a teacher's log-probs and top K, by blocks of 5 rows, against the
    same computed on the model's logits (routes replayed for the reference, as the learner does)."""
    config = small_config(vocab_size=300)
    model = HybridLM(config).eval()
    batch = _batch(config, ["a"] * 4, [0.0] * 4, seed=4)
    (rows,) = pack_micro_batches(batch, 1)
    mask = rows.completion_mask
    with torch.no_grad():
        logits = model(rows.input_ids, expert_ids=rows.expert_ids, mtp=False).logits
        expected = sampled_logprobs(logits, rows.labels, 0.8, 7, 0.9)[mask]
        score_reference(model, batch.rollouts, temperature=0.8, top_k=7, top_p=0.9, chunk=CHUNK)
    (scored,) = pack_micro_batches(batch, 1)
    torch.testing.assert_close(scored.scores[REFERENCE_SCORE][mask], expected, **LOOSE)
    save_pretrained(model, tmp_path / "teacher")
    teachers = TeacherScoringRole(teachers={}, general=str(tmp_path / "teacher"), temperature=1.2, top_k=3,
                                  logprob_chunk=CHUNK)
    teachers.score(teachers.models[str(tmp_path / "teacher")], batch.rollouts)
    with torch.no_grad():
        logits = model(rows.input_ids, mtp=False).logits
    top_logp, top_ids = torch.log_softmax(logits / 1.2, -1).topk(3, dim=-1)
    (scored,) = pack_micro_batches(batch, 1)
    torch.testing.assert_close(scored.scores[TEACHER_SCORE][mask], sampled_logprobs(logits, rows.labels, 1.2)[mask],
                               **LOOSE)
    torch.testing.assert_close(scored.scores[TEACHER_TOPK_LOGP][mask], top_logp[mask], **LOOSE)
    assert torch.equal(scored.scores[TEACHER_TOPK_IDS][mask], top_ids[mask].to(torch.int32))


@pytest.mark.parametrize("section", [_grpo, _mopd])
def test_a_chunk_below_one_row_is_a_clear_error(section):
    with pytest.raises(ValueError, match=r"(grpo|mopd)\.logprob_chunk must be >= 1, got 0"):
        section(logprob_chunk=0).validate()
    assert GRPOConfig().logprob_chunk == MOPDConfig().logprob_chunk == 128
