"""Distributed training on gloo (CPU): step time per layout at world 1, 2 and 4 on the same global batch, the
all-to-all's share of an expert-parallel MoE layer, and the planner's estimate next to each measured step.

    python bench/dist.py [--preset tiny] [--batch 8] [--seq 128] [--steps 4] [--worlds 1,2,4]

World 1 runs in this process; each larger world is one torchrun job (this script with `--worker`) that runs every
layout of that world in turn over one process group. A step is the trainer's: forward and backward of
`grad_accum` micro-batches, gradient norms and clipping, AdamW, the router-bias update. The step time is the median
over `--steps` steps after two warm-up steps, on the wall clock (the ranks share this machine's cores, so a
larger world on the same cores is slower: the numbers show what each layout costs in communication and overhead,
not a speedup).

The all-to-all share: one MoE layer's forward and backward on this rank's tokens, profiled; the time in the
dispatch and combine all-to-alls (and their waits) over the layer's time.

The planner's estimate (`hybridtron.distributed.plan.estimate`) for the same model, batch and layout on a "cluster" of
this machine: the fp32 matmul rate measured here as every GEMM's peak, gloo's measured all-reduce bus bandwidth as
every link's, efficiencies 1. It models GEMMs, attention, the scan and the collectives' bytes, not per-op
overheads, so on a CPU it is a lower bound; the ratio says how much of a measured step the model explains.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybridtron.config import PRESETS, preset
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.costs import Cluster
from hybridtron.distributed.mesh import init_parallel
from hybridtron.distributed.parallelize import parallelize
from hybridtron.distributed.plan import Estimate, Layout, Workload, estimate
from hybridtron.distributed.step import DataParallelBatches
from hybridtron.model.lm import HybridLM
from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.train.config import TrainConfig
from hybridtron.train.hooks import Hook
from hybridtron.train.loop import Trainer
from hybridtron.train.objectives import PretrainObjective

GRAD_ACCUM = 2
LAYOUTS = {1: ["dp_shard=1"],
           2: ["dp_shard=2", "tp=2", "ep=2", "pp=2", "cp=2"],
           4: ["dp_shard=4", "tp=2", "ep=4", "pp=2", "tp=2,ep=2", "cp=4", "dp_shard=2,cp=2", "cp=2,tp=2",
               "cp=2,pp=2"]}


class Batches:
    """The same global micro-batches at every world size (labels -100 at ~5% of positions)."""

    def __init__(self, vocab: int, batch: int, seq: int):
        self.vocab, self.batch, self.seq, self.steps = vocab, batch, seq, 0

    def next_step(self):
        generator = torch.Generator().manual_seed(self.steps)
        self.steps += 1
        out = []
        for _ in range(GRAD_ACCUM):
            ids = torch.randint(3, self.vocab, (self.batch, self.seq), generator=generator)
            labels = torch.roll(ids, -1, dims=1)
            labels[torch.rand(self.batch, self.seq, generator=generator) < 0.05] = IGNORE_INDEX
            out.append((ids, labels))
        return out

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


class Timer(Hook):
    def __init__(self):
        self.seconds = []

    def on_step_end(self, trainer, stats, decision):
        self.seconds.append(stats.seconds)


def parse_layout(text: str) -> DistConfig:
    return DistConfig(**{key: int(value) for key, value in (item.split("=") for item in text.split(","))})


def moe_alltoall_share(model, parallel, batch: int, seq: int) -> float | None:
    """The all-to-all's share of one MoE block's forward + backward on this rank's tokens (EP layouts only)."""
    from torch.profiler import ProfilerActivity, profile

    from hybridtron.distributed.expert_parallel import ExpertParallelExperts

    blocks = [layer for layer in model.backbone.layers if getattr(layer, "kind", None) == "moe"
              and isinstance(layer.mixer.experts, ExpertParallelExperts)]
    if not blocks:
        return None
    block = blocks[0]  # called as a block, so FSDP gathers its weights as in training
    rows = batch // parallel.layout.dp
    x = torch.randn(rows, seq // parallel.layout.tp, model.config.hidden_size, requires_grad=True)
    for _ in range(2):
        block(x).sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        block(x).sum().backward()
        total = time.perf_counter() - started
    a2a = sum(event.self_cpu_time_total for event in prof.key_averages()
              if "all_to_all" in event.key or "wait_tensor" in event.key) / 1e6
    return a2a / total


def run_layout(parallel, config_name: str, batch: int, seq: int, steps: int) -> dict:
    torch.manual_seed(0)
    config = preset(config_name)
    model = parallelize(HybridLM(config) if parallel is None else HybridLM.on_meta(config), parallel, seq_len=seq)
    batches = Batches(config.vocab_size, batch, seq)
    objective = PretrainObjective()
    if parallel is not None:
        batches = DataParallelBatches(batches, parallel, config.mtp_depths)
        objective = PretrainObjective(parallel.sum_over_data, config.mtp_depths)
    timer = Timer()
    train = TrainConfig(steps=steps + 2, grad_accum=GRAD_ACCUM, lr=1e-3, warmup_steps=1)
    Trainer(model, objective, batches, train, None, hooks=[timer], parallel=parallel).train()
    share = moe_alltoall_share(model, parallel, batch, seq) if parallel is not None else None
    return {"step_s": statistics.median(timer.seconds[2:]), "alltoall_share": share}


def gloo_bus_gbps(megabytes: int = 16) -> float:
    """All-reduce bus bandwidth of the world (GB/s, the 2 (n-1)/n convention)."""
    tensor = torch.ones(megabytes * 2 ** 20 // 4)
    dist.all_reduce(tensor)
    started = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(tensor)
    seconds = (time.perf_counter() - started) / 3
    n = dist.get_world_size()
    return 2 * (n - 1) / n * tensor.numel() * 4 / seconds / 1e9


def worker(args) -> None:
    torch.set_num_threads(1)
    results, parallel = {}, None
    for text in args.layouts.split(";"):
        parallel = init_parallel(parse_layout(text), preset(args.preset), batch_size=args.batch,
                                 grad_accum=GRAD_ACCUM, seq_len=args.seq, context_parallel=True)
        if not results:  # before any layout ran: the links alone
            results["_gloo_bus_gbps"] = gloo_bus_gbps()
        results[text] = run_layout(parallel, args.preset, args.batch, args.seq, args.steps)
    if parallel.is_main:
        Path(args.out).write_text(json.dumps(results))
    parallel.close()


def matmul_gflops(size: int = 1024) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = min(_seconds(lambda: a @ b) for _ in range(5))
    return 2 * size ** 3 / best / 1e9


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def planner_estimate(config_name: str, world: int, layout_text: str, batch: int, seq: int, gflops: float,
                     bus_gbps: float) -> float | None:
    values = {key: int(value) for key, value in (item.split("=") for item in layout_text.split(","))}
    others = values.get("tp", 1) * values.get("pp", 1) * values.get("cp", 1) * values.get("dp_replicate", 1)
    values["dp_shard"] = values.get("dp_shard", world // others)
    cluster = Cluster(gpus=world, gpus_per_node=world, nvlink_domain=world, hbm_gib=1e6, hbm_gbps=50.0,
                      nvlink_gbps=bus_gbps, ib_gbps=bus_gbps, bf16_tflops=gflops / 1e3, fp8_tflops=gflops / 1e3,
                      nvfp4_tflops=gflops / 1e3, compute_efficiency=1.0, link_efficiency=1.0,
                      runtime_reserve_gib=0.001)
    workload = Workload(seq_len=seq, tokens_per_iter=batch * GRAD_ACCUM * seq, micro_batch=batch // (
        values.get("dp_shard", 1) * values.get("dp_replicate", 1)), recompute="none", recipe="bf16")
    result = estimate(preset(config_name), cluster, workload, Layout(**values))
    return result.step_s if isinstance(result, Estimate) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layouts", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    torch.set_num_threads(1)
    gflops = matmul_gflops()
    rows, bus = [], {}
    for world in (int(w) for w in args.worlds.split(",")):
        if world == 1:
            rows.append((1, "single process", run_layout(None, args.preset, args.batch, args.seq, args.steps)))
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                       str(world), __file__, "--worker", "--preset", args.preset, "--batch", str(args.batch),
                       "--seq", str(args.seq), "--steps", str(args.steps), "--layouts", ";".join(LAYOUTS[world]),
                       "--out", str(out)]
            subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           cwd=Path(__file__).parent)
            result = json.loads(out.read_text())
        bus[world] = result.pop("_gloo_bus_gbps")
        rows += [(world, layout, values) for layout, values in result.items()]
    print(f"{args.preset}, global batch {args.batch} x {args.seq} x {GRAD_ACCUM} micro-batches per step, "
          f"1 thread per rank, {os.cpu_count()} cores; fp32 matmul {gflops:.0f} GFLOP/s; gloo all-reduce bus "
          + ", ".join(f"{gbps:.2f} GB/s at world {world}" for world, gbps in bus.items()) + "\n")
    print("| world | layout | step (s) | vs world 1 | all-to-all share of the MoE layer | planner (s) | "
          "measured / planner |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    base = rows[0][2]["step_s"]
    for world, layout, values in rows:
        planned = planner_estimate(args.preset, world, "dp_shard=1" if world == 1 else layout, args.batch,
                                   args.seq, gflops, bus.get(world, 1.0))
        step, share = values["step_s"], values["alltoall_share"]
        share_text = "-" if share is None else f"{share:.0%}"
        planned_text = "- | -" if planned is None else f"{planned:.4f} | {step / planned:.0f}x"
        print(f"| {world} | {layout} | {step:.3f} | {step / base:.2f}x | {share_text} | {planned_text} |")


if __name__ == "__main__":
    main()
