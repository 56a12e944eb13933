"""A ladder's projection checked on runs the fit did not see: fit the loss law on the rungs below a budget, then
predict every rung at or above it (each with the bootstrap's 90% interval) and the compute-optimal loss there.

    python bench/ladder_holdout.py runs/ladder/results.jsonl --held-out-from 1.6e13

BENCHMARKS.md, "The scaling ladder (issue 40)", gives its output for the tiny family's CPU ladder.
"""

from __future__ import annotations

import argparse

import numpy as np

from hybridtron.experiments.ladder.fit import (
    bootstrap_laws, fit_rows_law, flops_per_param_token, interval, load_results,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a ladder's results.jsonl")
    parser.add_argument("--held-out-from", type=float, required=True,
                        help="rungs of this budget and above are predicted, the rest fitted (required)")
    parser.add_argument("--bootstraps", type=int, default=200, help="resamples behind the intervals (default: 200)")
    args = parser.parse_args()
    rows = load_results(args.results)
    seen = [r for r in rows if r["budget"] < args.held_out_from]
    held = [r for r in rows if r["budget"] >= args.held_out_from]
    if not seen or not held:
        raise SystemExit(f"--held-out-from {args.held_out_from:g}: {len(seen)} rungs below it, {len(held)} at or "
                         f"above it; both sides need rungs")
    law = fit_rows_law(seen)
    laws = bootstrap_laws(seen, law, args.bootstraps, np.random.default_rng(0))
    print(f"law from {len(seen)} rungs: L(N, D) = {law.E:.3f} + {law.A:.4g} / N^{law.a:.3f} + {law.B:.4g} / "
          f"D^{law.b:.3f}")
    print("| rung | N | D | measured | predicted | 90% interval | predicted - measured |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for r in held:
        predicted = float(law.loss(r["active_params"], r["tokens"]))
        low, high = interval([float(b.loss(r["active_params"], r["tokens"])) for b in laws])
        print(f"| {r['name']} | {r['active_params']:,} | {r['tokens']:,} | {r['loss']:.3f} | {predicted:.3f} | "
              f"{low:.3f}-{high:.3f} | {predicted - r['loss']:+.3f} |")
    k = flops_per_param_token(seen)
    for budget in sorted({r["budget"] for r in held}):
        params, tokens, loss = law.optimal(budget, k)
        low, high = interval([b.optimal(budget, k)[2] for b in laws])
        best = min((r for r in held if r["budget"] == budget), key=lambda r: r["loss"])
        print(f"at C = {budget:.3g}: compute-optimal loss {loss:.3f} (90% interval {low:.3f}-{high:.3f}) at "
              f"N = {params:.3g}, D = {tokens:.3g}; the best rung there, {best['name']}: {best['loss']:.3f}")


if __name__ == "__main__":
    main()
