"""Running a planned ladder: every rung an ordinary pretraining run (hybridtron.train.pretrain), one after another,
in OUT/rungs/NAME (OUT: the plan's directory unless told otherwise), and one line per finished rung appended to
OUT/results.jsonl:

    {"name", "budget", "hidden", "layers", "params", "active_params", "tokens", "flops", "loss", "wall_s"}

`loss` is the rung's held-out loss at its last step (val_loss), `flops` its training FLOPs counted as the plan counts
them (on the configuration it trained, `--set` included), `wall_s` the seconds its training steps took.

A ladder is resumable as a run is: a rung with a line in results.jsonl is skipped, a finished rung without one (a
kill between its end and its line) is only read back, a rung with checkpoints continues from its latest. The
`--set` overrides given to every rung (a candidate's optimizer, an architecture option) are recorded in
OUT/ladder_run.json; a later `ladder run` into the same OUT must give the same ones.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hybridtron.errors import RunInterrupted
from hybridtron.experiments.ladder.plan import CONFIGS_DIR, LadderPlan, Rung
from hybridtron.files import METRICS_FILE, RUN_CONFIG, atomic_write_json
from hybridtron.model.lm import HybridLM
from hybridtron.train.config import RunConfig, change_config
from hybridtron.train.flops import model_flops_per_token
from hybridtron.train.pretrain import COMMAND as PRETRAIN
from hybridtron.train.run import complete_steps, export_model, has_checkpoints, refuse_torchrun

RESULTS_FILE = "results.jsonl"
RUNGS_DIR = "rungs"
RUN_RECORD = "ladder_run.json"  # the plan and the --set overrides this OUT's rungs trained with


def finished_names(results: Path) -> set[str]:
    if not results.is_file():
        return set()
    return {json.loads(line)["name"] for line in results.read_text().splitlines() if line.strip()}


def held_out_loss(run_dir: Path) -> float:
    """The last val_loss in a run's metrics.jsonl."""
    losses = [record["val_loss"] for record in map(json.loads, (run_dir / METRICS_FILE).read_text().splitlines())
              if "val_loss" in record]
    if not losses:
        raise ValueError(f"{run_dir / METRICS_FILE}: no held-out loss (val_loss); the ladder needs data.val_fraction "
                         f"> 0")
    return float(losses[-1])


def step_seconds(run_dir: Path) -> float:
    """The seconds of a run's training steps, resumes included (each metrics line: tokens / tokens_per_s)."""
    total = 0.0
    for record in map(json.loads, (run_dir / METRICS_FILE).read_text().splitlines()):
        if record.get("tokens_per_s"):
            total += record["tokens"] / record["tokens_per_s"]
    return total


def result_row(rung: Rung, config: RunConfig, run_dir: Path) -> dict:
    model = HybridLM.on_meta(config.model)  # counted on what the rung trained, its --set included
    tokens = config.train.steps * config.train.grad_accum * config.data.batch_size * config.data.seq_len
    return {"name": rung.name, "budget": rung.budget, "hidden": config.model.hidden_size,
            "layers": config.model.num_hidden_layers, "params": model.num_parameters(),
            "active_params": model.num_parameters(active=True), "tokens": tokens,
            "flops": model_flops_per_token(model, config.data.seq_len) * tokens, "loss": held_out_loss(run_dir),
            "wall_s": round(step_seconds(run_dir), 3)}


def check_record(out: Path, plan_dir: Path, overrides: list[str]) -> None:
    """Refuse other --set overrides than the ones this OUT's rungs trained with; record them on the first run."""
    record, given = out / RUN_RECORD, {"plan": str(plan_dir.resolve()), "overrides": list(overrides)}
    if record.is_file():
        saved = json.loads(record.read_text())
        if saved != given:
            raise ValueError(f"{out}: its rungs trained with plan {saved['plan']} and --set {saved['overrides']}, "
                             f"not {given['plan']} and {given['overrides']}; give those, or run into another --out")
        return
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record, given)


def train_rung(config: RunConfig, run_dir: Path, quiet: bool) -> None:
    """Train one rung to its end in `run_dir`, from its latest checkpoint where it has one; export it (the export
    marks a run complete)."""
    started = has_checkpoints(run_dir / "checkpoints")
    saved = RunConfig.load(run_dir / RUN_CONFIG) if started else None
    PRETRAIN.check(config)
    built = PRETRAIN.train_in(config, run_dir, resume=started, quiet=quiet, saved=saved)
    if built is not None:
        export_model(built.trainer, run_dir / "hf", built.tokenizer)


def run_ladder(plan_dir: Path, out: Path | None = None, overrides: list[str] = (), *, max_rungs: int | None = None,
               quiet: bool = True, stream=None) -> list[dict]:
    """Train the rungs of the plan in `plan_dir` that `out` has not finished (at most `max_rungs` of them); the rows
    this call appended to out/results.jsonl."""
    stream = sys.stdout if stream is None else stream
    refuse_torchrun("ladder run")  # the rungs train one after the other in one process
    plan_dir = Path(plan_dir)
    out = plan_dir if out is None else Path(out)
    plan = LadderPlan.load(plan_dir)
    check_record(out, plan_dir, list(overrides))
    results = out / RESULTS_FILE
    done = finished_names(results)
    rows = []
    for index, rung in enumerate(plan.rungs, start=1):
        if rung.name in done:
            continue
        if max_rungs is not None and len(rows) >= max_rungs:
            break
        config = change_config(RunConfig.load(plan_dir / CONFIGS_DIR / f"{rung.name}.json"), None, list(overrides))
        run_dir = out / RUNGS_DIR / rung.name
        print(f"[{index}/{len(plan.rungs)}] {rung.name}: {config.train.steps} steps, {rung.tokens:,} tokens, "
              f"{rung.flops:.3g} FLOPs", file=stream, flush=True)
        if complete_steps(run_dir) is None:
            try:
                train_rung(config, run_dir, quiet)
            except RunInterrupted as stopped:
                stopped.resume_command = f"hybridtron ladder run {plan_dir}" + (
                    f" --out {out}" if out != plan_dir else "") + "".join(f" --set {s}" for s in overrides)
                raise
        row = result_row(rung, config, run_dir)
        with results.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        rows.append(row)
        print(f"    held-out loss {row['loss']:.4f} ({row['wall_s']:.0f} s of steps)", file=stream, flush=True)
    return rows
