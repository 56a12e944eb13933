"""Checks before training starts: will the run fit in memory, and is the chosen precision fast on this machine.

Memory (`training_memory`): an estimate, not a measurement, so that a preset that cannot fit fails before it
allocates anything, with its numbers:

    weights + gradients + AdamW's two moments   16 bytes per parameter (fp32 master weights, the MTP block included)
    activations                                  tokens per micro-batch x layers x hidden x ACTIVATION_BYTES_PER_UNIT
                                                 (what autograd keeps for the backward: projections, norms, scans)
    logits                                       tokens x vocab x 8 bytes (the fp32 logits and their gradient)

against the memory this process can get: MemAvailable of /proc/meminfo on a CPU, free device memory on a GPU.

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

BYTES_PER_PARAMETER = 16  # fp32 weight, fp32 gradient, AdamW exp_avg and exp_avg_sq
ACTIVATION_BYTES_PER_UNIT = 64  # measured order of magnitude for the tiny preset's fp32 step; an estimate
BF16_SLOWDOWN_WARNING = 4.0  # warn when a bf16 matmul is this many times slower than fp32


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    state_bytes: int
    activation_bytes: int
    logits_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes + self.logits_bytes


def training_memory(model_config, micro_batch_tokens: int) -> MemoryEstimate:
    from hybridtron.model.lm import HybridLM

    parameters = HybridLM.on_meta(model_config).num_parameters(include_mtp=True)
    layers = model_config.num_hidden_layers + len(model_config.mtp_layers_block_type) * model_config.mtp_depths
    heads = 1 + model_config.mtp_depths
    return MemoryEstimate(parameters=parameters, state_bytes=parameters * BYTES_PER_PARAMETER,
                          activation_bytes=micro_batch_tokens * layers * model_config.hidden_size
                          * ACTIVATION_BYTES_PER_UNIT,
                          logits_bytes=micro_batch_tokens * model_config.vocab_size * 8 * heads)


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


def check_memory(model_config, micro_batch_tokens: int, device: torch.device, name: str) -> MemoryEstimate:
    """Raise ValueError, before anything is allocated, when the estimate exceeds what is available."""
    estimate = training_memory(model_config, micro_batch_tokens)
    available = available_memory(device)
    if available is not None and estimate.total_bytes > available:
        raise ValueError(
            f"{name} needs about {gib(estimate.total_bytes)} to train ({estimate.parameters / 1e9:.2f}B parameters: "
            f"{gib(estimate.state_bytes)} of weights, gradients and AdamW state; {gib(estimate.activation_bytes)} of "
            f"activations and {gib(estimate.logits_bytes)} of logits for {micro_batch_tokens} tokens per "
            f"micro-batch), but {device.type} has {gib(available)} available; use a smaller preset, fewer tokens per "
            f"micro-batch (data.batch_size, data.seq_len) or more machines")
    return estimate


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
