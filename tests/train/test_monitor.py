"""The stability monitor: signals (keys, values, the fused norms against their reference), each detector on
synthetic metric streams, the configuration, and the responses (skip, rollback, anneal, GOOD marks, run history)
on a small model with a synthetic loader."""

from __future__ import annotations

import io
import json
import math
import random

import pytest
import torch

from types import SimpleNamespace

from hybridtron.checkpoint.dcp import GOOD, CheckpointManager, step_of
from hybridtron.model.lm import HybridLM
from hybridtron.numerics.grad_accum import apply_output_grad_accumulation
from hybridtron.train import hooks as H
from hybridtron.train.config import RunConfig, TrainConfig
from hybridtron.train.evaluate import HeldOutLoss
from hybridtron.train.loop import Trainer
from hybridtron.train.monitor import (
    DivergenceError, LossSpike, MaxVio, MonitorConfig, MtpLeads, NoMonitor, NonFinite, ResidualSpread,
    StabilityMonitor, WgradGrowth, build_monitor, parse_faults,
)
from hybridtron.train.objectives import LoaderBatches, PretrainObjective
from hybridtron.train.stats import StepStats, group_norms, group_norms_ref, parameter_group


class ProgressionLoader:
    """Rows of arithmetic progressions mod the vocabulary (learnable in a few dozen steps); the position is the
    state, so a rollback or resume replays or skips exactly."""

    def __init__(self, vocab: int, batch: int = 4, seq: int = 16):
        self.vocab, self.batch, self.seq, self.position = vocab, batch, seq, 0

    def __next__(self):
        generator = torch.Generator().manual_seed(self.position)
        self.position += 1
        start = torch.randint(0, self.vocab, (self.batch, 1), generator=generator)
        stride = torch.randint(1, 4, (self.batch, 1), generator=generator)
        ids = (start + stride * torch.arange(self.seq + 1)) % self.vocab
        return ids[:, :-1], ids[:, 1:]

    def __iter__(self):
        return self

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def make_trainer(tmp_path, small_config, *, steps=40, checkpoint_every=10, monitor=None, train=None,
                 model_config=None, hooks=()):
    """A small model on a synthetic loader, validated and watched as pretraining is, with a quiet event stream."""
    model_config = model_config or small_config()
    model = HybridLM(model_config)
    config = TrainConfig(steps=steps, lr=3e-3, warmup_steps=5, checkpoint_every=checkpoint_every, val_every=1000,
                         maxvio_window=5, **(train or {}))
    monitor_config = monitor or MonitorConfig(min_history=8, window=20, good_after=5)
    batches = LoaderBatches(ProgressionLoader(model_config.vocab_size), config.grad_accum)
    val = [ProgressionLoader(model_config.vocab_size).__next__()]
    monitor, faults = build_monitor(monitor_config, tmp_path, model_config, stream=io.StringIO())
    if faults is not None:  # the drill wraps the batches and installs itself as a hook
        batches = faults.wrap_batches(batches, model_config.vocab_size, model_config.pad_token_id)
        hooks = (*hooks, faults)
    return Trainer(model, PretrainObjective(), batches, config, CheckpointManager(tmp_path / "checkpoints", keep=10),
                   hooks=[H.MetricsLogger(tmp_path), *hooks],
                   evaluators=[HeldOutLoss(val, config.val_every, per_batch_mean=True)],  # pretraining's definition
                   monitor=monitor)


class OnStepEnd(H.Hook):
    """A hook that calls `fn(trainer, stats)` at the end of every step."""

    def __init__(self, fn):
        self.fn = fn

    def on_step_end(self, trainer, stats, decision):
        self.fn(trainer, stats)


def stderr_of(trainer) -> str:
    return trainer.monitor.events.stream.getvalue()


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ============================================================================================== signals
def test_parameter_groups_name_layers_and_the_output_layer():
    assert parameter_group("backbone.layers.3.mixer.in_proj.weight") == "layer.3"
    assert parameter_group("backbone.embeddings.weight") == "embeddings"
    assert parameter_group("backbone.norm_f.weight") == "norm_f"
    assert parameter_group("lm_head.weight") == "lm_head"
    assert parameter_group("mtp.layers.0.eh_proj.weight") == "mtp"


def test_group_norms_match_reference(small_config):
    model = HybridLM(small_config())
    ids = torch.randint(0, 128, (2, 16))
    model(ids, ids).loss.backward()
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    fast, ref = group_norms(named), group_norms_ref(named)
    assert fast.keys() == ref.keys() and {"lm_head", "embeddings", "layer.0", "mtp"} <= fast.keys()
    for key in ref:
        assert fast[key] == pytest.approx(ref[key], rel=1e-6), key


def test_step_metrics_carry_every_signal_with_stable_keys(tmp_path, small_config):
    trainer = make_trainer(tmp_path, small_config, steps=10, train={"grad_clip": 0.05},
                           monitor=MonitorConfig(residual_every=5, update_ratio_every=5, min_history=8, window=20))
    trainer.train()
    records = {r["step"]: r for r in lines(tmp_path / "metrics.jsonl") if "loss" in r}
    moe_layers = [i for i, layer in enumerate(trainer.model.backbone.layers) if layer.kind == "moe"]
    n_layers = len(trainer.model.backbone.layers)
    for step, record in records.items():
        assert {f"wgrad_norm/layer.{i}" for i in range(n_layers)} <= record.keys()
        assert {"wgrad_norm/lm_head", "wgrad_norm/embeddings", "mtp_loss_1", "mtp_loss_2"} <= record.keys()
        assert {f"router_bias_spread/{i}" for i in moe_layers} <= record.keys()
        assert {f"maxvio/{i}" for i in moe_layers} <= record.keys()
        assert {"maxvio/mtp.1", "router_bias_spread/mtp.1"} <= record.keys(), "the MTP router is watched too"
        sampled = step in (1, 5, 10)
        assert ({f"residual_rms/{i}" for i in range(n_layers)} <= record.keys()) == sampled, step
        assert ("update_ratio" in record) == (step in (5, 10)), step
        assert not any(k.startswith("underflow/") for k in record), "no quantized module, no underflow keys"
        # the per-group norms are the norms before clipping: their root-sum-square is the loop's grad_norm
        total = math.sqrt(sum(v ** 2 for k, v in record.items() if k.startswith("wgrad_norm/")))
        assert record["grad_norm"] > 0.05 and total == pytest.approx(record["grad_norm"], rel=1e-4)
        assert 0 < record.get("update_ratio", 1e-3) < 1


def test_residual_rms_equals_the_block_outputs_rms(tmp_path, small_config):
    trainer = make_trainer(tmp_path, small_config, steps=1)
    captured = {}
    for index, layer in enumerate(trainer.model.backbone.layers):
        layer.register_forward_hook(lambda m, i, o, index=index: captured.setdefault(index, o.detach().clone())
                                    if m.training else None)
    trainer.train()
    record = next(r for r in lines(tmp_path / "metrics.jsonl") if r.get("step") == 1)
    for index, output in captured.items():
        assert record[f"residual_rms/{index}"] == pytest.approx(float(output.pow(2).mean().sqrt()), rel=1e-5)


def test_underflow_is_read_from_quantized_modules(tmp_path, small_config):
    from hybridtron.numerics import QuantLinear, QuantRecipe
    trainer = make_trainer(tmp_path, small_config, steps=2, monitor=MonitorConfig(underflow_every=2, min_history=8,
                                                                                  window=20))
    mixer = trainer.model.backbone.layers[0].mixer
    mixer.in_proj = QuantLinear.from_linear(mixer.in_proj, QuantRecipe(format="nvfp4"))
    trainer.train()
    records = {r["step"]: r for r in lines(tmp_path / "metrics.jsonl") if "loss" in r}
    key = "underflow/backbone.layers.0.mixer.in_proj"
    assert key in records[1] and key in records[2]
    assert 0 < records[1][key] < 0.5  # NVFP4 flushes some small values, far from all
    assert not mixer.in_proj.stats.enabled, "switched off outside sampled training forwards"


# ============================================================================================= detectors
CONFIG = MonitorConfig(window=50, min_history=20, mtp_lead_after=20)


def step_stats(step=30, *, mtp_losses=(), **fields) -> StepStats:
    """A step's stats holding only what a detector test gives."""
    losses = fields.pop("losses", {})
    return StepStats(step=step, lr=1e-3, losses=losses, tokens=0, expert_counts={}, mtp_losses=list(mtp_losses),
                     **fields)


def losses_stats(step: int, values: dict) -> StepStats:
    """`{"lm_loss": ..., "mtp_loss_1": ..., "grad_norm": ..., "wgrad_norm/lm_head": ...}` as a step's stats."""
    depths = sorted(k for k in values if k.startswith("mtp_loss_"))
    return step_stats(step, losses={k: v for k, v in values.items() if k in ("loss", "lm_loss")},
                      mtp_losses=[values[k] for k in depths], grad_norm=values.get("grad_norm", math.nan),
                      group_grad_norms={k.removeprefix("wgrad_norm/"): v for k, v in values.items()
                                        if k.startswith("wgrad_norm/")})


def feed(detector, stream):
    """Run a detector over a list of metric dicts as the monitor does; return the steps where it fired."""
    fired = []
    for step, values in enumerate(stream, start=1):
        stats = losses_stats(step, values)
        finding = detector.check(stats)
        if finding is not None:
            fired.append(step)
        else:
            detector.observe(stats)
    return fired


def healthy_losses(n, seed=0, noise=0.05):
    rng = random.Random(seed)
    return [3 + 2 * math.exp(-i / 100) + rng.gauss(0, noise) for i in range(n)]


def test_loss_spike_fires_on_a_spike_only():
    losses = healthy_losses(300)
    assert feed(LossSpike(CONFIG), [{"lm_loss": v} for v in losses]) == []
    losses[200] += 2.0
    assert feed(LossSpike(CONFIG), [{"lm_loss": v} for v in losses]) == [201]
    early = healthy_losses(300)
    early[10] += 5.0  # before min_history: not judged
    assert feed(LossSpike(CONFIG), [{"lm_loss": v} for v in early]) == []


def test_wgrad_growth_fires_on_tenfold_growth_not_on_noise():
    rng = random.Random(1)
    norms = [1.0 + 0.5 * rng.random() for _ in range(200)]
    assert feed(WgradGrowth(CONFIG), [{"grad_norm": v, "wgrad_norm/lm_head": v / 2} for v in norms]) == []
    norms[150] = 30.0
    stream = [{"grad_norm": 1.0, "wgrad_norm/lm_head": v} for v in norms]
    assert feed(WgradGrowth(CONFIG), stream) == [151]


def mtp_stream(n, degrade_from=None, rate=0.004, seed=0):
    """Main and MTP losses falling together with shared batch noise; from `degrade_from` the MTP loss climbs."""
    rng = random.Random(seed)
    stream = []
    for i, main in enumerate(healthy_losses(n, seed=seed, noise=0.0)):
        batch = rng.gauss(0, 0.15)  # the batch's difficulty, common to every depth
        extra = rate * (i - degrade_from) if degrade_from is not None and i >= degrade_from else 0.0
        stream.append({"lm_loss": main + batch, "mtp_loss_1": main + 0.3 + batch + rng.gauss(0, 0.02),
                       "mtp_loss_2": main + 0.4 + batch + extra + rng.gauss(0, 0.02)})
    return stream


def test_mtp_leads_fires_when_an_mtp_depth_degrades_and_the_main_loss_does_not():
    assert feed(MtpLeads(CONFIG), mtp_stream(400)) == []
    fired = feed(MtpLeads(CONFIG), mtp_stream(400, degrade_from=200, rate=0.01))
    assert fired and 200 < fired[0] <= 260, fired


def test_mtp_leads_fires_on_an_mtp_spike_but_not_on_a_spike_of_every_loss():
    stream = mtp_stream(200)
    stream[150]["mtp_loss_2"] += 1.5
    assert feed(MtpLeads(CONFIG), stream)[:1] == [151]
    stream = mtp_stream(200)
    for key in ("lm_loss", "mtp_loss_1", "mtp_loss_2"):
        stream[150][key] += 1.5  # a hard batch: every loss jumps together
    assert feed(MtpLeads(CONFIG), stream) == []


def test_maxvio_fires_above_its_share_of_the_bound_after_min_history():
    detector = MaxVio(CONFIG, bound=4.0)
    assert detector.check(step_stats(30, maxvio={"1": 1.9, "3": 1.2})) is None
    finding = detector.check(step_stats(30, maxvio={"1": 1.2, "3": 2.1}))
    assert finding.key == "maxvio/3" and finding.threshold == 2.0
    assert detector.check(step_stats(5, maxvio={"3": 3.9})) is None


def test_residual_spread_counts_orders_of_magnitude():
    detector = ResidualSpread(CONFIG)
    assert detector.check(step_stats(residual_rms={0: 0.1, 1: 50.0})) is None  # 2.7 orders
    finding = detector.check(step_stats(residual_rms={0: 0.01, 1: 1.0, 2: 20.0}))
    assert finding.value == pytest.approx(math.log10(2000))


def test_nonfinite_names_the_signal():
    detector = NonFinite(CONFIG)
    assert detector.check(losses_stats(1, {"loss": 3.0, "grad_norm": 1.0, "wgrad_norm/layer.3": 0.5})) is None
    finding = detector.check(losses_stats(1, {"loss": 3.0, "grad_norm": float("nan"),
                                              "wgrad_norm/layer.3": float("inf")}))
    assert "grad_norm" in finding.message and "wgrad_norm/layer.3" in finding.message


# ================================================================================================ config
def test_monitor_config_rejects_mistakes_by_name():
    with pytest.raises(ValueError, match="monitor.on_maxvio"):
        MonitorConfig(on_maxvio="skip").validate()
    with pytest.raises(ValueError, match="monitor.on_loss_spike"):
        MonitorConfig(on_loss_spike="panic").validate()
    with pytest.raises(ValueError, match="monitor.min_history"):
        MonitorConfig(window=10, min_history=20).validate()
    with pytest.raises(ValueError, match="monitor.inject_fault"):
        MonitorConfig(inject_fault="lr_spike@0").validate()
    with pytest.raises(ValueError, match="monitor.inject_fault"):
        MonitorConfig(inject_fault="meteor@3").validate()
    assert parse_faults("lr_spike@30, nan_grad@30,router_bias@5") == {30: ["lr_spike", "nan_grad"],
                                                                     5: ["router_bias"]}


def test_a_disabled_monitor_adds_no_hook(tmp_path, small_config, pretrain_config):
    run = pretrain_config("monitor.enabled=false", "monitor.inject_fault=nan_grad@3")
    monitor, faults = build_monitor(run.monitor, tmp_path, small_config())
    assert isinstance(monitor, NoMonitor) and faults is None


def test_monitor_section_in_run_config(tmp_path, pretrain_config):
    run = pretrain_config("monitor.on_mtp_leads=rollback", "monitor.loss_spike_sigma=4")
    assert run.monitor.on_mtp_leads == "rollback" and run.monitor.loss_spike_sigma == 4.0
    run.save(tmp_path / "run_config.json")
    assert RunConfig.load(tmp_path / "run_config.json").monitor == run.monitor
    with pytest.raises(ValueError, match="monitor"):
        pretrain_config("monitor.no_such_field=1")
    raw = json.loads((tmp_path / "run_config.json").read_text())
    del raw["monitor"]  # a run configured before the monitor existed
    (tmp_path / "old.json").write_text(json.dumps(raw))
    assert RunConfig.load(tmp_path / "old.json").monitor == MonitorConfig()


# ============================================================================================= responses
def test_nan_gradient_is_skipped_and_the_weights_stay(tmp_path, small_config):
    snapshots = {}
    snap = OnStepEnd(lambda t, stats: snapshots.__setitem__(stats.step, t.model.lm_head.weight.detach().clone()))
    trainer = make_trainer(tmp_path, small_config, steps=12, hooks=[snap],
                           monitor=MonitorConfig(min_history=8, window=20, inject_fault="nan_grad@9"))
    trainer.train()
    records = {r["step"]: r for r in lines(tmp_path / "metrics.jsonl") if "loss" in r}
    assert records[9]["skipped"] is True and records[9]["events"] == ["nonfinite:skip"]
    assert torch.equal(snapshots[9], snapshots[8]), "the skipped step changed no weight"
    assert torch.isfinite(trainer.model.lm_head.weight).all()
    events = lines(tmp_path / "events.jsonl")
    assert [e["action"] for e in events if e["detector"] == "nonfinite"] == ["skip"]
    assert "[monitor] step 9: nonfinite -> skip" in stderr_of(trainer)
    # the NaN was put in the final norm's gradient; clipping did not spread it, so the origin is named
    assert math.isfinite(records[9]["wgrad_norm/layer.0"]) and math.isfinite(records[9]["wgrad_norm/lm_head"])
    finding = next(e for e in events if e["detector"] == "nonfinite")
    assert "wgrad_norm/norm_f" in finding["message"] and "wgrad_norm/layer" not in finding["message"]


def test_rollback_restores_the_good_checkpoint_skips_the_window_and_keeps_every_line(tmp_path, small_config):
    monitor = MonitorConfig(min_history=8, window=20, good_after=5, on_nonfinite="rollback",
                            inject_fault="nan_grad@17", rollback_lr_scale=0.5)
    trainer = make_trainer(tmp_path, small_config, steps=30, monitor=monitor)
    trainer.train()
    events = lines(tmp_path / "events.jsonl")
    rolled = [e for e in events if e["action"] == "rolled_back"]
    assert len(rolled) == 1 and rolled[0]["step"] == 17 and rolled[0]["target_step"] == 10
    assert rolled[0]["lr_scale"] == 0.5
    # metrics.jsonl: one line per step 0..30, in order; the abandoned 11..17 moved aside, none lost
    steps = [r["step"] for r in lines(tmp_path / "metrics.jsonl")]
    assert steps == list(range(0, 31))
    aside = lines(tmp_path / "metrics.rolled_back.jsonl")
    assert [r["step"] for r in aside] == list(range(11, 18)) and all(r["rolled_back"] == 1 for r in aside)
    assert aside[-1]["rollback"] == 10
    # the data of steps 11..17 was never read again: 30 steps of training read 37 batches (one per step)
    assert trainer.batches.state_dict()["position"] == 37
    # the LR after the rollback is half the schedule's
    after = {r["step"]: r for r in lines(tmp_path / "metrics.jsonl")}
    assert after[15]["lr"] == pytest.approx(0.5 * 3e-3)
    assert trainer.monitor.history["rollbacks"] == 1
    # checkpoints: 0, 10, 20 and the final 30; every one loads; all but the newest marked GOOD
    manager = trainer.checkpoints
    assert [step_of(p) for p in manager.list()] == [0, 10, 20, 30]
    assert [step_of(p) for p in manager.list() if (p / GOOD).exists()] == [0, 10, 20]


def test_consecutive_skips_escalate_to_a_rollback(tmp_path, small_config):
    monitor = MonitorConfig(min_history=8, window=20, good_after=5, escalate_after=2,
                            inject_fault="nan_grad@16,nan_grad@17")
    trainer = make_trainer(tmp_path, small_config, steps=22, monitor=monitor)
    trainer.train()
    actions = [(e["step"], e["detector"], e["action"]) for e in lines(tmp_path / "events.jsonl")
               if e["detector"] in ("nonfinite", "monitor")]
    assert actions == [(16, "nonfinite", "skip"), (17, "nonfinite", "skip"), (17, "monitor", "rollback"),
                       (17, "monitor", "rolled_back")]


def test_anneal_rolls_back_and_cuts_the_budget(tmp_path, small_config):
    monitor = MonitorConfig(min_history=8, window=20, good_after=5, on_nonfinite="anneal", anneal_steps=6,
                            inject_fault="nan_grad@16")
    trainer = make_trainer(tmp_path, small_config, steps=40, monitor=monitor)
    trainer.train()
    assert trainer.step == 16 and trainer.schedule.total_steps == 16, "rolled back to 10, decayed for 6 steps"
    records = {r["step"]: r for r in lines(tmp_path / "metrics.jsonl") if "lr" in r}
    assert records[11]["lr"] == pytest.approx(3e-3) and records[16]["lr"] == pytest.approx(3e-3 / 6)
    assert [e["action"] for e in lines(tmp_path / "events.jsonl")].count("annealed") == 1


def test_too_many_rollbacks_stop_the_run(tmp_path, small_config):
    monitor = MonitorConfig(min_history=8, window=20, good_after=5, on_nonfinite="rollback", max_rollbacks=1,
                            inject_fault="nan_grad@12,nan_grad@14")
    trainer = make_trainer(tmp_path, small_config, steps=30, monitor=monitor)
    with pytest.raises(DivergenceError, match="after 1 rollbacks"):
        trainer.train()
    assert lines(tmp_path / "events.jsonl")[-1]["action"] == "give_up"


def test_without_a_good_checkpoint_a_rollback_becomes_a_skip(tmp_path):
    config = MonitorConfig(on_nonfinite="rollback")
    monitor = StabilityMonitor(config, tmp_path, maxvio_bound=4.0, stream=io.StringIO())
    trainer = SimpleNamespace(checkpoints=SimpleNamespace(latest=lambda good_only: None), model=None,
                              config=TrainConfig())
    stats = StepStats(step=3, lr=1e-3, losses={"loss": float("nan"), "lm_loss": float("nan")}, tokens=0,
                      expert_counts={}, grad_norm=1.0)
    monitor.signals = []  # judged on the losses alone
    decision = monitor.judge(trainer, stats)
    assert decision.action == "skip" and not decision.rolls_back and decision.target is None
    assert [e["action"] for e in lines(tmp_path / "events.jsonl")] == ["rollback", "skip"]


def test_bf16_grad_accum_switches_to_fp32_on_rollback_and_the_history_survives_resume(tmp_path, small_config):
    monitor = MonitorConfig(min_history=8, window=20, good_after=5, on_nonfinite="rollback",
                            inject_fault="nan_grad@13")
    trainer = make_trainer(tmp_path, small_config, steps=20, monitor=monitor,
                           train={"grad_accum_dtype": "bf16", "grad_accum": 2})
    head = apply_output_grad_accumulation(trainer.model, "bf16")
    trainer.train()
    assert trainer.config.grad_accum_dtype == "fp32"
    assert head.accum_dtype == "fp32" and head.main_grad.dtype == torch.float32 and trainer.model.lm_head is head
    saved = trainer.monitor.state_dict()
    resumed = make_trainer(tmp_path / "again", small_config, steps=20, monitor=monitor,
                           train={"grad_accum_dtype": "bf16"})
    apply_output_grad_accumulation(resumed.model, "bf16")
    resumed.load_checkpoint(trainer.checkpoints.latest())  # the final checkpoint, written after the rollback
    assert resumed.config.grad_accum_dtype == "fp32" and resumed.model.lm_head.accum_dtype == "fp32"
    assert saved["history"]["rollbacks"] == 1 and resumed.monitor.history["rollbacks"] == 1


def test_checkpoints_are_marked_good_only_after_good_after_steps(tmp_path, small_config):
    marks = {}
    mark = OnStepEnd(lambda t, stats: marks.__setitem__(
        stats.step, sorted(step_of(p) for p in t.checkpoints.list() if (p / GOOD).exists())))
    trainer = make_trainer(tmp_path, small_config, steps=27, checkpoint_every=10, hooks=[mark],
                           monitor=MonitorConfig(min_history=8, window=20, good_after=8))
    trainer.train()
    assert marks[17] == [0] and marks[18] == [0, 10] and marks[27] == [0, 10]
