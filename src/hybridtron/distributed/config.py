"""The `[dist]` section of a run: how the processes `torchrun` starts split the model and the batch.

    world = dp_replicate x dp_shard x cp x tp x pp          (dp_shard = -1: whatever the other degrees leave)
    EP borrows ranks from dp_shard x cp x tp; the experts are FSDP-sharded over the rest (efsdp)

The degrees are the planner's (`hybridtron.distributed.layout.Layout`): `hybridtron plan --layout ...` explains a layout
before any process starts, and a run checks its layout with the planner's rules before it builds a process group.
This module is plain data (no torch import), so the run configuration can hold it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

BACKENDS = ("auto", "nccl", "gloo")
PP_SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe")
CP_ATTENTION = ("all-gather", "ring")


@dataclass(frozen=True, kw_only=True)
class DistConfig:
    dp_replicate: int = 1  # HSDP replicas (each holds a full FSDP-sharded copy; gradients all-reduced across them)
    dp_shard: int = -1  # FSDP degree; -1 = the rest of the world after the other degrees
    tp: int = 1  # tensor parallel (attention by heads, Mamba by heads and groups, MLPs column/row; SP norms)
    pp: int = 1  # pipeline stages (cut at layer boundaries; embedding on the first, lm_head, MTP, loss on the last)
    cp: int = 1  # context parallel: head and tail chunks of every sequence per rank (context_parallel.py)
    ep: int = 1  # expert parallel: n_routed_experts / ep experts per rank, tokens dispatched by all-to-all
    etp: int = 1  # expert tensor parallel (1: each rank holds whole experts)
    backend: str = "auto"  # auto: NCCL on CUDA devices, gloo on CPU
    pp_schedule: str = "1f1b"  # 1f1b | interleaved-1f1b (two stages per rank) | gpipe
    ep_capacity_factor: float = 0.0  # 0 = dropless; > 0: each expert takes at most ceil(cf x tokens x k / E) rows
    cp_attention: str = "all-gather"  # all-gather: every rank gets the sequence's K/V; ring: K/V pass rank to rank
    offload_optimizer: bool = False  # FSDP2's CPU offload: each rank's fp32 weight shards, gradients and AdamW state
    #  in host memory, the optimizer step on the CPU (torchrun only; on a CPU device a no-op in memory)

    RESUMABLE: ClassVar = "all"  # a checkpoint resumes under any layout and world size (hybridtron.distributed.state)

    def validate(self) -> None:
        for name in ("dp_replicate", "tp", "pp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"dist.{name} must be >= 1, got {value}")
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ValueError(f"dist.dp_shard must be >= 1 or -1 (the rest of the world), got {self.dp_shard}")
        if self.backend not in BACKENDS:
            raise ValueError(f"dist.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"dist.pp_schedule must be one of {', '.join(PP_SCHEDULES)}, got {self.pp_schedule!r}")
        if self.cp_attention not in CP_ATTENTION:
            raise ValueError(f"dist.cp_attention must be one of {', '.join(CP_ATTENTION)}, got {self.cp_attention!r}")
        if not self.ep_capacity_factor >= 0:
            raise ValueError(f"dist.ep_capacity_factor must be >= 0 (0 = dropless), got {self.ep_capacity_factor}")
        if self.offload_optimizer and self.backend == "nccl":
            raise ValueError("dist.offload_optimizer=true with dist.backend=nccl: the offloaded gradients and AdamW "
                             "state are host tensors, which NCCL cannot reduce; use dist.backend=auto (NCCL for the "
                             "GPUs, gloo for the host)")

    def degrees(self, world: int) -> dict[str, int]:
        """The degrees with dp_shard resolved for `world` processes (the planner's `Layout` fields)."""
        others = self.dp_replicate * self.cp * self.tp * self.pp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world % others:
                raise ValueError(f"dist: dp_replicate x cp x tp x pp = {others} does not divide the {world} "
                                 f"processes, so dp_shard=-1 has no whole value")
            dp_shard = world // others
        return dict(dp_replicate=self.dp_replicate, dp_shard=dp_shard, cp=self.cp, tp=self.tp, pp=self.pp,
                    ep=self.ep, etp=self.etp)
