"""The planner's cost model: the hardware, where a process group falls on it and what a collective costs there,
and what one layer of the model costs in bytes and FLOPs.

Everything is an estimate from first principles; each assumption is a named, documented field or constant so a
user can change it and see what follows. Nothing here allocates or runs a model: parameter counts and the number
format of every GEMM come from `HybridLM.on_meta` and `numerics.policy.precision_plan` (the one statement of which
module runs in NVFP4, MXFP8, BF16 or fp32), read once per config.

Training bytes per parameter (FSDP2 with fp32 master weights, as torchtitan runs it), sharded over the FSDP degree:
fp32 master weight 4, fp32 gradient 4 (the reduce dtype stays fp32: the report's divergence-1 knob), Adam moments
8. The blocks in flight are gathered in BF16 (2 B), and each NVFP4 or MXFP8 GEMM also keeps its quantized operand
copies (row-wise and column-wise, for the forward and the backward GEMMs), so the precision policy shows up in the
transient weight memory and in the GEMM time, not in the persistent state.

Activations kept for the backward, bytes per token per layer before the tensor-parallel split (BF16 = 2, fp32 = 4;
h hidden, d Mamba inner width, g = 2 n_groups N, H Mamba heads, P head_dim, N state, Q chunk, a = q heads x
head_dim, c = kv width, L expert width, I expert and Is shared intermediate, k experts per token, E experts):

    every layer  residual input 2h, normed input 2h
    Mamba-2      in_proj out 2(2d+g+H), conv out 2(d+g), chunk states 4HPN/Q, dt 8H, scan out 4d,
                 gated-norm input 4d and output 2d
    attention    q 2a, k and v 4c, attention out 2a, logsumexp 4 x q heads (flash attention: no T x T tensor)
    dense MLP    up out 2I, activation out 2I
    LatentMoE    router scores 4E, latent in 2L and out 2L, per routed copy (k of them) dispatched input 2L,
                 up out 2I, activation out 2I, down out 2L; shared expert up out 2Is, activation out 2Is
    head         (1 + MTP depths) logits of 2V (the fused cross entropy keeps no log-probabilities)

Selective recompute recomputes the element-wise pieces (norm outputs, activation functions, the gated norm's
output), whose FLOPs are neglected; full recompute keeps only each layer's input (2h, sequence-parallel) and
recomputes the forward, one layer's activations alive at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from hybridtron.config import ATTENTION, MAMBA, MLP, MOE, ModelConfig
from hybridtron.model.lm import HybridLM
from hybridtron.numerics.policy import precision_plan

GiB = 1024 ** 3

# Bytes per stored element. NVFP4: a 4-bit E2M1 code plus one E4M3 scale per 16 values; MXFP8: one UE8M0 scale
# per 32; FP8 checkpoints (ModelOpt) use per-tensor scales, so one byte.
BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "mxfp8": 1.0 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
QUANTIZED_COPIES = 2  # row-wise and column-wise operand copies of an NVFP4/MXFP8 weight (Transformer Engine keeps both)
RECOMPUTE_MODES = ("none", "selective", "full")

# The checkpoints a server loads. "nvfp4" is NVIDIA's Nemotron 3 Ultra NVFP4 checkpoint (Model Optimizer): routed
# experts NVFP4, shared experts FP8, attention, latent projections, embedding, lm_head and the MTP block BF16, the
# router fp32 (NVIDIA's table); the Mamba projections FP8 (our reading of "FP8 for other layers": with it the total
# is 352.3 GB, the size NVIDIA publishes). Dense MLP layers, which Ultra lacks, go FP8 like the shared expert.
# "fp8" stores FP8 wherever "nvfp4" quantizes; "bf16" quantizes nothing (1,121 GB for Ultra, as published).
_ULTRA_NVFP4_CHECKPOINT = {
    "moe.experts": "nvfp4",
    "moe.shared_experts.up_proj": "fp8", "moe.shared_experts.down_proj": "fp8",
    "mamba.in_proj": "fp8", "mamba.out_proj": "fp8",
    "mlp.up_proj": "fp8", "mlp.down_proj": "fp8",
}
SERVING_CHECKPOINTS = {
    "nvfp4": _ULTRA_NVFP4_CHECKPOINT,
    "fp8": {role: "fp8" for role in _ULTRA_NVFP4_CHECKPOINT},
    "bf16": {},
}


# ------------------------------------------------------------------------------------------------- hardware
@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The machines, and what fraction of their datasheet numbers a tuned step reaches.

    Bandwidths are per GPU and per direction, in GB/s (10^9 B/s); FLOP/s are dense (no sparsity) datasheet peaks.
    Defaults are a GB200 NVL72 rack: NVLink 5 (1.8 TB/s both ways), one 400 Gb/s InfiniBand NIC per GPU, HBM3e.
    """

    gpus: int
    gpus_per_node: int = 8
    nvlink_domain: int = 72  # GPUs that reach each other over NVLink (a rack for NVL72, a node for HGX)
    hbm_gib: float = 186.0
    hbm_gbps: float = 8000.0
    nvlink_gbps: float = 900.0
    ib_gbps: float = 50.0  # 400 Gb/s
    host_gbps: float = 450.0  # GPU <-> CPU memory (NVLink-C2C on Grace; ~55 for PCIe 5)
    bf16_tflops: float = 2500.0
    fp8_tflops: float = 5000.0  # MXFP8 and FP8
    nvfp4_tflops: float = 10000.0
    compute_efficiency: float = 0.5  # fraction of peak FLOP/s a step's GEMMs and attention reach
    link_efficiency: float = 0.8  # fraction of link bandwidth a large collective reaches
    hbm_efficiency: float = 0.8  # fraction of HBM bandwidth a decode step's weight reads reach
    collective_latency_us: float = 10.0  # fixed cost of one collective (matters for small decode messages)
    runtime_reserve_gib: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
    host_adam_gparams_per_s: float = 1.0  # CPU Adam throughput per GPU's share of the host (optimizer offload)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"cluster: {f.name} must be a positive number, got {value!r}")
        if self.gpus % self.gpus_per_node:
            raise ValueError(f"cluster: {self.gpus} GPUs are not a whole number of nodes of {self.gpus_per_node}")
        if self.nvlink_domain % self.gpus_per_node and self.gpus_per_node % self.nvlink_domain:
            raise ValueError(f"cluster: an NVLink domain of {self.nvlink_domain} GPUs neither holds whole nodes of "
                             f"{self.gpus_per_node} nor divides one")
        for name in ("compute_efficiency", "link_efficiency", "hbm_efficiency"):
            if getattr(self, name) > 1:
                raise ValueError(f"cluster: {name} is a fraction of peak, got {getattr(self, name)}")

    def peak_flops(self, fmt: str) -> float:
        """Dense FLOP/s of a GEMM in `fmt` (fp32 GEMMs, i.e. the router, run as TF32 at half the BF16 rate)."""
        tflops = {"nvfp4": self.nvfp4_tflops, "mxfp8": self.fp8_tflops, "fp8": self.fp8_tflops,
                  "bf16": self.bf16_tflops, "fp32": self.bf16_tflops / 2}[fmt]
        return tflops * 1e12

    def domain_size(self) -> int:
        return min(self.nvlink_domain, self.gpus)

    def describe(self) -> str:
        """The assumptions an estimate rests on, in one line."""
        return (f"assumed: NVLink {self.nvlink_gbps:g} GB/s, IB {self.ib_gbps:g} GB/s, HBM {self.hbm_gbps:g} GB/s "
                f"per GPU; peak {self.bf16_tflops:g}/{self.fp8_tflops:g}/{self.nvfp4_tflops:g} TFLOP/s "
                f"BF16/FP8/NVFP4 at {self.compute_efficiency:.0%}; links at {self.link_efficiency:.0%}, HBM at "
                f"{self.hbm_efficiency:.0%}")


# Datasheet numbers of the GPUs people train and serve on. Hopper has no FP4 tensor cores: NVFP4 GEMMs run as FP8.
GPUS = {
    "gb200": dict(hbm_gib=186.0, hbm_gbps=8000.0, nvlink_gbps=900.0, bf16_tflops=2500.0, fp8_tflops=5000.0,
                  nvfp4_tflops=10000.0, nvlink_domain=72, host_gbps=450.0),
    "b200": dict(hbm_gib=180.0, hbm_gbps=8000.0, nvlink_gbps=900.0, bf16_tflops=2250.0, fp8_tflops=4500.0,
                 nvfp4_tflops=9000.0, nvlink_domain=8, host_gbps=55.0),
    "h200": dict(hbm_gib=141.0, hbm_gbps=4800.0, nvlink_gbps=450.0, bf16_tflops=989.0, fp8_tflops=1979.0,
                 nvfp4_tflops=1979.0, nvlink_domain=8, host_gbps=55.0),
    "h100": dict(hbm_gib=80.0, hbm_gbps=3350.0, nvlink_gbps=450.0, bf16_tflops=989.0, fp8_tflops=1979.0,
                 nvfp4_tflops=1979.0, nvlink_domain=8, host_gbps=55.0),
}


def cluster_for(gpu: str, gpus: int, **overrides) -> Cluster:
    """A `Cluster` of `gpus` GPUs of one kind; `overrides` (None values ignored) replace the datasheet numbers."""
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}; expected one of {', '.join(GPUS)}")
    fields = dict(GPUS[gpu])
    fields.update({name: value for name, value in overrides.items() if value is not None})
    return Cluster(gpus=gpus, **fields)


# ---------------------------------------------------------------------------------- placement and collectives
@functools.lru_cache(maxsize=4096)
def group_placement(span: int, stride: int, world: int, domain: int) -> tuple[float, int]:
    """Groups of span // stride members, every `stride` ranks in blocks of `span` consecutive ranks: (the mean
    share of a member's peers, itself included, in its own NVLink domain; the most domains one group touches)."""
    members = span // stride
    if members <= 1:
        return 1.0, 1
    blocks = world // span
    period = domain // math.gcd(span, domain)  # block starts repeat modulo the domain size with this period
    shares, most = [], 1
    for block in range(min(blocks, period)):
        start = block * span
        counts = []
        for d in range(start // domain, (start + span - 1) // domain + 1):
            lo, hi = max(start, d * domain), min(start + span, (d + 1) * domain)
            counts.append(-(-(hi - start) // stride) - -(-(lo - start) // stride))
        counts = [c for c in counts if c]
        shares.append(sum(c * c for c in counts) / members ** 2)
        most = max(most, len(counts))
    return sum(shares) / len(shares), most


def ring_seconds(cluster: Cluster, data_bytes: float, members: int, crosses: bool, factor: float = 1.0) -> float:
    """A ring all-gather / reduce-scatter (factor 1) or all-reduce (factor 2) of `data_bytes`; a ring that leaves
    the NVLink domain runs at InfiniBand speed."""
    if members <= 1 or data_bytes == 0:
        return 0.0
    bandwidth = (cluster.ib_gbps if crosses else cluster.nvlink_gbps) * 1e9 * cluster.link_efficiency
    return factor * (members - 1) / members * data_bytes / bandwidth


# ---------------------------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class ParamGroup:
    """Parameters of one role in one unit. role: the policy's GEMM role ("mamba.in_proj", "moe.experts", ...) or
    "other" (norms, conv, A_log, D, dt_bias, the embedding table). fmt: the format its GEMM runs in while training
    (None: not a GEMM operand)."""

    role: str
    fmt: str | None
    count: int
    expert: bool


@dataclass(frozen=True)
class Unit:
    """A piece the pipeline places whole: the embedding (first stage), one backbone layer, the head (norm_f and
    lm_head) or the MTP block (both on the last stage). `mixers`: the layer kinds it runs per token, the MTP
    block's once per depth. `gemm_flops`: forward FLOPs per token of its GEMMs, by training format. `windows`: the
    sliding window of each mixer (None: full attention, or not attention)."""

    name: str
    mixers: tuple[str, ...]
    params: tuple[ParamGroup, ...]
    gemm_flops: tuple[tuple[str, float], ...]
    logits: int = 0  # lm_head applications per token (1 + MTP depths) for the head, else 0
    windows: tuple[int | None, ...] = ()

    def core_flops_per_token(self, config: ModelConfig, seq_len: int, kind: str | None = None) -> float:
        """Attention's and the scan's forward FLOPs per token of this unit's mixers (of `kind` only if given)."""
        windows = self.windows or (None,) * len(self.mixers)
        return sum(core_flops_per_token(config, mixer, seq_len, window)
                   for mixer, window in zip(self.mixers, windows) if kind is None or mixer == kind)

    @property
    def dense_params(self) -> int:
        return sum(p.count for p in self.params if not p.expert)

    @property
    def expert_params(self) -> int:
        return sum(p.count for p in self.params if p.expert)

    def compute_copy_bytes(self, expert: bool) -> float:
        """Bytes of the BF16 (router: fp32) copies a gathered unit computes with, plus quantized operand copies."""
        total = 0.0
        for p in self.params:
            if p.expert != expert:
                continue
            per = BYTES["fp32"] if p.fmt == "fp32" else BYTES["bf16"]
            if p.fmt in ("nvfp4", "mxfp8"):
                per += QUANTIZED_COPIES * BYTES[p.fmt]
            total += p.count * per
        return total


@functools.lru_cache(maxsize=16)
def model_units(config: ModelConfig, recipe: str = "nvfp4", policy: str = "ultra") -> tuple[Unit, ...]:
    """The model as pipeline units, parameters counted on the meta device and formats from the precision policy."""
    model = HybridLM.on_meta(config)
    plan = precision_plan(model, recipe, policy)
    by_module = {g.name: g for g in plan}
    groups: dict[str, dict[tuple[str, str | None, bool], int]] = {}
    for name, param in model.named_parameters():
        unit = _unit_of(name)
        module = name.rpartition(".")[0]
        gemm = by_module.get(module)
        key = (gemm.role, gemm.format, ".experts." in name) if gemm else ("other", None, False)
        bucket = groups.setdefault(unit, {})
        bucket[key] = bucket.get(key, 0) + param.numel()
    flops: dict[str, dict[str, float]] = {}
    for gemm in plan:
        unit = _unit_of(gemm.name + ".")
        per_format = flops.setdefault(unit, {})
        per_format[gemm.format] = per_format.get(gemm.format, 0.0) + gemm.flops_per_token

    depths = config.mtp_depths
    names = ["embedding"] + [f"layer {i}" for i in range(config.num_hidden_layers)] + ["head"]
    names += ["mtp"] if config.has_mtp else []
    units = []
    for name in names:
        if name in ("embedding", "head"):
            mixers = ()
        elif name == "mtp":
            mixers = tuple(config.mtp_layers_block_type) * depths
        else:
            mixers = (config.layers_block_type[int(name.split()[1])],)
        windows = (config.attention_window(int(name.split()[1])),) if name.startswith("layer") else ()
        params = tuple(ParamGroup(role, fmt, count, expert)
                       for (role, fmt, expert), count in sorted(groups.get(name, {}).items(), key=str))
        units.append(Unit(name, mixers, params, tuple(sorted(flops.get(name, {}).items())),
                          logits=1 + depths if name == "head" else 0, windows=windows))
    return tuple(units)


def _unit_of(parameter_name: str) -> str:
    parts = parameter_name.split(".")
    if parts[0] == "backbone" and parts[1] == "layers":
        return f"layer {parts[2]}"
    if parts[0] == "backbone" and parts[1] == "embeddings":
        return "embedding"
    return "mtp" if parts[0] == "mtp" else "head"  # head: norm_f and lm_head


def parameter_count(config: ModelConfig, include_mtp: bool = True) -> int:
    """Every parameter of the model (what `HybridLM.num_parameters(include_mtp=...)` counts)."""
    return sum(u.dense_params + u.expert_params for u in model_units(config) if include_mtp or u.name != "mtp")


# --------------------------------------------------------------------------------------------- activations
@functools.lru_cache(maxsize=4096)
def activation_bytes(config: ModelConfig, kind: str, tp: int, etp: int, recompute: str) -> float:
    """Bytes one layer keeps for its backward per token on a CP rank, on one tensor-parallel rank (see the module
    docstring for the tensors). Full recompute keeps only the layer input; its one-layer peak is `recompute="none"`."""
    h = config.hidden_size
    if recompute == "full":
        return 2 * h / tp
    selective = recompute == "selective"
    kept = 2 * h + (0 if selective else 2 * h)  # residual input; normed input
    routed = 0.0
    if kind == MAMBA:
        d, heads = config.mamba_inner_size, config.mamba_num_heads
        g = 2 * config.n_groups * config.ssm_state_size
        states = 4 * heads * config.mamba_head_dim * config.ssm_state_size / config.chunk_size
        kept += 2 * (2 * d + g + heads) + 2 * (d + g) + states + 8 * heads + 4 * d + 4 * d + (0 if selective else 2 * d)
    elif kind == ATTENTION:
        q = config.num_attention_heads * config.head_dim
        kv = max(config.num_key_value_heads, tp) * config.head_dim  # kv heads are replicated when TP exceeds them
        kept += 2 * q + 4 * kv + 2 * q + 4 * config.num_attention_heads
    elif kind == MLP:
        kept += 2 * config.intermediate_size + (0 if selective else 2 * config.intermediate_size)
    elif kind == MOE:
        width, inter, k = config.expert_width, config.moe_intermediate_size, config.num_experts_per_tok
        shared = config.moe_shared_expert_intermediate_size
        kept += 4 * config.n_routed_experts + 2 * shared + (0 if selective else 2 * shared)
        if config.moe_latent_size:
            kept += 2 * width + 2 * width
        per_copy_width = 2 * width + 2 * width  # dispatched input, down out
        per_copy_inter = 2 * inter + (0 if selective else 2 * inter)  # up out, activation out
        # ETP 1: each TP rank routes its own sequence-parallel slice; ETP = TP: the TP group gathers its tokens and
        # each rank computes a 1/etp slice of every expert.
        routed = k * (per_copy_width + per_copy_inter) / tp if etp == 1 else k * (per_copy_width + per_copy_inter / etp)
    else:
        raise AssertionError(f"unknown layer kind {kind!r}")
    return kept / tp + routed


def core_flops_per_token(config: ModelConfig, kind: str, seq_len: int, window: int | None = None) -> float:
    """Forward FLOPs per token outside the GEMMs of the policy: causal attention over the sequence (QK^T and PV,
    half the keys on average; a layer with a sliding `window`, `config.attention_window(layer)`, the keys its
    window reaches) and the chunked SSD scan (intra-chunk Q(N+P), state in and out 4NP, per head)."""
    if kind == ATTENTION:
        return 4.0 * mean_keys_per_query(seq_len, window) * config.num_attention_heads * config.head_dim
    if kind == MAMBA:
        n, p, q = config.ssm_state_size, config.mamba_head_dim, config.chunk_size
        return config.mamba_num_heads * (q * (n + p) + 4.0 * n * p)
    return 0.0


def mean_keys_per_query(seq_len: int, window: int | None = None) -> float:
    """Keys a query attends to, averaged over the positions of a sequence: seq_len / 2 when causal (the estimate's
    convention for full attention), and for a window W < seq_len the exact mean of min(t + 1, W)."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return window - window * (window - 1) / (2 * seq_len)


# ------------------------------------------------------------------------------------------ serving weights
def checkpoint_bytes(config: ModelConfig, checkpoint: str, include_mtp: bool = True) -> tuple[float, float]:
    """(bytes of the non-expert weights, bytes of the routed experts) of a serving checkpoint."""
    if checkpoint not in SERVING_CHECKPOINTS:
        raise ValueError(f"unknown checkpoint format {checkpoint!r}; expected one of {', '.join(SERVING_CHECKPOINTS)}")
    table = SERVING_CHECKPOINTS[checkpoint]
    dense = experts = 0.0
    for unit in model_units(config):
        if unit.name == "mtp" and not include_mtp:
            continue
        for p in unit.params:
            if p.role == "moe.gate":
                fmt = "fp32"
            elif unit.name == "mtp" or p.role in ("other", "lm_head"):
                fmt = "bf16"  # the MTP block, embedding, lm_head, norms and conv stay BF16 in every checkpoint
            else:
                fmt = table.get(p.role, "bf16")
            if p.expert:
                experts += p.count * BYTES[fmt]
            else:
                dense += p.count * BYTES[fmt]
    return dense, experts
