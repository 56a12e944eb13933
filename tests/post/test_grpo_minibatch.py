"""Several optimizer steps a rollout batch (`[grpo]` / `[mopd]` global_batch and epochs, hybridtron.post.rl): the
clip statistics by hand; the old log-probs fixed at the batch's start, so that its first step's ratio is 1 and the
second's has moved and clips; the weights handed to the rollout role once a rollout batch (sync and one step
stale); a run resumed from a checkpoint between two mini-batches, bit for bit; DP 2 equal to one process; the
named preset configs/grpo_miles.toml; and clear errors."""

from __future__ import annotations

import copy
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.model.lm import HybridLM
from hybridtron.post.grpo import GRPOConfig, GRPOObjective
from hybridtron.post.losses import GRPOLossConfig, grpo_loss
from hybridtron.post.rl.batches import RolloutBatches, rollout_pipeline_factory
from hybridtron.post.rl.roles import Role, RoleSpec
from hybridtron.train.config import TrainConfig, build_section, read_toml
from hybridtron.train.hooks import Hook
from hybridtron.train.loop import Trainer

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))  # the torchrun helpers of the DP tests
from test_grpo import _grpo, _lines, _random_batch, _same, grpo_argv, policy_dir  # noqa: E402,F401  (a fixture)
from test_dist_rl import assert_same_steps, layout_args, records, torchrun  # noqa: E402
from test_mopd import _mopd, models  # noqa: E402,F401  (models: the fixture)

REPO = Path(__file__).parents[2]


# ------------------------------------------------------------------------------------------ the statistics
def test_clip_statistics_by_hand():
    """Four tokens whose ratio r = pi / pi_old is 0.5, 1.5, 1.1 and 0.7, advantages -1, +1, +1, +1: the lower bound
    (1 - 0.2) cuts token 1 (A < 0, r < 0.8), the upper (1 + 0.28) token 2 (A > 0, r > 1.28); token 4's r < 0.8
    with A > 0 is not clipped (the pessimistic max keeps r A)."""
    ratios = torch.tensor([[0.5, 1.5, 1.1, 0.7]])
    old = torch.log(torch.tensor([[0.4, 0.2, 0.5, 0.5]]))
    logp = old + ratios.log()
    advantages = torch.tensor([[-1.0, 1.0, 1.0, 1.0]])
    _, metrics = grpo_loss(logp, old, advantages, torch.ones(1, 4), 4, GRPOLossConfig(correction="none"))
    assert metrics["clip_fraction"].item() == pytest.approx(0.5)
    assert metrics["clip_fraction_low"].item() == pytest.approx(0.25)
    assert metrics["clip_fraction_high"].item() == pytest.approx(0.25)
    assert metrics["ratio_range"].tolist() == pytest.approx([0.5, 1.5])
    # k3 of KL(current || old) on the current policy's samples: 1/r - 1 + log r per token
    k3 = sum(1 / r - 1 + math.log(r) for r in (0.5, 1.5, 1.1, 0.7)) / 4
    assert metrics["approx_kl"].item() == pytest.approx(k3, rel=1e-5)
    # no valid token: an empty range, which any other absorbs
    _, metrics = grpo_loss(logp, old, advantages, torch.zeros(1, 4), 4, GRPOLossConfig(correction="none"))
    assert metrics["ratio_range"].tolist() == [math.inf, -math.inf]


class RandomRollouts(Role):
    """A rollout role whose batch n is `_random_batch` seeded by n (two groups of four), tagged with the weights
    it was last given."""

    name = "rollout"

    def __init__(self, config):
        self.config, self.version = config, None
        self.rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]]

    def load_weights(self, version, state_dict):
        self.version = version

    def step(self, request):
        batch = _random_batch(self.config, self.rewards, seed=request.index)
        batch.index, batch.policy_version = request.index, self.version
        return batch


class Recorder(Hook):
    def __init__(self):
        self.lines = []

    def on_step_end(self, trainer, stats, decision):
        self.lines.append(stats.record())


def _minibatch_trainer(model, grpo: GRPOConfig, steps: int, staleness: int = 0):
    objective = GRPOObjective(grpo, model.config.mtp_depths)
    source = RolloutBatches(
        rollout_pipeline_factory([RoleSpec(RandomRollouts, dict(config=model.config))], "inline", staleness),
        staleness=staleness, grad_accum=1, mini_batches=grpo.mini_batches, epochs=grpo.epochs,
        old_logprobs=lambda mbs: [objective.old_logprobs(model, mb) for mb in mbs])
    recorder = Recorder()
    trainer = Trainer(model, objective, source, TrainConfig(steps=steps, lr=0.05, warmup_steps=0, decay_fraction=0.0,
                                                            grad_clip=0.0), None, hooks=[recorder])
    return trainer, source, recorder


def test_the_second_step_of_a_rollout_batch_is_off_policy_and_clips(small_config):
    """One rollout batch of 8 rows, global_batch 4: two optimizer steps. The first one's ratio is exactly 1 (the old
    log-probs, computed before it, are the policy it trains); the second's old log-probs are still those of the
    initial policy, so its ratio is pi_after_step_1 / pi_initial, computed here by hand from the two models, and
    its clip statistics follow from those ratios and the batch's advantages."""
    torch.manual_seed(0)
    config = small_config(vocab_size=64)
    grpo = GRPOConfig(group_size=4, prompts_per_step=2, global_batch=4, mtp_loss_weight=0.0, eval_tasks=0,
                      correction="none")
    assert (grpo.mini_batches, grpo.steps_per_rollout) == (2, 2)
    model = HybridLM(config)
    initial = copy.deepcopy(model)
    trainer, source, recorder = _minibatch_trainer(model, grpo, steps=2)
    trainer.train(until=1)
    second = source.steps[1][0]  # the second mini-batch: rows 4-7 of the rollout batch, group 2
    objective = trainer.objective
    assert torch.equal(second.old_logprobs, objective.old_logprobs(initial, second))
    after_first = objective.old_logprobs(model, second)
    trainer.train(until=2)
    first, last = recorder.lines
    assert first["ratio_min"] == first["ratio_max"] == 1.0
    assert first["clip_fraction"] == first["clip_fraction_low"] == first["clip_fraction_high"] == 0.0
    assert first["approx_kl"] == 0.0
    # by hand: the ratios of the second step, the tokens each bound cuts
    mask = second.policy_mask
    ratio = torch.exp(after_first - second.old_logprobs)[mask]
    advantages = second.advantages.unsqueeze(1).expand_as(mask)[mask]
    low = ((advantages < 0) & (ratio < 0.8)).float().mean().item()
    high = ((advantages > 0) & (ratio > 1.28)).float().mean().item()
    assert last["ratio_min"] == pytest.approx(ratio.min().item(), rel=1e-5)
    assert last["ratio_max"] == pytest.approx(ratio.max().item(), rel=1e-5)
    assert ratio.min() < 0.8 and ratio.max() > 1.28  # the update moved the policy past both bounds
    assert last["clip_fraction_low"] == pytest.approx(low) and last["clip_fraction_high"] == pytest.approx(high)
    assert last["clip_fraction_low"] + last["clip_fraction_high"] > 0
    k3 = (1 / ratio - 1 + ratio.log()).mean().item()
    assert last["approx_kl"] == pytest.approx(k3, rel=1e-4) and k3 > 0
    assert [line["rollout_step"] for line in recorder.lines] == [0.0, 1.0]
    assert source.consumed == 1  # both steps trained the one rollout batch


def test_epochs_revisit_the_mini_batches_against_the_same_old_policy(small_config):
    """global_batch 4 and epochs 2: four steps over one rollout batch, mini-batches 1, 2, 1, 2; the third step reads
    the first mini-batch's old log-probs again (fixed at the batch's start), the weights go to the rollout role
    only after the fourth (one request in flight: batch 2 was not asked for before it)."""
    torch.manual_seed(0)
    config = small_config(vocab_size=64)
    grpo = GRPOConfig(group_size=4, prompts_per_step=2, global_batch=4, epochs=2, mtp_loss_weight=0.0, eval_tasks=0)
    model = HybridLM(config)
    trainer, source, recorder = _minibatch_trainer(model, grpo, steps=5)
    trainer.train(until=4)
    assert source.consumed == 1 and source.requested == 1
    assert [line["rollout_step"] for line in recorder.lines] == [0.0, 1.0, 2.0, 3.0]
    assert recorder.lines[0]["ratio_max"] == 1.0 and recorder.lines[2]["ratio_max"] != 1.0
    trainer.train(until=5)
    assert source.consumed == 2 and source.current.policy_version == 4  # sampled after the fourth step
    assert recorder.lines[4]["ratio_min"] == recorder.lines[4]["ratio_max"] == 1.0
    source.close()


# ------------------------------------------------------------------------------------- the command, resume
def _killed_and_resumed(policy_dir, tmp_path, *extra, steps=4, last_kept=3, launch=_grpo):
    """The run of `extra` for `steps` steps, and the same run killed after its step-`last_kept` checkpoint and
    resumed: their run directories."""
    assert launch(policy_dir, tmp_path / "full", "--steps", str(steps), *extra) in (0, None)
    shutil.copytree(tmp_path / "full", tmp_path / "killed")
    for later in range(last_kept + 1, steps + 1):
        shutil.rmtree(tmp_path / "killed" / "checkpoints" / f"step_{later:06d}", ignore_errors=True)
    shutil.rmtree(tmp_path / "killed" / "hf")
    assert launch(policy_dir, tmp_path / "killed", "--steps", str(steps), "--resume", *extra) in (0, None)
    return tmp_path / "full", tmp_path / "killed"


@pytest.mark.parametrize("mode, staleness", [
    (["--set", "grpo.async_rollouts=false"], [0.0, 0.0, 0.0, 0.0]),
    (["--set", "grpo.async_rollouts=true", "--set", "grpo.rollout_backend=inline"], [0.0, 0.0, 1.0, 1.0]),
], ids=["sync", "async"])
@pytest.mark.timeout(300)
def test_a_run_resumed_between_two_mini_batches_is_bit_for_bit(policy_dir, tmp_path, mode, staleness):
    """Rollout batches of 8 rows, global_batch 4: 4 steps are 2 rollout batches. Killed after the checkpoint of step
    3 (between the two mini-batches of batch 2: its old log-probs come from weights the checkpoint does not keep)
    and resumed: the same metrics, line for line, and the same weights. The rollout role gets the weights after
    steps 0 and 2 only: batch 2 is sampled with those after step 2 (sync), or with the initial ones, one rollout
    batch stale (async)."""
    extra = ("--set", "grpo.global_batch=4", "--set", "train.checkpoint_every=3", "--set", "grpo.eval_tasks=0",
             "--set", "train.lr=1e-2", *mode)
    full, killed = _killed_and_resumed(policy_dir, tmp_path, *extra)
    lines = _lines(full)
    assert _lines(killed) == lines and [line["step"] for line in lines] == [1, 2, 3, 4]
    assert [line["rollout_step"] for line in lines] == [0.0, 1.0, 0.0, 1.0]
    assert [line["policy_staleness"] for line in lines] == staleness
    assert lines[0]["ratio_max"] == lines[2]["ratio_max"] == 1.0 and lines[1]["ratio_max"] != 1.0
    assert _same(_weights(full), _weights(killed))


@pytest.mark.timeout(300)
def test_mopd_trains_mini_batches_against_a_fixed_proximal_policy_and_resumes_between_them(models, tmp_path):
    """MOPD's learner shares the mini-batches: 2 prompts a rollout batch, one a step; killed between the two steps of
    batch 2 and resumed, the same lines; the proximal policy of each batch's second step is one update old."""
    extra = ("--set", "mopd.global_batch=1", "--set", "mopd.warmup_steps=0", "--set", "mopd.eval_tasks=0",
             "--set", "train.checkpoint_every=3", "--set", "train.lr=1e-2")
    full, killed = _killed_and_resumed(models, tmp_path, *extra, launch=_mopd)
    lines = _lines(full)
    assert _lines(killed) == lines and [line["rollout_step"] for line in lines] == [0.0, 1.0, 0.0, 1.0]
    assert lines[0]["ratio_min"] == lines[0]["ratio_max"] == 1.0 and lines[1]["ratio_max"] != 1.0
    assert lines[1]["approx_kl"] > 0


def _weights(run):
    return load_pretrained(run / "hf").state_dict()


def _torchrun_grpo(policy_dir, out, *extra):
    torchrun(grpo_argv(policy_dir, out, *extra), timeout=280)


@pytest.mark.timeout(600)
def test_mini_batches_on_two_processes_match_one_process_and_resume_there(policy_dir, tmp_path):
    """DP 2 x EP 2, each rank generating half of every rollout batch and training half of every mini-batch: the
    metrics of one process (the clip statistics and the ratio range included); killed between two mini-batches and
    resumed under torchrun (each rank's old log-probs from the checkpoint), the same lines again."""
    extra = ("--set", "grpo.global_batch=4", "--set", "train.checkpoint_every=3", "--set", "grpo.eval_tasks=0",
             "--set", "train.lr=1e-2")
    assert _grpo(policy_dir, tmp_path / "single", "--steps", "4", *extra) == 0
    full, killed = _killed_and_resumed(policy_dir, tmp_path, *extra, *layout_args("dist.ep=2"),
                                       launch=_torchrun_grpo)
    single, world2 = records(tmp_path / "single"), records(full)
    assert_same_steps(world2, single)
    for got, want in zip(world2, single):
        for key in ("ratio_min", "ratio_max", "clip_fraction_low", "clip_fraction_high", "approx_kl"):
            assert abs(got[key] - want[key]) <= 1e-5 * max(1.0, abs(want[key])), (want["step"], key)
    assert _lines(killed) == _lines(full)


# ------------------------------------------------------------------------------------------ preset, errors
def test_the_miles_preset_is_two_optimizer_steps_a_rollout_batch():
    """configs/grpo_miles.toml: Ultra's miles recipe, 32 prompts x 8 samples a rollout batch, 128 a step."""
    grpo = build_section(GRPOConfig, read_toml(REPO / "configs" / "grpo_miles.toml")["grpo"], "grpo")
    grpo.validate()
    assert (grpo.rollout_batch_rows, grpo.global_batch, grpo.steps_per_rollout) == (256, 128, 2)
    assert (grpo.eps_clip, grpo.eps_clip_high) == (0.2, 0.28)


@pytest.mark.parametrize("override, message", [
    ("grpo.global_batch=3", "grpo.global_batch=3 must divide the rollout batch's 8 rows (grpo.prompts_per_step=2 x "
                            "4 samples a prompt)"),
    ("grpo.global_batch=16", "grpo.global_batch=16 must divide the rollout batch's 8 rows"),
    ("grpo.epochs=0", "grpo.epochs must be >= 1, got 0"),
    ("grpo.global_batch=-4", "grpo.global_batch must be >= 0, got -4"),
])
def test_bad_mini_batch_settings_are_clear_errors(policy_dir, tmp_path, capsys, override, message):
    assert _grpo(policy_dir, tmp_path / "run", "--set", override) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_pipeline_parallelism_refuses_several_steps_a_rollout_batch(policy_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets: the layout is checked before any process group
    assert _grpo(policy_dir, tmp_path / "run", "--set", "grpo.global_batch=4", "--set", "dist.pp=2") == 2
    assert "dist.pp=2: grpo.global_batch=4 / grpo.epochs=1 train a rollout batch over several optimizer steps" in \
        capsys.readouterr().err
