"""MOPD (hybridtron.post.mopd, .mixture, .teachers): teacher routing by domain, the stratified prompts, the teacher
scores against the teacher's own forward, the objective against the loss function and by hand, asynchronous roles
against the synchronous mode, the command end to end with its warmup and resume, and clear errors. (The loss
function itself, by hand: tests/post/test_losses.py, test_mopd_loss_by_hand and its neighbours.)"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch

from hybridtron.checkpoint import load_pretrained, save_pretrained
from hybridtron.cli import main as cli_main
from hybridtron.config import ModelConfig, parse_pattern
from hybridtron.data.chat import save_tokenizer_files
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.model.lm import HybridLM
from hybridtron.envs import Environment, Task, assistant_turn
from hybridtron.post.losses import mopd_loss
from hybridtron.post.mixture import DomainSampler, MixtureEnv, domain_quotas
from hybridtron.post.mopd import COMMAND, MOPD_TRAIN, MOPDConfig, MOPDObjective, MOPDRunConfig
from hybridtron.post.rl.batches import pack_micro_batches
from hybridtron.post.rl.objective import sampled_logprobs
from hybridtron.post.rl.rollout import Rollout, RolloutBatch
from hybridtron.post.teachers import (
    TEACHER_SCORE, TEACHER_TOPK_IDS, TEACHER_TOPK_LOGP, TeacherPanel, TeacherScoringRole,
)
from hybridtron.train.config import TrainConfig
from hybridtron.train.monitor.config import MonitorConfig


class AlphaEnv(Environment):
    """Domain "alpha": reward 1 for an even number of characters. Importable by a role process as
    `test_mopd:AlphaEnv`."""

    domain = "alpha"
    system_prompt = "You count."

    def __init__(self, levels=(1,)):
        self.levels = tuple(levels)

    def generate(self, rng):
        n = rng.randint(0, 10 ** 6)
        return Task(prompt=f"Count to {n}.", domain=self.domain, difficulty=rng.choice(self.levels),
                    reference=assistant_turn(f"{n} is the target", str(n)))

    def reward(self, task, completion):
        return float(len(completion) % 2 == 0)


class BetaEnv(AlphaEnv):
    """Domain "beta": reward 1 for an odd number of characters, its own system prompt."""

    domain = "beta"
    system_prompt = "You answer."

    def generate(self, rng):
        n = rng.randint(0, 10 ** 6)
        return Task(prompt=f"What is {n}?", domain=self.domain, difficulty=1,
                    reference=assistant_turn("think", f"answer {n}"))

    def reward(self, task, completion):
        return float(len(completion) % 2 == 1)


ALPHA, BETA = f"{__name__}:AlphaEnv", f"{__name__}:BetaEnv"
CONFIG = dict(
    vocab_size=512, hidden_size=48, layers_block_type=parse_pattern("M*E-ME"), num_attention_heads=4,
    num_key_value_heads=2, head_dim=12, intermediate_size=64, mamba_num_heads=4, mamba_head_dim=8, n_groups=2,
    ssm_state_size=8, conv_kernel=4, chunk_size=8, n_routed_experts=8, num_experts_per_tok=3,
    moe_intermediate_size=24, moe_shared_expert_intermediate_size=32, moe_latent_size=16, routed_scaling_factor=2.5,
    n_group=4, topk_group=2, num_nextn_predict_layers=1, mtp_num_depths=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A student and two teachers (different random weights, one tokenizer with the chat template), as HF
    checkpoints: {"student": dir, "alpha": dir, "beta": dir}."""
    root = tmp_path_factory.mktemp("mopd_models")
    words = ["What is", "Count to", "answer", "target", "think", "You count.", "You answer."] + \
        [str(i) for i in range(100)]
    tokenizer = Tokenizer.train([" ".join(random.Random(i).choices(words, k=30)) for i in range(300)], 512)
    dirs = {}
    for seed, name in enumerate(("student", "alpha", "beta")):
        torch.manual_seed(seed)
        dirs[name] = root / name
        save_pretrained(HybridLM(ModelConfig(**CONFIG)), dirs[name])
        save_tokenizer_files(tokenizer, dirs[name], model_max_length=256)
    return dirs


def tiny_mopd(**overrides) -> MOPDConfig:
    values = dict(envs=(ALPHA, BETA), prompts_per_step=3, max_new_tokens=8, task_pool=30, draft_length=2,
                  eval_tasks=0, warmup_steps=0, teacher_batch_size=2, rollout_threads=1)
    return MOPDConfig(**{**values, **overrides})


def run_config(models, **overrides) -> MOPDRunConfig:
    return MOPDRunConfig(student=str(models["student"]), teachers={"alpha": str(models["alpha"])},
                         general=str(models["beta"]), model=ModelConfig.from_hf(models["student"]),
                         mopd=tiny_mopd(**overrides),
                         train=TrainConfig(**{**MOPD_TRAIN, "steps": 2, "grad_accum": 2, "lr": 1e-3}),
                         monitor=MonitorConfig(enabled=False))


# ------------------------------------------------------------------------------------ teachers and domains
def test_teacher_panel_routes_by_domain_with_the_general_fallback(models):
    a, b = str(models["alpha"]), str(models["beta"])
    panel = TeacherPanel.parse(f"alpha={a}, beta = {b}")
    assert panel.teacher_for("alpha") == a and panel.teacher_for("beta") == b
    with pytest.raises(ValueError, match="domain 'gamma' has no teacher: --teachers names alpha, beta and there is "
                                         "no --general fallback"):
        panel.teacher_for("gamma")
    with pytest.raises(ValueError, match="domain 'gamma' has no teacher"):
        panel.check_domains(["alpha", "beta", "gamma"])
    with pytest.raises(ValueError, match="names the domain\\(s\\) beta, but no environment"):
        panel.check_domains(["alpha"])
    general = TeacherPanel.parse(f"alpha={a}", general=b)
    assert general.teacher_for("gamma") == b and general.teacher_for("alpha") == a
    assert TeacherPanel.parse(f"alpha={a},beta={a}", general=a).directories() == [a]  # loaded once
    assert TeacherPanel.parse(None, general=b).teacher_for("alpha") == b


@pytest.mark.parametrize("text, error, message", [
    ("alpha", ValueError, "'alpha' is not DOMAIN=DIR"),
    ("=DIR", ValueError, "'=DIR' is not DOMAIN=DIR"),
    ("alpha=", ValueError, "'alpha=' is not DOMAIN=DIR"),
    ("alpha={a},alpha={a}", ValueError, "domain 'alpha' is given twice"),
    ("alpha=/no/such/dir", FileNotFoundError, "--teachers alpha=/no/such/dir: no such checkpoint directory"),
    ("", ValueError, "--teachers is required"),
])
def test_teacher_panel_rejects_bad_syntax_and_missing_dirs(models, text, error, message):
    with pytest.raises(error, match=message):
        TeacherPanel.parse(text.format(a=models["alpha"]))


def test_domain_quotas_and_the_stratified_sampler():
    assert domain_quotas(5, [1, 1]) == [3, 2]  # 2.5 / 2.5: the tie to the first
    assert domain_quotas(10, [3, 1, 1]) == [6, 2, 2]
    assert domain_quotas(4, [0.9, 0.1]) == [3, 1]  # 3.6 / 0.4 -> 4 / 0, then one each
    assert domain_quotas(1, [1, 1]) == [1, 0]  # fewer prompts than domains
    domains = ["a"] * 6 + ["b"] * 4
    sampler = DomainSampler(domains, [1] * 10, {"a": 0.5, "b": 0.5})
    picked = sampler.sample(4, torch.Generator().manual_seed(0))
    assert sorted(domains[i] for i in picked) == ["a", "a", "b", "b"] and len(set(picked)) == 4
    assert picked == sampler.sample(4, torch.Generator().manual_seed(0))
    rest = sampler.sample(10, torch.Generator().manual_seed(1), exclude={6, 7, 8})
    assert [i for i in rest if domains[i] == "b"] == [9]  # the only b left


def test_mixture_env_dispatches_on_the_domain():
    mixture = MixtureEnv((ALPHA, BETA), weights=(2, 1))
    tasks = mixture.tasks("train", 6, seed=0)
    assert [t.domain for t in tasks] == ["alpha"] * 4 + ["beta"] * 2
    # "ab" has two characters: alpha's reward 1, beta's 0; one batch call per member
    assert mixture.rewards(tasks, ["ab"] * 6) == [1.0] * 4 + [0.0] * 2
    assert mixture.prompt_messages(tasks[0])[0]["content"] == "You count."
    assert mixture.prompt_messages(tasks[-1])[0]["content"] == "You answer."
    assert [e["domain"] for e in mixture.sft_examples(3)] == ["alpha", "alpha", "beta"]
    with pytest.raises(ValueError, match="task .* has domain 'gamma'"):
        mixture.reward(Task(prompt="x", domain="gamma"), "y")
    with pytest.raises(ValueError, match="each must have its own"):
        MixtureEnv((ALPHA, ALPHA))
    with pytest.raises(ValueError, match="2 environments"):
        MixtureEnv((ALPHA, BETA), weights=(1,))


def test_levels_per_environment():
    config = tiny_mopd(levels=(1, 2), env_levels=(f"{BETA}=3-5",))
    assert config.level_map() == {ALPHA: (1, 2), BETA: (3, 4, 5)}
    assert tiny_mopd(env_levels=(f"{ALPHA}=2/4",)).level_map() == {ALPHA: (2, 4)}
    with config.mixture() as mixture:
        assert mixture.members[0].levels == (1, 2) and mixture.members[1].levels == (3, 4, 5)
    for bad, message in (("alpha", "is not ENV=LEVELS"), (f"{ALPHA}=x", "is not ENV=LEVELS"),
                         ("math=1", "'math' is not one of mopd.envs")):
        with pytest.raises(ValueError, match=message):
            tiny_mopd(env_levels=(bad,)).validate()


def _rollouts(config: ModelConfig, domains, seed=0, experts=True) -> RolloutBatch:
    """One rollout per domain entry: random prompt (3-6 tokens) and completion (2-9), random expert ids."""
    g = torch.Generator().manual_seed(seed)
    k, E = config.num_experts_per_tok, config.n_routed_experts
    moe_names = [str(i) for i, kind in enumerate(config.layers_block_type) if kind == "moe"]
    rollouts = []
    for i, domain in enumerate(domains):
        P, C = int(torch.randint(3, 7, (1,), generator=g)), int(torch.randint(2, 10, (1,), generator=g))
        ids = {name: torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(P + C - 1)]).to(torch.int16)
               for name in moe_names} if experts else None
        rollouts.append(Rollout(task_id=f"t{i}", domain=domain, difficulty=1,
                                prompt_ids=torch.randint(0, config.vocab_size, (P,), generator=g).tolist(),
                                completion_ids=torch.randint(0, config.vocab_size, (C,), generator=g).tolist(),
                                logprobs=-torch.rand(C, generator=g) * 3 - 3, finish_reason="stop",
                                expert_ids=ids))
    return RolloutBatch(index=1, policy_version=0, group_size=1, rollouts=rollouts, stats={})


def test_teacher_scores_are_each_domains_teacher_log_probs(models):
    """Batched, sorted and padded, the role's scores equal each rollout's own teacher forward, row by row (the
    general teacher for a domain without one); at temperature 0.5 the logits are divided by it."""
    config = ModelConfig.from_hf(models["student"])
    batch = _rollouts(config, ["alpha", "beta", "alpha", "gamma", "alpha"])
    role = TeacherScoringRole(teachers={"alpha": str(models["alpha"])}, general=str(models["beta"]),
                              temperature=0.5, batch_size=2, top_k=5)
    role.step(batch)
    teachers = {name: load_pretrained(models[name], dtype=torch.float32).eval() for name in ("alpha", "beta")}
    for r in batch.rollouts:
        full = torch.tensor([r.prompt_ids + r.completion_ids])
        with torch.no_grad():
            logits = teachers["alpha" if r.domain == "alpha" else "beta"](full[:, :-1], mtp=False).logits
        all_logp = torch.log_softmax(logits[0].float() / 0.5, -1)[len(r.prompt_ids) - 1:]
        logp = all_logp.gather(-1, torch.tensor(r.completion_ids)[:, None])[:, 0]
        assert torch.allclose(r.scores[TEACHER_SCORE], logp, atol=1e-5), r.domain
        # the top-5 tokens of each completion position, most likely first, and their log-probs
        ids, top = r.scores[TEACHER_TOPK_IDS], r.scores[TEACHER_TOPK_LOGP]
        assert ids.dtype == torch.int32 and ids.shape == top.shape == (len(r.completion_ids), 5)
        assert torch.allclose(top, all_logp.topk(5, dim=-1).values, atol=1e-5)
        assert torch.allclose(all_logp.gather(-1, ids.long()), top, atol=1e-5)
    assert batch.stats["teacher_seconds"] > 0
    # the micro-batch lays them out beside the completion tokens: [B, L, K], zeros on the prompt and the padding
    (mb,) = pack_micro_batches(batch, 1)
    mask = mb.completion_mask
    assert mb.scores[TEACHER_TOPK_LOGP].shape == (*mask.shape, 5) and mb.scores[TEACHER_TOPK_IDS].dtype == torch.int32
    assert (mb.scores[TEACHER_TOPK_LOGP][~mask] == 0).all() and (mb.scores[TEACHER_TOPK_LOGP][mask] < 0).all()


# ---------------------------------------------------------------------------------------------- the objective
def _scored(config: ModelConfig, domains, seed=0) -> RolloutBatch:
    batch = _rollouts(config, domains, seed)
    g = torch.Generator().manual_seed(seed + 100)
    for r in batch.rollouts:
        r.scores[TEACHER_SCORE] = -torch.rand(len(r.completion_ids), generator=g) * 4
    return batch


def _step(model, objective, micro_batches):
    model.zero_grad()
    objective.begin_step(micro_batches)
    outputs = [objective(model, mb) for mb in micro_batches]
    for out in outputs:
        out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    metrics = {key: float(torch.stack([o.metrics[key] for o in outputs]).mean()) for key in outputs[0].metrics}
    # each MTP depth's loss is the output's typed `mtp_losses` (the trainer logs it as mtp_loss_<d>)
    metrics.update({f"mtp_loss_{depth}": float(torch.stack([o.mtp_losses[depth - 1] for o in outputs]).mean())
                    for depth in range(1, len(outputs[0].mtp_losses) + 1)})
    return grads, metrics, outputs


def test_objective_is_the_mopd_loss_with_per_domain_reverse_kl_by_hand(small_config):
    config = small_config(vocab_size=64)
    model = HybridLM(config)
    objective = MOPDObjective(tiny_mopd(mtp_loss_weight=0.0), ["alpha", "beta"], 0)
    batch = _scored(config, ["alpha", "beta", "alpha", "beta", "alpha"])
    (mb,) = pack_micro_batches(batch, 1)
    grads, metrics, (out,) = _step(model, objective, [mb])
    # the loss is mopd_loss on the learner's log-probs, proximal = the learner now, behaviour = the engine's
    logp = sampled_logprobs(model(mb.input_ids, expert_ids=mb.expert_ids, mtp=False).logits, mb.labels, 1.0)
    mask, teacher = mb.completion_mask, mb.scores[TEACHER_SCORE]
    expected, _ = mopd_loss(logp, logp.detach(), teacher, mask, int(mask.sum()), tiny_mopd().loss_config(),
                            behav_logp=mb.rollout_logprobs)
    expected = float(expected.detach())
    assert math.isclose(float(out.loss.detach()), expected, rel_tol=1e-6) and expected != 0
    # IcePop drops the tokens whose c = pi_prox / pi_behav falls outside [0.2, 5]
    c = (logp.detach() - mb.rollout_logprobs).exp()[mask]
    dropped = float(((c < 0.2) | (c > 5)).float().mean())
    assert 0 < dropped < 1 and math.isclose(metrics["is_out_of_bounds_share"], dropped, rel_tol=1e-5)
    # reverse KL per domain: mean over that domain's completion tokens of log pi_student - log pi_teacher
    for domain in ("alpha", "beta"):
        rows = torch.tensor([d == domain for d in mb.domains])
        diff = [(logp.detach() - teacher)[b][mask[b]] for b in range(len(rows)) if rows[b]]
        assert math.isclose(metrics[f"reverse_kl/{domain}"], float(torch.cat(diff).mean()), rel_tol=1e-5)
    assert math.isclose(metrics["reverse_kl"], float((logp.detach() - teacher)[mask].mean()), rel_tol=1e-5)
    assert metrics["completion_tokens"] == sum(len(r.completion_ids) for r in batch.rollouts)


def test_objective_with_kl_top_k_is_the_topk_loss_on_the_learners_logits(small_config):
    """kl_top_k = 4: the loss is mopd_loss's top-K form on the learner's log-probs (at the sampling temperature) of
    the teacher's top-4 tokens, over the same mask, c_t and global count; without the teacher's top-K tokens in
    the micro-batch it is a clear error."""
    config = small_config(vocab_size=64)
    model = HybridLM(config)
    cfg = tiny_mopd(mtp_loss_weight=0.0, kl_top_k=4, temperature=0.5)
    batch = _scored(config, ["alpha", "beta", "alpha"], seed=5)
    g = torch.Generator().manual_seed(7)
    for r in batch.rollouts:
        teacher_all = torch.log_softmax(torch.randn(len(r.completion_ids), 64, generator=g), -1)
        top, ids = teacher_all.topk(4, dim=-1)
        r.scores[TEACHER_TOPK_IDS], r.scores[TEACHER_TOPK_LOGP] = ids.to(torch.int32), top
    (mb,) = pack_micro_batches(batch, 1)
    _, metrics, (out,) = _step(model, MOPDObjective(cfg, ["alpha", "beta"], 0), [mb])
    with torch.no_grad():
        logits = model(mb.input_ids, expert_ids=mb.expert_ids, mtp=False).logits
    all_logp = torch.log_softmax(logits.float() / 0.5, -1)
    logp = sampled_logprobs(logits, mb.labels, 0.5)
    mask = mb.completion_mask
    from hybridtron.post.losses import topk_reverse_kl

    kl = topk_reverse_kl(all_logp.gather(-1, mb.scores[TEACHER_TOPK_IDS].long()), mb.scores[TEACHER_TOPK_LOGP])
    expected, _ = mopd_loss(logp, logp, mb.scores[TEACHER_SCORE], mask, int(mask.sum()), cfg.loss_config(),
                            behav_logp=mb.rollout_logprobs, topk_kl=kl)
    assert math.isclose(float(out.loss.detach()), float(expected), rel_tol=1e-5) and float(expected) != 0
    # the top-K KL per domain: the mean over that domain's completion tokens, each against its own teacher
    for domain in ("alpha", "beta"):
        rows = torch.tensor([d == domain for d in mb.domains]).unsqueeze(1) & mask
        assert math.isclose(metrics[f"topk_reverse_kl/{domain}"], float(kl[rows].mean()), rel_tol=1e-5)
    assert math.isclose(metrics["topk_reverse_kl"], float(kl[mask].mean()), rel_tol=1e-5)
    del mb.scores[TEACHER_TOPK_IDS]
    with pytest.raises(ValueError, match="mopd.kl_top_k=4, but the teacher-scoring role sent no top-K tokens"):
        MOPDObjective(cfg, ["alpha", "beta"], 0)(model, mb)


def test_objective_gradient_does_not_depend_on_grad_accum(small_config):
    """The behaviour log-probs set to the learner's (c = 1): the policy gradient of the token mean of the reverse
    KL, the same over 1, 2 or 5 micro-batches, as are the logged per-domain figures."""
    config = small_config(vocab_size=64, mtp_num_depths=2)
    model = HybridLM(config)
    batch = _scored(config, ["alpha", "beta", "beta", "alpha", "alpha"], seed=3)
    (whole,) = pack_micro_batches(batch, 1)
    with torch.no_grad():
        logp = sampled_logprobs(model(whole.input_ids, expert_ids=whole.expert_ids).logits, whole.labels, 1.0)
    order = sorted(range(5), key=lambda i: len(batch.rollouts[i].prompt_ids) + len(batch.rollouts[i].completion_ids))
    for row, i in enumerate(order):  # pack_micro_batches sorts rows by length
        r = batch.rollouts[i]
        r.logprobs = logp[row][whole.completion_mask[row]].clone()
    results = [_step(model, MOPDObjective(tiny_mopd(), ["alpha", "beta"], 2), pack_micro_batches(batch, n))
               for n in (1, 2, 5)]
    (grads, metrics, _), others = results[0], results[1:]
    assert metrics["is_out_of_bounds_share"] == 0.0 and any(g.abs().max() > 0 for g in grads.values())
    for other_grads, other_metrics, _ in others:
        for name in grads:
            assert torch.allclose(other_grads[name], grads[name], atol=1e-6, rtol=1e-4), name
        for key in ("loss", "policy_loss", "mtp_loss_1", "reverse_kl", "reverse_kl/alpha", "reverse_kl/beta",
                    "teacher_logp", "entropy", "is_mismatch"):
            assert math.isclose(other_metrics[key], metrics[key], rel_tol=1e-4, abs_tol=1e-6), key


# ---------------------------------------------------------------------------------------- sync and async
def _train(models, tmp_path, name, **overrides):
    config = run_config(models, **overrides)
    built = COMMAND.build(config, tmp_path / name, None, quiet=True)  # no warmup: the student is the policy
    trainer = built.trainer
    try:
        trainer.train()
    finally:
        built.close()  # the rollout pipeline's roles
    lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return {n: p.detach().clone() for n, p in trainer.model.state_dict().items()}, lines


def _same(a, b, atol=0.0):
    return all(torch.allclose(a[name], b[name], rtol=0.0, atol=atol) for name in a)


@pytest.fixture(scope="module")
def inline_staleness_1(models, tmp_path_factory):
    """The asynchronous roles at staleness 1 in this process (the inline backend): what the process and Ray backends
    must give. (A run is a function of its config: the same whichever test trains it first.)"""
    return _train(models, tmp_path_factory.mktemp("mopd_async"), "inline1", async_rollouts=True, staleness=1,
                  rollout_backend="inline")


@pytest.mark.timeout(300)
def test_async_roles_at_staleness_0_make_the_synchronous_update(models, tmp_path, inline_staleness_1):
    """Rollout and teacher scoring in processes at staleness 0, two replicas each (each generating, then scoring,
    half of the step): the weights of the synchronous run. At
    staleness 1 (inline here; the process and Ray backends run the same protocol, next test) batch 2 was sampled
    with the initial weights, so the update differs. (Spawning the four role processes is most of this test's
    20-40 s on 2 cores.)"""
    sync, sync_lines = _train(models, tmp_path, "sync")
    async0, async_lines = _train(models, tmp_path, "async0", async_rollouts=True, staleness=0,
                                 rollout_backend="process", rollout_replicas=2, teacher_replicas=2)
    # the same to float noise: each rollout replica generates, and each teacher replica scores, half of the rows, and
    # forwards of half the rows round differently on some CPUs (measured: 4e-9 on an AVX-512 CPU; on an AVX2 EPYC
    # 3e-7 in lm_head after two steps, and the step-2 reverse KL by 1e-6 relative, before and after the run
    # scaffold; GRPO's replica test allows the same): 1e3 times closer than one step of staleness moves them (below)
    assert _same(sync, async0, atol=1e-6)
    assert [line["rollout_ranks"] for line in async_lines] == [2.0, 2.0]
    assert [line["reverse_kl/beta"] for line in sync_lines] == \
        pytest.approx([line["reverse_kl/beta"] for line in async_lines], rel=1e-5)
    inline1, lines1 = inline_staleness_1
    assert not _same(sync, inline1, atol=1e-4)  # batch 2 was sampled with the initial weights (measured: 2e-3)
    assert [line["policy_staleness"] for line in sync_lines] == [0.0, 0.0]
    assert [line["policy_staleness"] for line in lines1] == [0.0, 1.0]


def test_ray_actors_can_be_placed_by_custom_resources(models):
    config = run_config(models, rollout_ray_resource="rollout_node", teacher_ray_resource="teachers")
    rollout, teachers = COMMAND.role_specs(config, Path(config.student), "ray", None)
    assert (rollout.role_name, teachers.role_name) == ("rollout", "teachers")
    assert rollout.resources == {"resources": {"rollout_node": 1}}
    assert teachers.resources == {"resources": {"teachers": 1}}
    assert COMMAND.role_specs(run_config(models), Path(config.student), "ray", None)[1].resources == {}


@pytest.mark.slow  # starting a local Ray cluster takes 30-60 s on 2 cores
@pytest.mark.timeout(300)
def test_the_ray_backend_runs_the_same_three_roles(models, tmp_path, inline_staleness_1):
    pytest.importorskip("ray")  # the optional `rl` extra
    inline1, _ = inline_staleness_1
    ray1, ray_lines = _train(models, tmp_path, "ray1", async_rollouts=True, staleness=1, rollout_backend="ray")
    assert _same(inline1, ray1)
    assert [line["policy_staleness"] for line in ray_lines] == [0.0, 1.0]


# ------------------------------------------------------------------------------------------------- the command
def _mopd(models, out, *extra, teachers=None):
    return cli_main(mopd_argv(models, out, *extra, teachers=teachers))


def mopd_argv(models, out, *extra, teachers=None) -> list[str]:
    """A short MOPD run on the toy domains (also what tests/distributed/test_dist_rl.py runs under torchrun)."""
    teachers = f"alpha={models['alpha']}" if teachers is None else teachers
    return ["mopd", "--student", str(models["student"]), "--teachers", teachers,
            "--general", str(models["beta"]), "--out", str(out), "--quiet",
            "--set", f"mopd.envs={ALPHA},{BETA}", "--set", "mopd.prompts_per_step=2",
            "--set", "mopd.task_pool=20", "--set", "mopd.max_new_tokens=8", "--set", "mopd.draft_length=2",
            "--set", "mopd.eval_tasks=2", "--set", "mopd.eval_every=2", "--set", "mopd.eval_max_tokens=6",
            "--set", "mopd.warmup_examples=12", "--set", "mopd.warmup_batch_size=2",
            "--set", "mopd.warmup_seq_len=64", "--set", "train.checkpoint_every=2",
            "--set", "train.grad_accum=2", *extra]


TIMING = ("seconds", "per_s", "wait_s")


def _lines(path):
    return [{k: v for k, v in json.loads(line).items() if not any(t in k for t in TIMING)}
            for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def new_run_with_warmup(models, tmp_path_factory):
    """A new run of the command, warmup (3 SFT steps) then 3 MOPD steps, and what it wrote to stderr: (run directory,
    stderr). Trained once for two tests: the end-to-end test kills and resumes copies of it (the directory itself
    stays as the run left it), the new-run test reads how its MOPD phase started."""
    out = tmp_path_factory.mktemp("mopd_full") / "full"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):  # the command's errors are lines printed to sys.stderr
        code = _mopd(models, out, "--steps", "3", "--set", "mopd.warmup_steps=3")
    assert code == 0, stderr.getvalue()[-2000:]
    return out, stderr.getvalue()


@pytest.mark.timeout(300)
def test_mopd_end_to_end_with_warmup_and_resume_bit_for_bit(models, new_run_with_warmup, tmp_path, capsys):
    """Warmup (3 SFT steps) then 3 MOPD steps; the same run killed in MOPD after its step-2 checkpoint, and one
    killed in the warmup after its step-2 checkpoint, both resumed: the same metrics line for line, the same
    weights. A finished run says it is complete."""
    full, _ = new_run_with_warmup
    assert (full / "warmup" / "hf" / "config.json").is_file() and (full / "warmup_data.jsonl").is_file()
    lines = _lines(full)
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    for key in ("reverse_kl", "reverse_kl/alpha", "reverse_kl/beta", "policy_loss", "mtp_loss_1", "teacher_logp",
                "reward_mean/alpha", "response_length/beta", "is_mismatch", "entropy", "policy_staleness"):
        assert key in lines[1], key
    assert "pass_at_1/alpha" in lines[0] and "pass_at_1/beta" in lines[-1]
    assert (full / "hf" / "tokenizer_config.json").is_file()
    weights = load_pretrained(full / "hf").state_dict()

    in_mopd = tmp_path / "killed_in_mopd"
    shutil.copytree(full, in_mopd)
    shutil.rmtree(in_mopd / "checkpoints" / "step_000003")
    shutil.rmtree(in_mopd / "hf")
    in_warmup = tmp_path / "killed_in_warmup"
    shutil.copytree(full, in_warmup)
    for item in ("checkpoints", "hf", "warmup/hf", "warmup/checkpoints/step_000003"):
        shutil.rmtree(in_warmup / item)
    (in_warmup / "metrics.jsonl").unlink()
    warmup_lines = _lines(full / "warmup")
    for killed in (in_mopd, in_warmup):
        assert _mopd(models, killed, "--steps", "3", "--set", "mopd.warmup_steps=3") == 2  # no silent restart
        assert "pass --resume" in capsys.readouterr().err
        assert cli_main(["mopd", "--out", str(killed), "--resume", "--quiet"]) == 0
        assert _lines(killed) == lines and _lines(killed / "warmup") == warmup_lines
        assert _same(weights, load_pretrained(killed / "hf").state_dict())
    capsys.readouterr()
    assert cli_main(["mopd", "--out", str(in_mopd), "--resume", "--quiet"]) == 0
    assert "this run is complete" in capsys.readouterr().out


@pytest.fixture(scope="module")
def one_step_without_warmup(models, tmp_path_factory):
    """The run directory of one MOPD step with warmup_steps=0 and the top-K reverse KL (mopd.kl_top_k=8): one run for
    the ablation test and the top-K test (the loss it trains does not change where MOPD starts)."""
    out = tmp_path_factory.mktemp("mopd_no_warmup") / "run"
    assert _mopd(models, out, "--steps", "1", "--set", "mopd.warmup_steps=0", "--set", "mopd.eval_tasks=0",
                 "--set", "mopd.kl_top_k=8") == 0
    return out


def test_mopd_without_warmup_is_the_ablation(one_step_without_warmup):
    """warmup_steps=0: no warmup directory; MOPD starts from --student itself."""
    run = one_step_without_warmup
    assert not (run / "warmup").exists() and [line["step"] for line in _lines(run)] == [1]


def test_a_new_run_with_warmup_goes_on_to_mopd(new_run_with_warmup):
    """A fresh run's MOPD phase starts after its warmup (the warmup's checkpoints are the run's own, not an unfinished
    run that would need --resume): the end-to-end test's new run, read here."""
    run, stderr = new_run_with_warmup
    assert "holds an unfinished run" not in stderr
    assert (run / "warmup" / "hf" / "config.json").is_file()
    assert [line["step"] for line in _lines(run)] == [0, 1, 2, 3] and (run / "hf").is_dir()


def test_mopd_command_trains_the_topk_reverse_kl(one_step_without_warmup):
    """mopd.kl_top_k reaches the teacher-scoring role: the learner trains on, and logs, the top-K KL."""
    (line,) = _lines(one_step_without_warmup)
    assert line["topk_reverse_kl"] > 0 and "clip_fraction" not in line


def test_mopd_smoke_on_math_and_code_with_teacher_sampled_warmup(models, tmp_path):
    """The real environments (math graded in child processes, code in the sandbox), the warmup on completions
    sampled from each domain's teacher."""
    assert cli_main(["mopd", "--student", str(models["student"]), "--teachers",
                     f"math={models['alpha']},code={models['beta']}", "--out", str(tmp_path / "run"), "--quiet",
                     "--steps", "1", "--set", "mopd.prompts_per_step=2", "--set", "mopd.max_new_tokens=8",
                     "--set", "mopd.task_pool=10", "--set", "mopd.env_levels=math=1,code=1-2",
                     "--set", "mopd.eval_tasks=0",
                     "--set", "mopd.warmup_steps=1", "--set", "mopd.warmup_data=teacher",
                     "--set", "mopd.warmup_examples=4", "--set", "mopd.warmup_batch_size=2"]) == 0
    conversations = [json.loads(line) for line in (tmp_path / "run" / "warmup_data.jsonl").read_text().splitlines()]
    assert [c["domain"] for c in conversations] == ["math", "math", "code", "code"]
    (line,) = _lines(tmp_path / "run")
    assert line["reward_mean/math"] == 0.0 and "reverse_kl/code" in line


def test_a_verified_warmup_whose_teacher_solves_nothing_is_a_clear_error(models, tmp_path, capsys):
    """`mopd.warmup_data=verified` keeps only teacher answers the environment scores 1; the untrained test teachers
    solve no math task, so the warmup would have no math data: an error naming the setting, not an empty domain."""
    assert cli_main(["mopd", "--student", str(models["student"]), "--teachers",
                     f"math={models['alpha']},code={models['beta']}", "--out", str(tmp_path / "run"), "--quiet",
                     "--steps", "1", "--set", "mopd.prompts_per_step=2", "--set", "mopd.max_new_tokens=4",
                     "--set", "mopd.task_pool=10", "--set", "mopd.env_levels=math=1,code=1-2",
                     "--set", "mopd.eval_tasks=0", "--set", "mopd.warmup_steps=1", "--set", "mopd.warmup_data=verified",
                     "--set", "mopd.warmup_tries=2", "--set", "mopd.warmup_examples=4"]) == 2
    err = capsys.readouterr().err
    assert "mopd.warmup_data=verified: the teacher " in err and "solved none of 2 math training tasks in 2 tries" in err


@pytest.mark.parametrize("setting, message", [
    (dict(teachers="alpha"), "--teachers: 'alpha' is not DOMAIN=DIR"),
    (dict(teachers="alpha=/no/such/dir"), "--teachers alpha=/no/such/dir: no such checkpoint directory"),
    (dict(teachers="gamma={a}"), "names the domain(s) gamma, but no environment of mopd.envs has them"),
    (dict(extra=("--set", "mopd.prompts_per_step=1")), "mopd.prompts_per_step (1) must be at least the number"),
    (dict(extra=("--set", "mopd.correction=clip")), "mopd: correction must be one of tis, icepop, none"),
    (dict(extra=("--set", "mopd.warmup_data=web")), "mopd.warmup_data must be one of env, teacher, verified"),
    (dict(extra=("--set", "mopd.group_size=4")), "unknown mopd fields ['group_size']"),
    (dict(extra=("--set", "mopd.envs=nowhere:Env")), "cannot import Env from nowhere"),
])
def test_bad_inputs_are_clear_errors(models, tmp_path, capsys, setting, message):
    teachers = setting.get("teachers", "alpha={a}").format(a=models["alpha"])
    assert _mopd(models, tmp_path / "run", *setting.get("extra", ()), teachers=teachers) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_unknown_domain_without_fallback_and_foreign_teachers_are_errors(models, tmp_path, capsys):
    out = str(tmp_path / "run")
    common = ["--out", out, "--set", f"mopd.envs={ALPHA},{BETA}", "--set", "mopd.prompts_per_step=2"]
    assert cli_main(["mopd", "--student", str(models["student"]), "--teachers", f"alpha={models['alpha']}",
                     *common]) == 2
    assert "domain 'beta' has no teacher: --teachers names alpha and there is no --general" in capsys.readouterr().err
    foreign = tmp_path / "foreign"  # a teacher of another vocabulary
    save_pretrained(HybridLM(ModelConfig(**{**CONFIG, "vocab_size": 640})), foreign)
    assert cli_main(["mopd", "--student", str(models["student"]), "--teachers", f"alpha={foreign}",
                     "--general", str(models["beta"]), *common]) == 2
    assert "a vocabulary of 640 tokens, the student's has 512" in capsys.readouterr().err
    assert cli_main(["mopd", "--teachers", f"alpha={models['alpha']}", *common]) == 2
    assert "--student is required" in capsys.readouterr().err
    assert cli_main(["mopd", "--student", str(tmp_path / "none"), "--general", str(models["beta"]), *common]) == 2
    assert "--student " + str(tmp_path / "none") + ": no such directory" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_print_config_round_trips(models, tmp_path, capsys):
    assert _mopd(models, tmp_path / "run", "--print-config") == 0
    text = capsys.readouterr().out
    assert "[mopd]" in text and "icepop_low = 0.2" in text and "warmup_steps = 20" in text
    (tmp_path / "c.toml").write_text(text.split("\n", 2)[2])
    assert _mopd(models, tmp_path / "run", "--config", str(tmp_path / "c.toml"), "--print-config") == 0
    assert capsys.readouterr().out == text
