"""A parallel layout, the workload it runs, and the structural rules a layout must pass: what the planner
(`plan.py`), the serving planner (`serving.py`) and a run's own check (`mesh.check_run_layout`) share.

A layout is torchtitan's ParallelDims plus the expert dimensions:

    world = dp_replicate x dp_shard x cp x tp x pp
    EP borrows ranks from (dp_shard, cp, tp): ep x etp divides dp_shard x cp x tp, and the experts' own FSDP
    degree is efsdp = dp_shard x cp x tp / (ep x etp). ETP is 1 (each rank routes its own tokens to whole experts)
    or tp (the TP group splits every expert).

A rejected layout carries the rule it failed and a one-line reason (`check_layout`; the planner adds its memory
rule, `plan.estimate`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from hybridtron.config import ATTENTION, MAMBA, MLP, MOE, ModelConfig
from hybridtron.distributed.costs import RECOMPUTE_MODES, Cluster
from hybridtron.numerics.policy import POLICIES, RECIPES

LAYOUT_KEYS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")


@dataclass(frozen=True, kw_only=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> float:
        return self.dp_shard * self.cp * self.tp / (self.ep * self.etp)

    def __str__(self) -> str:
        return ",".join(f"{key}={getattr(self, key)}" for key in LAYOUT_KEYS)

    @classmethod
    def parse(cls, text: str, gpus: int) -> "Layout":
        """`"tp=8,pp=2,cp=32,ep=128"`: unnamed dimensions are 1, except dp_shard, which takes the rest (or -1)."""
        values: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in LAYOUT_KEYS:
                raise ValueError(f"--layout {text!r}: {item!r} is not KEY=N with KEY one of {', '.join(LAYOUT_KEYS)}")
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"--layout {text!r}: {key}={raw.strip()!r} is not an integer") from None
            if key in values:
                raise ValueError(f"--layout {text!r}: {key} is given twice")
            if value < 1 and not (key == "dp_shard" and value == -1):
                raise ValueError(f"--layout {text!r}: {key} must be >= 1 (dp_shard may be -1 for the rest)")
            values[key] = value
        if not values:
            raise ValueError("--layout is empty; expected e.g. tp=8,pp=2,cp=32,ep=128")
        if values.get("dp_shard", -1) == -1:
            others = math.prod(values.get(k, 1) for k in ("dp_replicate", "cp", "tp", "pp"))
            if gpus % others:
                raise ValueError(f"--layout {text!r}: dp_replicate x cp x tp x pp = {others} does not divide "
                                 f"{gpus} GPUs, so dp_shard has no whole value")
            values["dp_shard"] = gpus // others
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One training iteration: `tokens_per_iter` tokens in sequences of `seq_len`, `micro_batch` per forward."""

    seq_len: int = 1_048_576
    tokens_per_iter: int = 25_165_824
    micro_batch: int = 1
    recompute: str = "auto"  # or one of RECOMPUTE_MODES
    offload_optimizer: bool = False  # master weights, gradients and Adam state of the shard in host memory
    recipe: str = "nvfp4"
    policy: str = "ultra"

    def __post_init__(self):
        for name in ("seq_len", "tokens_per_iter", "micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"workload: {name} must be a positive integer, got {value!r}")
        if self.tokens_per_iter % self.seq_len:
            raise ValueError(f"workload: tokens_per_iter {self.tokens_per_iter:,} is not a whole number of "
                             f"sequences of seq_len {self.seq_len:,}")
        if self.recompute not in ("auto",) + RECOMPUTE_MODES:
            raise ValueError(f"workload: recompute must be auto or one of {', '.join(RECOMPUTE_MODES)}, "
                             f"got {self.recompute!r}")
        if self.recipe not in RECIPES or self.policy not in POLICIES:
            raise ValueError(f"workload: recipe must be one of {RECIPES} and policy one of {POLICIES}, got "
                             f"{self.recipe!r}, {self.policy!r}")

    @property
    def sequences(self) -> int:
        return self.tokens_per_iter // self.seq_len


@dataclass(frozen=True)
class Rejected:
    layout: Layout
    rule: str  # short name of the failed rule, for summaries
    reason: str  # one line


@functools.lru_cache(maxsize=256)
def tensor_parallel_reason(config: ModelConfig, tp: int) -> str | None:
    """Why `tp` cannot split this model's layers (Megatron's asserts, plus the widths TP cuts), or None."""
    if config.vocab_size % tp:  # a width the tokenizer sets, not the architecture: padding it is the remedy
        return (f"tp {tp} does not divide vocab_size {config.vocab_size} (the vocab-parallel embedding and lm_head): "
                f"pad model.vocab_size to {-(-config.vocab_size // tp) * tp}, a multiple of dist.tp {tp}")
    kinds = set(config.layers_block_type) | (set(config.mtp_layers_block_type) if config.has_mtp else set())
    checks = []
    if MAMBA in kinds:
        checks += [("n_groups", config.n_groups, "Mamba's B/C and gated norm split by group"),
                   ("mamba_num_heads", config.mamba_num_heads, "Mamba splits by head")]
    if ATTENTION in kinds:
        checks.append(("num_attention_heads", config.num_attention_heads, "attention splits q by head"))
    if MOE in kinds:
        checks.append(("moe_shared_expert_intermediate_size", config.moe_shared_expert_intermediate_size,
                       "the shared expert is column/row parallel"))
    if MLP in kinds:
        checks.append(("intermediate_size", config.intermediate_size, "the dense MLP is column/row parallel"))
    for name, value, why in checks:
        if value % tp:
            return f"tp {tp} does not divide {name} {value} ({why})"
    kv = config.num_key_value_heads
    if ATTENTION in kinds and kv % tp and tp % kv:
        return f"tp {tp} neither divides num_key_value_heads {kv} nor is a multiple of it (kv heads split or replicate)"
    return None


def check_layout(config: ModelConfig, cluster: Cluster, workload: Workload, layout: Layout) -> Rejected | None:
    """The structural rules, in a fixed order; the first that fails is the reason. Memory is checked later."""
    def reject(rule, reason):
        return Rejected(layout, rule, reason)

    if layout.world != cluster.gpus:
        return reject("world", f"dp_replicate x dp_shard x cp x tp x pp = {layout.world} != {cluster.gpus} GPUs")
    reason = tensor_parallel_reason(config, layout.tp)
    if reason:
        return reject("tp", reason)
    if layout.etp not in (1, layout.tp):
        return reject("etp", f"etp {layout.etp} is neither 1 nor tp {layout.tp} (experts use the TP group or none)")
    if config.moe_intermediate_size % layout.etp:
        return reject("etp", f"etp {layout.etp} does not divide moe_intermediate_size {config.moe_intermediate_size}")
    if layout.pp > config.num_hidden_layers:
        return reject("pp", f"pp {layout.pp} > {config.num_hidden_layers} layers: every stage needs a layer")
    if layout.cp > 1 and workload.seq_len % (2 * layout.cp):
        return reject("cp", f"seq_len {workload.seq_len:,} does not split into 2 x cp = {2 * layout.cp} chunks "
                            f"(each CP rank takes a head and a tail chunk to balance causal attention)")
    if config.n_routed_experts % layout.ep:
        return reject("ep.experts", f"ep {layout.ep} does not divide {config.n_routed_experts} experts")
    ranks = layout.dp_shard * layout.cp * layout.tp
    if ranks % (layout.ep * layout.etp):
        return reject("ep.ranks", f"ep {layout.ep} x etp {layout.etp} does not divide dp_shard x cp x tp = {ranks} "
                                  f"(EP borrows ranks from the data, context and tensor dimensions)")
    per_step = layout.dp * workload.micro_batch
    if workload.sequences % per_step:
        return reject("dp", f"{workload.sequences} sequences per iteration do not split over dp {layout.dp} x "
                            f"micro-batch {workload.micro_batch}")
    micro_batches = workload.sequences // per_step
    if layout.pp > 1 and micro_batches < layout.pp:
        return reject("pp.microbatches", f"{micro_batches} micro-batches per DP rank < pp {layout.pp} (1F1B needs "
                                         f"one per stage)")
    return None


@functools.lru_cache(maxsize=256)
def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def candidate_layouts(gpus: int):
    """Every factorization of the GPUs into (dp_replicate, dp_shard, cp, tp, pp), times every EP degree dividing
    the GPUs, times ETP 1 or tp."""
    for tp in divisors(gpus):
        for pp in divisors(gpus // tp):
            for cp in divisors(gpus // (tp * pp)):
                rest = gpus // (tp * pp * cp)
                for dp_replicate in divisors(rest):
                    for ep in divisors(gpus):
                        for etp in sorted({1, tp}):
                            yield Layout(dp_replicate=dp_replicate, dp_shard=rest // dp_replicate, cp=cp, tp=tp,
                                         pp=pp, ep=ep, etp=etp)
