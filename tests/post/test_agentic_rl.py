"""RL on multi-turn trajectories (hybridtron.post.rl.trajectories): the rollout role runs the turn loop for a tool
environment; a trajectory's sequence, loss mask and log-probs line up with its tokens and the tool responses get no
gradient; the turns' routing records join onto one sequence; GRPO runs end to end on `math-python`, with its
agentic statistics, and resumes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.cli import main as cli_main
from hybridtron.data.chat import load_chat_tokenizer, tokenize_chat, tool_turn_text
from hybridtron.data.tokenizer import IM_END
from hybridtron.envs import get_env
from hybridtron.envs.agentic import Trajectory, Turn
from hybridtron.envs.base import TOOL_ERRORS, Task
from hybridtron.infer.engine import HybridEngine
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.scheduler import Completion
from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.post.grpo import GRPOConfig, GRPOObjective
from hybridtron.post.rl.batches import pack_micro_batches
from hybridtron.post.agentic import engine_generate
from hybridtron.post.rl.rollout import Rollout, RolloutBatch, RolloutRequest, RolloutRole
from hybridtron.post.rl.trajectories import joined_routing, trajectory_sample

CONTEXT = 1536  # a math-python prompt (system turn with the python tool) is ~900 tokens of this tokenizer


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, small_config, random_policy):
    """tests/post/test_grpo.py's small random policy with the context a tool environment's prompt needs."""
    directory = tmp_path_factory.mktemp("agentic_policy") / "hf"
    words = ["What is", "python", "code", "print", "boxed", "answer", "tool_call"] + [str(i) for i in range(100)]
    return random_policy(directory, small_config(vocab_size=512, mtp_num_depths=2, max_position_embeddings=CONTEXT),
                         words)


@pytest.fixture(scope="module")
def policy(policy_dir):
    return load_pretrained(policy_dir, dtype=torch.float32), load_chat_tokenizer(policy_dir, vocab_size=512)


class ScriptedEngine:
    """A rollout engine (`RolloutEngine.generate`'s shape) whose "model" solves math-python with its tool: a
    `python` call printing the task's answer, then the answer (off by one for every other trajectory, so that the
    groups disagree); each sampled token has log-prob -0.25."""

    last_stats = None

    def __init__(self, tokenizer, tasks):
        self.tokenizer, self.tasks, self.seen = tokenizer, tasks, 0

    def generate(self, prompts, params, n, *, version, expert_ids=False, first_prompt=0):
        assert n == 1 and version == 0
        out = []
        for i, ids in enumerate(prompts):
            text = self.tokenizer.decode(ids)
            task = next(t for t in self.tasks if t.prompt in text)
            if "<tool_response>" not in text:
                reply = '<tool_call>\n{"name": "python", "arguments": {"code": "print(%s)"}}\n</tool_call>' \
                    % task.answer
            else:
                reply = f"The answer is \\boxed{{{int(task.answer) + (first_prompt + i) % 2}}}."
            tokens = self.tokenizer.encode(reply) + [self.tokenizer.token_id(IM_END)]
            out.append([Completion(list(ids), tokens, torch.full((len(tokens),), -0.25), "stop")])
        return out

    def close(self):
        pass


def tiny_grpo(**overrides) -> GRPOConfig:
    values = dict(group_size=2, prompts_per_step=2, max_new_tokens=8, task_pool=20, draft_length=2, eval_tasks=0,
                  max_refill_rounds=0, rollout_threads=1, levels=(1,))
    return GRPOConfig(**{**values, **overrides})


@pytest.fixture(scope="module")
def scripted_batch(policy_dir, policy):
    """One rollout-role step on math-python with the scripted engine: 2 tasks x 2 trajectories, each a tool call,
    its response, and an answer."""
    model, _ = policy
    role = RolloutRole(model_dir=str(policy_dir), model_config=model.config, env="math-python", env_options={},
                       config=tiny_grpo())
    try:
        role.engine = ScriptedEngine(role.tokenizer, role.tasks)
        role.version = 0
        return role.step(RolloutRequest(1)), role.tokenizer
    finally:
        role.close()


def test_a_trajectory_is_one_rollout_with_its_model_tokens_marked(scripted_batch):
    batch, tokenizer = scripted_batch
    assert len(batch.rollouts) == 4 and batch.group_size == 2
    assert [r.reward for r in batch.rollouts] == [1.0, 0.0, 1.0, 0.0]
    im_end = tokenizer.token_id(IM_END)
    for r in batch.rollouts:
        mask, completion = r.completion_mask.tolist(), r.completion_ids
        assert len(mask) == len(completion) == len(r.logprobs) and mask[0] and mask[-1]
        assert r.finish_reason == "answer" and completion[-1] == im_end
        # the model's two turns, with the tool response and the next generation prompt between them
        first_end = completion.index(im_end) + 1
        second = mask.index(True, first_end)
        assert all(mask[:first_end]) and not any(mask[first_end:second]) and all(mask[second:])
        between = tokenizer.decode(completion[first_end:second])
        assert "<tool_response>" in between and r.task_id and between.rstrip().endswith("assistant")
        assert torch.equal(r.logprobs, torch.where(r.completion_mask, -0.25, 0.0))
    mb = pack_micro_batches(batch, 1)[0]
    for b in range(len(batch.rollouts)):
        # each position's label and behaviour log-prob are those of the token after it, where the model sampled it
        r = next(r for r in batch.rollouts if len(r.prompt_ids) + len(r.completion_ids) - 1 == int(mb.valid[b].sum())
                 and (mb.input_ids[b, :len(r.prompt_ids)] == torch.tensor(r.prompt_ids)).all()
                 and (mb.input_ids[b, len(r.prompt_ids):int(mb.valid[b].sum())]
                      == torch.tensor(r.completion_ids[:-1])).all())
        P, C = len(r.prompt_ids), len(r.completion_ids)
        labels = mb.labels[b, P - 1:P + C - 1]
        assert torch.equal(labels, torch.where(r.completion_mask, torch.tensor(r.completion_ids), IGNORE_INDEX))
        assert torch.equal(mb.rollout_logprobs[b, P - 1:P + C - 1], r.logprobs)
        assert (mb.labels[b, :P - 1] == IGNORE_INDEX).all()


def test_tool_responses_get_exactly_zero_gradient(scripted_batch, policy):
    """The GRPO loss's gradient w.r.t. what feeds the logits (lm_head's input, one row per position: with the MTP
    loss off nothing else reads it) is exactly 0 at every position predicting a prompt or tool-response token, and
    not at the model's tokens."""
    batch, _ = scripted_batch
    model, _ = policy
    mb = pack_micro_batches(batch, 1)[0]
    captured = []

    def keep(module, args, out):
        out.retain_grad()
        captured.append(out)

    hook = model.backbone.norm_f.register_forward_hook(keep)
    try:
        objective = GRPOObjective(tiny_grpo(mtp_loss_weight=0.0, kl_coef=0.0), 0)
        objective.begin_step([mb])
        model.zero_grad()
        objective(model, mb).loss.backward()
    finally:
        hook.remove()
    grad = captured[0].grad[:, :mb.labels.shape[1]].abs().amax(dim=-1)
    trained = mb.labels != IGNORE_INDEX
    assert (grad[~trained] == 0).all()
    tool = mb.valid & ~trained
    assert tool.sum() > 50  # prompts and tool responses were there
    assert (grad[trained] > 0).float().mean() > 0.9


def test_the_batch_carries_the_agentic_statistics(scripted_batch):
    stats = scripted_batch[0].stats
    assert stats["tool_calls_per_trajectory"] == 1.0 and stats["turns_per_trajectory"] == 2.0
    assert stats["tool_calls_well_formed"] == 1.0
    assert all(stats[f"tool_errors/{kind}"] == 0.0 for kind in TOOL_ERRORS)
    assert stats["reward_mean"] == 0.5 and stats["groups_trained"] == 2.0
    assert 0 < stats["response_length"] == stats["model_tokens_per_trajectory"]


def test_routing_records_join_onto_the_sequence():
    """Turn k's record gives the rows from the end of turn k-1 (minus one: the row that read its last token) to
    the end of turn k (minus one); environment tokens after the last turn are dropped."""
    trajectory = Trajectory(task=Task(prompt="p"), token_ids=[], model_mask=[], logprobs=[], prompt_length=4)
    trajectory.append([1, 2, 3, 4])
    spans = []
    for k, (model_tokens, tool_tokens) in enumerate([(3, 2), (4, 3)]):
        start = len(trajectory.token_ids)
        trajectory.append([5] * model_tokens, [-1.0] * model_tokens)
        end = len(trajectory.token_ids)
        record = {"1": torch.full((end - 1, 3), k, dtype=torch.int16)}
        trajectory.turns.append(Turn(start, end, "", "stop", expert_ids=record))
        trajectory.append([6] * tool_tokens)
        spans.append(end)
    trajectory.finish = "token_budget"
    sample = trajectory_sample(trajectory)
    assert len(sample.prompt_ids) == 4 and len(sample.token_ids) == 3 + 2 + 4  # the trailing tool tokens dropped
    assert sample.model_mask.tolist() == [True] * 3 + [False] * 2 + [True] * 4
    rows = sample.expert_ids["1"][:, 0].tolist()
    assert rows == [0] * (spans[0] - 1) + [1] * (spans[1] - spans[0])
    trajectory.turns[1].expert_ids = {"1": torch.zeros(spans[1] - 2, 3, dtype=torch.int16)}  # a position short
    with pytest.raises(ValueError, match="turn 1's routing record of router 1 holds 11 positions, expected 12"):
        joined_routing(trajectory)
    trajectory.turns[0].expert_ids = None  # a turn without a record: no replay
    assert trajectory_sample(trajectory).expert_ids is None


def test_the_learner_replays_each_turns_routing_and_matches_the_engines_log_probs(policy):
    """Three turns sampled by hybridtron's engine (MTP drafts, routing recorded), tool responses between them: the
    joined routing is, position for position, the learner's own on the whole sequence (fp32, the same weights), and
    with it replayed the learner's log-prob of every model token is the engine's."""
    model, tokenizer = policy
    env = get_env("math-python")
    task = env.tasks("train", 1, seed=0)[0]
    prompt = tokenize_chat(tokenizer, env.prompt_messages(task), tools=list(env.tools),
                           add_generation_prompt=True).ids.tolist()
    generate = engine_generate(HybridEngine.from_model(model, tokenizer, speculative=True, draft_length=2),
                               expert_ids=True)
    trajectory = Trajectory(task=task, token_ids=[], model_mask=[], logprobs=[], prompt_length=len(prompt))
    trajectory.append(prompt)
    for turn in range(3):
        completion = generate([trajectory.token_ids], SamplingParams(temperature=0.9, seed=turn, max_tokens=6))[0]
        start = len(trajectory.token_ids)
        trajectory.append(completion.token_ids, completion.logprobs.tolist())
        trajectory.turns.append(Turn(start, len(trajectory.token_ids), "", completion.finish_reason,
                                     expert_ids=completion.expert_ids))
        if turn < 2:
            trajectory.append(tokenizer.encode(tool_turn_text([f"{turn} apples"])))
    trajectory.finish = "answer"
    sample = trajectory_sample(trajectory)
    rollout = Rollout(task_id=task.id, domain=task.domain, difficulty=1, prompt_ids=sample.prompt_ids,
                      completion_ids=sample.token_ids, logprobs=sample.logprobs, finish_reason=sample.finish_reason,
                      advantage=1.0, expert_ids=sample.expert_ids, completion_mask=sample.model_mask)
    mb = pack_micro_batches(RolloutBatch(1, 0, 1, [rollout], {}), 1)[0]
    assert int(mb.completion_mask.sum()) == sample.generated > 10
    valid = mb.valid.flatten()
    routers = {name: moe for name, moe in model.routers().items() if not name.startswith("mtp.")}
    for replay in (False, True):
        objective = GRPOObjective(tiny_grpo(temperature=0.9, routing_replay=replay, mtp_loss_weight=0.0), 0)
        with torch.no_grad():
            logp = objective.scores(objective.forward(model.eval(), mb)[0], mb).logp
        for name, moe in routers.items():  # without replay: the learner's own choice, the same as the turns'
            assert torch.equal(moe.last_expert_ids[valid], mb.expert_ids[name].flatten(0, 1)[valid]), name
        diff = (logp - mb.rollout_logprobs).abs()[mb.completion_mask]
        assert float(diff.max()) < 1e-5, (replay, float(diff.max()))


def _lines(path):
    return [{k: v for k, v in json.loads(line).items() if not any(t in k for t in ("seconds", "per_s", "wait_s"))}
            for line in (path / "metrics.jsonl").read_text().splitlines()]


def _run(policy_dir, out, *extra):
    return cli_main(["grpo", "--model", str(policy_dir), "--env", "math-python", "--out", str(out), "--quiet",
                     "--set", "grpo.group_size=2", "--set", "grpo.prompts_per_step=2", "--set", "grpo.task_pool=10",
                     "--set", "grpo.max_new_tokens=6", "--set", "grpo.levels=1", "--set", "grpo.max_refill_rounds=0",
                     "--set", "grpo.eval_tasks=2", "--set", "grpo.eval_every=2", "--set", "grpo.eval_max_tokens=4",
                     "--set", "grpo.draft_length=2", "--set", "train.grad_accum=2",
                     "--set", "train.checkpoint_every=1", *extra])


@pytest.mark.timeout(300)
def test_grpo_on_math_python_end_to_end_and_resume(policy_dir, tmp_path):
    """`hybridtron grpo --env math-python` with the random policy (routing replay on, MTP drafts): 2 steps with the
    agentic statistics and the held-out pass@1 logged; killed after step 1 and resumed, the same metrics."""
    assert _run(policy_dir, tmp_path / "full", "--steps", "2") == 0
    full = _lines(tmp_path / "full")
    assert [line["step"] for line in full] == [0, 1, 2]
    for key in ("tool_calls_per_trajectory", "turns_per_trajectory", "tool_calls_well_formed",
                "model_tokens_per_trajectory", *(f"tool_errors/{kind}" for kind in TOOL_ERRORS), "policy_loss",
                "reward_mean"):
        assert key in full[-1], key
    assert full[-1]["turns_per_trajectory"] >= 1.0
    assert "pass_at_1" in full[0] and "pass_at_1/L1" in full[-1]  # the held-out tasks through the turn loop
    shutil.copytree(tmp_path / "full", tmp_path / "killed")
    shutil.rmtree(tmp_path / "killed" / "checkpoints" / "step_000002")
    shutil.rmtree(tmp_path / "killed" / "hf")
    assert _run(policy_dir, tmp_path / "killed", "--steps", "2", "--resume") == 0
    assert _lines(tmp_path / "killed") == full
    a, b = (load_pretrained(tmp_path / name / "hf").state_dict() for name in ("full", "killed"))
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_mopd_distils_a_tool_environment_beside_a_single_turn_one(policy_dir, tmp_path):
    """`hybridtron mopd` over math (one generation) and terminal (the turn loop) with a teacher for each (here the
    student itself: its reverse KL to itself is 0 on every trained token)."""
    assert cli_main(["mopd", "--student", str(policy_dir), "--teachers", f"math={policy_dir},terminal={policy_dir}",
                     "--out", str(tmp_path / "run"), "--quiet", "--steps", "1",
                     "--set", "mopd.envs=math,terminal", "--set", "mopd.prompts_per_step=2",
                     "--set", "mopd.task_pool=10", "--set", "mopd.max_new_tokens=6", "--set", "mopd.draft_length=2",
                     "--set", "mopd.warmup_steps=0", "--set", "mopd.eval_tasks=0"]) == 0
    line = _lines(tmp_path / "run")[-1]
    assert line["step"] == 1 and line["turns_per_trajectory"] >= 1.0 and "tool_calls_well_formed" in line
    for domain in ("math", "terminal"):
        assert abs(line[f"reverse_kl/{domain}"]) < 1e-4, (domain, line[f"reverse_kl/{domain}"])
