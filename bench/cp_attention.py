"""Context-parallel attention, all-gather against ring (`dist.cp_attention`): what a cp rank keeps for the backward,
and the forward + backward time, side by side in one process group.

    python bench/cp_attention.py [--seq 8192] [--cps 2,4] [--reps 3]

For each cp, one torchrun job of cp processes (this script with `--worker`, gloo, one thread each) runs one
attention layer of bench22m (4 query heads, 2 KV heads, head dim 64) in its context-parallel form on one sequence of
`--seq` positions, each rank on its head and tail chunks, both forms alternating. Kept for the backward: the bytes
of the tensors autograd saves in the layer's forward (`torch.autograd.graph.saved_tensors_hooks`), the largest
rank's. The all-gather form keeps the whole sequence's keys and values (and SDPA's inputs per chunk); the ring
keeps this rank's queries, keys, values, output and log-sum-exp. Time: the slowest rank's median forward +
backward. The ranks share this machine's cores, so the times compare the two forms, not the speedup over cp.
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

from hybridtron.config import bench22m
from hybridtron.distributed.context_parallel import apply_context_parallel
from hybridtron.model.attention import Attention

from clock import cpu_model

FORMS = ("all-gather", "ring")


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves while `fn` runs its forward (each storage once)."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn()
    return sum(storages.values()), out


def worker(args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = {}
    for form in FORMS:
        layer = Attention(bench22m())
        apply_context_parallel(layer, dist.group.WORLD, form)
        layers[form] = layer
    layers["ring"].load_state_dict(layers["all-gather"].state_dict())
    rows = torch.randn(2, args.seq // (2 * cp), bench22m().hidden_size, requires_grad=True)
    results = {form: {"seconds": []} for form in FORMS}
    for repeat in range(args.reps + 1):
        for form, layer in layers.items():
            dist.barrier()
            started = time.perf_counter()
            kept, out = saved_bytes(lambda: layer(rows))
            out.square().sum().backward()
            seconds = torch.tensor([time.perf_counter() - started])
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            results[form]["kept_bytes"] = kept
            if repeat:  # the first is a warm-up
                results[form]["seconds"].append(float(seconds))
    kept = torch.tensor([float(results[form]["kept_bytes"]) for form in FORMS])
    dist.all_reduce(kept, op=dist.ReduceOp.MAX)
    for form, value in zip(FORMS, kept.tolist()):
        results[form]["kept_bytes"] = value
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--cps", default="2,4")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print(f"CPU: {cpu_model()}; {os.cpu_count()} cores; torch {torch.__version__}; gloo, one thread per rank; one "
          f"attention layer of bench22m, {args.seq} positions, forward + backward")
    print("| cp | form | kept for backward per rank (MiB) | slowest rank, median (s) | ring / all-gather time |")
    print("|---|---|---:|---:|---:|")
    for cp in (int(value) for value in args.cps.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "results.json"
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                            str(cp), __file__, "--worker", "--out", str(out), "--seq", str(args.seq), "--reps",
                            str(args.reps)], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            results = json.loads(out.read_text())
        medians = {form: statistics.median(results[form]["seconds"]) for form in FORMS}
        for form in FORMS:
            ratio = f"{medians['ring'] / medians['all-gather']:.2f}" if form == "ring" else ""
            print(f"| {cp} | {form} | {results[form]['kept_bytes'] / 2 ** 20:.1f} | {medians[form]:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
