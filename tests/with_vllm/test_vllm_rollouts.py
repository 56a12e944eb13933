"""vLLM as the rollout engine of GRPO and MOPD (`engine = "vllm"`, hybridtron.post.rl.engines.vllm), on vLLM's CPU
build in `.venv-vllm` (scripts/setup_vllm.sh; `HYBRIDTRON_VLLM_PYTHON` names another Python with vllm): the
engine's samples and log-probs against the learner's recomputation, seeds, stop tokens, the weight push and its
version check, teacher scoring's prompt log-probs, a vLLM process that dies; a GRPO and a MOPD run training with
vLLM's rollouts end to end (and resumed on hybridtron's engine); and the refusals, each one line. A tiny dense model
(Mamba-2, attention, MLP: what vLLM's CPU backend runs) with an attention-only MTP block."""

from __future__ import annotations

import json
import os
import random
import signal

import pytest
import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.cli import main as cli_main
from hybridtron.config import ModelConfig, parse_pattern
from hybridtron.data.chat import load_chat_tokenizer
from hybridtron.envs import Environment, Task
from hybridtron.infer.sampling import SamplingParams
from hybridtron.model.lm import HybridLM
from hybridtron.post.grpo import GRPOConfig
from hybridtron.post.mopd import MOPDConfig
from hybridtron.post.rl.engines.vllm import CPU_KV_CACHE_GIB, VLLMRollouts, check_vllm
from hybridtron.post.rl.objective import head_forward, sampled_logprobs, token_scores
from hybridtron.post.rl.roles import RoleStopped

pytestmark = [pytest.mark.skipif(bool(os.environ.get("HYBRIDTRON_NO_VLLM")),
                                 reason="HYBRIDTRON_NO_VLLM is set: no .venv-vllm (scripts/setup_vllm.sh)"),
              pytest.mark.timeout(600)]


class ToyEnv(Environment):
    """Reward 1 for a completion of even length in characters (groups disagree). Importable by a role process."""

    domain = "toy"

    def generate(self, rng):
        return Task(prompt=f"Count to {rng.randint(0, 10 ** 6)}.", domain="toy", difficulty=1)

    def reward(self, task, completion):
        return float(len(completion) % 2 == 0)


TOY = f"{__name__}:ToyEnv"
SAMPLING = dict(temperature=0.8, top_k=20, top_p=0.9)


def dense_config(**overrides) -> ModelConfig:
    """Mamba-2, attention, MLP, and an attention-only MTP block (head_dim 32: vLLM's CPU attention has no 12 or 16)."""
    base = dict(vocab_size=512, hidden_size=64, layers_block_type=parse_pattern("M*-M*-"), num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, intermediate_size=128, mamba_num_heads=4, mamba_head_dim=16,
                n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16, num_nextn_predict_layers=1,
                mtp_layers_block_type=("full_attention",), max_position_embeddings=256)
    return ModelConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, random_policy):
    directory = tmp_path_factory.mktemp("dense") / "hf"
    words = ["What is", "Count to", "Reason step by step", "boxed", "answer", "think"] + [str(i) for i in range(100)]
    return random_policy(directory, dense_config(), words)


@pytest.fixture(scope="module")
def engine(policy_dir):
    """One vLLM process for the engine-level tests, holding the policy's weights as version 1."""
    model = load_pretrained(policy_dir, dtype=torch.float32)
    tokenizer = load_chat_tokenizer(policy_dir, vocab_size=512)
    config = GRPOConfig(speculative=False, **SAMPLING)
    vllm = VLLMRollouts(config, model_dir=str(policy_dir), model_config=model.config, tokenizer=tokenizer)
    vllm.load_weights(1, model.state_dict())
    yield vllm, model
    vllm.close()


def _learner_logprobs(model, completion, temperature, top_k, top_p):
    ids = torch.tensor([completion.prompt_ids + completion.token_ids])
    P = len(completion.prompt_ids)
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits[:, P - 1:]
    return sampled_logprobs(logits, ids[:, P:], temperature, top_k, top_p)[0]


def test_samples_and_logprobs_are_the_learners(engine):
    """n samples a prompt, each with the log-probs of the filtered, temperature-scaled distribution it was drawn from
    (logprobs_mode="processed_logprobs"): the learner's recomputation agrees to fp32 rounding. The same seed gives the
    same samples; a prompt's samples depend on its index in the round, not on the prompts beside it."""
    vllm, model = engine
    params = SamplingParams(seed=3, max_tokens=10, **SAMPLING)
    prompts = [[1, 10, 20, 30], [1, 11, 21]]
    out = vllm.generate(prompts, params, 3, version=1)
    assert [len(row) for row in out] == [3, 3]
    for row in out:
        assert len({tuple(c.token_ids) for c in row}) > 1  # n samples, not one repeated
        for c in row:
            assert len(c.token_ids) == len(c.logprobs) <= 10 and c.finish_reason in ("stop", "length")
            assert (c.logprobs <= 0).all()
            learner = _learner_logprobs(model, c, **SAMPLING)
            assert torch.allclose(learner, c.logprobs, atol=1e-4), (learner - c.logprobs).abs().max()
    again = vllm.generate(prompts, params, 3, version=1)
    assert [[c.token_ids for c in row] for row in again] == [[c.token_ids for c in row] for row in out]
    second = vllm.generate([prompts[1]], params, 3, version=1, first_prompt=1)  # a replica's share of the round
    assert [c.token_ids for c in second[0]] == [c.token_ids for c in out[1]]


def test_stop_tokens_end_a_sample_and_stay_in_it(engine):
    vllm, model = engine
    params = SamplingParams(seed=5, max_tokens=12, temperature=1.0)
    free = vllm.generate([[1, 10, 20]], params, 1, version=1)[0][0]
    stop = free.token_ids[3]
    cut = vllm.generate([[1, 10, 20]], SamplingParams(seed=5, max_tokens=12, temperature=1.0,
                                                      stop_token_ids=(stop,)), 1, version=1)[0][0]
    first = free.token_ids.index(stop)
    assert cut.token_ids == free.token_ids[:first + 1] and cut.finish_reason == "stop"


def test_a_round_longer_than_a_prefill_step_is_sampled(engine):
    """A seeded round whose prompts exceed one scheduler step's token budget (4096 tokens by default: here 16
    prompts x 8 samples x 41 tokens, a GRPO step's size). vLLM 0.32 splits such prefills over steps and then rewinds
    the seeded generator of each split sample with `Generator.set_offset`, which a CPU generator does not have
    (RuntimeError: every GRPO step of 16 x 8 math prompts failed), so the CPU engine runs without chunked prefill."""
    vllm, _ = engine
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(16, 512) for _ in range(40)] for _ in range(16)]
    params = SamplingParams(seed=7, max_tokens=4, **SAMPLING)
    out = vllm.generate(prompts, params, 8, version=1)
    assert [len(row) for row in out] == [8] * 16 and all(c.token_ids for row in out for c in row)
    again = vllm.generate(prompts, params, 8, version=1)
    assert [[c.token_ids for c in row] for row in again] == [[c.token_ids for c in row] for row in out]


def test_weights_are_pushed_and_the_version_checked(engine):
    """New weights reach vLLM (its samples' log-probs are those of the new model), labelled with their version; a
    rollout asking for another version is refused."""
    vllm, model = engine
    moved = {name: value + 0.05 * torch.randn_like(value) if value.is_floating_point() else value
             for name, value in model.state_dict().items()}
    vllm.load_weights(2, moved)
    assert vllm.held_version() == "2"
    with pytest.raises(RoleStopped, match="weight version: vLLM holds '2', the rollout asked for '1'"):
        vllm.generate([[1, 10, 20]], SamplingParams(seed=1, max_tokens=4), 1, version=1)
    c = vllm.generate([[1, 10, 20]], SamplingParams(seed=1, max_tokens=6, **SAMPLING), 1, version=2)[0][0]
    other = HybridLM(model.config, init=False)
    other.load_state_dict(moved)
    assert torch.allclose(_learner_logprobs(other, c, **SAMPLING), c.logprobs, atol=1e-4)
    assert not torch.allclose(_learner_logprobs(model, c, **SAMPLING), c.logprobs, atol=1e-3)
    vllm.load_weights(1, model.state_dict())


def test_prompt_logprobs_are_a_teachers_scores_at_temperature_1(engine):
    """What MOPD's teacher scoring needs, from vLLM's prompt log-probs: each token's log-prob and the top-k, equal
    to the teacher's `token_scores` at temperature 1 (vLLM does not scale prompt log-probs by a temperature)."""
    vllm, model = engine
    sequence = [1, 10, 20, 30, 40, 50]
    rows = vllm.score([sequence], top_k=4)[0]
    head, _ = head_forward(model, torch.tensor([sequence[:-1]]), mtp=False)
    expected = token_scores(head, torch.tensor([sequence[1:]]), 1.0, top=4)
    assert torch.allclose(torch.tensor([r[0] for r in rows]), expected.logp[0], atol=1e-4)
    assert [r[1] for r in rows] == expected.top_ids[0].tolist()
    assert torch.allclose(torch.tensor([r[2] for r in rows]), expected.top_logp[0], atol=1e-4)


def test_a_vllm_process_that_dies_is_one_line(engine):
    """(Last of the engine's tests: it kills the process.)"""
    vllm, _ = engine
    os.kill(vllm.process.process.pid, signal.SIGKILL)
    with pytest.raises(RoleStopped, match=r"grpo.engine=vllm: vLLM failed while generating with the weights of step "
                                          r"1: its process died \(exit code -9\).*resume it \(--resume\)") as info:
        vllm.generate([[1, 10]], SamplingParams(seed=1, max_tokens=4), 1, version=1)
    assert "\n" not in str(info.value)
    vllm.close()  # the log the line names outlives the engine; the weights written for vLLM do not
    assert vllm.process.log.is_file() and str(vllm.process.log) in str(info.value)
    assert [p.name for p in vllm.workdir.iterdir()] == ["vllm.log"]


# ------------------------------------------------------------------------------------------------ end to end
def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_grpo_trains_on_vllm_rollouts_and_resumes_on_hybridtrons(policy_dir, tmp_path):
    """GRPO with vLLM generating every rollout, its roles in a process (the asynchronous mode, one step off-policy):
    it trains, logs the rollout-vs-trainer mismatch (small: both fp32), and its checkpoint resumes on hybridtron's
    own engine."""
    run = tmp_path / "grpo"
    argv = ["grpo", "--model", str(policy_dir), "--env", TOY, "--out", str(run), "--quiet", "--steps", "2",
            "--set", "grpo.engine=vllm", "--set", "grpo.speculative=false", "--set", "grpo.group_size=4",
            "--set", "grpo.prompts_per_step=2", "--set", "grpo.task_pool=20", "--set", "grpo.max_new_tokens=12",
            "--set", "grpo.eval_tasks=0", "--set", "grpo.temperature=0.8", "--set", "grpo.top_k=20",
            "--set", "grpo.async_rollouts=true", "--set", "grpo.rollout_backend=process",
            "--set", "train.grad_accum=1", "--set", "train.checkpoint_every=2"]
    assert cli_main(argv) == 0
    lines = _metrics(run)
    assert [line["step"] for line in lines] == [1, 2]
    assert [line["policy_staleness"] for line in lines] == [0.0, 1.0]
    for line in lines:
        assert line["rollout_tokens"] > 0 and line["rollout_tokens_per_s"] > 0
        assert torch.isfinite(torch.tensor(line["loss"])) and line["is_out_of_bounds_share"] == 0.0
    # step 1: the weights that sampled are the learner's, so w = exp(learner - vLLM) measures the engines alone
    # (both fp32); step 2's batch was sampled one step behind the learner, and w measures that step too
    first, second = lines
    assert first["is_mismatch"] < 1e-5 and 1 - 1e-4 < first["is_weight_min"] <= first["is_weight_max"] < 1 + 1e-4
    assert first["is_mismatch"] < second["is_mismatch"] < 1e-2
    assert 0.9 < second["is_weight_min"] < 1 < second["is_weight_max"] < 1.1
    resumed = ["grpo", "--out", str(run), "--resume", "--steps", "3", "--quiet", "--set", "grpo.engine=hybridtron"]
    assert cli_main(resumed) == 0
    assert [line["step"] for line in _metrics(run)] == [1, 2, 3]


def test_mopd_trains_on_vllm_rollouts_and_vllm_teacher_scores(policy_dir, tmp_path):
    """MOPD with vLLM sampling the student's rollouts and a teacher scoring them on vLLM too (prompt log-probs with
    the top-K of the top-K reverse KL)."""
    run = tmp_path / "mopd"
    argv = ["mopd", "--student", str(policy_dir), "--general", str(policy_dir), "--out", str(run), "--quiet",
            "--steps", "2", "--set", "mopd.engine=vllm", "--set", "mopd.speculative=false",
            "--set", "mopd.teacher_engine=vllm", "--set", "mopd.kl_top_k=4",
            "--set", "mopd.envs=math", "--set", "mopd.prompts_per_step=3", "--set", "mopd.task_pool=20",
            "--set", "mopd.max_new_tokens=10", "--set", "mopd.eval_tasks=0", "--set", "mopd.warmup_steps=0",
            "--set", "train.grad_accum=1", "--set", "train.checkpoint_every=2"]
    assert cli_main(argv) == 0
    lines = _metrics(run)
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:  # synchronous: every batch sampled with the learner's weights
        assert line["is_mismatch"] < 1e-5 and line["rollout_tokens"] > 0
        assert 1 - 1e-4 < line["is_weight_min"] <= line["is_weight_max"] < 1 + 1e-4
    # the teacher is the student at step 0: vLLM's scores are the learner's own log-probs
    assert lines[0]["reverse_kl"] == pytest.approx(0, abs=1e-5)
    assert lines[0]["topk_reverse_kl"] == pytest.approx(0, abs=1e-5)


def test_a_teacher_on_vllm_needs_temperature_1(policy_dir, tmp_path, capsys):
    argv = ["mopd", "--student", str(policy_dir), "--general", str(policy_dir), "--out", str(tmp_path / "t"),
            "--quiet", "--set", "mopd.teacher_engine=vllm", "--set", "mopd.temperature=0.8", "--set", "mopd.envs=math",
            "--set", "mopd.warmup_steps=0"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "mopd.teacher_engine=vllm: the teachers score at the rollouts' temperature " \
        "(mopd.temperature=0.8), and vLLM's prompt log-probs are the plain log-softmax" in err


# ------------------------------------------------------------------------------------------------ refusals
def _refusal(policy_dir, tmp_path, capsys, *sets, env=None, monkeypatch=None):
    argv = ["grpo", "--model", str(policy_dir), "--env", TOY, "--out", str(tmp_path / "refused"), "--quiet",
            "--steps", "1", "--set", "grpo.engine=vllm", *[arg for s in sets for arg in ("--set", s)]]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    return err


def test_no_vllm_environment_is_one_line(policy_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HYBRIDTRON_VLLM_PYTHON", str(tmp_path / "nowhere" / "python"))
    err = _refusal(policy_dir, tmp_path, capsys, "grpo.speculative=false")
    assert "grpo.engine=vllm: no vLLM environment at" in err and "./scripts/setup_vllm.sh" in err
    assert "grpo.engine=hybridtron" in err


@pytest.mark.parametrize("sets, expected", [
    (("grpo.weight_sync=nccl", "grpo.speculative=false"),
     "grpo.weight_sync=nccl is vLLM's NCCL weight-transfer engine, which needs GPUs; set grpo.weight_sync=reload"),
    ((), "vLLM's CPU backend cannot decode a Mamba hybrid speculatively"),
])
def test_what_vllm_cannot_run_on_a_cpu_is_refused(policy_dir, tmp_path, capsys, sets, expected):
    if torch.cuda.is_available():
        pytest.skip("the CPU's refusals")
    assert expected in _refusal(policy_dir, tmp_path, capsys, *sets)


def test_a_moe_model_on_a_cpu_is_refused(policy_dir):
    if torch.cuda.is_available():
        pytest.skip("the CPU's refusals")
    moe = dense_config(layers_block_type=parse_pattern("M*E"), n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, moe_shared_expert_intermediate_size=32)
    with pytest.raises(ValueError, match=r"mopd.engine=vllm: the model has MoE layers \(2\), and vLLM's CPU backend "
                                         r"has no kernel for its non-gated relu2 experts"):
        check_vllm(MOPDConfig(speculative=False), moe, str(policy_dir))


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM's CPU backend's memory check")
def test_vllm_starts_on_a_cpu_whatever_memory_is_free(policy_dir, monkeypatch):
    """Left to itself vLLM's CPU backend wants gpu_memory_utilization of the machine's memory free when it starts
    (any other process on the machine stopped the run); the engine gives it CPU_KV_CACHE_GIB of KV cache instead.
    At a share of 1.0, which no running machine has free, it starts and samples."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    model_config = ModelConfig.from_hf(policy_dir)
    tokenizer = load_chat_tokenizer(policy_dir, vocab_size=512)
    vllm = VLLMRollouts(GRPOConfig(speculative=False, vllm_gpu_memory_utilization=1.0), model_dir=str(policy_dir),
                        model_config=model_config, tokenizer=tokenizer)
    try:
        vllm.load_weights(1, load_pretrained(policy_dir, dtype=torch.float32).state_dict())
        out = vllm.generate([[1, 10, 20]], SamplingParams(seed=1, max_tokens=4), 2, version=1)
        assert len(out[0]) == 2 and all(1 <= len(c.token_ids) <= 4 for c in out[0])
        assert f"Explicitly set ({float(CPU_KV_CACHE_GIB)}/" in vllm.process.log.read_text()
    finally:
        vllm.close()


def test_a_vllm_that_does_not_start_is_one_line(policy_dir, tmp_path, monkeypatch):
    """A Python without vllm (this one): the start fails, named in one line with the log and the fix."""
    import sys

    monkeypatch.setenv("HYBRIDTRON_VLLM_PYTHON", sys.executable)
    model_config = ModelConfig.from_hf(policy_dir)
    tokenizer = load_chat_tokenizer(policy_dir, vocab_size=512)
    with pytest.raises(RoleStopped, match=r"grpo.engine=vllm: vLLM failed while starting: ModuleNotFoundError: No "
                                          r"module named 'vllm'; its log: .*vllm.log; its log says why, or set "
                                          r"grpo.engine=hybridtron"):
        VLLMRollouts(GRPOConfig(speculative=False), model_dir=str(policy_dir), model_config=model_config,
                     tokenizer=tokenizer)


def test_grpo_on_a_tool_environment_samples_its_turns_on_vllm(tmp_path, random_policy):
    """GRPO on `math-python` (the turn loop: the system turn declares the `python` tool) with vLLM sampling every turn:
    the trajectory's model tokens come back with their log-probs (the learner's to fp32 rounding at step 1) and the
    agentic statistics are logged. The random policy rarely calls its tool: this checks the plumbing of trajectories
    through vLLM; the turns after a tool call go through the same `generate` (tests/post/test_agentic_rl.py)."""
    words = ["What is", "python", "print", "boxed", "answer", "tool_call"] + [str(i) for i in range(100)]
    directory = random_policy(tmp_path / "policy", dense_config(max_position_embeddings=1536), words)
    run = tmp_path / "grpo"
    assert cli_main(["grpo", "--model", str(directory), "--env", "math-python", "--out", str(run), "--quiet",
                     "--steps", "1", "--set", "grpo.engine=vllm", "--set", "grpo.speculative=false",
                     "--set", "grpo.group_size=2", "--set", "grpo.prompts_per_step=2", "--set", "grpo.task_pool=10",
                     "--set", "grpo.max_new_tokens=8", "--set", "grpo.eval_tasks=0", "--set", "grpo.max_refill_rounds=0",
                     "--set", "train.grad_accum=1"]) == 0
    line = _metrics(run)[-1]
    assert line["step"] == 1 and line["turns_per_trajectory"] >= 1.0 and line["rollout_tokens"] > 0
    assert "tool_calls_well_formed" in line and "tool_calls_per_trajectory" in line
    assert line["is_mismatch"] < 1e-5 and 1 - 1e-4 < line["is_weight_min"] <= line["is_weight_max"] < 1 + 1e-4


def test_grpo_with_vllm_in_a_ray_actor(policy_dir, tmp_path):
    """The rollout role as a Ray actor (`rollout_backend = "ray"`) owning its vLLM process: the same protocol as
    inline and in a process (the weights pushed every step, the version checked)."""
    pytest.importorskip("ray")  # the `ray` extra, which scripts/setup.sh installs
    run = tmp_path / "grpo"
    assert cli_main(["grpo", "--model", str(policy_dir), "--env", TOY, "--out", str(run), "--quiet", "--steps", "2",
                     "--set", "grpo.engine=vllm", "--set", "grpo.speculative=false", "--set", "grpo.group_size=4",
                     "--set", "grpo.prompts_per_step=2", "--set", "grpo.task_pool=20", "--set", "grpo.max_new_tokens=12",
                     "--set", "grpo.eval_tasks=0", "--set", "grpo.rollout_backend=ray",
                     "--set", "train.grad_accum=1"]) == 0
    lines = _metrics(run)
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:  # synchronous: each batch sampled by vLLM with the learner's weights of that step
        assert line["rollout_tokens"] > 0 and line["is_mismatch"] < 1e-5
        assert 1 - 1e-4 < line["is_weight_min"] <= line["is_weight_max"] < 1 + 1e-4
