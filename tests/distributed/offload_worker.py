"""Train under layouts with and without `dist.offload_optimizer`, then measure where each rank's training state is.

    torchrun --nproc-per-node N tests/distributed/offload_worker.py OUT.json LAYOUT [LAYOUT ...]

LAYOUT as in layout_worker.py (`offload_optimizer=1` turns the offload on). Each layout trains as
`layout_worker.train` does; then one more forward and backward leaves a step's gradients in place and every rank
counts the bytes of its parameter shards (the fp32 master weights), their gradients, the AdamW moments and step
counters, by the device that holds them, which FSDP parameters FSDP offloads (`FSDPParam.offload_to_cpu`) and, on a
GPU, the bytes allocated on it then (scripts/gpu_check.sh runs this worker on one GPU).
Global rank 0 writes, per layout, the steps' records, every rank's counts and the run's log line
(`Parallel.describe`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import layout_worker
from hybridtron.distributed.mesh import init_parallel

STATE = ("master", "grads", "moments", "steps")


class Measured(layout_worker.Record):
    """layout_worker's recorder, keeping its trainer for the measurement after training."""

    trainer = None

    def on_train_start(self, trainer):
        Measured.trainer = trainer


layout_worker.Record = Measured  # `layout_worker.train` builds its recorder by this name


def placement(trainer) -> dict:
    """This rank's bytes of each kind of training state by device type, and the FSDP parameters' offload flags."""
    trainer.forward_backward()  # a step's gradients, left in place
    counts = {kind: {} for kind in STATE}

    def add(kind: str, tensor: torch.Tensor) -> None:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        where = local.device.type
        counts[kind][where] = counts[kind].get(where, 0) + local.numel() * local.element_size()

    for param in trainer.model.parameters():
        add("master", param)
        if param.grad is not None:
            add("grads", param.grad)
        state = trainer.optimizer.state.get(param, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                add("moments", state[key])
        if "step" in state:
            add("steps", state["step"])
    groups = [module._get_fsdp_state()._fsdp_param_group for module in trainer.model.modules()
              if isinstance(module, FSDPModule)]
    offloads = sorted({p.offload_to_cpu for group in groups if group is not None for p in group.fsdp_params})
    device = trainer.parallel.device
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    return {"bytes": counts, "offload_to_cpu": offloads, "device_allocated": allocated}


def main(out: str, layouts: list[str]) -> None:
    torch.set_num_threads(1)
    results = {}
    for text in layouts:
        config, options = layout_worker.parse_layout(text)
        parallel = init_parallel(config, layout_worker.model_config(), batch_size=layout_worker.BATCH,
                                 grad_accum=layout_worker.GRAD_ACCUM, seq_len=layout_worker.SEQ)
        steps = layout_worker.train(parallel, int(options.get("steps", layout_worker.STEPS)))
        ranks = [None] * parallel.world
        dist.all_gather_object(ranks, placement(Measured.trainer))
        results[text] = {"steps": steps, "ranks": ranks, "describe": parallel.describe()}
    if parallel.is_main:
        Path(out).write_text(json.dumps(results))
    parallel.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
