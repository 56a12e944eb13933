"""`hybridtron ladder`: the plan's budgets and family, the fits on synthetic ladders drawn from a known law (exponents,
projection, robustness, bootstrap interval, effective speedup), a toy ladder run killed and continued, and each
error message."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from hybridtron.cli import main as cli_main
from hybridtron.config import ATTENTION, MAMBA, MLP, MOE, preset
from hybridtron.experiments.ladder.fit import (LossLaw, analyze, effective_speedup, fit_isoflop, load_results)
from hybridtron.experiments.ladder.plan import (MIN_STEPS, LadderPlan, family_member, plan_ladder, smallest_budget)
from hybridtron.experiments.ladder.run import RESULTS_FILE, run_ladder
from hybridtron.train.config import RunConfig, change_config
from hybridtron.train.flops import config_flops_per_token

# a toy base for the run: short rows, tiny batches, a small vocabulary, no MTP
TOY = ["data.families=json,text,functional", "data.seq_len=32", "data.batch_size=2", "data.vocab_size=512",
       "model.vocab_size=512", "model.num_nextn_predict_layers=0", "data.val_batches=1", "train.threads=1",
       "train.log_every=1000"]
TRUE_LAW = LossLaw(E=1.8, A=100.0, B=200.0, a=0.34, b=0.28)


def synthetic_ladder(law=TRUE_LAW, budgets=(1e13, 3e13, 1e14, 3e14, 1e15), points=5, noise=0.003, seed=0,
                     efficiency=1.0):
    """Rows of an isoFLOP ladder whose losses follow `law` with relative Gaussian noise; `efficiency` s trains as if
    the model had s N parameters and s D tokens, a compute multiplier of s^2 (C = 6ND)."""
    rng = np.random.default_rng(seed)
    rows = []
    for budget in budgets:
        centre = law.optimal(budget, 6.0)[0]
        for i in range(points):
            params = centre * 2.0 ** (i - (points - 1) / 2)
            tokens = budget / (6 * params)
            loss = float(law.loss(efficiency * params, efficiency * tokens)) * (1 + noise * rng.standard_normal())
            rows.append({"budget": budget, "flops": budget, "params": 1.5 * params, "active_params": params,
                         "tokens": tokens, "loss": loss})
    return rows


# ------------------------------------------------------------------------------------------------ the plan
def test_plan_spends_each_budget_on_a_family_of_the_preset():
    base = RunConfig(model=preset("tiny"))
    plan = plan_ladder(base, "tiny", [3e14, 1e15], points=5)
    assert [r.budget for r in plan.rungs] == [3e14] * 5 + [1e15] * 5
    for rung in plan.rungs:
        # FLOPs: the budget up to the rounding to whole steps (half a step's FLOPs)
        per_step = rung.flops / rung.steps
        assert abs(rung.flops - rung.budget) <= per_step / 2 + 1
        # 6ND falls short of C by attention's, the scan's and MTP's share: between a third and all of it for tiny
        assert 0.3 < rung.six_nd / rung.flops < 1.0
        assert rung.steps >= MIN_STEPS
    for budget in (3e14, 1e15):
        sizes = [r.active_params for r in plan.rungs if r.budget == budget]
        assert sizes == sorted(sizes) and len(set(sizes)) == 5
    # the family keeps the preset's kinds of layer in order, and its ratios
    wide = family_member(preset("tiny"), 384)
    assert wide.layers_block_type == preset("tiny").layers_block_type * 2
    assert set(family_member(preset("tiny"), 32).layers_block_type) == {MAMBA, MOE, ATTENTION, MLP}
    assert wide.num_attention_heads == 12 and wide.num_key_value_heads == 4 and wide.moe_latent_size == 192
    # the rung's run config is the plan's member, steps and a proportional proxy of the ladder's largest run
    config = plan.rung_config(plan.rungs[0])
    assert config.train.steps == plan.rungs[0].steps
    assert config.data.proxy_of == max(r.tokens for r in plan.rungs)
    assert config_flops_per_token(config.model, config.data.seq_len) * plan.rungs[0].tokens == \
        pytest.approx(plan.rungs[0].flops)


def test_a_budget_too_small_names_the_smallest_that_works():
    base = change_config(RunConfig(), None, TOY)
    smallest = smallest_budget(base, 3, 2.0, 20.0, 1e8)
    with pytest.raises(ValueError, match=rf"budget 1e\+08 is too small for family tiny .* the smallest that works "
                                         rf"is {re.escape(f'{smallest:.2g}')}$"):
        plan_ladder(base, "tiny", [1e8], points=3)
    plan_ladder(base, "tiny", [smallest], points=3)
    with pytest.raises(ValueError, match="at least 3"):
        plan_ladder(base, "tiny", [smallest], points=2)


# ------------------------------------------------------------------------------------------------ the fits
def test_fit_recovers_the_law_the_frontier_and_the_projection():
    report = analyze(synthetic_ladder(), 1e17, bootstraps=40)
    law = report["law"]
    # tolerances: exponents within 0.03, E within 0.05 nats; the isoFLOP frontier's alpha within 0.03 of
    # a / (a + b); the projection two decades past the ladder within 0.5%
    assert law["a"] == pytest.approx(TRUE_LAW.a, abs=0.03) and law["b"] == pytest.approx(TRUE_LAW.b, abs=0.03)
    assert law["E"] == pytest.approx(TRUE_LAW.E, abs=0.05)
    assert report["alpha"] == pytest.approx(TRUE_LAW.a / (TRUE_LAW.a + TRUE_LAW.b), abs=0.03)
    truth = TRUE_LAW.optimal(1e17, 6.0)[2]
    assert report["projected_loss"] == pytest.approx(truth, rel=0.005)
    low, high = report["projected_interval"]
    assert low <= truth <= high, "the bootstrap's 90% interval holds the true projected loss"
    assert report["tokens_per_param"] == pytest.approx(TRUE_LAW.optimal(1e17, 6.0)[1] / TRUE_LAW.optimal(1e17, 6.0)[0],
                                                       rel=0.3)
    over = report["overtrained"]
    assert over["factor"] == 13 and over["penalty"] > 0


def test_the_isoflop_quadratic_is_robust_to_an_outlier():
    rows = [row for row in synthetic_ladder(budgets=(1e14,), points=7, noise=0.0)]
    clean = fit_isoflop(1e14, rows).tokens_opt
    rows[1] = {**rows[1], "loss": rows[1]["loss"] + 0.5}  # one rung gone wrong
    robust = fit_isoflop(1e14, rows).tokens_opt
    x = np.log10([r["tokens"] for r in rows])
    least_squares = 10 ** (-np.polyfit(x, [r["loss"] for r in rows], 2)[1] / (2 * np.polyfit(
        x, [r["loss"] for r in rows], 2)[0]))
    assert abs(math.log10(robust / clean)) < 0.05, "Huber: D* moves by less than 12%"
    assert abs(math.log10(least_squares / clean)) > 2 * abs(math.log10(robust / clean))


def test_effective_speedup_recovers_a_known_compute_multiplier():
    baseline = synthetic_ladder(seed=1)
    candidate = synthetic_ladder(seed=2, efficiency=2.0)  # trains as if 2x parameters and 2x tokens: 4x compute
    result = effective_speedup(candidate, baseline, 1e16, bootstraps=40)
    assert result["speedup"] == pytest.approx(4.0, rel=0.25)
    low, high = result["interval"]
    assert low <= 4.0 <= high
    assert all(s == pytest.approx(4.0, rel=0.15) for s in result["by_budget"].values())


# ------------------------------------------------------------------------------------------------ errors
def test_fit_errors_name_the_budget_and_the_fix(tmp_path):
    rows = synthetic_ladder(budgets=(1e14,), points=7, noise=0.0)  # smallest model (most tokens) first
    with pytest.raises(ValueError, match=r"budget 1e\+14: 2 point\(s\); a quadratic needs at least three"):
        fit_isoflop(1e14, rows[:2])
    with pytest.raises(ValueError, match=r"budget 1e\+14: the minimum .* lies below its fewest tokens .*add rungs with "
                                         r"fewer tokens \(larger models\), e\.g\. "):
        fit_isoflop(1e14, rows[:3])
    with pytest.raises(ValueError, match=r"lies above its most tokens .*add rungs with more tokens"):
        fit_isoflop(1e14, rows[4:])
    downward = [{**row, "loss": 5.0 - (math.log10(row["tokens"]) - 8) ** 2} for row in rows]
    with pytest.raises(ValueError, match=r"budget 1e\+14: the loss opens downward .* add rungs further out, e\.g\."):
        fit_isoflop(1e14, downward)
    path = tmp_path / RESULTS_FILE
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({k: v for k, v in rows[1].items() if k != "loss"}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: missing field 'loss'"):
        load_results(path)
    assert cli_main(["ladder", "fit", str(path)]) == 2


# ------------------------------------------------------------------------------------------------ the run
def test_a_ladder_runs_is_killed_and_continues_without_redoing_a_rung(tmp_path, capsys):
    base = change_config(RunConfig(), None, TOY)
    budget = smallest_budget(base, 3, 2.0, 0.02, 1e8)
    plan = plan_ladder(base, "tiny", [budget, 1.5 * budget], points=3, centre_ratio=0.02)
    plan.save(tmp_path)
    assert LadderPlan.load(tmp_path).to_dict() == plan.to_dict()
    first = run_ladder(tmp_path, max_rungs=4)  # a ladder stopped after four rungs
    assert [row["name"] for row in first] == [r.name for r in plan.rungs[:4]]
    results = tmp_path / RESULTS_FILE
    lines = results.read_text().splitlines()
    results.write_text("\n".join(lines[:3]) + "\n")  # killed after the 4th rung finished, before its line
    fourth = tmp_path / "rungs" / plan.rungs[3].name / "metrics.jsonl"
    trained = fourth.stat().st_mtime_ns
    rest = run_ladder(tmp_path)
    assert [row["name"] for row in rest] == [r.name for r in plan.rungs[3:]]
    assert fourth.stat().st_mtime_ns == trained, "the finished rung is read back, not trained again"
    rows = load_results(results)
    assert [row["name"] for row in rows] == [r.name for r in plan.rungs]
    for row, rung in zip(rows, plan.rungs):
        assert row["tokens"] == rung.tokens and row["flops"] == pytest.approx(rung.flops)
        assert row["active_params"] == rung.active_params and math.isfinite(row["loss"]) and row["wall_s"] > 0
    assert run_ladder(tmp_path) == [], "a finished ladder has nothing to do"
    with pytest.raises(ValueError, match=r"its rungs trained with plan .* and --set \[\]"):
        run_ladder(tmp_path, overrides=["train.lr=1e-3"])
