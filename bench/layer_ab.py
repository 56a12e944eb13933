"""One layer's training step (forward + backward) in this tree against another tree of the package, side by side.

    python bench/layer_ab.py --baseline /path/to/old/src --rounds 4 --reps 10

For a refactor that must not slow the model down: each round runs this tree and the baseline in fresh worker
processes, one after the other (order alternating), each timing `--reps` passes of one Mamba-2 layer and one
128-expert LatentMoE layer of `bench22m` on a [4, 512, 256] input, 1 thread, process CPU time after 3 warm-up
passes. The table gives each tree's fastest pass over all rounds and the ratio this tree / baseline (below 1 is
faster). The baseline is a `src/` directory, e.g. of `git worktree add /tmp/old <commit>`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

WORKER = """
import json, sys, time, torch
torch.set_num_threads(1)
from hybridtron.config import bench22m
from hybridtron.model.mamba2 import Mamba2Mixer
from hybridtron.model.moe import MoE
torch.manual_seed(0)
config = bench22m()
layers = {"Mamba-2 layer": Mamba2Mixer(config),
          "LatentMoE layer, 128 experts": MoE(config.replace(n_routed_experts=128, n_group=1, topk_group=1))}
x = torch.randn(4, 512, config.hidden_size, requires_grad=True)
best = {}
for name, layer in layers.items():
    def step():
        out = layer(x)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
    for _ in range(3):
        step()
    times = []
    for _ in range(int(sys.argv[1])):
        started = time.process_time()
        step()
        times.append(time.process_time() - started)
    best[name] = min(times)
print(json.dumps(best))
"""


def run_worker(src: Path, reps: int) -> dict[str, float]:
    result = subprocess.run([sys.executable, "-c", WORKER, str(reps)], capture_output=True, text=True, check=True,
                            env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"})
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the other tree's src/ directory")
    parser.add_argument("--rounds", type=int, default=4, help="rounds, each running both trees (default: 4)")
    parser.add_argument("--reps", type=int, default=10, help="timed passes per layer and worker (default: 10)")
    args = parser.parse_args()
    this = Path(__file__).resolve().parents[1] / "src"
    best: dict[str, dict[str, float]] = {"this": {}, "baseline": {}}
    for round_index in range(args.rounds):
        order = [("this", this), ("baseline", args.baseline)]
        for label, src in order if round_index % 2 == 0 else order[::-1]:
            for name, seconds in run_worker(src, args.reps).items():
                best[label][name] = min(seconds, best[label].get(name, float("inf")))
    print("| layer | baseline ms | this tree ms | this / baseline |\n|---|---:|---:|---:|")
    for name, baseline in best["baseline"].items():
        mine = best["this"][name]
        print(f"| {name} | {baseline * 1e3:.1f} | {mine * 1e3:.1f} | {mine / baseline:.3f} |")


if __name__ == "__main__":
    main()
