"""Asynchronous RL's rollout replicas on a CPU: one GRPO step's generation by 1, 2, ... rollout processes
(`grpo.rollout_replicas`), each generating its share of the step's prompts and exchanging the shares.

    python bench/rollout_replicas.py --model runs/quickstart/hf --sides 1x1,1x2,2x1

Each side (`REPLICASxTHREADS`: rollout processes, torch threads each) is a role pipeline of the GRPO rollout role
on the process backend, given the policy's weights; then `--rounds` requests, the sides alternating request by
request (the other sides' processes wait idle on their queues), each a whole step's batch: `--prompts` math prompts x
`--group` samples, temperature 1, up to `--max-new-tokens` tokens, plain decoding (MTP drafts lose on batched CPU
rollouts: BENCHMARKS.md, "GRPO"), no dynamic sampling (one generation round a step, so every request is the same
amount of work). The first request of each side pays its processes' start and is left out. Reports each side's
total time over the same timed requests (the same batches, so the same tokens), generated tokens/s and the speedup
over the first side, and checks that every side made the same batches (the same completions, token for token).
On a machine of C cores, compare 1 x C (intra-op threads) with C x 1 (replicas) as well as with 1 x 1.

Record the CPU model and flags with the numbers (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import os
import time

from clock import cpu_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the policy: an HF export with its chat template")
    parser.add_argument("--sides", default="1x1,1x2,2x1", help="REPLICASxTHREADS to compare (default 1x1,1x2,2x1)")
    parser.add_argument("--levels", default="1,2", help="math levels (default 1,2)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="timed requests per side (after a first one)")
    args = parser.parse_args()

    import torch

    from hybridtron.checkpoint import load_pretrained
    from hybridtron.post.grpo import GRPOConfig
    from hybridtron.post.rl.roles import RolePipeline, RoleSpec
    from hybridtron.post.rl.rollout import ROLLOUT_ROLE, RolloutRequest, RolloutRole

    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores; torch {torch.__version__}")
    model = load_pretrained(args.model, dtype=torch.float32)
    levels = tuple(int(v) for v in args.levels.split(","))
    config = GRPOConfig(prompts_per_step=args.prompts, group_size=args.group, max_new_tokens=args.max_new_tokens,
                        speculative=False, dynamic_sampling=False, levels=levels, task_pool=max(200, args.prompts))
    role = dict(model_dir=args.model, model_config=model.config, env="math", env_options=config.env_options(),
                config=config)
    sides = [tuple(int(v) for v in side.split("x")) for side in args.sides.split(",")]
    pipelines = {(n, threads): RolePipeline([RoleSpec(RolloutRole, {**role, "threads": threads}, replicas=n)],
                                            "process").start() for n, threads in sides}
    seconds = dict.fromkeys(sides, 0.0)
    tokens = dict.fromkeys(sides, 0)
    batches: dict[tuple, dict[int, list]] = {side: {} for side in sides}
    try:
        for pipeline in pipelines.values():  # weights, then the untimed first request (the processes' start)
            pipeline.send_weights(ROLLOUT_ROLE, 0, model.state_dict())
            pipeline.submit(RolloutRequest(1))
            pipeline.receive()
        for request in range(2, args.rounds + 2):
            for side in sides if request % 2 == 0 else sides[::-1]:
                started = time.perf_counter()
                pipelines[side].submit(RolloutRequest(request))
                batch = pipelines[side].receive().item
                seconds[side] += time.perf_counter() - started
                tokens[side] += int(batch.stats["rollout_tokens"])
                batches[side][request] = [r.completion_ids for r in batch.rollouts]
    finally:
        for pipeline in pipelines.values():
            pipeline.close()
    same = all(batches[side] == batches[sides[0]] for side in sides)
    print(f"\none step's rollouts: {args.prompts} prompts x {args.group} samples, up to {args.max_new_tokens} "
          f"tokens; {args.rounds} requests per side")
    print(f"{'replicas':>8} {'threads':>7} {'s/batch':>8} {'tokens':>7} {'tokens/s':>9} {'x first':>7}")
    for side in sides:
        n, threads = side
        print(f"{n:>8} {threads:>7} {seconds[side] / args.rounds:8.2f} {tokens[side]:>7} "
              f"{tokens[side] / seconds[side]:9.0f} {seconds[sides[0]] / seconds[side]:7.2f}")
    print(f"the same batches on every side: {same}")
    if not same:
        raise SystemExit("the sides made different batches")


if __name__ == "__main__":
    main()
