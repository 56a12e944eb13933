"""Peak memory per rank of building a sharded model: the whole model on every rank, then `parallelize`, against the
meta-device build that `hybridtron pretrain` runs under torchrun (`hybridtron.distributed.materialize`).

    python bench/materialize.py [--preset bench22m] [--depth 8] [--worlds 2,4] [--layout dp_shard]

`--depth N` repeats the preset's layer pattern N times (a deeper model of the same width: its embedding and lm_head,
the largest single tensors, become a small part of it, as in a real model). Each (world, build) pair is its own
torchrun job on gloo (this script with `--worker`), so each rank's peak resident memory (`ru_maxrss`) is that
build's alone. A rank reports its peak before the build (torch and the process group loaded), after it, and the
bytes of its own shards; the table gives the medians over the ranks. Both builds give every rank the same shards
(checked here: a checksum of each rank's shards must agree between them).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridtron.config import PRESETS, preset
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.mesh import init_parallel
from hybridtron.distributed.parallelize import parallelize
from hybridtron.model.lm import HybridLM


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def deeper(preset_name: str, depth: int):
    config = preset(preset_name)
    return config.replace(layers_block_type=config.layers_block_type * depth)


def worker(out: str, preset_name: str, depth: str, layout: str, build: str) -> None:
    torch.set_num_threads(1)
    config = deeper(preset_name, int(depth))
    world = int(os.environ["WORLD_SIZE"])
    degrees = {"dp_shard": {"dp_shard": world}, "tp": {"tp": world}, "ep": {"ep": world}}[layout]
    parallel = init_parallel(DistConfig(**degrees), config, batch_size=world, grad_accum=1, seq_len=64)
    before = peak_mib()
    torch.manual_seed(0)
    started = time.perf_counter()
    model = parallelize(HybridLM(config) if build == "whole" else HybridLM.on_meta(config), parallel)
    seconds = time.perf_counter() - started
    shards = [t.to_local() if isinstance(t, DTensor) else t for t in model.state_dict().values()]
    record = {"before": before, "after": peak_mib(), "seconds": seconds,
              "shard_mib": sum(t.numel() * t.element_size() for t in shards) / 2**20,
              "checksum": sum(float(t.double().sum()) for t in shards)}
    everyone = [None] * world
    dist.all_gather_object(everyone, record)
    if parallel.is_main:
        Path(out).write_text(json.dumps(everyone))
    parallel.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench22m", choices=sorted(PRESETS))
    parser.add_argument("--depth", type=int, default=8, help="the preset's layer pattern, repeated this many times")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--layout", default="dp_shard", choices=("dp_shard", "tp", "ep"),
                        help="how the world shards the model: FSDP (default), TP or EP over every rank")
    parser.add_argument("--worker", nargs=5, metavar=("OUT", "PRESET", "DEPTH", "LAYOUT", "BUILD"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    model = HybridLM.on_meta(deeper(args.preset, args.depth))
    whole_mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    print(f"{args.preset} x {args.depth} ({len(model.config.layers_block_type)} layers): "
          f"{model.num_parameters(include_mtp=True) / 1e6:.1f}M parameters, {whole_mib:.0f} MiB of fp32 weights; "
          f"{args.layout} over every rank, gloo; medians over the ranks\n")
    print("| world | build | peak RSS before (MiB) | peak RSS after (MiB) | growth (MiB) | own shards (MiB) | "
          "build (s) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for world in map(int, args.worlds.split(",")):
        checksums = {}
        for build in ("whole", "meta"):
            with tempfile.TemporaryDirectory() as scratch:
                out = Path(scratch) / "ranks.json"
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(world), __file__, "--worker", str(out), args.preset, str(args.depth), args.layout, build]
                done = subprocess.run(command, capture_output=True, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"})
                if done.returncode:
                    sys.exit(f"world {world}, {build} build failed:\n{done.stderr[-3000:]}")
                ranks = json.loads(out.read_text())
            checksums[build] = [rank["checksum"] for rank in ranks]

            def median(key):
                return statistics.median(rank[key] for rank in ranks)

            print(f"| {world} | {build} | {median('before'):.0f} | {median('after'):.0f} | "
                  f"{median('after') - median('before'):.0f} | {median('shard_mib'):.0f} | {median('seconds'):.2f} |")
        if checksums["whole"] != checksums["meta"]:
            sys.exit(f"world {world}: the two builds gave different shards ({checksums})")


if __name__ == "__main__":
    main()
