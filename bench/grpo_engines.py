"""GRPO with vLLM rollouts against hybridtron's engine: the same run (policy, seed, steps, batch) once with each
`grpo.engine`, then one table: held-out greedy math pass@1 before and after, rollout tokens/s, the rollout-vs-learner
log-prob mismatch and the share of tokens TIS truncated (IcePop: masked), and the wall time of each run.

    python bench/grpo_engines.py --model runs/dense-sft/hf --out runs/dense-grpo --steps 40
    python bench/grpo_engines.py --model runs/dense-sft/hf --out runs/dense-grpo --steps 40 --table-only  # re-read

The policy must be a dense model (Mamba-2, attention, MLP layers: the `tiny-dense` preset after SFT), what vLLM's
CPU backend runs; vLLM comes from the vLLM environment (scripts/setup_vllm.sh). Each arm is `hybridtron grpo` into
`OUT-ENGINE` (OUT-hybridtron, OUT-vllm), one after the other, synchronous, one torch thread (vLLM's worker: one
thread too, its default binding), MTP drafts off (vLLM's CPU backend cannot draft for a Mamba hybrid); the held-out
evaluation (the same `--eval-tasks` test tasks, greedy, on hybridtron's engine in both arms) runs at step 0 and at the
end. Extra `--set SECTION.FIELD=VALUE` go to both arms. An arm whose directory already holds a finished run is not run
again (the table reads it).

Columns: pass@1 at step 0 and at the last step; rollout tokens/s = all rollout tokens / all generation seconds of the
run (grading excluded); `|logp diff|` = `is_mismatch`, the mean over a step's tokens of |learner log-prob - rollout
log-prob|, averaged over the steps (and its largest step); `masked` = `is_out_of_bounds_share`, the share of tokens
whose importance weight fell outside the TIS / IcePop bounds, mean and largest over the steps; `w max` = the largest
importance weight of the run; `cut` = the share of samples stopped at `max_new_tokens`. `--per-step` prints the
mismatch and the masked share of every step too.

Record the CPU model and flags and the load average with the numbers (BENCHMARKS.md): the script prints them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from clock import cpu_line

ENGINES = ("hybridtron", "vllm")
# issue 12's working GRPO recipe on the math environment (docs/post-training.md, "GRPO"), MTP off for both arms, at
# 16 x 8 rollouts a step without dynamic sampling's refills (which tripled each step's generation: at a pass rate near
# 0.1 most groups agree), so that the vLLM arm fits a quarter of an hour on a shared 2-core CPU
RECIPE = ("grpo.levels=1,2", "grpo.temperature=0.5", "grpo.prompts_per_step=16", "grpo.group_size=8",
          "grpo.dynamic_sampling=false", "grpo.max_new_tokens=64", "grpo.eval_max_tokens=80", "grpo.speculative=false",
          "grpo.mtp_loss_weight=0", "grpo.curriculum=false", "grpo.eval_every=100000", "train.lr=1e-4",
          "train.threads=1")


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finished(run: Path, steps: int) -> bool:
    lines = metrics(run)
    return bool(lines) and lines[-1].get("step") == steps and "pass_at_1" in lines[-1]


def run_arm(args, engine: str, out: Path) -> float | None:
    """Runs one arm unless `out` holds it finished; its wall seconds (None: not run here)."""
    if finished(out, args.steps):
        print(f"{engine}: {out} is finished; reading it", flush=True)
        return None
    if out.exists():
        raise SystemExit(f"grpo_engines: {out} exists and is not a finished {args.steps}-step run; remove it or "
                         f"finish it with `hybridtron grpo --out {out} --resume --steps {args.steps}`")
    sets = [*RECIPE, f"grpo.engine={engine}", f"grpo.seed={args.seed}", f"train.seed={args.seed}",
            f"grpo.eval_tasks={args.eval_tasks}", *args.set]
    command = ["hybridtron", "grpo", "--model", args.model, "--env", "math", "--out", str(out),
               "--steps", str(args.steps), "--quiet", *[part for s in sets for part in ("--set", s)]]
    print(f"{engine}: {' '.join(command)}", flush=True)
    started = time.perf_counter()
    done = subprocess.run(command)
    if done.returncode != 0:
        raise SystemExit(f"grpo_engines: the {engine} arm exited {done.returncode} ({out})")
    return time.perf_counter() - started


def summary(out: Path, wall: float | None) -> dict:
    lines = metrics(out)
    steps = [line for line in lines if "is_mismatch" in line]
    evals = [line for line in lines if "pass_at_1" in line]
    mismatch = [line["is_mismatch"] for line in steps]
    masked = [line.get("is_out_of_bounds_share", 0.0) for line in steps]
    return {"before": evals[0]["pass_at_1"], "after": evals[-1]["pass_at_1"],
            "tok_s": sum(line["rollout_tokens"] for line in steps) / sum(line["rollout_seconds"] for line in steps),
            "mismatch": statistics.mean(mismatch), "mismatch_max": max(mismatch),
            "masked": statistics.mean(masked), "masked_max": max(masked),
            "w_max": max(line["is_weight_max"] for line in steps),
            "cut": statistics.mean(line["truncated_share"] for line in steps),
            "reward": (steps[0]["reward_mean"], steps[-1]["reward_mean"]), "wall": wall,
            "per_step": [(line["step"], line["is_mismatch"], line.get("is_out_of_bounds_share", 0.0))
                         for line in steps]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the dense SFT policy (an HF export with its chat template)")
    parser.add_argument("--out", required=True, help="run directories OUT-hybridtron and OUT-vllm")
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps of each arm (default 40)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-tasks", type=int, default=400, help="held-out test tasks (default 400)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="the arms, in order (default hybridtron,vllm)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="passed to both arms' `hybridtron grpo` (after the recipe's, so it wins)")
    parser.add_argument("--table-only", action="store_true", help="run nothing; print the table of OUT-* runs")
    parser.add_argument("--per-step", action="store_true", help="also print every step's mismatch and masked share")
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise SystemExit(f"grpo_engines: --engines must name some of {', '.join(ENGINES)}, got {args.engines!r}")
    print(cpu_line(), flush=True)
    results = {}
    for engine in engines:
        out = Path(f"{args.out}-{engine}")
        wall = None if args.table_only else run_arm(args, engine, out)
        if not finished(out, args.steps):
            raise SystemExit(f"grpo_engines: {out} is not a finished {args.steps}-step run")
        results[engine] = summary(out, wall)
    print(cpu_line())
    print(f"\nGRPO from {args.model}, {args.steps} steps, seed {args.seed}; held-out greedy math pass@1 "
          f"({args.eval_tasks} tasks)")
    print(f"{'engine':>10} {'pass@1 0':>9} {'pass@1 end':>10} {'reward 1st/last':>16} {'rollout tok/s':>13} "
          f"{'|logp diff| mean/max':>21} {'masked mean/max':>16} {'w max':>9} {'cut':>5} {'wall s':>7}")
    for engine, r in results.items():
        wall = "-" if r["wall"] is None else f"{r['wall']:.0f}"  # "-": read back, not run here
        print(f"{engine:>10} {r['before']:9.2%} {r['after']:10.2%} {r['reward'][0]:7.3f}/{r['reward'][1]:<8.3f} "
              f"{r['tok_s']:13.0f} {r['mismatch']:10.2e}/{r['mismatch_max']:<10.2e} "
              f"{r['masked']:7.4f}/{r['masked_max']:<8.4f} {r['w_max']:9.6f} {r['cut']:5.2f} {wall:>7}")
    if args.per_step:
        print(f"\n{'step':>5}" + "".join(f" {e + ' |logp diff|':>24} {e + ' masked':>18}" for e in results))
        for rows in zip(*(r["per_step"] for r in results.values())):
            print(f"{rows[0][0]:5d}" + "".join(f" {m:24.2e} {s:18.4f}" for _, m, s in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
