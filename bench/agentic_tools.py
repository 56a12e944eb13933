"""What a tool is worth to a model: greedy pass@1 on held-out `math-python` tasks with the `python` tool against the
same model answering without it, `terminal` pass@1, the share of well-formed tool calls and turns per trajectory, one
row per checkpoint (e.g. the base model, after agentic SFT, after GRPO), and with `--copy-levels` pass@1 on `copy`
(repeat a number or a name: the copying a tool rests on).

    python bench/agentic_tools.py --models base=runs/quickstart/hf,sft=runs/sft-tools/hf,grpo=runs/grpo-tools/hf \
        --levels 1 --tasks 50 --terminal-levels 1,2,3 --terminal-tasks 30 --show 2

Each side runs the turn loop (`hybridtron.post.agentic.run_episodes`, hybridtron's engine, greedy, no speculative
decoding) on the test split: "tool" is `math-python` as trained (the tool declared, up to its 4 turns); "no tool" is
`get_env("math-python", tool=False)`: the same tasks, no tool declared, one turn, so the model must answer from its
head (a call it still writes is an `unknown_tool` error and no answer). Well-formed: calls that parsed, named a
declared tool and fit its arguments, of all calls (none: no call made); turns and model tokens per trajectory. `--show`
prints the first trajectories of each side as the model wrote them (tool responses included), to see where a failing
model goes wrong: a number copied wrong into the call, the tool's output copied wrong into \\boxed{}, no call at all.

Record the CPU model and flags and the load with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from clock import cpu_model


def parse_models(text: str) -> list[tuple[str, str]]:
    models = []
    for item in text.split(","):
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"--models: expected LABEL=DIR[,LABEL=DIR...], got {item!r}")
        models.append((label, path))
    return models


def parse_levels(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(level) for level in text.split(","))
    except ValueError:
        raise ValueError(f"{option} {text}: expected comma-separated integers such as 1,2") from None


def side(engine, env, tasks, max_tokens: int, token_budget: int, show: int, label: str) -> dict:
    """One side's summary (`envs.agentic.summarize`) with its wall time, after printing `show` trajectories."""
    from hybridtron.envs.agentic import summarize
    from hybridtron.infer.sampling import SamplingParams
    from hybridtron.post.agentic import engine_generate, run_episodes

    started = time.perf_counter()
    trajectories = run_episodes(engine_generate(engine), engine.tokenizer, env, tasks,
                                SamplingParams(temperature=0.0, max_tokens=max_tokens), token_budget=token_budget)
    levels: dict[int, list[float]] = {}
    for trajectory in trajectories:
        levels.setdefault(trajectory.task.difficulty, []).append(trajectory.reward)
    summary = summarize(trajectories) | {"seconds": time.perf_counter() - started,
                                         "by_level": {level: sum(r) / len(r) for level, r in sorted(levels.items())}}
    for trajectory in trajectories[:show]:
        text = engine.tokenizer.decode(trajectory.token_ids[trajectory.prompt_length:])
        print(f"--- {label}: {trajectory.task.prompt}  (answer {trajectory.task.answer}; reward {trajectory.reward:g}, "
              f"{trajectory.finish})\n{text}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", required=True, help="LABEL=DIR,...: checkpoints (or run directories' hf/)")
    parser.add_argument("--levels", default="1", help="math-python levels (default 1: products)")
    parser.add_argument("--tasks", type=int, default=50, help="math-python test tasks per side (default 50)")
    parser.add_argument("--terminal-levels", default="", help="terminal levels, e.g. 1,2,3 (default: no terminal)")
    parser.add_argument("--terminal-tasks", type=int, default=30, help="terminal test tasks (default 30)")
    parser.add_argument("--copy-levels", default="", help="copy levels, e.g. 1,2,3: the copying the tools rest on "
                        "(default: none)")
    parser.add_argument("--copy-tasks", type=int, default=60, help="copy test tasks (default 60)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per turn (default 128)")
    parser.add_argument("--token-budget", type=int, default=1024, help="tokens per trajectory (default 1024)")
    parser.add_argument("--seed", type=int, default=0, help="the test tasks' draw (default 0)")
    parser.add_argument("--show", type=int, default=2, help="trajectories printed per side (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--json", help="also write the table as JSON to this file")
    args = parser.parse_args()
    try:
        models = parse_models(args.models)
        levels = parse_levels(args.levels, "--levels")
        terminal_levels = parse_levels(args.terminal_levels, "--terminal-levels") if args.terminal_levels else ()
        copy_levels = parse_levels(args.copy_levels, "--copy-levels") if args.copy_levels else ()
    except ValueError as exc:
        parser.error(str(exc))

    import torch

    from hybridtron.envs import get_env
    from hybridtron.infer.engine import load_engine

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; "
          f"{args.threads} torch thread(s)")
    rows = {}
    for label, path in models:
        engine = load_engine(path, speculative=False)
        row = {}
        with get_env("math-python", levels=levels) as env:
            tasks = env.tasks("test", args.tasks, args.seed)
            row["tool"] = side(engine, env, tasks, args.max_tokens, args.token_budget, args.show, f"{label} tool")
        with get_env("math-python", levels=levels, tool=False) as env:
            row["no_tool"] = side(engine, env, tasks, args.max_tokens, args.token_budget, args.show,
                                  f"{label} no tool")
        if terminal_levels:
            with get_env("terminal", levels=terminal_levels) as env:
                row["terminal"] = side(engine, env, env.tasks("test", args.terminal_tasks, args.seed),
                                       args.max_tokens, args.token_budget, args.show, f"{label} terminal")
        if copy_levels:
            with get_env("copy", levels=copy_levels) as env:
                row["copy"] = side(engine, env, env.tasks("test", args.copy_tasks, args.seed), args.max_tokens,
                                   args.token_budget, args.show, f"{label} copy")
        rows[label] = row
        print(f"[{label}: {sum(s['seconds'] for s in row.values()):.0f} s; load average {os.getloadavg()[0]:.1f}]",
              flush=True)

    def share(value) -> str:
        return "-" if value is None else f"{100 * value:.0f}%"

    header = (f"{'model':<10} {'math tool':>9} {'no tool':>8} {'well-formed':>11} {'turns':>6} {'calls':>6} "
              f"{'terminal':>9} {'well-formed':>11} {'turns':>6} {'copy':>6}")
    print(f"\nmath-python levels {','.join(map(str, levels))}, {args.tasks} tasks; terminal levels "
          f"{','.join(map(str, terminal_levels)) or '-'}, {args.terminal_tasks if terminal_levels else 0} tasks; "
          f"copy levels {','.join(map(str, copy_levels)) or '-'}; greedy pass@1\n{header}")
    for label, row in rows.items():
        tool, direct, terminal, copied = row["tool"], row["no_tool"], row.get("terminal"), row.get("copy")
        calls = tool["tool_calls"] / tool["trajectories"]
        print(f"{label:<10} {share(tool['pass_rate']):>9} {share(direct['pass_rate']):>8} "
              f"{share(tool['well_formed']):>11} {tool['turns']:>6.2f} {calls:>6.2f} "
              + (f"{share(terminal['pass_rate']):>9} {share(terminal['well_formed']):>11} {terminal['turns']:>6.2f}"
                 if terminal else f"{'-':>9} {'-':>11} {'-':>6}")
              + f" {share(copied['pass_rate'] if copied else None):>6}")
    for label, row in rows.items():
        for name, summary in row.items():
            by_level = ", ".join(f"L{level} {share(value)}" for level, value in summary["by_level"].items())
            print(f"  {label} {name}: pass by level {by_level}; finishes {summary['finishes']}, "
                  f"errors {summary['errors']}, "
                  f"{summary['model_tokens']:.0f} model tokens per trajectory, {summary['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
