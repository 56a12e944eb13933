"""The layout of a vLLM engine (rollouts, serving): its tensor, data and expert parallelism, checked against the model.

How vLLM splits a `nemotron_h` model (vllm 0.32: config/parallel.py, model_executor/layers/fused_moe/config.py's
`FusedMoEParallelConfig.make`, model_executor/layers/mamba/mamba_mixer2.py, model_executor/models/nemotron_h.py):
an engine spans tp x dp GPUs. Attention, Mamba, MLP, the embedding and lm_head split over the tp GPUs of a data
parallel rank; the dp ranks each hold that split whole and serve their own requests (DP attention). The routed
experts are laid over all tp x dp GPUs at once: with expert parallelism (`--enable-expert-parallel`) each GPU holds
n_experts / (tp x dp) whole experts, so EP is tp x dp and not a size of its own; without it every expert is split
tensor-parallel over the tp x dp GPUs.

What the model requires of tp (vLLM's asserts, each a one-line refusal here): it divides the attention heads; it
divides the KV heads or they divide it (then each KV head is replicated tp / kv_heads times); it divides the Mamba
heads; it divides the Mamba groups (n_groups), or n_groups is 1 (replicated): the constraint miles names, TP <= 8 for
Nemotron 3's 8 groups; it divides the dense MLP's width. The experts: with EP they divide evenly over tp x dp (vLLM
would place an uneven remainder; the planner keeps every GPU's share equal), without it tp x dp divides their width.

`plan_engine` lays out an engine of N GPUs as miles lays out its SGLang engines for a large MoE model
(`--rollout-num-gpus-per-engine 32 --sglang-enable-dp-attention --sglang-dp-size 4 --sglang-enable-ep-moe`: attention
TP 8, DP 4, EP 32): attention and Mamba tensor-parallel as far as the model and one node allow, data parallel over
the rest, the experts expert-parallel over all N. `hybridtron plan --rollout` prints it as `vllm serve` flags and as
the `[grpo]` / `[mopd]` settings (`vllm_tensor_parallel`, `vllm_data_parallel`, `vllm_expert_parallel`,
`vllm_gpu_memory_utilization`), which the RL commands check with `check_engine_layout` against their model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hybridtron.config import MLP, MOE, ModelConfig
from hybridtron.distributed.costs import GiB, Cluster, checkpoint_bytes

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of each GPU's memory an engine may take


@dataclass(frozen=True)
class EngineLayout:
    tensor_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: bool = False
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION

    @property
    def gpus(self) -> int:
        return self.tensor_parallel * self.data_parallel

    @property
    def expert_ranks(self) -> int:
        """GPUs the routed experts are spread over (EP: each holds whole experts; else each holds a slice of all)."""
        return self.gpus

    def serve_flags(self) -> str:
        flags = [f"--tensor-parallel-size {self.tensor_parallel}"]
        if self.data_parallel > 1:
            flags.append(f"--data-parallel-size {self.data_parallel}")
        if self.expert_parallel:
            flags.append("--enable-expert-parallel")
        flags.append(f"--gpu-memory-utilization {self.gpu_memory_utilization:g}")
        return " ".join(flags)

    def engine_args(self) -> dict:
        """The `vllm.LLM` arguments of this layout that differ from vLLM's defaults."""
        args = {"tensor_parallel_size": (self.tensor_parallel, 1), "data_parallel_size": (self.data_parallel, 1),
                "enable_expert_parallel": (self.expert_parallel, False),
                "gpu_memory_utilization": (self.gpu_memory_utilization, DEFAULT_GPU_MEMORY_UTILIZATION)}
        return {key: value for key, (value, default) in args.items() if value != default}

    def settings(self) -> dict:
        """The RL section's fields that set this layout."""
        return {"vllm_tensor_parallel": self.tensor_parallel, "vllm_data_parallel": self.data_parallel,
                "vllm_expert_parallel": self.expert_parallel,
                "vllm_gpu_memory_utilization": self.gpu_memory_utilization}


def layout_blocker(config: ModelConfig, layout: EngineLayout) -> tuple[str, str] | None:
    """(the setting, why this model cannot run with it) for the first rule of the module docstring it breaks, or
    None. The setting is named by its RL field."""
    tp, ranks = layout.tensor_parallel, layout.expert_ranks
    kinds = set(config.layers_block_type) | set(config.mtp_layers_block_type if config.has_mtp else ())
    for name, value in (("vllm_tensor_parallel", tp), ("vllm_data_parallel", layout.data_parallel)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return name, f"must be a positive integer, got {value!r}"
    share = layout.gpu_memory_utilization
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        return "vllm_gpu_memory_utilization", f"must be in (0, 1] (a share of each GPU's memory), got {share!r}"
    kv = config.num_key_value_heads
    rules = [
        (config.num_attention_heads % tp == 0, f"the {config.num_attention_heads} attention heads"),
        (kv % tp == 0 or tp % kv == 0, f"the {kv} KV heads (or be a multiple of them)"),
        (config.mamba_num_heads % tp == 0, f"the {config.mamba_num_heads} Mamba heads"),
        (config.n_groups % tp == 0 or config.n_groups == 1, f"the {config.n_groups} Mamba groups (n_groups)"),
    ]
    if MLP in kinds:
        rules.append((config.intermediate_size % tp == 0, f"the dense MLP's width {config.intermediate_size}"))
    for holds, what in rules:
        if not holds:
            return "vllm_tensor_parallel", f"{tp} must divide {what}"
    if MOE not in kinds:
        if layout.expert_parallel:
            return "vllm_expert_parallel", "the model has no MoE layer, so there are no experts to spread"
        return None
    if layout.expert_parallel and config.n_routed_experts % ranks:
        return ("vllm_expert_parallel", f"the {config.n_routed_experts} routed experts do not spread evenly over "
                                        f"tp x dp = {ranks} GPUs")
    if not layout.expert_parallel and config.moe_intermediate_size % ranks:
        return ("vllm_expert_parallel", f"false splits each expert's width {config.moe_intermediate_size} over tp x "
                                        f"dp = {ranks} GPUs, which does not divide it; set it to true")
    return None


def check_engine_layout(config: ModelConfig, layout: EngineLayout, section: str) -> None:
    """ValueError in one line naming `section`'s field when vLLM cannot lay the model out so."""
    blocked = layout_blocker(config, layout)
    if blocked is not None:
        field, why = blocked
        value = getattr(layout, {"vllm_tensor_parallel": "tensor_parallel", "vllm_data_parallel": "data_parallel",
                                 "vllm_expert_parallel": "expert_parallel",
                                 "vllm_gpu_memory_utilization": "gpu_memory_utilization"}[field])
        shown = json.dumps(value) if isinstance(value, bool) else value
        raise ValueError(f"{section}.{field}={shown}: {why}")


@dataclass(frozen=True)
class EnginePlan:
    layout: EngineLayout
    gpu: str
    checkpoint: str  # the weights' format: bf16, fp8, nvfp4 (dist.costs.SERVING_CHECKPOINTS)
    dense_gib: float  # per GPU: everything but the routed experts, split over tp
    expert_gib: float  # per GPU: the routed experts, split over tp x dp
    budget_gib: float  # gpu_memory_utilization x the GPU's memory
    speculative_tokens: int  # MTP draft length for `--speculative-config` (0: the model has no MTP block)

    @property
    def free_gib(self) -> float:
        """What the engine has left per GPU for the KV cache, the Mamba states and activations."""
        return self.budget_gib - self.dense_gib - self.expert_gib


def plan_engine(config: ModelConfig, cluster: Cluster, gpu: str, checkpoint: str = "bf16",
                gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION, draft_length: int = 3) -> EnginePlan:
    """The layout of one engine on `cluster.gpus` GPUs (module docstring); ValueError when no tensor-parallel size
    the model allows divides them or the weights do not fit."""
    gpus = cluster.gpus
    node = min(cluster.gpus_per_node, gpus)
    has_moe = MOE in config.layers_block_type
    layouts = [EngineLayout(tp, gpus // tp, has_moe and gpus > 1, gpu_memory_utilization)
               for tp in range(node, 0, -1) if node % tp == 0 and gpus % tp == 0]
    valid = [layout for layout in layouts if layout_blocker(config, layout) is None]
    if not valid:
        _, why = layout_blocker(config, layouts[-1])
        raise ValueError(f"--gpus {gpus}: no vLLM engine layout fits this model ({why})")
    layout = valid[0]
    dense, experts = checkpoint_bytes(config, checkpoint)
    result = EnginePlan(layout, gpu, checkpoint, dense / layout.tensor_parallel / GiB,
                        experts / layout.expert_ranks / GiB, gpu_memory_utilization * cluster.hbm_gib,
                        draft_length if config.has_mtp else 0)
    if result.free_gib <= 0:
        raise ValueError(f"--gpus {gpus}: the {checkpoint} weights take {result.dense_gib + result.expert_gib:.1f} "
                         f"GiB per GPU, more than {gpu_memory_utilization:g} of a {gpu}'s {cluster.hbm_gib:g} GiB; "
                         f"give the engine more GPUs or a smaller format (--checkpoint)")
    return result


def format_engine(result: EnginePlan, config: ModelConfig, name: str) -> str:
    layout = result.layout
    tp, dp = layout.tensor_parallel, layout.data_parallel
    kv = config.num_key_value_heads
    kv_note = f", each KV head replicated {tp // kv}x" if tp > kv else ""
    rows = [("tensor parallel (attention, Mamba, MLP)",
             f"{tp}   ({config.num_attention_heads} attention heads, {kv} KV heads{kv_note}; "
             f"{config.mamba_num_heads} Mamba heads in {config.n_groups} groups)"),
            ("data parallel (DP attention)", f"{dp}")]
    if MOE in config.layers_block_type:
        rows.append(("expert parallel", f"{layout.expert_ranks}   ({config.n_routed_experts // layout.expert_ranks} "
                                        f"of {config.n_routed_experts} routed experts per GPU)")
                    if layout.expert_parallel else ("experts", f"tensor-parallel over {layout.expert_ranks} GPUs"))
    rows += [("weights per GPU", f"{result.dense_gib + result.expert_gib:.2f} GiB (non-expert {result.dense_gib:.2f}, "
                                 f"experts {result.expert_gib:.2f}) of {result.budget_gib:.1f} GiB "
                                 f"({layout.gpu_memory_utilization:g} of the GPU)"),
             ("left for KV cache, Mamba state, activations", f"{result.free_gib:.2f} GiB per GPU")]
    lines = [f"{name} on one vLLM engine of {layout.gpus} {result.gpu} GPUs ({result.checkpoint} weights):"]
    lines += [f"  {label:<44}{value}" for label, value in rows]
    lines += ["", "serve it:", f"  vllm serve DIR {layout.serve_flags()}"]
    if result.speculative_tokens:
        spec = json.dumps({"method": "mtp", "num_speculative_tokens": result.speculative_tokens})
        lines.append(f"      --speculative-config '{spec}'")
    lines += ["", "or roll out GRPO / MOPD on it ([grpo] or [mopd]):", '  engine = "vllm"']
    lines += [f"  {key} = {json.dumps(value)}" for key, value in layout.settings().items()]
    return "\n".join(lines)
