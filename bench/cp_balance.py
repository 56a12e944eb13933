"""Context parallelism's causal-attention work per cp rank: head-and-tail chunks against contiguous shares.

    python bench/cp_balance.py [--seq 8192] [--cps 2,4,8] [--reps 3] [--threads 1] [--clock cpu]

Under CP every rank's queries attend to the keys before them, so with contiguous shares the last rank does about
2 cp / (cp + 1) times the mean work and every step waits for it. `dist.context_parallel` gives rank r the chunks
r and 2 cp - 1 - r of 2 cp, which read 2 cp + 1 chunks of keys on every rank. This times, for each cp rank, the
forward and backward of that rank's attention (`context_parallel.chunk_attention`, the function the CP attention
runs, on the whole sequence's keys as the all-gather leaves them) for both cuts, one attention layer of bench22m
(4 query heads, 2 KV heads, head dim 64) on one sequence of `--seq` positions. No process group: the compute
each rank does, which is what the balance changes (the all-gather moves the same bytes either way).
"""

from __future__ import annotations

import argparse
import os

import torch

from hybridtron.config import bench22m
from hybridtron.distributed.context_parallel import chunk_attention, own_chunks

import clock
from clock import timed
from clock import cpu_model


def rank_seconds(seq: int, chunks: tuple[int, ...], pieces: int, reps: int) -> float:
    """The fastest of `reps` forward + backward passes of the attention of `chunks` (each seq / pieces long)."""
    config = bench22m()
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    generator = torch.Generator().manual_seed(0)
    length = seq // pieces
    q = torch.randn(len(chunks), heads, length, head_dim, generator=generator, requires_grad=True)
    keys = torch.randn(1, kv_heads, seq, head_dim, generator=generator, requires_grad=True)
    values = torch.randn(1, kv_heads, seq, head_dim, generator=generator, requires_grad=True)

    def step():
        chunk_attention(q, keys, values, chunks).sum().backward()

    step()  # warm-up
    return min(timed(step) for _ in range(reps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--cps", default="2,4,8")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    clock.add_clock_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock.select(args.clock)
    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores; torch {torch.__version__}; {args.threads} thread(s), "
          f"{args.clock} clock; one attention layer of bench22m, {args.seq} positions, forward + backward")
    print("| cp | cut | seconds per rank (rank 0 .. cp-1) | slowest / mean | slowest rank, contiguous / head-and-tail |")
    print("|---|---|---|---|---|")
    for cp in (int(value) for value in args.cps.split(",")):
        if args.seq % (2 * cp):
            raise SystemExit(f"--seq {args.seq} does not split into 2 x cp = {2 * cp} chunks")
        cuts = {"contiguous": [rank_seconds(args.seq, (rank,), cp, args.reps) for rank in range(cp)],
                "head-and-tail": [rank_seconds(args.seq, own_chunks(rank, cp), 2 * cp, args.reps)
                                  for rank in range(cp)]}
        speedup = max(cuts["contiguous"]) / max(cuts["head-and-tail"])
        for name, seconds in cuts.items():
            per_rank = " ".join(f"{s:.3f}" for s in seconds)
            imbalance = max(seconds) / (sum(seconds) / len(seconds))
            print(f"| {cp} | {name} | {per_rank} | {imbalance:.2f} | "
                  f"{f'{speedup:.2f}x' if name == 'head-and-tail' else ''} |")


if __name__ == "__main__":
    main()
