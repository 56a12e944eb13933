"""Plan a parallel layout: model config + cluster + workload -> every layout, the valid ones ranked by step time.

A layout (`layout.Layout`) is torchtitan's ParallelDims plus the expert dimensions, checked by the structural rules
of `layout.check_layout`; this module estimates the valid ones and ranks them.

Ranks are laid out pp-major with tp innermost (torchtitan's mesh order): a TP group is tp consecutive ranks, a CP
group spans cp x tp consecutive ranks, an EP group ep x etp, and the data-parallel groups stride across the rest.
Whether a group stays inside one NVLink domain follows from that.

What each dimension does (per GPU, per step):

- DP (dp_shard: FSDP; dp_replicate: HSDP replicas) splits the sequences of an iteration; dp_shard x cp also
  shards the dense weights, gradients and optimizer state. Costs a parameter all-gather and a gradient
  reduce-scatter per micro-batch (overlapped with compute), and an all-reduce over the replicas per step.
- TP splits every GEMM and the sequence-parallel activations by tp. Costs an all-gather and a reduce-scatter of
  the activations per layer in the forward and again in the backward, on the critical path. Mamba's B/C groups
  and gated norm split by group, so tp must divide n_groups (8 for Nemotron 3: TP <= 8).
- CP splits each sequence: tokens per CP rank = seq_len / cp. Attention passes K/V around a ring (overlapped with
  attention compute); Mamba passes its state (S_out = a * S_in + S_local: one all-gather, independent of length).
- EP places n_experts / ep experts on each rank. Costs an all-to-all before and after the routed experts, at the
  latent width, in the forward and again in the backward; bytes to ranks outside the NVLink domain go over IB.
- PP splits the layers into stages (balanced by estimated compute; embedding first, lm_head and MTP last). A 1F1B
  schedule idles (pp - 1) micro-batch slots per step (the bubble) and keeps up to pp micro-batches in flight.

The memory and FLOP model is in `costs.py`, serving layouts in `serving.py`. Rejected layouts each carry a one-line reason; memory is checked with
the cheapest recompute that fits (none, selective, full) unless the workload fixes one.

    hybridtron plan --preset ultra3 --gpus 4096 --gpus-per-node 8 --nvlink-domain 72 --hbm-gib 192 \\
        --seq-len 1048576 --tokens-per-iter 25165824 [--layout tp=8,pp=2,cp=32,ep=128] [--serve --batch B] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from collections import Counter
from dataclasses import dataclass

from hybridtron.checkpoint.hf import read_model_config
from hybridtron.config import ATTENTION, MAMBA, MOE, PRESETS, ModelConfig, preset
from hybridtron.distributed.costs import (
    GPUS, GiB, RECOMPUTE_MODES, SERVING_CHECKPOINTS, Cluster, Unit, activation_bytes, cluster_for,
    group_placement, model_units, ring_seconds,
)
from hybridtron.distributed.layout import Layout, Rejected, Workload, candidate_layouts, check_layout
from hybridtron.distributed.serving import format_serve, serve_plan
from hybridtron.distributed.vllm_layout import DEFAULT_GPU_MEMORY_UTILIZATION, format_engine, plan_engine
from hybridtron.numerics.policy import POLICIES, RECIPES


# ------------------------------------------------------------------------------------------------ results
@dataclass(frozen=True)
class Memory:
    """GiB per GPU on the fullest pipeline stage, with the recompute mode chosen."""

    master_weights: float  # fp32, sharded
    gradients: float  # fp32, sharded
    optimizer: float  # Adam moments, sharded (0 when offloaded)
    host: float  # offloaded: the master weights, gradients and Adam moments above, in host memory instead
    compute_weights: float  # BF16 + quantized copies of the two blocks in flight, one block's unsharded gradient
    activations: float  # with `recompute`, all micro-batches in flight, logits included
    reserve: float
    total: float
    recompute: str
    activations_by_recompute: dict[str, float]  # the activations under each mode, to compare
    stage: int


@dataclass(frozen=True)
class Comm:
    """Seconds per step on the slowest stage: what each collective costs, and what of it the step waits for."""

    tp: float
    ep_nvlink: float
    ep_ib: float
    etp: float
    cp: float  # total; `cp_exposed` is what attention compute does not hide
    cp_exposed: float
    pp_p2p: float
    fsdp: float  # parameter all-gathers and gradient reduce-scatters; `fsdp_exposed` is what compute does not hide
    fsdp_exposed: float
    dp_replicate: float
    offload: float
    links: dict[str, str]  # which link each group's collective runs on


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    step_s: float
    compute_s: float  # GEMMs, attention and scan, recompute included, summed over the step's micro-batches
    bubble_s: float
    optimizer_s: float
    tokens_per_s_per_gpu: float
    memory: Memory
    comm: Comm
    sequences: int
    micro_batches: int  # per DP rank per step
    tokens_per_cp_rank: int  # per micro-batch
    tokens_per_rank: float  # per micro-batch, after the sequence-parallel split over TP
    experts_per_rank: float
    stages: tuple[str, ...]
    warnings: tuple[str, ...]
    notes: tuple[str, ...]  # one short tag per warning, for tables


@dataclass(frozen=True)
class Plan:
    cluster: Cluster
    workload: Workload
    layouts: tuple[Estimate, ...]  # valid, fastest first
    rejected: tuple[Rejected, ...]
    warnings: tuple[str, ...]

    def rejection_summary(self) -> list[tuple[str, int, str]]:
        """(rule, how many layouts it rejected, one example reason), most frequent first."""
        counts = Counter(r.rule for r in self.rejected)
        examples = {}
        for r in self.rejected:
            examples.setdefault(r.rule, r.reason)
        return [(rule, count, examples[rule]) for rule, count in counts.most_common()]


# --------------------------------------------------------------------------------------------- the model
class _Stage:
    """A pipeline stage's units, with the sums every layout's estimate reads."""

    def __init__(self, units: tuple[Unit, ...]):
        self.units = units
        self.mixers = tuple(kind for unit in units for kind in unit.mixers)
        self.kinds = Counter(self.mixers)
        self.dense_params = sum(u.dense_params for u in units)
        self.expert_params = sum(u.expert_params for u in units)
        self.unit_params = [(u.dense_params, u.expert_params) for u in units]
        self.unit_copies = [(u.compute_copy_bytes(False), u.compute_copy_bytes(True)) for u in units]
        self.logits = sum(u.logits for u in units)
        flops: Counter = Counter()
        for unit in units:
            for fmt, value in unit.gemm_flops:
                flops[fmt] += value
        self.gemm_flops = dict(flops)
        layers = [int(u.name.split()[1]) for u in units if u.name.startswith("layer")]
        extras = "".join(f" + {u.name}" for u in units if not u.name.startswith("layer"))
        self.label = f"layers {layers[0]}-{layers[-1]}{extras}"

    def count(self, kind: str) -> int:
        return self.kinds[kind]


def _unit_seconds_per_token(config: ModelConfig, cluster: Cluster, unit: Unit, seq_len: int) -> float:
    gemm = sum(flops / cluster.peak_flops(fmt) for fmt, flops in unit.gemm_flops)
    core = unit.core_flops_per_token(config, seq_len) / cluster.peak_flops("bf16")
    return gemm + core


@functools.lru_cache(maxsize=64)
def pipeline_stages(config: ModelConfig, cluster: Cluster, workload: Workload, pp: int) -> tuple[_Stage, ...]:
    """Contiguous stages at layer boundaries with the largest stage's compute as small as it can be."""
    units = model_units(config, workload.recipe, workload.policy)
    layers = [u for u in units if u.name.startswith("layer")]
    head = [u for u in units if u.name in ("head", "mtp")]
    costs = [_unit_seconds_per_token(config, cluster, u, workload.seq_len) for u in layers]
    costs[-1] += sum(_unit_seconds_per_token(config, cluster, u, workload.seq_len) for u in head)
    limit = _smallest_stage_limit(costs, pp)
    groups, current, acc = [], [], 0.0
    for i, (layer, cost) in enumerate(zip(layers, costs)):
        must_close = len(layers) - i == pp - len(groups) - 1  # one layer left for each stage still to open
        if current and (acc + cost > limit * (1 + 1e-9) or must_close):
            groups.append(current)
            current, acc = [], 0.0
        current.append(layer)
        acc += cost
    groups.append(current)
    assert len(groups) == pp, (len(groups), pp)
    groups[0] = [units[0]] + groups[0]
    groups[-1] = groups[-1] + head
    return tuple(_Stage(tuple(g)) for g in groups)


def _smallest_stage_limit(costs: list[float], parts: int) -> float:
    def stages_needed(limit):
        count, acc = 1, 0.0
        for cost in costs:
            if acc + cost > limit:
                count, acc = count + 1, 0.0
            acc += cost
        return count

    lo, hi = max(costs), sum(costs)
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if stages_needed(mid) <= parts else (mid, hi)
    return hi


# ------------------------------------------------------------------------------------------- the estimate
@dataclass(frozen=True)
class _Groups:
    """Where each process group of a layout lies: whether its ring leaves an NVLink domain, and for EP the share of
    a rank's all-to-all peers inside its own domain."""

    crosses: dict[str, bool]
    ep_share: float
    ep_domains: int


def _groups(cluster: Cluster, layout: Layout) -> _Groups:
    L, world, domain = layout, cluster.gpus, cluster.domain_size()
    fsdp_span = L.dp_shard * L.cp * L.tp
    spans = dict(tp=(L.tp, 1), cp=(L.cp * L.tp, L.tp), fsdp=(fsdp_span, L.tp), efsdp=(fsdp_span, L.ep * L.etp),
                 pp=(world, world // L.pp), dp_replicate=(L.dp_replicate * fsdp_span, fsdp_span))
    crosses = {name: group_placement(span, stride, world, domain)[1] > 1 for name, (span, stride) in spans.items()}
    ep_share, ep_domains = group_placement(L.ep * L.etp, L.etp, world, domain)
    return _Groups(crosses, ep_share, ep_domains)


def _stage_memory(config: ModelConfig, cluster: Cluster, workload: Workload, layout: Layout, stage: _Stage,
                  index: int, micro_batches: int, tokens: int) -> dict:
    """GiB per GPU of one stage: sharded fp32 state, compute copies, activations under each recompute mode."""
    L, c = layout, config
    experts_split = L.ep * L.etp
    shard = stage.dense_params / (L.tp * L.dp_shard * L.cp) + stage.expert_params / (experts_split * L.efsdp)
    # FSDP2's CPU offload keeps the fp32 shard, its gradient and the Adam state on the host (master + gradient + 2
    # moments); the device keeps the gathered copies and the unsharded gradients, as without it
    fp32 = 0.0 if workload.offload_optimizer else shard * 4 / GiB
    host = 4 * shard * 4 / GiB if workload.offload_optimizer else 0.0
    copies = sorted((dense / L.tp + expert / experts_split for dense, expert in stage.unit_copies), reverse=True)
    sharded = (L.dp_shard * L.cp > 1, L.efsdp > 1)  # a reduce-scatter needs the unsharded gradient first
    unsharded_grad = max(dense / L.tp * sharded[0] + expert / experts_split * sharded[1]
                         for dense, expert in stage.unit_params) * 4
    compute_weights = (sum(copies[:2]) + unsharded_grad) / GiB
    in_flight = min(L.pp - index, micro_batches)  # 1F1B: stage i holds pp - i micro-batches
    logits = stage.logits * tokens * 2 * c.vocab_size / L.tp
    activations = {}
    for mode in RECOMPUTE_MODES:
        kept = sum(n * activation_bytes(c, kind, L.tp, L.etp, mode) for kind, n in stage.kinds.items())
        peak = max((activation_bytes(c, kind, L.tp, L.etp, "none") for kind in stage.kinds), default=0.0) \
            if mode == "full" else 0.0  # the one layer being recomputed
        activations[mode] = (in_flight * (kept * tokens + logits) + peak * tokens) / GiB
    fixed = 4 * fp32 + compute_weights + cluster.runtime_reserve_gib  # master + gradients + 2 Adam moments
    return dict(shard=shard, fp32=fp32, host=host, compute_weights=compute_weights, activations=activations,
                fixed=fixed)


def _stage_seconds(config: ModelConfig, cluster: Cluster, workload: Workload, layout: Layout, stage: _Stage,
                   groups: _Groups, recompute: str, tokens: int, shard: float) -> dict:
    """Seconds of one micro-batch on one stage: compute and every collective, and what of each is exposed."""
    L, c = layout, config
    nvlink = cluster.nvlink_gbps * 1e9 * cluster.link_efficiency
    ib = cluster.ib_gbps * 1e9 * cluster.link_efficiency
    tokens_sp = tokens / L.tp
    efficiency = cluster.compute_efficiency
    full = recompute == "full"

    # Each GEMM at its format's peak (the precision policy); attention and the scan at BF16. TP splits the work.
    gemm_per_token = sum(flops / (cluster.peak_flops(fmt) * efficiency) for fmt, flops in stage.gemm_flops.items())
    bf16 = cluster.peak_flops("bf16") * efficiency
    attention_per_token = sum(u.core_flops_per_token(c, workload.seq_len, ATTENTION) for u in stage.units) / bf16
    scan_per_token = sum(u.core_flops_per_token(c, workload.seq_len, MAMBA) for u in stage.units) / bf16
    forward_s = (gemm_per_token + attention_per_token + scan_per_token) * tokens / L.tp
    attention_s = attention_per_token * tokens / L.tp
    compute_s = forward_s * (4 if full else 3)  # backward = 2 x forward, + 1 forward when recomputing

    passes = 6 if full else 4  # activation collectives per layer: forward 2, backward 2, recompute 2
    moe_layers = stage.count(MOE)
    tp_s = ring_seconds(cluster, passes * len(stage.mixers) * tokens * c.hidden_size * 2, L.tp,
                         groups.crosses["tp"])
    a2a_bytes = moe_layers * passes * tokens_sp * c.num_experts_per_tok * c.expert_width * 2
    ep_nvlink_s = a2a_bytes * max(groups.ep_share - 1 / L.ep, 0.0) / nvlink if L.ep > 1 else 0.0
    ep_ib_s = a2a_bytes * (1 - groups.ep_share) / ib if L.ep > 1 else 0.0
    etp_s = ring_seconds(cluster, moe_layers * passes * tokens * c.num_experts_per_tok * c.expert_width * 2,
                          L.etp, groups.crosses["tp"])
    cp_s = cp_exposed = 0.0
    if L.cp > 1:
        ring_passes = 4 if full else 3  # K/V forward; K/V and dK/dV backward; again when recomputing
        kv_width = max(c.num_key_value_heads // L.tp, 1) * c.head_dim
        kv_bytes = stage.count(ATTENTION) * ring_passes * (L.cp - 1) * tokens * 2 * kv_width * 2
        state = c.mamba_num_heads / L.tp * (c.mamba_head_dim * c.ssm_state_size + 1) * 4  # S_local and a, fp32
        state_bytes = stage.count(MAMBA) * (ring_passes - 1) * (L.cp - 1) * state  # forward, backward (, again)
        bandwidth = ib if groups.crosses["cp"] else nvlink
        cp_s = (kv_bytes + state_bytes) / bandwidth
        cp_exposed = max(0.0, kv_bytes / bandwidth - 3 * attention_s) + state_bytes / bandwidth
    pp_s = 2 * tokens_sp * c.hidden_size * 2 / (ib if groups.crosses["pp"] else nvlink) if L.pp > 1 else 0.0
    gathers = 2 + 2 + 4 + (2 if full else 0)  # BF16 gather forward, backward (, recompute); fp32 reduce-scatter
    fsdp_s = (ring_seconds(cluster, stage.dense_params / L.tp * gathers, L.dp_shard * L.cp, groups.crosses["fsdp"])
              + ring_seconds(cluster, stage.expert_params / (L.ep * L.etp) * gathers, round(L.efsdp),
                              groups.crosses["efsdp"]))
    fsdp_exposed = max(0.0, fsdp_s - compute_s)  # prefetched: hidden behind compute up to its length
    offload_s = 3 * 4 * shard / (cluster.host_gbps * 1e9) if workload.offload_optimizer else 0.0
    micro_s = compute_s + tp_s + ep_nvlink_s + ep_ib_s + etp_s + cp_exposed + pp_s + fsdp_exposed + offload_s
    return dict(micro_s=micro_s, compute=compute_s, tp=tp_s, ep_nvlink=ep_nvlink_s, ep_ib=ep_ib_s, etp=etp_s,
                cp=cp_s, cp_exposed=cp_exposed, pp_p2p=pp_s, fsdp=fsdp_s, fsdp_exposed=fsdp_exposed,
                offload=offload_s)


def estimate(config: ModelConfig, cluster: Cluster, workload: Workload, layout: Layout) -> Estimate | Rejected:
    """Memory, communication and step time of one layout, or why it cannot run (see the module docstring)."""
    rejected = check_layout(config, cluster, workload, layout)
    if rejected:
        return rejected
    L = layout
    micro_batches = workload.sequences // (L.dp * workload.micro_batch)
    tokens = workload.micro_batch * workload.seq_len // L.cp  # per CP rank per micro-batch
    stages = pipeline_stages(config, cluster, workload, L.pp)
    memory = [_stage_memory(config, cluster, workload, L, stage, i, micro_batches, tokens)
              for i, stage in enumerate(stages)]

    def total(i, mode):
        return memory[i]["fixed"] + memory[i]["activations"][mode]

    modes = RECOMPUTE_MODES if workload.recompute == "auto" else (workload.recompute,)
    fitting = [mode for mode in modes if max(total(i, mode) for i in range(L.pp)) <= cluster.hbm_gib]
    if not fitting:
        worst = max(total(i, modes[-1]) for i in range(L.pp))
        return Rejected(layout, "memory", f"needs {worst:.1f} GiB per GPU with {modes[-1]} recompute > "
                                          f"{cluster.hbm_gib:g} GiB HBM")
    recompute = fitting[0]

    groups = _groups(cluster, L)
    seconds = [_stage_seconds(config, cluster, workload, L, stage, groups, recompute, tokens, memory[i]["shard"])
               for i, stage in enumerate(stages)]
    t = max(seconds, key=lambda s: s["micro_s"])  # the slowest stage paces the pipeline
    largest_shard = max(m["shard"] for m in memory)
    replicate_s = ring_seconds(cluster, largest_shard * 4, L.dp_replicate, groups.crosses["dp_replicate"], factor=2)
    optimizer_s = (largest_shard / (cluster.host_adam_gparams_per_s * 1e9) if workload.offload_optimizer else
                   largest_shard * 32 / (cluster.hbm_gbps * 1e9 * cluster.hbm_efficiency))  # read + write 16 B
    bubble_s = (L.pp - 1) * t["micro_s"]
    step_s = micro_batches * t["micro_s"] + bubble_s + replicate_s + optimizer_s

    warnings = _warnings(config, cluster, L, groups, bubble_s / step_s, micro_batches, tokens)
    fullest = max(range(L.pp), key=lambda i: total(i, recompute))
    m = memory[fullest]
    links = {name: "-" if members <= 1 else "IB" if groups.crosses[name] else "NVLink" for name, members in
             dict(tp=L.tp, cp=L.cp, fsdp=L.dp_shard * L.cp, efsdp=round(L.efsdp), pp=L.pp,
                  dp_replicate=L.dp_replicate).items()}
    links["ep"] = "-" if L.ep == 1 else "NVLink" if groups.ep_domains == 1 else \
        f"{1 - groups.ep_share:.0%} of peers off the NVLink domain"
    per_step = {key: t[key] * micro_batches for key in t}
    return Estimate(
        layout=layout, step_s=step_s, compute_s=per_step["compute"], bubble_s=bubble_s, optimizer_s=optimizer_s,
        tokens_per_s_per_gpu=workload.tokens_per_iter / step_s / cluster.gpus,
        memory=Memory(master_weights=m["fp32"], gradients=m["fp32"], optimizer=2 * m["fp32"], host=m["host"],
                      compute_weights=m["compute_weights"], activations=m["activations"][recompute],
                      reserve=cluster.runtime_reserve_gib, total=total(fullest, recompute), recompute=recompute,
                      activations_by_recompute=dict(m["activations"]), stage=fullest),
        comm=Comm(tp=per_step["tp"], ep_nvlink=per_step["ep_nvlink"], ep_ib=per_step["ep_ib"], etp=per_step["etp"],
                  cp=per_step["cp"], cp_exposed=per_step["cp_exposed"], pp_p2p=per_step["pp_p2p"],
                  fsdp=per_step["fsdp"], fsdp_exposed=per_step["fsdp_exposed"], dp_replicate=replicate_s,
                  offload=per_step["offload"], links=links),
        sequences=workload.sequences, micro_batches=micro_batches, tokens_per_cp_rank=tokens,
        tokens_per_rank=tokens / L.tp, experts_per_rank=config.n_routed_experts / L.ep,
        stages=tuple(s.label for s in stages), warnings=tuple(text for _, text in warnings),
        notes=tuple(tag for tag, _ in warnings))


def _warnings(config: ModelConfig, cluster: Cluster, layout: Layout, groups: _Groups, bubble_share: float,
              micro_batches: int, tokens: int) -> list[tuple[str, str]]:
    """(short tag, one line) for each thing about a valid layout that costs or surprises."""
    out, domain = [], cluster.domain_size()
    if groups.ep_domains > 1:
        out.append((f"EP>{domain}", f"EP {layout.ep} spans more than one {domain}-GPU NVLink domain (up to "
                                    f"{groups.ep_domains}): {1 - groups.ep_share:.0%} of its all-to-all peers are "
                                    f"reached over InfiniBand; EP within the domain keeps it on NVLink (the "
                                    f"report's RL runs gained 20% end to end from that)"))
    if groups.crosses["tp"]:
        out.append(("TP on IB", f"TP {layout.tp} leaves the {domain}-GPU NVLink domain: every layer's TP "
                                f"collectives run on IB"))
    if bubble_share > 0.2:
        out.append((f"bubble {bubble_share:.0%}", f"pipeline bubble is {bubble_share:.0%} of the step "
                                                  f"({micro_batches} micro-batches over {layout.pp} stages)"))
    if tokens % config.chunk_size:
        out.append(("chunk", f"{tokens:,} tokens per CP rank are not a multiple of Mamba's chunk_size "
                             f"{config.chunk_size}"))
    if layout.ep > 1 and layout.efsdp * layout.ep > config.n_routed_experts:
        out.append(("dim-1 FSDP", f"efsdp {layout.efsdp:g} x ep {layout.ep} > {config.n_routed_experts} experts: "
                                  f"FSDP shards the stacked expert weights on dim 1, not dim 0"))
    return out


# ---------------------------------------------------------------------------------------------- the search

def plan(config: ModelConfig, cluster: Cluster, workload: Workload) -> Plan:
    """Every layout of the cluster: the valid ones ranked by estimated step time, the others with their reason."""
    valid, rejected = [], []
    for layout in candidate_layouts(cluster.gpus):
        result = estimate(config, cluster, workload, layout)
        (rejected if isinstance(result, Rejected) else valid).append(result)
    valid.sort(key=lambda e: (e.step_s, e.memory.total))
    return Plan(cluster, workload, tuple(valid), tuple(rejected), cluster_warnings(cluster))


def cluster_warnings(cluster: Cluster) -> tuple[str, ...]:
    domain = cluster.nvlink_domain
    if cluster.gpus > domain and cluster.gpus % domain:
        return (f"{cluster.gpus} GPUs are not a whole number of {domain}-GPU NVLink domains "
                f"({cluster.gpus // domain} full, {cluster.gpus % domain} left over): groups that straddle a "
                f"boundary run at IB speed",)
    return ()


# ---------------------------------------------------------------------------------------------- formatting
def _layout_cells(layout: Layout) -> str:
    return (f"{layout.dp_replicate:>3} {layout.dp_shard:>4} {layout.cp:>3} {layout.tp:>3} {layout.pp:>3} "
            f"{layout.ep:>4} {layout.etp:>3}")


def format_plan(result: Plan, name: str, top: int) -> str:
    c, w = result.cluster, result.workload
    lines = [f"{name} on {c.gpus:,} GPUs ({c.hbm_gib:g} GiB each, NVLink domain {c.nvlink_domain}); "
             f"{w.sequences} sequences of {w.seq_len:,} tokens per iteration, micro-batch {w.micro_batch}, "
             f"{w.recipe} recipe, {w.policy} policy",
             f"{len(result.layouts):,} valid layouts of {len(result.layouts) + len(result.rejected):,}; "
             f"the fastest {min(top, len(result.layouts))} by estimated step time:", ""]
    header = (f"{'#':>3}  {'dpr':>3} {'dps':>4} {'cp':>3} {'tp':>3} {'pp':>3} {'ep':>4} {'etp':>3}  "
              f"{'recompute':<9} {'GiB/GPU':>8} {'step s':>8} {'tok/s/GPU':>10} {'bubble':>6} {'EP IB s':>8}  notes")
    lines += [header, "-" * len(header)]
    for rank, e in enumerate(result.layouts[:top], start=1):
        lines.append(f"{rank:>3}  {_layout_cells(e.layout)}  {e.memory.recompute:<9} {e.memory.total:>8.1f} "
                     f"{e.step_s:>8.2f} {e.tokens_per_s_per_gpu:>10,.0f} {e.bubble_s / e.step_s:>6.0%} "
                     f"{e.comm.ep_ib:>8.2f}  {', '.join(e.notes)}")
    if result.rejected:
        lines += ["", "rejected, by rule (count, one example):"]
        for rule, count, example in result.rejection_summary():
            lines.append(f"  {rule:<16} {count:>7,}  {example}")
    if result.warnings:
        lines += [""] + [f"warning: {text}" for text in result.warnings]
    lines += ["", "`--layout tp=8,pp=2,...` explains one layout in full", c.describe()]
    return "\n".join(lines)


def format_estimate(result: Estimate | Rejected, config: ModelConfig, cluster: Cluster, workload: Workload,
                    name: str) -> str:
    layout = result.layout
    head = (f"{name}: {layout}  (world {layout.world}, dp {layout.dp}, efsdp {layout.efsdp:g}) on "
            f"{cluster.gpus:,} GPUs")
    if isinstance(result, Rejected):
        return f"{head}\nREJECTED ({result.rule}): {result.reason}"
    e, m, k = result, result.memory, result.comm
    lines = [head,
             f"  sequences per iteration    {e.sequences} of {workload.seq_len:,} tokens; {e.micro_batches} "
             f"micro-batch{'es' if e.micro_batches != 1 else ''} of {workload.micro_batch} per DP rank",
             f"  tokens per CP rank         {e.tokens_per_cp_rank:,} per micro-batch ({e.tokens_per_rank:,.0f} per "
             f"rank after the sequence-parallel split over TP {layout.tp})",
             f"  experts per EP rank        {e.experts_per_rank:g} of {config.n_routed_experts}",
             "  pipeline stages            " + "; ".join(f"{i}: {s}" for i, s in enumerate(e.stages)),
             "",
             f"memory per GPU (stage {m.stage}, {'no' if m.recompute == 'none' else m.recompute} recompute): "
             f"{m.total:.1f} of {cluster.hbm_gib:g} GiB",
             f"  fp32 master weights        {m.master_weights:8.2f} GiB (sharded over FSDP and TP/EP)",
             f"  fp32 gradients             {m.gradients:8.2f} GiB",
             f"  Adam moments               {m.optimizer:8.2f} GiB" + ("  (offloaded to the host)"
                                                                          if workload.offload_optimizer else ""),
             *([f"  host memory per GPU        {m.host:8.2f} GiB (the offloaded fp32 master weights, gradients and "
                f"Adam moments; not in the total)"] if workload.offload_optimizer else []),
             f"  compute copies             {m.compute_weights:8.2f} GiB (BF16 + {workload.recipe} operand copies "
             f"of 2 blocks in flight, by the {workload.policy} policy)",
             f"  activations                {m.activations:8.2f} GiB (" + ", ".join(
                 f"{mode}: {gib:.1f}" for mode, gib in m.activations_by_recompute.items()) + ")",
             f"  runtime reserve            {m.reserve:8.2f} GiB",
             "",
             f"step {e.step_s:.2f} s, {e.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; per step on the slowest stage:",
             f"  compute                      {e.compute_s:>7.2f} s (GEMMs by format, attention, scan"
             f"{'; the forward twice' if m.recompute == 'full' else ''})",
             f"  TP all-gather/reduce-scatter {k.tp:>7.2f} s on {k.links['tp']}",
             f"  EP all-to-all                {k.ep_nvlink:>7.2f} s NVLink + {k.ep_ib:.2f} s IB ({k.links['ep']})",
             f"  ETP gather/scatter           {k.etp:>7.2f} s",
             f"  CP K/V ring + Mamba states   {k.cp:>7.2f} s on {k.links['cp']}, {k.cp_exposed:.2f} s not hidden "
             f"by attention",
             f"  PP send/receive              {k.pp_p2p:>7.2f} s on {k.links['pp']}",
             f"  PP bubble                    {e.bubble_s:>7.2f} s ({e.bubble_s / e.step_s:.0%} of the step)",
             f"  FSDP gather/reduce-scatter   {k.fsdp:>7.2f} s on {k.links['fsdp']}/{k.links['efsdp']}, "
             f"{k.fsdp_exposed:.2f} s not hidden by compute",
             f"  DP replica all-reduce        {k.dp_replicate:>7.2f} s on {k.links['dp_replicate']}",
             f"  optimizer step               {e.optimizer_s:>7.2f} s" + (f" (host; transfers {k.offload:.2f} s)"
                                                                        if workload.offload_optimizer else ""),
             ]
    if e.warnings:
        lines += [""] + [f"warning: {text}" for text in e.warnings]
    lines += ["", cluster.describe()]
    return "\n".join(lines)


def _jsonable(value):
    if dataclasses.is_dataclass(value):
        out = {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, Layout):
            out.update(world=value.world, dp=value.dp, efsdp=value.efsdp)
        return out
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


# ------------------------------------------------------------------------------------------------ command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=None, help=f"model preset, one of {', '.join(PRESETS)} "
                                                        f"(default: ultra3 when --config is not given)")
    parser.add_argument("--config", default=None,
                        help="a checkpoint directory, a run directory (its hf/ export) or a config.json instead of "
                             "--preset (default: none)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the job (required)")
    parser.add_argument("--gpu", default="gb200", help=f"GPU kind for the datasheet numbers, one of "
                                                       f"{', '.join(GPUS)} (default: gb200)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default: 8)")
    parser.add_argument("--nvlink-domain", type=int, default=None,
                        help="GPUs that reach each other over NVLink (default: the GPU kind's, 72 for gb200, 8 else)")
    parser.add_argument("--hbm-gib", type=float, default=None, help="memory per GPU in GiB (default: the GPU kind's)")
    parser.add_argument("--nvlink-gbps", type=float, default=None,
                        help="NVLink GB/s per GPU per direction (default: the GPU kind's)")
    parser.add_argument("--ib-gbps", type=float, default=None,
                        help="InfiniBand GB/s per GPU per direction (default: 50, one 400 Gb/s NIC)")
    parser.add_argument("--hbm-gbps", type=float, default=None, help="HBM GB/s per GPU (default: the GPU kind's)")
    parser.add_argument("--seq-len", type=int, default=1_048_576,
                        help="tokens per sequence; the context per sequence with --serve (default: 1048576)")
    parser.add_argument("--tokens-per-iter", type=int, default=25_165_824,
                        help="tokens per training iteration (default: 25165824, the report's 24 x 1M)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch (default: 1)")
    parser.add_argument("--recompute", default="auto", choices=("auto",) + RECOMPUTE_MODES,
                        help="activation recompute (default: auto, the cheapest that fits)")
    parser.add_argument("--offload-optimizer", action="store_true",
                        help="keep master weights, gradients and Adam state in host memory (default: off)")
    parser.add_argument("--recipe", default="nvfp4", choices=RECIPES, help="low-precision recipe (default: nvfp4)")
    parser.add_argument("--policy", default="ultra", choices=POLICIES,
                        help="precision policy (default: ultra, the report's mixed policy)")
    parser.add_argument("--layout", default=None,
                        help="explain one layout, e.g. tp=8,pp=2,cp=32,ep=128 (default: rank them all)")
    parser.add_argument("--top", type=int, default=10, help="layouts to list (default: 10)")
    parser.add_argument("--serve", action="store_true", help="compare serving layouts instead (default: training)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded at once with --serve (default: 1)")
    parser.add_argument("--checkpoint", default=None, choices=tuple(SERVING_CHECKPOINTS),
                        help="serving checkpoint format (default: nvfp4, NVIDIA's mixed NVFP4/FP8/BF16 checkpoint; "
                             "bf16 with --rollout, the weights the learner pushes)")
    parser.add_argument("--rollout", action="store_true",
                        help="lay out one vLLM engine of --gpus GPUs for rollouts or serving: the `vllm serve` flags "
                             "and the [grpo] / [mopd] settings (hybridtron.distributed.vllm_layout; --checkpoint: its "
                             "weights, here bf16 unless given) (default: off)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                        help=f"with --rollout: the share of each GPU's memory vLLM takes (default: "
                             f"{DEFAULT_GPU_MEMORY_UTILIZATION})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables (default: off)")


def run(args) -> int:
    if args.preset and args.config:
        raise ValueError("give --preset or --config, not both")
    name = args.config or args.preset or "ultra3"
    config = read_model_config(args.config) if args.config else preset(name)
    if args.gpus is None or args.gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {args.gpus}")
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if args.rollout:
        cluster = cluster_for(args.gpu, args.gpus, gpus_per_node=min(args.gpus_per_node, args.gpus),
                              hbm_gib=args.hbm_gib)
        result = plan_engine(config, cluster, args.gpu, args.checkpoint or "bf16", args.gpu_memory_utilization)
        print(json.dumps(_jsonable(result)) if args.json else format_engine(result, config, name))
        return 0
    cluster = cluster_for(args.gpu, args.gpus, gpus_per_node=args.gpus_per_node, nvlink_domain=args.nvlink_domain,
                          hbm_gib=args.hbm_gib, nvlink_gbps=args.nvlink_gbps, ib_gbps=args.ib_gbps,
                          hbm_gbps=args.hbm_gbps)
    if args.serve:
        result = serve_plan(config, cluster, args.batch, args.seq_len, args.checkpoint or "nvfp4")
        print(json.dumps(_jsonable(result)) if args.json else format_serve(result, name, cluster))
        return 0
    workload = Workload(seq_len=args.seq_len, tokens_per_iter=args.tokens_per_iter, micro_batch=args.micro_batch,
                        recompute=args.recompute, offload_optimizer=args.offload_optimizer, recipe=args.recipe,
                        policy=args.policy)
    if args.layout:
        result = estimate(config, cluster, workload, Layout.parse(args.layout, cluster.gpus))
        if args.json:
            print(json.dumps({"valid": isinstance(result, Estimate), **_jsonable(result),
                              "cluster": _jsonable(cluster), "workload": _jsonable(workload)}))
        else:
            print(format_estimate(result, config, cluster, workload, name))
        return 1 if isinstance(result, Rejected) else 0
    result = plan(config, cluster, workload)
    if args.json:
        print(json.dumps({"cluster": _jsonable(cluster), "workload": _jsonable(workload),
                          "valid_count": len(result.layouts), "rejected_count": len(result.rejected),
                          "layouts": _jsonable(result.layouts[:args.top]),
                          "rejected_by_rule": [dict(rule=r, count=n, example=x)
                                               for r, n, x in result.rejection_summary()],
                          "warnings": list(result.warnings)}))
    else:
        print(format_plan(result, name, args.top))
    return 0
