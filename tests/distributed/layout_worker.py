"""Train a small hybrid model for a few steps under parallel layouts, on every rank of one torchrun job.

    torchrun --nproc-per-node N tests/distributed/layout_worker.py OUT.json LAYOUT [LAYOUT ...]

LAYOUT is `dp_shard=2,ep=2`-style ([dist] fields; unnamed ones default, dp_shard takes the rest; also
`recompute=full|selective` and `compile=BACKEND` for the blocks, `precision=nvfp4|mxfp8` for the emulated GEMMs,
`grad_accum_dtype=bf16` for lm_head's gradient reduction, `documents=1` for batches with a document mask (seq_idx),
`moe_norms=1` for a model with Marin's two MoE RMSNorms (moe_latent_norm, moe_output_norm), and `steps=N`). Each layout
builds its own meshes over the one process group, trains `train_steps` steps from the same initialization on
the same global batches, and global rank 0 writes, per layout, every step's metrics, gradient norm and globally
reduced expert counts to OUT.json. `train(None, ...)` is the single-process reference the tests compare against.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

from hybridtron.data.batch import TokenBatch
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.mesh import Parallel, init_parallel
from hybridtron.distributed.parallelize import parallelize
from hybridtron.distributed.step import DataParallelBatches
from hybridtron.model.lm import HybridLM
from hybridtron.numerics.policy import convert_for_training
from hybridtron.ops.cross_entropy import IGNORE_INDEX
from hybridtron.train.hooks import Hook
from hybridtron.train.loop import Trainer
from hybridtron.train.config import TrainConfig
from hybridtron.train.objectives import BatchSource, PretrainObjective


def _tests_conftest():
    """tests/conftest.py as a module of its own name: under pytest `conftest` may name another directory's."""
    path = Path(__file__).resolve().parents[1] / "conftest.py"
    spec = importlib.util.spec_from_file_location("hybridtron_tests_conftest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_small_config = _tests_conftest()._small_config

BATCH, SEQ, GRAD_ACCUM, STEPS = 4, 32, 2, 10
# The initialization's seed. The expert counts are compared exactly, so no routing decision of these runs may sit
# within float rounding of a tie: from seed 0's weights, TP (whose all-reduces sum in another order) moved one token
# to another expert at step 3 while its losses and gradient norms still agreed to 1e-5. Seed 1 has no such tie.
SEED = 1


def model_config(moe_norms: bool = False):
    return _small_config(moe_latent_norm=True, moe_output_norm=True) if moe_norms else _small_config()


class SyntheticBatches(BatchSource):
    """Deterministic global micro-batches with document boundaries (labels -100 at ~6% of positions, so the ranks'
    valid-token counts differ and the loss weighting is exercised); its position is the step count. `documents`:
    `TokenBatch`es whose seq_idx starts a new document after each of those boundaries (a document mask)."""

    def __init__(self, vocab: int, seed: int = 1, documents: bool = False):
        self.vocab, self.seed, self.steps, self.documents = vocab, seed, 0, documents

    def next_step(self):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.steps)
        self.steps += 1
        batches = []
        for _ in range(GRAD_ACCUM):
            ids = torch.randint(3, self.vocab, (BATCH, SEQ), generator=generator)
            labels = torch.roll(ids, -1, dims=1)
            labels[torch.rand(BATCH, SEQ, generator=generator) < 0.06] = IGNORE_INDEX
            labels[:, -1] = IGNORE_INDEX
            if self.documents:
                starts = torch.zeros_like(ids)
                starts[:, 1:] = labels[:, :-1] == IGNORE_INDEX  # a new document where no label reached
                batches.append(TokenBatch(ids, labels, seq_idx=starts.cumsum(1)))
            else:
                batches.append((ids, labels))
        return batches

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


class Record(Hook):
    def __init__(self):
        self.steps = []

    def on_step_end(self, trainer, stats, decision):
        counts = dict(zip(trainer.balance.names, trainer.balance.step_counts.tolist()))
        if trainer.parallel is not None:  # under PP each stage counted its own routers
            counts = trainer.parallel.merge_over_stages(counts)
        self.steps.append({"losses": stats.losses, "grad_norm": stats.grad_norm, "tokens": stats.tokens,
                           "group_grad_norms": stats.group_grad_norms, "expert_counts": counts,
                           "signals": {k: v for k, v in stats.signals.items() if k.startswith("ep_dropped/")}})


def train(parallel, steps: int = STEPS, *, recompute: str = "none", compile_backend: str | None = None,
          precision: str = "fp32", grad_accum_dtype: str = "fp32", documents: bool = False,
          moe_norms: bool = False) -> list[dict]:
    """Train `steps` steps from the initialization of seed SEED; the per-step records (same on every rank). The
    precision policy is applied before the layout, as `hybridtron.train.run.assemble_trainer` does."""
    torch.manual_seed(SEED)
    config = model_config(moe_norms)
    model = HybridLM(config) if parallel is None else HybridLM.on_meta(config)  # as `pretrain` builds it
    train_config = TrainConfig(steps=steps, grad_accum=GRAD_ACCUM, lr=3e-3, warmup_steps=2, grad_clip=1.0,
                               precision=precision)
    convert_for_training(model, train_config)
    model = parallelize(model, Parallel.single_process() if parallel is None else parallel, recompute=recompute,
                        compile=compile_backend is not None,
                        compile_backend=compile_backend or "inductor",
                        output_reduce_dtype=torch.bfloat16 if grad_accum_dtype == "bf16" else torch.float32)
    batches = SyntheticBatches(config.vocab_size, documents=documents)
    objective = PretrainObjective()
    if parallel is not None:
        batches = DataParallelBatches(batches, parallel, config.mtp_depths)
        objective = PretrainObjective(parallel.sum_over_data, config.mtp_num_depths)
    record = Record()
    Trainer(model, objective, batches, train_config, None, hooks=[record], parallel=parallel).train()
    if parallel is not None and model.lm_head is not None:  # the dtype FSDP reduces the output layer's gradient in
        reduce_dtype = model.lm_head._get_fsdp_state()._fsdp_param_group.mp_policy.reduce_dtype
        for step in record.steps:
            step["lm_head_reduce_dtype"] = str(reduce_dtype)
    return record.steps


# not [dist] fields: how the blocks run and what the run trains in
TRAIN_OPTIONS = ("recompute", "compile", "precision", "grad_accum_dtype", "steps", "documents", "moe_norms")


def parse_layout(text: str) -> tuple[DistConfig, dict]:
    values, options = {}, {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        if key in TRAIN_OPTIONS:
            options[key] = value
        else:
            values[key] = value if key in ("pp_schedule", "cp_attention") else \
                (float(value) if "." in value else int(value))
    return DistConfig(**values), options


def main(out: str, layouts: list[str]) -> None:
    torch.set_num_threads(1)
    results = {}
    for text in layouts:
        # what dynamo compiled for the last layout's blocks stays with Block.forward; start clean, as a run of its own
        # does (kept, it made the next compiled layout take 38 s instead of 9)
        torch._dynamo.reset()
        config, options = parse_layout(text)
        moe_norms = bool(int(options.get("moe_norms", 0)))
        parallel = init_parallel(config, model_config(moe_norms), batch_size=BATCH, grad_accum=GRAD_ACCUM, seq_len=SEQ,
                                 context_parallel=True)
        results[text] = train(parallel, int(options.get("steps", STEPS)), recompute=options.get("recompute", "none"),
                              compile_backend=options.get("compile"), precision=options.get("precision", "fp32"),
                              grad_accum_dtype=options.get("grad_accum_dtype", "fp32"),
                              documents=bool(int(options.get("documents", 0))), moe_norms=moe_norms)
    if parallel.is_main:
        Path(out).write_text(json.dumps(results))
    parallel.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
