"""Pretraining throughput and model FLOPs utilization (MFU) against this machine's measured matmul peak.

    python bench/pretrain.py [--threads 2] [--steps 5] [--batch 4] [--seq 512]

The peak is measured here, in the same run: the fastest of a few square matmuls in fp32 and in bf16. Model FLOPs
per token of a training step are counted by hybridtron.train.flops (6 x the active matmul parameters, attention's
score and value products, the chunked Mamba scan, MTP), as `hybridtron ladder` counts its budgets. MFU = achieved
model FLOP/s / peak FLOP/s.
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridtron.config import bench22m
from hybridtron.model.lm import HybridLM
from hybridtron.train.flops import model_flops_per_token

from clock import timed


def finished(fn, device: torch.device):
    """`fn` that returns only once the work it queued on `device` has run (a GPU runs it asynchronously)."""
    if device.type != "cuda":
        return fn

    def run():
        result = fn()
        torch.cuda.synchronize(device)
        return result

    return run


def matmul_peak(dtype: torch.dtype, device: torch.device = torch.device("cpu"), repeats: int = 8) -> float:
    """FLOP/s of the fastest square matmul in `dtype` on `device`, on the same clock as the steps: the best of
    `repeats` at growing sizes, until a size runs slower than the one before. CPU kernels without native bf16 slow
    down as the matrices grow (an AVX2 EPYC: 1.5 GFLOP/s at 256, 0.3 at 2048), so one large size would understate
    that peak, and would take minutes."""
    best = 0.0
    for size in (4096, 8192) if device.type == "cuda" else (256, 1024, 2048):
        a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
        product = finished(lambda: a @ b, device)
        product()
        rate = 2 * size ** 3 / min(timed(product) for _ in range(repeats))
        if rate < best:
            break
        best = rate
    return best


def step_time(model: HybridLM, batch: int, seq_len: int, steps: int, autocast: bool) -> float:
    ids = torch.randint(3, model.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(ids, -1, dims=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    times = []
    for i in range(steps + 1):
        started = time.perf_counter()
        with context:
            loss = model(ids, labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i:  # the first step warms up allocators and caches
            times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    peaks = {"fp32": matmul_peak(torch.float32), "bf16": matmul_peak(torch.bfloat16)}
    model = HybridLM(bench22m())
    flops_per_token = model_flops_per_token(model, args.seq)
    tokens = args.batch * args.seq
    print(f"bench22m: {model.num_parameters() / 1e6:.1f}M parameters, {model.num_parameters(active=True) / 1e6:.1f}M "
          f"active; {flops_per_token / 1e6:.1f} MFLOP per token per training step; batch {args.batch}x{args.seq}, "
          f"{args.threads} threads")
    print("\n| precision | matmul peak (GFLOP/s) | step (s) | tokens/s | model GFLOP/s | MFU vs its peak | MFU vs fp32 peak |")
    print("|---|---|---|---|---|---|---|")
    for precision, autocast in (("fp32", False), ("bf16", True)):
        seconds = step_time(model, args.batch, args.seq, args.steps, autocast)
        achieved = flops_per_token * tokens / seconds
        print(f"| {precision} | {peaks[precision] / 1e9:.0f} | {seconds:.3f} | {tokens / seconds:.0f} | "
              f"{achieved / 1e9:.1f} | {achieved / peaks[precision]:.0%} | {achieved / peaks['fp32']:.0%} |")


if __name__ == "__main__":
    main()
