"""Checks before training starts: will the run fit in memory, and is the chosen precision fast on this machine.

Memory (`check_memory`): an estimate, not a measurement, so that a run that cannot fit fails on every rank before
it allocates anything, with its numbers. It is the planner's per-GPU memory model (`hybridtron.distributed.plan.estimate`,
what `hybridtron plan --layout` prints) applied to the run's layout, on the fullest rank (the fullest pipeline
stage):

    weights, gradients, AdamW's two moments   16 bytes per parameter (fp32), this rank's shard: FSDP divides them
                                              by its degree, TP by tp, EP the routed experts by ep, PP by stage
    gathered weights                          the blocks in flight, gathered by FSDP, and one unsharded gradient
    activations                               what the micro-batches in flight keep for the backward on this rank
                                              (its rows and, under CP, its positions; TP's sequence shards), under
                                              `train.recompute`, the logits of lm_head and the MTP depths included

The planner counts BF16 activations and compute copies, as a GPU run keeps them; a run that computes in fp32
(`train.precision` fp32, and nvfp4 / mxfp8, which are emulated in fp32) keeps twice the bytes, and is counted so.
Against the memory this process can get: free device memory on its GPU (less the planner's runtime reserve for the
CUDA context and communication buffers), or MemAvailable of /proc/meminfo shared by the processes torchrun started
on this machine (LOCAL_WORLD_SIZE) on a CPU.

bf16 on a CPU (`bf16_slowdown`): torch runs bf16 matmuls natively only where the CPU has AMX or AVX512-BF16; on
others (an AVX2-only EPYC, for one) each bf16 GEMM is converted element by element and runs 25x or more slower than
fp32, and a whole bf16 training step ~40x. A short probe measures both rates before training, so such a run is
announced with its numbers and the advice to train in fp32 or with the emulated formats (which compute in fp32).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from hybridtron.config import ModelConfig
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.costs import GiB, cluster_for, parameter_count
from hybridtron.distributed.layout import Layout, Workload
from hybridtron.distributed.mesh import run_device, world_from_env
from hybridtron.distributed.plan import Estimate, estimate
from hybridtron.train.config import TrainConfig

BF16_SLOWDOWN_WARNING = 4.0  # warn when a bf16 matmul is this many times slower than fp32
PLANNER_RECIPES = {"nvfp4": "nvfp4", "mxfp8": "mxfp8"}  # train.precision -> the planner's recipe (else bf16)


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's share of a run, in bytes (module docstring)."""

    layout: Layout
    parameters: int  # of the whole model
    state_bytes: int
    gathered_bytes: int
    activation_bytes: int
    reserve_bytes: int
    tokens: int  # per micro-batch on this rank, before TP's sequence split
    processes: int  # processes sharing this memory: those on this machine for the CPU's, one for a GPU's

    @property
    def total_bytes(self) -> int:
        """Of one process."""
        return self.state_bytes + self.gathered_bytes + self.activation_bytes + self.reserve_bytes


def training_memory(model_config: ModelConfig, micro_batch_tokens: int, *, train: TrainConfig | None = None,
                    dist_config: DistConfig | None = None, world: int = 1,
                    device: torch.device | None = None) -> MemoryEstimate:
    """One rank's share of training `model_config` on `world` processes in the `dist_config` layout (default: the
    default layout, FSDP over every process), `micro_batch_tokens` tokens per global micro-batch (every
    data-parallel rank's rows), with `train`'s gradient accumulation, recompute and precision (default: the
    defaults); `device` the rank's (default: the CPU)."""
    train = TrainConfig() if train is None else train
    dist_config = DistConfig() if dist_config is None else dist_config
    device = torch.device("cpu") if device is None else device
    layout = Layout(**dist_config.degrees(world))
    # the rows a data-parallel rank takes of a micro-batch, as one sequence: memory depends on the tokens alone
    rank_tokens = micro_batch_tokens // layout.dp
    # offloaded, the fp32 state leaves a GPU's memory; on the CPU it is where it was
    workload = Workload(seq_len=rank_tokens, tokens_per_iter=micro_batch_tokens * train.grad_accum,
                       recompute=train.recompute, recipe=PLANNER_RECIPES.get(train.precision, "bf16"),
                       policy=train.precision_policy,
                       offload_optimizer=dist_config.offload_optimizer and device.type == "cuda")
    # memory never binds here (`check_memory` compares with what the device has); the GPU kind sets no figure used
    cluster = cluster_for("h100", world, gpus_per_node=world, nvlink_domain=world, hbm_gib=float(2 ** 40))
    result = estimate(model_config, cluster, workload, layout)
    if not isinstance(result, Estimate):
        raise ValueError(f"dist layout {layout} on {world} processes: {result.reason}")
    memory, computes = result.memory, 1 if train.precision == "bf16" else 2  # fp32 bytes over the planner's BF16
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    return MemoryEstimate(
        layout=layout, parameters=parameter_count(model_config),
        state_bytes=round((memory.master_weights + memory.gradients + memory.optimizer) * GiB),
        gathered_bytes=round(memory.compute_weights * computes * GiB),
        activation_bytes=round(memory.activations * computes * GiB),
        reserve_bytes=round(memory.reserve * GiB) if device.type == "cuda" else 0,
        tokens=rank_tokens // layout.cp, processes=min(local, world))


def available_memory(device: torch.device) -> int | None:
    """Bytes this process can allocate on `device`, or None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_memory(model_config: ModelConfig, micro_batch_tokens: int, device: torch.device | None = None,
                 name: str = "this run", *, train: TrainConfig | None = None,
                 dist_config: DistConfig | None = None) -> MemoryEstimate:
    """Raise ValueError, before anything is allocated, when this rank's share of the run (`training_memory`, on
    the world torchrun started, or one process) exceeds what its device has available. Every rank calls it and
    reaches the same verdict (a rank that stops makes torchrun stop the others). `device`: the rank's (default:
    `dist.mesh.run_device`, cuda:LOCAL_RANK or the CPU)."""
    dist_config = DistConfig() if dist_config is None else dist_config
    device = run_device(dist_config) if device is None else device
    world = world_from_env()[0]
    share = training_memory(model_config, micro_batch_tokens, train=train, dist_config=dist_config, world=world,
                            device=device)
    available = available_memory(device)
    needed = share.total_bytes * share.processes
    if available is not None and needed > available:
        where = "" if world == 1 else f" per process in layout {share.layout}"
        rank = "" if world == 1 else " on the fullest rank"
        machine = f"; {gib(needed)} for the {share.processes} processes on this machine" * (share.processes > 1)
        raise ValueError(
            f"{name} needs about {gib(share.total_bytes)} to train{where} ({share.parameters / 1e9:.2f}B parameters: "
            f"{gib(share.state_bytes)} of weights, gradients and AdamW state{rank}; {gib(share.gathered_bytes)} for "
            f"the blocks in flight; {gib(share.activation_bytes)} of activations and logits for {share.tokens} tokens "
            f"per micro-batch{machine}), but {device} has {gib(available)} available; use a smaller preset, fewer "
            f"tokens per micro-batch (data.batch_size, data.seq_len), train.recompute or more "
            f"{'GPUs' if device.type == 'cuda' else 'machines'}")
    return share


def matmul_rate(dtype: torch.dtype, size: int = 512, seconds: float = 0.05) -> float:
    """GFLOP/s of a [size, size] x [size, size] matmul in `dtype` on the CPU, over about `seconds`."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b  # warm up
    count, started = 0, time.perf_counter()
    while True:
        a @ b
        count += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return 2 * size ** 3 * count / elapsed / 1e9


def bf16_slowdown() -> tuple[float, float]:
    """(fp32 GFLOP/s, bf16 GFLOP/s) of this CPU's matmuls."""
    return matmul_rate(torch.float32), matmul_rate(torch.bfloat16)


def bf16_warning(precision: str, device: torch.device) -> str | None:
    """The message to print before a bf16 run on a CPU whose bf16 matmuls are slow, else None."""
    if precision != "bf16" or device.type != "cpu":
        return None
    fp32, bf16 = bf16_slowdown()
    if bf16 * BF16_SLOWDOWN_WARNING >= fp32:
        return None
    return (f"warning: train.precision=bf16 on a CPU without native bf16 matmuls (no AMX or AVX512-BF16): bf16 runs "
            f"at {bf16:.1f} GFLOP/s against {fp32:.1f} in fp32 here ({fp32 / bf16:.0f}x slower), so each step will "
            f"be many times slower; use train.precision=fp32, or nvfp4 / mxfp8 (emulated: they compute in fp32)")
