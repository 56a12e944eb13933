"""GRPO (hybridtron.post.grpo on the RL core, hybridtron.post.rl): the learner's log-probs against the engine's, routing
replay, the objective's aggregation, dynamic sampling and the curriculum, sync against async, the command end to end
with resume, and clear errors. (The loss functions themselves: tests/post/test_losses.py.)"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil

import pytest
import torch

from hybridtron.checkpoint import load_pretrained, save_pretrained
from hybridtron.cli import main as cli_main
from hybridtron.config import ModelConfig
from hybridtron.data.chat import load_chat_tokenizer, tokenize_chat
from hybridtron.infer.engine import HybridEngine
from hybridtron.infer.sampling import SamplingParams, probs_from_logits
from hybridtron.model.lm import HybridLM
from hybridtron.envs import Environment, Task
from hybridtron.post.grpo import COMMAND, GRPO_TRAIN, GRPOConfig, GRPOObjective, GRPORunConfig
from hybridtron.post.losses import group_advantages
from hybridtron.post.reference import REFERENCE_SCORE, ReferenceScoringRole, score_reference
from hybridtron.post.rl.batches import pack_micro_batches, uniform_micro_batches
from hybridtron.post.rl.objective import sampled_logprobs
from hybridtron.post.rl.rollout import PassRateCurriculum, Rollout, RolloutBatch, RolloutRequest, RolloutRole
from hybridtron.train.config import TrainConfig
from hybridtron.train.loop import Trainer
from hybridtron.train.objectives import BatchSource
from hybridtron.train.monitor.config import MonitorConfig


class ToyEnv(Environment):
    """Level 1: reward 1 for a completion of even length in characters, else 0 (groups mostly disagree); level 2:
    always 0 (every group agrees). Importable by a rollout process as `test_grpo:ToyEnv`."""

    domain = "toy"

    def __init__(self, levels=(1, 2)):
        self.levels = tuple(levels)

    def generate(self, rng):
        level = rng.choice(self.levels)
        return Task(prompt=f"Count to {rng.randint(0, 10 ** 6)}.", domain="toy", difficulty=level)

    def reward(self, task, completion):
        return 0.0 if task.difficulty == 2 else float(len(completion) % 2 == 0)


TOY = f"{__name__}:ToyEnv"


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, small_config, random_policy):
    """A small random model (tests/conftest.py's small config, 512 tokens, MTP) as an HF checkpoint with the chat
    tokenizer and template, as an SFT export leaves it."""
    directory = tmp_path_factory.mktemp("policy") / "hf"
    words = ["What is", "Count to", "Reason step by step", "boxed", "answer", "think"] + [str(i) for i in range(100)]
    return random_policy(directory, small_config(vocab_size=512, mtp_num_depths=2, max_position_embeddings=256), words)


@pytest.fixture(scope="module")
def policy(policy_dir):
    return load_pretrained(policy_dir, dtype=torch.float32), load_chat_tokenizer(policy_dir, vocab_size=512)


def tiny_grpo(**overrides) -> GRPOConfig:
    values = dict(group_size=4, prompts_per_step=2, max_new_tokens=10, task_pool=40, draft_length=2, eval_tasks=0,
                  max_refill_rounds=1, rollout_threads=1)
    return GRPOConfig(**{**values, **overrides})


def prompts_of(tokenizer, n: int) -> list[list[int]]:
    return [tokenize_chat(tokenizer, [{"role": "user", "content": f"What is {i} + {i}?"}],
                          add_generation_prompt=True).ids.tolist() for i in range(n)]


def rollouts_from(completions, rewards_PG) -> RolloutBatch:
    advantages = group_advantages(torch.tensor(rewards_PG), mode="zscore")
    rollouts = [Rollout(task_id=f"t{p}", domain="toy", difficulty=1, prompt_ids=c.prompt_ids,
                        completion_ids=c.token_ids, logprobs=c.logprobs, finish_reason=c.finish_reason,
                        reward=rewards_PG[p][g], advantage=float(advantages[p, g]),
                        expert_ids={k: v.to(torch.int16) for k, v in c.expert_ids.items()} if c.expert_ids else None)
                for p, group in enumerate(completions) for g, c in enumerate(group)]
    return RolloutBatch(index=1, policy_version=0, group_size=len(completions[0]), rollouts=rollouts, stats={})


# ------------------------------------------------------------------------------------- log-probs, parity
def test_sampled_logprobs_are_those_of_the_engines_sampling_distribution():
    logits = torch.randn(2, 5, 11, dtype=torch.float64).float() * 3
    tokens = torch.randint(0, 11, (2, 5))
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 0, 1.0), (0.8, 4, 1.0), (1.2, 0, 0.8), (0.9, 6, 0.7)):
        probs = probs_from_logits(logits, temperature, top_k, top_p)
        expected = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log().clamp(min=-50.0)
        got = sampled_logprobs(logits, tokens, temperature, top_k, top_p)
        assert torch.allclose(got, expected, atol=1e-5), (temperature, top_k, top_p)
    # a token outside the nucleus: floored, and no gradient through it (nor NaN elsewhere)
    logits = torch.tensor([[[5.0, 0.0, -5.0]]], requires_grad=True)
    value = sampled_logprobs(logits, torch.tensor([[2]]), 1.0, 0, 0.5)
    value.sum().backward()
    assert value.item() == -50.0 and torch.equal(logits.grad, torch.zeros_like(logits))


def _parity(model, tokenizer, speculative, temperature=0.9, top_p=1.0, engine_model=None, autocast=False):
    """Max and mean |trainer - engine| log-prob over the completion tokens of a generation with routing replay."""
    engine = HybridEngine.from_model(engine_model or model, tokenizer, speculative=speculative, draft_length=2)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=3, max_tokens=12)
    completions = engine.generate(prompts_of(tokenizer, 3), params, n=2, logprobs=True, expert_ids=True)
    batch = rollouts_from(completions, [[0.0, 1.0]] * 3)
    mb = pack_micro_batches(batch, 1)[0]
    objective = GRPOObjective(tiny_grpo(temperature=temperature, top_p=top_p, mtp_loss_weight=0.0), 0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logp = objective.scores(objective.forward(model.eval(), mb)[0], mb).logp
    diff = (logp - mb.rollout_logprobs).abs()[mb.completion_mask]
    return float(diff.max()), float(diff.mean()), int(mb.completion_mask.sum())


@pytest.mark.parametrize("speculative", [False, True])
def test_trainer_and_engine_log_probs_agree_in_fp32(policy, speculative):
    """The learner's forward (full sequence, routing replayed) and the engine's decoding (prefill, cache, MTP
    drafts verified in chunks) give the same log-prob for every sampled token, at a temperature and with top-p."""
    model, tokenizer = policy
    for temperature, top_p in ((0.9, 1.0), (1.0, 0.9)):
        worst, _, tokens = _parity(model, tokenizer, speculative, temperature, top_p)
        assert tokens > 20 and worst < 1e-5, (temperature, top_p, worst)


@pytest.mark.parametrize("speculative", [False, True])
def test_trainer_and_engine_log_probs_in_bf16_stay_within_the_budget(policy, speculative):
    """bf16 against fp32, in both directions: an engine holding bf16 weights against the fp32 trainer, and a
    trainer under bf16 autocast against the fp32 engine. The budget, |delta log p| mean < 0.01 and max < 0.1 over
    the completion tokens, is about 10x what this model measures (0.001 / 0.004) and 5x what the quickstart +
    SFT model does (0.0010 / 0.02 over 72 tokens; docs/LOG.md, GRPO)."""
    model, tokenizer = policy
    bf16_engine = copy.deepcopy(model).to(torch.bfloat16)
    for engine_model, autocast in ((bf16_engine, False), (None, True)):
        worst, mean, _ = _parity(model, tokenizer, speculative, engine_model=engine_model, autocast=autocast)
        assert mean < 0.01 and worst < 0.1, (autocast, mean, worst)


def test_routing_replay_forces_the_rollout_experts_and_the_router_still_learns(policy):
    model, tokenizer = policy
    engine = HybridEngine.from_model(model, tokenizer, speculative=True, draft_length=2)
    completions = engine.generate(prompts_of(tokenizer, 2), SamplingParams(seed=1, max_tokens=8), n=2,
                                  expert_ids=True)
    mb = pack_micro_batches(rollouts_from(completions, [[0.0, 1.0]] * 2), 1)[0]
    learner = copy.deepcopy(model).train()
    with torch.no_grad():  # a learner whose own routing differs from the rollout's
        for moe in learner.moe_layers():
            moe.gate.weight.add_(torch.randn_like(moe.gate.weight))
    routers = {name: moe for name, moe in learner.routers().items() if not name.startswith("mtp.")}
    valid = mb.valid.flatten()
    for replay in (True, False):
        objective = GRPOObjective(tiny_grpo(routing_replay=replay, mtp_loss_weight=0.0), 0)
        learner.zero_grad()
        logp = objective.scores(objective.forward(learner, mb)[0], mb).logp  # routing replayed by `forward`
        logp[mb.completion_mask].sum().backward()
        same = [torch.equal(moe.last_expert_ids[valid], mb.expert_ids[name].flatten(0, 1)[valid])
                for name, moe in routers.items()]
        assert all(same) if replay else not all(same)
        for moe in routers.values():
            assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------- the objective
def _random_batch(config: ModelConfig, rewards_PG, *, seed=0, experts=True) -> RolloutBatch:
    """Rollouts of random tokens (prompt 3-6, completion 2-9 tokens), with random distinct expert ids."""
    g = torch.Generator().manual_seed(seed)
    k, E = config.num_experts_per_tok, config.n_routed_experts
    moe_names = [str(i) for i, kind in enumerate(config.layers_block_type) if kind == "moe"]
    advantages = group_advantages(torch.tensor(rewards_PG), mode="zscore")
    rollouts = []
    for p, group in enumerate(rewards_PG):
        prompt = torch.randint(0, config.vocab_size, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
        for reward, advantage in zip(group, advantages[p].tolist()):
            C = int(torch.randint(2, 10, (1,), generator=g))
            length = len(prompt) + C - 1
            ids = {name: torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(length)]).to(torch.int16)
                   for name in moe_names} if experts else None
            rollouts.append(Rollout(task_id=f"t{p}", domain="toy", difficulty=1, prompt_ids=prompt.tolist(),
                                    completion_ids=torch.randint(0, config.vocab_size, (C,), generator=g).tolist(),
                                    logprobs=-torch.rand(C, generator=g) * 3, finish_reason="stop", reward=reward,
                                    advantage=advantage, expert_ids=ids))
    return RolloutBatch(index=1, policy_version=0, group_size=len(rewards_PG[0]), rollouts=rollouts, stats={})


def _gradients(model, objective, micro_batches):
    model.zero_grad()
    objective.begin_step(micro_batches)
    for mb in micro_batches:
        objective(model, mb).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_zero_variance_groups_contribute_nothing(small_config):
    """A group whose rewards all agree adds no term and no token count to the policy loss: the gradient with it
    equals the gradient without it."""
    config = small_config(vocab_size=64)
    model = HybridLM(config)
    objective = GRPOObjective(tiny_grpo(mtp_loss_weight=0.0, kl_coef=0.0), 0)
    informative = _random_batch(config, [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]], seed=1)
    agreeing = _random_batch(config, [[1.0, 1.0, 1.0, 1.0]], seed=2)
    both = dataclasses.replace(informative, rollouts=informative.rollouts + agreeing.rollouts)
    without = _gradients(model, objective, pack_micro_batches(informative, 1))
    with_them = _gradients(model, objective, pack_micro_batches(both, 2))
    assert objective.counts[1] == sum(len(r.completion_ids) for r in informative.rollouts)
    for name in without:
        assert torch.allclose(with_them[name], without[name], atol=1e-6, rtol=1e-5), name
    only_agreeing = _gradients(model, objective, pack_micro_batches(agreeing, 1))  # nothing but the MTP-free zero
    assert all(g.abs().max() == 0 for g in only_agreeing.values())


def _scored_by(reference, batch, config: GRPOConfig) -> RolloutBatch:
    """`batch` with the reference-scoring role's scores (what the pipeline hands the learner)."""
    score_reference(reference, batch.rollouts, temperature=config.temperature, top_k=config.top_k,
                    top_p=config.top_p, routing_replay=config.routing_replay)
    return batch


def test_reference_kl_is_logged_without_changing_the_gradient(small_config):
    """grpo.reference_kl: the k3 KL to the frozen initial model is logged with kl_coef = 0, 0 while the policy is
    the reference and positive once it has moved, and the gradient is the one without a reference."""
    config = small_config(vocab_size=64)
    model = HybridLM(config)
    reference = copy.deepcopy(model).requires_grad_(False).eval()
    grpo = tiny_grpo(mtp_loss_weight=0.0, reference_kl=True)
    micro_batches = pack_micro_batches(_scored_by(reference, _random_batch(config, [[1.0, 0.0, 0.0, 1.0]], seed=3),
                                                  grpo), 1)
    plain = GRPOObjective(tiny_grpo(mtp_loss_weight=0.0), 0)
    logged = GRPOObjective(grpo, 0)
    expected, got = _gradients(model, plain, micro_batches), _gradients(model, logged, micro_batches)
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert "kl" not in plain(model, micro_batches[0]).metrics
    assert logged(model, micro_batches[0]).metrics["kl"].abs() < 1e-6
    with torch.no_grad():
        model.lm_head.weight.add_(0.5 * torch.randn_like(model.lm_head.weight))
    assert logged(model, micro_batches[0]).metrics["kl"] > 1e-3


@pytest.mark.parametrize("routing_replay, top_k, top_p", [(True, 0, 1.0), (False, 5, 0.9)])
def test_the_reference_role_scores_what_the_learner_would_compute(small_config, tmp_path, routing_replay, top_k,
                                                                   top_p):
    """The reference-scoring role's log-probs, laid out in a micro-batch, are the reference's forward on that
    micro-batch (routes replayed, the rollout's temperature and filters) at every completion token, to float noise
    (each forward batches other rows)."""
    config = small_config(vocab_size=64)
    reference = HybridLM(config).eval()
    save_pretrained(reference, tmp_path / "initial")
    grpo = tiny_grpo(temperature=0.7, top_k=top_k, top_p=top_p, routing_replay=routing_replay,
                     reference_batch_size=3)
    batch = _random_batch(config, [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]], seed=5)
    role = ReferenceScoringRole(model_dir=str(tmp_path / "initial"), model_config=config, config=grpo)
    scored = role.step(batch)
    assert scored.stats["reference_seconds"] >= 0
    mb = pack_micro_batches(scored, 1)[0]
    with torch.no_grad():
        logits = reference(mb.input_ids, expert_ids=mb.expert_ids if routing_replay else None, mtp=False).logits
    expected = sampled_logprobs(logits, mb.labels, 0.7, top_k, top_p)
    mask = mb.completion_mask
    assert torch.allclose(mb.scores[REFERENCE_SCORE][mask], expected[mask], atol=1e-5)
    assert (mb.scores[REFERENCE_SCORE][~mask] == 0).all()


def test_the_kl_without_reference_scores_is_a_clear_error(small_config):
    config = small_config(vocab_size=64)
    model = HybridLM(config)
    mb = pack_micro_batches(_random_batch(config, [[1.0, 0.0, 0.0, 1.0]], seed=3), 1)[0]
    objective = GRPOObjective(tiny_grpo(kl_coef=0.1), 0)
    objective.begin_step([mb])
    with pytest.raises(ValueError, match=r"grpo.kl_coef=0.1, grpo.reference_kl=False: the KL needs the reference's "
                                         r"log-probs, but the rollouts carry no scores\['reference'\]"):
        objective(model, mb)


def test_uniform_micro_batches_pad_to_one_shape_and_change_no_loss(small_config):
    """Under PP a step's micro-batches are padded to one shape and to grad_accum of them (the pipeline's stages
    exchange fixed shapes): the padding is no completion and not valid, so the step's loss, metrics and gradient
    are those of the ragged micro-batches."""
    config = small_config(vocab_size=64)
    model = HybridLM(config)
    ragged = pack_micro_batches(_random_batch(config, [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]], seed=4), 3)
    uniform = uniform_micro_batches(ragged, 4)
    assert len({tuple(mb.input_ids.shape) for mb in ragged}) > 1
    assert len(uniform) == 4 and len({tuple(mb.input_ids.shape) for mb in uniform}) == 1
    assert not uniform[-1].valid.any() and not uniform[-1].completion_mask.any()
    objective = GRPOObjective(tiny_grpo(), config.mtp_depths)
    ragged_metrics, uniform_metrics = _step_metrics(model, objective, ragged), _step_metrics(model, objective, uniform)
    for name, value in ragged_metrics.items():
        assert abs(value - uniform_metrics[name]) < 1e-6, name
    expected, got = _gradients(model, objective, ragged), _gradients(model, objective, uniform)
    assert all(torch.allclose(expected[name], got[name], atol=1e-7) for name in expected)


def _step_metrics(model, objective, micro_batches) -> dict[str, float]:
    """The step's metrics as the trainer logs them (each one's mean over the micro-batches), and its expert counts."""
    objective.begin_step(micro_batches)
    with torch.no_grad():
        outputs = [objective(model, mb) for mb in micro_batches]
    metrics = {key: float(torch.stack([out.metrics[key] for out in outputs]).mean()) for key in outputs[0].metrics}
    for name in outputs[0].expert_counts:
        for expert, count in enumerate(sum(out.expert_counts[name] for out in outputs).tolist()):
            metrics[f"count/{name}/{expert}"] = count
    return metrics


class FixedBatches(BatchSource):
    """A batch source giving the same rollouts every step, split into `micro_batches`."""

    def __init__(self, batch, micro_batches):
        self.batch, self.micro_batches = batch, micro_batches

    def next_step(self):
        return pack_micro_batches(self.batch, self.micro_batches)

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def test_grad_accum_does_not_change_the_gradient_through_the_trainer(small_config):
    """The trainer's step over 1, 3 or 6 micro-batches of the same rollouts (policy loss with TIS and a KL to a
    reference, MTP loss on, routing replayed): the same gradient, the same logged metrics."""
    config = small_config(vocab_size=64, mtp_num_depths=2)
    base = HybridLM(config)
    reference = copy.deepcopy(base).requires_grad_(False).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    grpo = tiny_grpo(kl_coef=0.05, entropy_coef=0.01, mtp_loss_weight=0.1)
    batch = _scored_by(reference, _random_batch(config, [[1.0, 0.0, 0.5, 1.0], [0.0, 0.0, 1.0, 0.0],
                                                         [1.0, 1.0, 1.0, 1.0]], seed=3), grpo)
    results = []
    for micro_batches in (1, 3, 6):
        model = copy.deepcopy(base)
        objective = GRPOObjective(grpo, 2)
        trainer = Trainer(model, objective, FixedBatches(batch, micro_batches), TrainConfig(grad_accum=micro_batches),
                          None)
        stats = trainer.forward_backward()
        # the MTP depths' losses are the step's typed `mtp_losses`, logged as mtp_loss_<d>
        logged = {**stats.losses, **{f"mtp_loss_{d}": v for d, v in enumerate(stats.mtp_losses, start=1)}}
        results.append(({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, logged))
    (grads, losses), others = results[0], results[1:]
    assert "mtp_loss_1" in losses and "mtp_loss_2" in losses
    for other_grads, other_losses in others:
        for name in grads:
            assert torch.allclose(other_grads[name], grads[name], atol=1e-6, rtol=1e-4), name
        for key in ("loss", "policy_loss", "mtp_loss_1", "mtp_loss_2", "kl", "entropy", "is_mismatch",
                    "policy_tokens"):
            assert math.isclose(other_losses[key], losses[key], rel_tol=1e-4, abs_tol=1e-6), key
    assert losses["policy_tokens"] == sum(len(r.completion_ids) for r in batch.rollouts[:8])


# ------------------------------------------------------------------------------ rollouts: sampling, curriculum
def test_curriculum_weights_are_a_gaussian_around_the_target():
    curriculum = PassRateCurriculum([1, 1, 2, 3], target=0.5, sigma=0.2, ema=0.5)
    assert torch.allclose(curriculum.weights(), torch.ones(4, dtype=torch.float64))  # nothing seen: the target
    curriculum.update(0, 1.0)  # prompt 0 (level 1): estimate 1.0; level 1 too
    curriculum.update(2, 0.25)
    curriculum.update(0, 0.0)  # an EMA: 0.5 * 1.0 + 0.5 * 0.0
    expected = torch.tensor([0.5, 0.5, 0.25, 0.5], dtype=torch.float64)  # prompt 1: its level's 0.5 * 1 + 0.5 * 0
    assert torch.allclose(curriculum.pass_rates(), expected)
    gauss = torch.exp(-(expected - 0.5) ** 2 / (2 * 0.2 ** 2))
    assert torch.allclose(curriculum.weights(), gauss)
    assert math.isclose(float(gauss[2]), math.exp(-0.0625 / 0.08))
    # sampling follows the weights and never repeats within a step
    curriculum = PassRateCurriculum([1] * 5 + [2] * 5, target=0.5, sigma=0.1)
    for i in range(5):
        curriculum.update(i, 1.0)  # level 1, far from the target: weight exp(-12.5); level 2 unseen: weight 1
    picks = [i for seed in range(50) for i in curriculum.sample(2, torch.Generator().manual_seed(seed))]
    assert sum(i < 5 for i in picks) <= 1
    drawn = curriculum.sample(10, torch.Generator().manual_seed(0), exclude={0, 1})
    assert sorted(drawn) == list(range(2, 10))
    state = curriculum.state_dict()
    fresh = PassRateCurriculum([1] * 5 + [2] * 5, target=0.5, sigma=0.1)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.weights(), curriculum.weights())
    assert torch.allclose(PassRateCurriculum([1, 2], enabled=False).weights(), torch.ones(2, dtype=torch.float64))


def _role(policy_dir, model, **overrides):
    role = RolloutRole(model_dir=str(policy_dir), model_config=model.config, env=TOY, env_options={"levels": (1, 2)},
                       config=tiny_grpo(**overrides))
    role.load_weights(0, model.state_dict())
    return role


def test_dynamic_sampling_drops_agreeing_groups_and_refills_within_its_cap(policy_dir, policy):
    model, _ = policy
    role = _role(policy_dir, model, prompts_per_step=3, max_refill_rounds=3)
    batch = role.step(RolloutRequest(1))
    groups = [batch.rollouts[i:i + 4] for i in range(0, len(batch.rollouts), 4)]
    assert batch.stats["groups_trained"] == len(groups) <= 3
    assert all(len({r.reward for r in group}) > 1 for group in groups)  # only informative groups
    assert all(group[0].difficulty == 1 for group in groups)
    assert 1 <= batch.stats["generation_rounds"] <= 4 and batch.stats["groups_dropped"] >= 0
    # level 2 only: every group agrees; the cap stops the refills, the step trains on the last round
    role = _role(policy_dir, model, prompts_per_step=2, max_refill_rounds=1)
    role.env.levels, role.tasks = (2,), [t for t in role.tasks if t.difficulty == 2]
    role.curriculum = PassRateCurriculum([2] * len(role.tasks))
    batch = role.step(RolloutRequest(1))
    assert batch.stats["generation_rounds"] == 2 and batch.stats["groups_dropped"] == 4
    assert batch.stats["groups_trained"] == 2 and all(r.advantage == 0 for r in batch.rollouts)
    # without dynamic sampling: one round, every group kept
    role = _role(policy_dir, model, prompts_per_step=4, dynamic_sampling=False)
    batch = role.step(RolloutRequest(1))
    assert batch.stats["generation_rounds"] == 1 and len(batch.rollouts) == 16
    assert batch.stats["groups_dropped"] == 0 and "mtp_acceptance_length" in batch.stats


def test_a_batch_is_a_function_of_state_weights_and_index(policy_dir, policy):
    """Two roles from the same state give the same rollouts for the same request; the curriculum state moves."""
    model, _ = policy
    first, second = _role(policy_dir, model), _role(policy_dir, model)
    a, b = first.step(RolloutRequest(5)), second.step(RolloutRequest(5))
    assert [r.completion_ids for r in a.rollouts] == [r.completion_ids for r in b.rollouts]
    assert all(torch.equal(x.logprobs, y.logprobs) for x, y in zip(a.rollouts, b.rollouts))
    state = first.state_dict()
    assert int((~torch.isnan(state["curriculum"]["estimates"])).sum()) >= 2
    third = _role(policy_dir, model)
    third.load_state_dict(state)
    c, d = first.step(RolloutRequest(6)), third.step(RolloutRequest(6))
    assert [r.completion_ids for r in c.rollouts] == [r.completion_ids for r in d.rollouts]


# ----------------------------------------------------------------------------------------- sync and async
def _train(policy_dir, tmp_path, name, steps=2, **grpo_overrides):
    config = GRPORunConfig(base_model=str(policy_dir), env=TOY, model=ModelConfig.from_hf(policy_dir),
                           grpo=tiny_grpo(levels=(1,), **grpo_overrides),
                           train=TrainConfig(**{**GRPO_TRAIN, "steps": steps, "grad_accum": 2, "lr": 1e-3}),
                           monitor=MonitorConfig(enabled=False))
    built = COMMAND.build(config, tmp_path / name, None, quiet=True)  # the trainer and its rollout pipeline
    trainer = built.trainer
    try:
        trainer.train()
    finally:
        built.close()
    lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return {n: p.detach().clone() for n, p in trainer.model.state_dict().items()}, lines


def _same(a, b, atol=0.0):
    return all(torch.allclose(a[name], b[name], rtol=0.0, atol=atol) for name in a)


@pytest.fixture(scope="module")
def inline_staleness_1(policy_dir, tmp_path_factory):
    """The asynchronous protocol at staleness 1 in this process (the inline backend): what the process and Ray
    backends must give. (A run is a function of its config: the same whichever test trains it first.)"""
    return _train(policy_dir, tmp_path_factory.mktemp("grpo_async"), "inline1", async_rollouts=True, staleness=1,
                  rollout_backend="inline")


@pytest.mark.timeout(300)
def test_async_with_staleness_0_makes_the_synchronous_update_and_staleness_1_is_one_step_behind(policy_dir,
                                                                                               tmp_path,
                                                                                               inline_staleness_1):
    sync, sync_lines = _train(policy_dir, tmp_path, "sync")
    async0, _ = _train(policy_dir, tmp_path, "async0", async_rollouts=True, staleness=0, rollout_backend="process")
    assert _same(sync, async0)
    inline1, lines1 = inline_staleness_1
    # two rollout processes, each generating half of every round: the tokens one process samples, so the protocol,
    # not the timing, fixes which weights sampled each batch. Their log-probs come from forwards of half the rows,
    # which some CPUs' GEMMs round differently (an AVX2 EPYC: one token's log-prob by 5e-7), and the rollout
    # correction reads them: the weights agree to an ulp, 1e4 times closer than one step of staleness moves them.
    process1, process_lines = _train(policy_dir, tmp_path, "process1", async_rollouts=True, staleness=1,
                                     rollout_backend="process", rollout_replicas=2)
    assert _same(inline1, process1, atol=1e-6)
    assert [line["rollout_ranks"] for line in process_lines] == [2.0, 2.0]
    assert not _same(sync, inline1, atol=1e-4)  # batch 2 was sampled with the initial weights
    assert [line["policy_staleness"] for line in sync_lines] == [0.0, 0.0]
    assert [line["policy_staleness"] for line in process_lines] == [0.0, 1.0]
    assert [line["reward_mean"] for line in lines1] == [line["reward_mean"] for line in process_lines]


@pytest.mark.timeout(300)
def test_the_ray_backend_runs_the_same_protocol(policy_dir, tmp_path, inline_staleness_1):
    pytest.importorskip("ray")
    inline1, _ = inline_staleness_1
    ray1, _ = _train(policy_dir, tmp_path, "ray1", async_rollouts=True, staleness=1, rollout_backend="ray")
    assert _same(inline1, ray1)


# ------------------------------------------------------------------------------------------- the command
def _grpo(model, out, *extra):
    return cli_main(grpo_argv(model, out, *extra))


def grpo_argv(model, out, *extra) -> list[str]:
    """A short GRPO run on the toy environment (also what tests/distributed/test_dist_rl.py runs under torchrun)."""
    return ["grpo", "--model", str(model), "--env", TOY, "--out", str(out), "--quiet",
            "--set", "grpo.group_size=4", "--set", "grpo.prompts_per_step=2", "--set", "grpo.task_pool=40",
            "--set", "grpo.max_new_tokens=10", "--set", "grpo.draft_length=2", "--set", "grpo.levels=1",
            "--set", "grpo.eval_tasks=4", "--set", "grpo.eval_every=2", "--set", "grpo.eval_max_tokens=8",
            "--set", "train.checkpoint_every=2", "--set", "train.grad_accum=2", *extra]


TIMING = ("seconds", "per_s", "wait_s", "tokens_per_s")


def _lines(path):
    return [{k: v for k, v in json.loads(line).items() if not any(t in k for t in TIMING)}
            for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", [["--set", "grpo.async_rollouts=false"],
                                  ["--set", "grpo.async_rollouts=true", "--set", "grpo.rollout_backend=inline"]],
                         ids=["sync", "async"])
@pytest.mark.timeout(300)
def test_grpo_end_to_end_and_resume_bit_for_bit(policy_dir, tmp_path, mode, capsys):
    """The command, 3 steps; then the same run killed after its step-2 checkpoint and resumed (the async run's
    checkpoint holds the batch it had sampled ahead, with weights the checkpoint does not keep): the same metrics,
    line for line, and the same weights. Sync also: 2 steps, then --resume --steps 3 extends the finished run
    exactly."""
    assert _grpo(policy_dir, tmp_path / "full", "--steps", "3", *mode) == 0
    shutil.copytree(tmp_path / "full", tmp_path / "killed")
    shutil.rmtree(tmp_path / "killed" / "checkpoints" / "step_000003")
    shutil.rmtree(tmp_path / "killed" / "hf")
    assert _grpo(policy_dir, tmp_path / "killed", "--steps", "3", "--resume", *mode) == 0
    full = _lines(tmp_path / "full")
    assert _lines(tmp_path / "killed") == full and [line["step"] for line in full] == [0, 1, 2, 3]
    for key in ("reward_mean", "policy_loss", "mtp_loss_1", "is_mismatch", "entropy", "clip_fraction",
                "groups_trained", "rollout_tokens", "response_length", "policy_staleness"):
        assert key in full[1], key
    assert "pass_at_1" in full[0] and "pass_at_1" in full[2] and "pass_at_1/L1" in full[3]
    weights = load_pretrained(tmp_path / "full" / "hf").state_dict()
    assert _same(weights, load_pretrained(tmp_path / "killed" / "hf").state_dict())
    assert (tmp_path / "full" / "hf" / "tokenizer_config.json").is_file()
    assert "held-out pass@1" in capsys.readouterr().out
    if mode[-1].endswith("false"):
        assert _grpo(policy_dir, tmp_path / "part", "--steps", "2", *mode) == 0
        assert _grpo(policy_dir, tmp_path / "part", "--steps", "3", "--resume", *mode) == 0
        assert _lines(tmp_path / "part") == full
        assert _same(weights, load_pretrained(tmp_path / "part" / "hf").state_dict())
        pytest.importorskip("matplotlib")  # the HTML report draws the rollout panels
        from hybridtron.train.report import load_run, render_html

        assert "<h2>Rollouts</h2>" in render_html(load_run(tmp_path / "full"))


def test_grpo_smoke_on_the_math_environment(policy_dir, tmp_path):
    """The real environment (a random policy scores 0: every group agrees and dynamic sampling falls back), and
    more micro-batches asked for than a step has rows (8): one row each; the MTP loss off (the MTP block's routers
    then count no tokens)."""
    assert cli_main(["grpo", "--model", str(policy_dir), "--env", "math", "--out", str(tmp_path / "run"), "--quiet",
                     "--steps", "2", "--set", "grpo.group_size=4", "--set", "grpo.prompts_per_step=2",
                     "--set", "train.grad_accum=16", "--set", "grpo.mtp_loss_weight=0",
                     "--set", "grpo.max_new_tokens=8", "--set", "grpo.task_pool=20", "--set", "grpo.levels=1",
                     "--set", "grpo.max_refill_rounds=0", "--set", "grpo.eval_tasks=0"]) == 0
    lines = _lines(tmp_path / "run")
    assert [line["step"] for line in lines] == [1, 2] and lines[-1]["reward_mean"] == 0.0


@pytest.mark.parametrize("override, message", [
    ("grpo.group_size=1", "grpo.group_size must be >= 2"),
    ("grpo.temperature=0", "grpo.temperature must be > 0"),
    ("grpo.thinking=maybe", "grpo.thinking must be one of auto, on, off"),
    ("grpo.tis_low=3", "grpo: tis_low / tis_high must satisfy"),
    ("grpo.advantage_mode=rank", "grpo: advantage_mode must be one of"),
    ("grpo.rollout_backend=threads", "grpo.rollout_backend must be one of"),
    ("grpo.groups=4", "unknown grpo fields"),
    ("grpo.group_size=four", "grpo.group_size: expected int"),
    ("model.hidden_size=64", "[model] cannot be set here: the model is fixed by base_model ("),
])
def test_malformed_config_values_are_clear_errors(policy_dir, tmp_path, capsys, override, message):
    assert _grpo(policy_dir, tmp_path / "run", "--set", override) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_bad_inputs_are_clear_errors(policy_dir, tmp_path, capsys):
    assert cli_main(["grpo", "--model", str(policy_dir), "--env", "chess", "--out", str(tmp_path / "a")]) == 2
    assert "unknown environment; known: code, copy, math" in capsys.readouterr().err
    assert cli_main(["grpo", "--model", str(policy_dir), "--env", "nowhere:Env", "--out", str(tmp_path / "a")]) == 2
    assert "cannot import Env from nowhere" in capsys.readouterr().err
    base = tmp_path / "base"  # a pretrained model: the chat tokens, but no chat template
    base.mkdir()
    for item in policy_dir.iterdir():
        (base / item.name).write_bytes(item.read_bytes())
    config = json.loads((base / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    assert cli_main(["grpo", "--model", str(base), "--env", "math", "--out", str(tmp_path / "b")]) == 2
    assert "no chat template" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    assert cli_main(["grpo", "--env", "math", "--out", str(tmp_path / "c")]) == 2
    assert "--model is required" in capsys.readouterr().err
