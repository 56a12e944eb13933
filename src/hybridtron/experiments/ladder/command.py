"""`hybridtron ladder`: a scaling ladder in three subcommands (docs/research.md, "The scaling ladder").

    hybridtron ladder plan --family tiny --budgets 3e12,1e13,3e13 [--points 5] --out runs/ladder
    hybridtron ladder run runs/ladder [--set train.lr=2e-3] [--out runs/ladder-candidate]
    hybridtron ladder fit runs/ladder/results.jsonl [--target 1e18] [--baseline OTHER.jsonl] [--plot ladder.png]

`plan` writes the rungs (hybridtron.experiments.ladder.plan), `run` trains them resumably
(hybridtron.experiments.ladder.run), `fit` reads results.jsonl (hybridtron.experiments.ladder.fit).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybridtron.config import PRESETS
from hybridtron.experiments.ladder.fit import (BOOTSTRAPS, OVERTRAIN, analyze, effective_speedup, format_report,
                                               load_results, plot_report)
from hybridtron.experiments.ladder.plan import (CHINCHILLA_TOKENS_PER_PARAM, DEFAULT_SPREAD, PLAN_FILE, LadderPlan,
                                                family_base, plan_ladder)
from hybridtron.experiments.ladder.run import RESULTS_FILE, run_ladder
from hybridtron.train.config import RunConfig, change_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ladder_command", metavar="SUBCOMMAND", required=True)
    plan = sub.add_parser("plan", help="the rungs of each compute budget, as a table and run configs",
                          description="plan isoFLOP rungs over a preset's family of widths and depths")
    plan.add_argument("--family", default="tiny", choices=sorted(PRESETS),
                      help="the preset whose family the rungs come from (default: tiny)")
    plan.add_argument("--budgets", required=True, help="compute budgets in FLOPs, comma-separated, e.g. "
                                                       "3e12,1e13,3e13 (required)")
    plan.add_argument("--points", type=int, default=5, help="rungs per budget, at least 3 (default: 5)")
    plan.add_argument("--spread", type=float, default=DEFAULT_SPREAD,
                      help=f"factor in active parameters between neighbouring rungs of a budget (default: "
                           f"{DEFAULT_SPREAD:g})")
    plan.add_argument("--centre", type=float, default=CHINCHILLA_TOKENS_PER_PARAM,
                      help=f"tokens per parameter each budget's middle rung trains on, a guess the fit corrects; "
                           f"lower it for budgets too small for the family (default: Chinchilla's "
                           f"{CHINCHILLA_TOKENS_PER_PARAM:g})")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                      help="override the base run every rung starts from, e.g. --set data.seq_len=128 or --set "
                           "model.vocab_size=512 (the family is derived from the preset so changed) (repeatable)")
    plan.add_argument("--out", required=True, help="the ladder directory: plan.json, base_config.json, configs/ "
                                                   "(required)")
    run = sub.add_parser("run", help="train every rung not yet finished; append each to results.jsonl",
                         description="train a planned ladder's rungs as pretraining runs, resumably")
    run.add_argument("ladder", metavar="DIR", help="the ladder directory of `ladder plan`")
    run.add_argument("--out", help="where the rungs and results.jsonl go, e.g. a candidate's directory beside the "
                                   "baseline's (default: DIR)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                     help="override every rung, e.g. --set train.lr=2e-3 or an architecture option --set "
                          "model.moe_latent_size=64 (repeatable; an OUT keeps the ones it began with)")
    run.add_argument("--max-rungs", type=int, help="train at most this many rungs now, the rest on the next call "
                                                   "(default: all)")
    run.add_argument("--progress", action="store_true", help="each rung's mixture table and progress bar (default: "
                                                             "one line per rung)")
    fit = sub.add_parser("fit", help="isoFLOP minima, the frontier, the loss law and its projection",
                         description="fit a ladder's results.jsonl and project it to a target compute")
    fit.add_argument("results", metavar="RESULTS.jsonl", help="a ladder's results.jsonl")
    fit.add_argument("--target", type=float, default=1e18, help="the compute to project to, in FLOPs (default: 1e18)")
    fit.add_argument("--baseline", metavar="RESULTS.jsonl", help="a baseline ladder's results: report the effective "
                                                                 "speedup of this one over it (default: none)")
    fit.add_argument("--json", action="store_true", help="print the report as JSON (default: a table and lines)")
    fit.add_argument("--plot", metavar="FILE", help="draw the isoFLOP profiles, frontier and projection (needs "
                                                    "matplotlib) (default: none)")
    fit.add_argument("--bootstraps", type=int, default=BOOTSTRAPS,
                     help=f"resamples behind the 90%% intervals (default: {BOOTSTRAPS})")
    fit.add_argument("--overtrain", type=float, default=OVERTRAIN,
                     help=f"the overtraining factor whose loss penalty is reported (default: {OVERTRAIN:g})")
    fit.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default: 0)")


def run(args) -> int:
    return {"plan": run_plan, "run": run_run, "fit": run_fit}[args.ladder_command](args)


def parse_budgets(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--budgets {text!r}: expected FLOP counts separated by commas, e.g. 3e12,1e13") from None


def run_plan(args) -> int:
    base = change_config(RunConfig(model=family_base(args.family)), None, args.overrides)
    plan = plan_ladder(base, args.family, parse_budgets(args.budgets), args.points, args.spread, args.centre)
    out = Path(args.out)
    if (out / PLAN_FILE).is_file() and LadderPlan.load(out).to_dict() != plan.to_dict():
        raise ValueError(f"{out}: holds another ladder's plan; choose another --out")
    plan.save(out)
    print(plan.format())
    print(f"\nplan: {out / PLAN_FILE}; run it with: hybridtron ladder run {out}")
    return 0


def run_run(args) -> int:
    run_ladder(Path(args.ladder), Path(args.out) if args.out else None, args.overrides, max_rungs=args.max_rungs,
               quiet=not args.progress)
    out = Path(args.out or args.ladder)
    print(f"results: {out / RESULTS_FILE}; fit them with: hybridtron ladder fit {out / RESULTS_FILE}")
    return 0


def run_fit(args) -> int:
    rows = load_results(args.results)
    report = analyze(rows, args.target, overtrain=args.overtrain, bootstraps=args.bootstraps, seed=args.seed)
    if args.baseline:
        report["effective_speedup"] = effective_speedup(rows, load_results(args.baseline), args.target,
                                                        bootstraps=args.bootstraps, seed=args.seed)
    if args.plot:
        plot_report(report, args.plot)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
