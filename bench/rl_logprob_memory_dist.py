"""Peak memory of a GRPO learner step on 2 gloo processes at Ultra's vocabulary: lm_head applied by the RL passes by
blocks of rows under FSDP and TP (`distributed/head.py`) against the model's whole logits, the path they took there
before.

    python bench/rl_logprob_memory_dist.py [--layouts fsdp,tp] [--paths blocks,logits] [--tokens 1024]
                                           [--no-count]

bench/rl_logprob_memory.py's setup (the `tiny` preset with vocabulary 131,072, fp32, rows of 512 positions, one
micro-batch of `--tokens` positions, one forward and backward of `GRPOObjective` with [grpo]'s defaults, the MTP
loss on, no routing replay) on 2 processes: `fsdp` is dp_shard=2 (each rank half the rows), `tp` is tp=2 (each rank
every row; the MoE layers replaced by dense ones, since the RL learner under TP does not count a rollout's experts
on the sequence shards yet). The paths:

    blocks  as the learner runs now: lm_head called by the passes, `grpo.logprob_chunk` rows at a time
    logits  the model's [tokens, vocab] logits and each MTP depth's, handed to the same loss (`blockwise_head`
            answering None, as it did for a sharded head before)

Each (layout, path) runs in 2 fresh processes. Per rank: `peak` is the growth of the process's peak resident memory
(`ru_maxrss`) from before the model is built to after the backward; `rows` the most rows of any tensor an op made
whose last dimension is the vocabulary (views left out; counting runs each op through a dispatch mode, so `time`
is measured with `--no-count` only).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from hybridtron.config import MLP, MOE, tiny
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.mesh import init_parallel
from hybridtron.distributed.parallelize import parallelize
from hybridtron.model.lm import HybridLM
from hybridtron.post.grpo import GRPOConfig, GRPOObjective
from hybridtron.post.rl import objective as objective_module
from hybridtron.post.rl.batches import shard_micro_batch

sys.path.insert(0, str(Path(__file__).parent))
from long_context_memory import GiB, peak_rss_bytes  # noqa: E402
from rl_logprob_memory import ROW, VOCAB, micro_batch  # noqa: E402

WORLD = 2
LAYOUTS = {"fsdp": DistConfig(dp_shard=2, backend="gloo"), "tp": DistConfig(tp=2, backend="gloo")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LargestPerVocabulary(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor) and tensor.ndim and tensor.shape[-1] == VOCAB:
                    self.rows = max(self.rows, tensor.numel() // VOCAB)
        return out


def worker(rank: int, port: int, layout: str, path: str, tokens: int, count: bool, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if path == "logits":
        objective_module.blockwise_head = lambda model: None
    before = peak_rss_bytes()
    config = tiny().replace(vocab_size=VOCAB)
    if layout == "tp":
        config = config.replace(layers_block_type=tuple(MLP if k == MOE else k for k in config.layers_block_type),
                                mtp_layers_block_type=tuple(MLP if k == MOE else k for k in
                                                            config.mtp_layers_block_type))
    parallel = init_parallel(LAYOUTS[layout], config, batch_size=tokens // ROW, grad_accum=1, seq_len=ROW)
    torch.manual_seed(0)
    model = parallelize(HybridLM.on_meta(config), parallel)
    objective = GRPOObjective(GRPOConfig(routing_replay=False), config.mtp_depths, parallel)
    mb = shard_micro_batch(micro_batch(config, tokens), parallel, lookahead=config.mtp_depths)
    objective.begin_step([mb])
    seen = LargestPerVocabulary()
    start = time.perf_counter()
    with seen if count else contextlib.nullcontext():
        objective(model, mb).loss.backward()
    results.put((rank, peak_rss_bytes() - before, seen.rows if count else None, time.perf_counter() - start))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="fsdp,tp")
    parser.add_argument("--paths", default="blocks,logits")
    parser.add_argument("--tokens", type=int, default=1024, help=f"positions of the micro-batch, a multiple of "
                                                                  f"{WORLD} x {ROW} (default 1024)")
    parser.add_argument("--no-count", action="store_true", help="time the step; no count of the rows")
    args = parser.parse_args()
    if args.tokens < WORLD * ROW or args.tokens % (WORLD * ROW):
        parser.error(f"--tokens: {args.tokens} is not a multiple of {WORLD} x {ROW} positions")
    layouts, paths = args.layouts.split(","), args.paths.split(",")
    if bad := sorted(set(layouts) - set(LAYOUTS)) + sorted(set(paths) - {"blocks", "logits"}):
        parser.error(f"unknown layout or path: {', '.join(bad)} (layouts: fsdp, tp; paths: blocks, logits)")
    print(f"tiny with vocab {VOCAB}, fp32, GRPO learner forward + backward of {args.tokens} positions on {WORLD} "
          f"gloo processes, 1 thread each; torch {torch.__version__}\n")
    print("| layout | path | positions a rank | peak a rank (GiB) | rows over the vocabulary | time (s) |")
    print("|---|---|---:|---:|---:|---:|")
    context = mp.get_context("spawn")
    for layout in layouts:
        for path in paths:
            results = context.Queue()
            mp.start_processes(worker, args=(free_port(), layout, path, args.tokens, not args.no_count, results),
                               nprocs=WORLD, start_method="spawn")
            ranks = sorted(results.get() for _ in range(WORLD))
            positions = args.tokens // WORLD if layout == "fsdp" else args.tokens
            peak = " / ".join(f"{r[1] / GiB:.2f}" for r in ranks)
            rows = "-" if ranks[0][2] is None else max(r[2] for r in ranks)
            print(f"| {layout} | {path} | {positions} | {peak} | {rows} | {max(r[3] for r in ranks):.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
