"""GRPO on a CPU: rollout tokens/s with and without MTP speculative drafts, and the step time of synchronous against
one-step off-policy asynchronous GRPO.

    python bench/grpo.py --model runs/sft/hf --levels 1,2 --rounds 3 --steps 6

1. Rollouts: one GRPO step's generation (`--prompts` math prompts x `--group` samples, temperature 1, up to
   `--max-new-tokens` tokens) with the engine's plain decoding and with MTP drafts of each `--draft-lengths`, one
   thread, the same prompts and seeds, alternating round by round; each side keeps its fastest round (other jobs
   only add time). Reports generated tokens/s, the ratio to plain decoding and the mean acceptance length. The
   samples are distributed the same way with or without drafts (the token streams differ: the draws do).
2. Step time: `--steps` GRPO steps (held-out evaluation off) synchronously (`--sync-threads` torch threads for
   the one process that generates and then trains) and asynchronously (the learner and the rollout process on
   one thread each, batch n + 1 sampled while step n trains); the mean wall time of a step after the first (the
   first pays the rollout process's start and has nothing to overlap with), and the learner's mean wait for
   rollouts.

Record the CPU model and flags with the numbers (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from clock import cpu_line


def rollout_throughput(args) -> None:
    import torch

    from hybridtron.checkpoint import load_pretrained
    from hybridtron.data.chat import load_chat_tokenizer, tokenize_chat
    from hybridtron.infer.engine import HybridEngine
    from hybridtron.infer.sampling import SamplingParams
    from hybridtron.envs import get_env

    torch.set_num_threads(1)
    model = load_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = load_chat_tokenizer(args.model, vocab_size=model.config.vocab_size)
    with get_env("math", levels=args.levels) as env:
        tasks = env.tasks("train", args.prompts, seed=1)
        prompts = [tokenize_chat(tokenizer, env.prompt_messages(t), add_generation_prompt=True).ids.tolist()
                   for t in tasks]
    sides = {"plain": HybridEngine.from_model(model, tokenizer, speculative=False)}
    for k in args.draft_lengths:
        sides[f"MTP k={k}"] = HybridEngine.from_model(model, tokenizer, speculative=True, draft_length=k)
    best = {name: (float("inf"), 0, 0.0) for name in sides}
    for round_ in range(args.rounds):
        order = list(sides) if round_ % 2 == 0 else list(sides)[::-1]
        for name in order:
            engine = sides[name]
            params = SamplingParams(temperature=1.0, seed=round_, max_tokens=args.max_new_tokens)
            started = time.perf_counter()
            completions = engine.generate(prompts, params, n=args.group, logprobs=True, expert_ids=True)
            seconds = time.perf_counter() - started
            tokens = sum(len(c.token_ids) for group in completions for c in group)
            stats = getattr(engine, "last_stats", None)
            acceptance = stats.mean_acceptance_length if stats is not None and stats.steps else 0.0
            if seconds / tokens < best[name][0] / max(best[name][1], 1):
                best[name] = (seconds, tokens, acceptance)
    plain_rate = best["plain"][1] / best["plain"][0]
    print(f"rollouts: {args.prompts} prompts x {args.group} samples, T=1, <= {args.max_new_tokens} tokens, "
          f"1 thread, best of {args.rounds}")
    print(f"{'decoding':>10} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'x plain':>8} {'accept':>7}")
    for name, (seconds, tokens, acceptance) in best.items():
        rate = tokens / seconds
        print(f"{name:>10} {tokens:7d} {seconds:8.2f} {rate:9.0f} {rate / plain_rate:8.2f} "
              f"{acceptance if acceptance else float('nan'):7.2f}")


def step_times(args) -> None:
    from hybridtron.cli import main as cli_main

    root = Path(tempfile.mkdtemp(prefix="bench-grpo-"))
    common = ["--set", f"grpo.group_size={args.group}", "--set", f"grpo.prompts_per_step={args.prompts}",
              "--set", f"grpo.max_new_tokens={args.max_new_tokens}", "--set", "grpo.eval_tasks=0",
              "--set", f"grpo.levels={','.join(map(str, args.levels))}", "--set", "monitor.enabled=false",
              "--set", "train.checkpoint_every=1000", "--quiet", "--steps", str(args.steps)]
    modes = {"sync": ["--set", "grpo.async_rollouts=false", "--set", f"train.threads={args.sync_threads}"],
             "async": ["--set", "grpo.async_rollouts=true", "--set", "train.threads=1",
                       "--set", "grpo.rollout_threads=1"]}
    results = {}
    for name, extra in modes.items():
        out = root / name
        started = time.perf_counter()
        assert cli_main(["grpo", "--model", args.model, "--env", "math", "--out", str(out), *common, *extra]) == 0
        wall = time.perf_counter() - started
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        lines = [line for line in lines if line.get("step", 0) >= 1]
        seconds = [line["tokens"] / line["tokens_per_s"] for line in lines]
        waits = [line["rollout_wait_s"] for line in lines]
        results[name] = (statistics.mean(seconds[1:]), statistics.mean(waits[1:]), wall,
                         statistics.mean(line["rollout_tokens_per_s"] for line in lines[1:]))
    print(f"\nstep time: {args.steps} GRPO steps of {args.prompts} x {args.group} rollouts (steps 2..{args.steps})")
    print(f"{'mode':>6} {'s/step':>7} {'waiting':>8} {'rollout tok/s':>14} {'run wall s':>10}")
    for name, (step, wait, wall, rate) in results.items():
        print(f"{name:>6} {step:7.2f} {wait:8.2f} {rate:14.0f} {wall:10.1f}")
    print(f"async / sync step time: {results['async'][0] / results['sync'][0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the policy (an SFT export with its chat template)")
    parser.add_argument("--levels", default="1,2", help="math levels (default 1,2)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft-lengths", default="3,5")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sync-threads", type=int, default=2)
    parser.add_argument("--skip", choices=("rollouts", "steps"), help="leave one part out")
    args = parser.parse_args()
    args.levels = tuple(int(v) for v in args.levels.split(","))
    args.draft_lengths = [int(v) for v in args.draft_lengths.split(",") if v]
    print(f"{cpu_line()}; torch {__import__('torch').__version__}")
    if args.skip != "rollouts":
        rollout_throughput(args)
    if args.skip != "steps":
        step_times(args)


if __name__ == "__main__":
    sys.exit(main())
