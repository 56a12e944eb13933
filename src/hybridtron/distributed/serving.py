"""Serving layouts: wide tensor parallelism against wide expert parallelism for one decode batch.

A decode step produces one token for each of the batch's sequences. Per GPU it reads its share of the weights
(the dense ones every step; of the routed experts, those some token chose), reads each sequence's KV cache and
reads and writes its Mamba state, computes, and communicates:

- wide TP: attention and Mamba tensor-parallel over the widest valid TP (n_groups caps it at 8 for Nemotron 3),
  every routed expert split over all GPUs (ETP = GPUs). Every GPU reads an equal slice of each expert in use; the
  price is an all-reduce of every layer's activations, and an all-gather/reduce-scatter of all tokens around the
  experts when the GPUs outnumber the attention TP group.
- wide EP: every expert whole on one GPU (EP = GPUs), attention TP x DP-attention for each split of the GPUs. Each
  token goes once to each chosen expert's GPU at the latent width (an all-to-all before and after the experts) and
  a sequence's attention, KV heads and all-reduces stay inside its group; the price is that the GPU holding the
  most experts in use sets the pace, and that DP-attention replicates the dense weights.

Small batches are bound by weight reads, large ones by activation traffic and KV reads; `serve_plan` prices both at
the given batch and at each layout's largest batch, and says which term decides. Memory per GPU: the checkpoint's
weights (`costs.SERVING_CHECKPOINTS`), then FP8 KV cache and fp32 SSM + BF16 conv state per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridtron.config import ATTENTION, MOE, ModelConfig
from hybridtron.distributed.costs import GiB, SERVING_CHECKPOINTS, Cluster, checkpoint_bytes, model_units
from hybridtron.distributed.layout import divisors, tensor_parallel_reason
from hybridtron.model.memory import kv_cache_bytes, mamba_state_bytes


@dataclass(frozen=True)
class ServeLayout:
    """Attention and Mamba run tensor-parallel over `attention_tp` GPUs, `attention_dp` such groups side by side
    (DP-attention), each holding its own sequences; the routed experts spread over all GPUs by EP or ETP."""

    name: str
    attention_tp: int
    attention_dp: int
    ep: int
    etp: int


@dataclass(frozen=True)
class ServeEstimate:
    layout: ServeLayout
    weights_gib: float  # per GPU
    free_gib: float  # HBM left after the weights
    state_gib_per_sequence: float  # KV cache + Mamba state one sequence puts on each GPU of its attention group
    max_batch: int  # sequences at this context that fit next to the weights and the runtime reserve
    fits: bool
    step_s: float  # one decode step: one token for each of the batch's sequences
    weight_read_s: float
    state_read_s: float
    compute_s: float
    comm_s: float
    bound: str
    tokens_per_s: float


@dataclass(frozen=True)
class ServePlan:
    checkpoint: str
    batch: int
    context: int
    weights_total_gib: float
    candidates: tuple[ServeEstimate, ...]
    best: ServeEstimate | None  # the fastest layout that holds the batch
    at_max_batch: tuple[ServeEstimate, ...]  # each layout at the largest batch it holds: its best throughput
    crossover_batch: int | None  # smallest power-of-two batch at which a wide-EP layout beats wide TP
    reasoning: tuple[str, ...]


def serve_layouts(config: ModelConfig, gpus: int) -> list[ServeLayout]:
    """Wide TP: the widest valid attention TP, every expert split over all GPUs. Wide EP: every expert whole on one
    GPU (EP = GPUs), attention TP x DP-attention for each valid split of the GPUs."""
    valid_tp = [t for t in divisors(gpus) if tensor_parallel_reason(config, t) is None]
    out = []
    if config.moe_intermediate_size % gpus == 0:
        t = max(valid_tp)
        out.append(ServeLayout("wide TP", t, gpus // t, 1, gpus))
    if config.n_routed_experts % gpus == 0:
        for t in sorted(valid_tp, reverse=True):
            out.append(ServeLayout(f"wide EP, attention TP {t} x DP {gpus // t}", t, gpus // t, gpus, 1))
    if not out:
        raise ValueError(f"serve: {gpus} GPUs neither split the experts' intermediate size "
                         f"{config.moe_intermediate_size} (wide TP) nor the {config.n_routed_experts} experts "
                         f"(wide EP)")
    return out


def serve_estimate(config: ModelConfig, cluster: Cluster, layout: ServeLayout, batch: int, context: int,
                   checkpoint: str = "nvfp4") -> ServeEstimate:
    """One decode step at `batch` sequences of `context` tokens (FP8 KV cache, fp32 SSM state)."""
    c, gpus = config, cluster.gpus
    t, d = layout.attention_tp, layout.attention_dp
    dense_bytes, expert_bytes = checkpoint_bytes(config, checkpoint)
    weights = dense_bytes / t + expert_bytes / gpus
    free = cluster.hbm_gib - weights / GiB
    # FP8 KV cache (kv heads beyond TP replicate, not split; a windowed layer holds its window), fp32 SSM and BF16
    # conv state
    kv_per_gpu = kv_cache_bytes(c, context, "fp8") / min(t, c.num_key_value_heads)
    mamba_per_gpu = mamba_state_bytes(c, "fp32", "bf16") / t
    state = kv_per_gpu + mamba_per_gpu
    per_group = max(0, int((free - cluster.runtime_reserve_gib) * GiB // state))
    sequences_per_group = -(-batch // d)

    # A decode step runs the backbone; the MTP block's weights are held, and read only when it drafts.
    read_dense, read_experts = checkpoint_bytes(config, checkpoint, include_mtp=False)
    moe_layers = sum(kind == MOE for kind in c.layers_block_type)
    attention_layers = sum(kind == ATTENTION for kind in c.layers_block_type)
    touched = 1 - (1 - c.num_experts_per_tok / c.n_routed_experts) ** batch  # share of a layer's experts in use
    if layout.ep > 1:  # the busiest GPU, not the mean one, sets the pace: mean + sqrt(2 ln G) standard deviations
        local = c.n_routed_experts / layout.ep
        busiest = min(local, local * touched + math.sqrt(local * touched * (1 - touched) * 2 * math.log(layout.ep)))
        expert_read = read_experts / c.n_routed_experts * busiest
    else:
        expert_read = read_experts * touched / gpus
    hbm = cluster.hbm_gbps * 1e9 * cluster.hbm_efficiency
    weight_read_s = (read_dense / t + expert_read) / hbm
    state_read_s = sequences_per_group * (kv_per_gpu + 2 * mamba_per_gpu) / hbm  # KV; state r+w

    backbone = [u for u in model_units(config) if u.name.startswith("layer") or u.name == "head"]
    dense_active = sum(u.dense_params for u in backbone)
    expert_active = sum(u.expert_params for u in backbone) * c.num_experts_per_tok / c.n_routed_experts
    expert_fmt = SERVING_CHECKPOINTS[checkpoint].get("moe.experts", "bf16")
    attention_flops = 4 * context * c.num_attention_heads * c.head_dim * attention_layers  # QK^T and PV per token
    compute_s = ((2 * dense_active + attention_flops) * sequences_per_group / t / cluster.peak_flops("bf16")
                 + 2 * expert_active * batch / gpus / cluster.peak_flops(expert_fmt)) / cluster.compute_efficiency

    nvlink = cluster.nvlink_gbps * 1e9 * cluster.link_efficiency
    ib = cluster.ib_gbps * 1e9 * cluster.link_efficiency
    domain = cluster.domain_size()
    latency = cluster.collective_latency_us * 1e-6
    comm_s = 0.0
    if t > 1:  # one all-reduce of the activations per layer inside the attention group
        comm_s += c.num_hidden_layers * (latency + 2 * (t - 1) / t * sequences_per_group * c.hidden_size * 2
                                         / (nvlink if t <= domain else ib))
    if layout.ep > 1:  # dispatch and combine: each token once to each chosen expert, at the latent width
        sent = batch / gpus * c.num_experts_per_tok * c.expert_width * 2
        home = min(domain, gpus) / gpus  # share of the destinations inside this GPU's NVLink domain
        comm_s += moe_layers * 2 * (latency + sent * (home - 1 / gpus) / nvlink + sent * (1 - home) / ib)
    elif d > 1:  # every GPU holds a slice of every expert: gather all tokens, reduce-scatter the partial outputs
        comm_s += moe_layers * 2 * (latency + (gpus - 1) / gpus * batch * c.hidden_size * 2
                                    / (nvlink if gpus <= domain else ib))
    terms = {"weight reads": weight_read_s, "KV/state reads": state_read_s, "compute": compute_s,
             "communication": comm_s}
    step_s = max(weight_read_s + state_read_s, compute_s) + comm_s
    return ServeEstimate(layout, weights / GiB, free, state / GiB, per_group * d, batch <= per_group * d, step_s,
                         weight_read_s, state_read_s, compute_s, comm_s, max(terms, key=terms.get),
                         batch / step_s)


def serve_plan(config: ModelConfig, cluster: Cluster, batch: int, context: int,
               checkpoint: str = "nvfp4") -> ServePlan:
    """Wide TP against wide EP (with each DP-attention split) for decoding `batch` sequences at `context`."""
    for name, value in (("batch", batch), ("context", context)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"serve: {name} must be a positive integer, got {value!r}")
    layouts = serve_layouts(config, cluster.gpus)

    def at(batch_size):
        return [serve_estimate(config, cluster, s, batch_size, context, checkpoint) for s in layouts]

    candidates = tuple(at(batch))
    fitting = [e for e in candidates if e.fits]
    best = min(fitting, key=lambda e: e.step_s) if fitting else None
    peaks = tuple(serve_estimate(config, cluster, e.layout, e.max_batch, context, checkpoint)
                  for e in candidates if e.max_batch >= 1)
    crossover, size = None, 1
    while any(e.layout.ep == 1 for e in candidates) and size <= max(e.max_batch for e in candidates):
        tp, *ep = sorted(at(size), key=lambda e: e.layout.ep)
        if ep and min(e.step_s for e in ep) < tp.step_s:
            crossover = size
            break
        size *= 2
    dense, experts = checkpoint_bytes(config, checkpoint)
    return ServePlan(checkpoint, batch, context, (dense + experts) / GiB, candidates, best, peaks, crossover,
                     _serve_reasoning(candidates, best, peaks, batch, crossover))


_SERVE_TERMS = {"weight reads": "weight_read_s", "KV/state reads": "state_read_s", "compute": "compute_s",
                "communication": "comm_s"}


def _why(term: str, faster: ServeEstimate, slower: ServeEstimate) -> str:
    """Why the faster of wide TP and wide EP wins on `term`, in the terms of the two layouts."""
    tp_wins = faster.layout.ep == 1
    ep = slower if tp_wins else faster
    if term == "weight reads" and tp_wins:
        return (f"small batches are bound by weight reads: wide TP reads an equal 1/{faster.layout.etp} slice of "
                f"every expert in use, while under wide EP the GPU holding the most experts in use sets the pace"
                + (f" and DP-attention over {ep.layout.attention_dp} groups makes each GPU read 1/"
                   f"{ep.layout.attention_tp} of the dense weights" if ep.layout.attention_dp > 1 else ""))
    if term == "communication" and not tp_wins:
        gpus = slower.layout.etp
        tp_side = (f"wide TP gathers every token to all {gpus} GPUs for their slices of the experts and "
                   f"reduce-scatters the partial outputs back" if slower.layout.attention_dp > 1 else
                   f"wide TP all-reduces every layer's activations over all {gpus} GPUs")
        return (f"large batches are bound by activation traffic: {tp_side}, while wide EP sends each token once to "
                f"each chosen expert, at the latent width")
    if term == "communication":
        return ("wide EP pays two all-to-alls per MoE layer, mostly fixed latency at a batch this small, on top of "
                "the attention all-reduces")
    if term == "KV/state reads" and not tp_wins:
        return (f"DP-attention keeps each sequence's KV cache on one {ep.layout.attention_tp}-GPU group instead of "
                f"replicating kv heads across a wider TP group")
    return f"{faster.layout.name} does less of it per GPU"


def _serve_reasoning(candidates, best, peaks, batch, crossover) -> tuple[str, ...]:
    if best is None:
        most = max(candidates, key=lambda e: e.max_batch)
        return (f"no layout holds {batch} sequences at this context: the most is {most.max_batch:,} "
                f"({most.layout.name}); use more GPUs, a shorter context or a smaller checkpoint",)
    lines = [f"at batch {batch}, {best.layout.name} is fastest: {best.step_s * 1e3:.2f} ms per step, "
             f"{best.tokens_per_s:,.0f} tokens/s; its step is bound by {best.bound}"]
    wide_tp = [e for e in candidates if e.layout.ep == 1 and e.fits]
    wide_ep = [e for e in candidates if e.layout.ep > 1 and e.fits]
    if wide_tp and wide_ep:
        faster, slower = sorted((wide_tp[0], min(wide_ep, key=lambda e: e.step_s)), key=lambda e: e.step_s)
        gaps = {term: getattr(slower, key) - getattr(faster, key) for term, key in _SERVE_TERMS.items()}
        term = max(gaps, key=gaps.get)
        lines.append(f"{faster.layout.name} beats {slower.layout.name} by {(slower.step_s - faster.step_s) * 1e3:.2f}"
                     f" ms, most of it in {term} ({getattr(faster, _SERVE_TERMS[term]) * 1e3:.2f} vs "
                     f"{getattr(slower, _SERVE_TERMS[term]) * 1e3:.2f} ms): {_why(term, faster, slower)}")
    if peaks:
        top = max(peaks, key=lambda e: e.tokens_per_s)
        others = "; ".join(f"{e.layout.name} {e.tokens_per_s:,.0f} at {e.max_batch:,}" for e in peaks if e is not top)
        lines.append(f"for throughput, at the largest batch each holds: {top.layout.name} {top.tokens_per_s:,.0f} "
                     f"tokens/s at batch {top.max_batch:,}" + (f" ({others})" if others else ""))
    if any(e.layout.ep == 1 for e in candidates) and any(e.layout.ep > 1 for e in candidates):
        lines.append(f"wide EP overtakes wide TP from batch {crossover:,} at this context" if crossover else
                     "wide EP does not overtake wide TP at any batch that fits at this context")
    return tuple(lines)


def format_serve(result: ServePlan, name: str, cluster: Cluster) -> str:
    lines = [f"{name} serving on {cluster.gpus} GPUs of {cluster.hbm_gib:g} GiB: {result.checkpoint} checkpoint "
             f"{result.weights_total_gib:.1f} GiB, batch {result.batch}, context {result.context:,}", ""]
    header = (f"{'layout':<34} {'weights':>8} {'free':>7} {'max batch':>9} {'step ms':>8} {'tok/s':>9} "
              f"{'weights':>8} {'KV/state':>8} {'compute':>8} {'comm':>7}  bound")
    lines += [header + "   (GiB per GPU; then ms per step)", "-" * len(header)]
    for e in result.candidates:
        lines.append(f"{e.layout.name:<34} {e.weights_gib:>8.1f} {e.free_gib:>7.1f} {e.max_batch:>9,} "
                     f"{e.step_s * 1e3:>8.2f} {e.tokens_per_s:>9,.0f} {e.weight_read_s * 1e3:>8.2f} "
                     f"{e.state_read_s * 1e3:>8.2f} {e.compute_s * 1e3:>8.2f} {e.comm_s * 1e3:>7.2f}  {e.bound}"
                     + ("" if e.fits else "  (batch does not fit)"))
    lines += [""] + list(result.reasoning) + ["", cluster.describe()]
    return "\n".join(lines)
