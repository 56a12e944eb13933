"""Export policy: which weight matrices a deployed checkpoint stores in NVFP4 or FP8, and what they weigh.

Post-training quantization (`hybridtron quantize`, ModelOpt's unified checkpoint) has one low-precision format per
checkpoint, so a module either takes it or stays BF16. Policies:

    ultra    the trainer's ``ultra`` precision policy (:mod:`hybridtron.numerics.policy`), read as an export: a
             weight is quantized where that policy trains it in NVFP4 (Mamba in_proj, routed and shared experts,
             dense MLPs outside the BF16 tail); all it keeps in higher precision stays BF16: the last 15% of the
             layers, Mamba out_proj (MXFP8 in training: the export format has no MXFP8 layer), attention
             q/k/v/o, the LatentMoE latent projections and the MTP block
    experts  only the routed experts (the bulk of a MoE model's bytes, and the layers a token reads sparsely)
    all      every linear and routed expert

Under every policy the embedding, the norms, the Mamba conv and SSM parameters, lm_head and the MoE router stay
unquantized; the router (its weight and score-correction bias) in fp32, as `save_pretrained` writes it.

Bytes per weight matrix of ``n`` elements (what the checkpoint writer stores, `hybridtron.deploy.modelopt_format`):
NVFP4 ``n/2`` (two E2M1 codes a byte) + ``n/16`` (an E4M3 scale per 16) + 8 (the fp32 ``weight_scale_2`` and
``input_scale``); FP8 ``n`` + 8 (``weight_scale``, ``input_scale``); BF16 ``2n``. The model is built on the meta
device, so a 550B preset costs its config arithmetic only.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hybridtron.numerics.policy import precision_plan

EXPORT_POLICIES = ("ultra", "experts", "all")
WEIGHT_FORMATS = ("nvfp4", "fp8", "bf16")
NVFP4_GROUP = 16
SCALAR_BYTES = 4  # an fp32 per-tensor scale
NEVER_QUANTIZED_ROLES = ("moe.gate", "lm_head")


@dataclass(frozen=True)
class ExportWeight:
    """One weight of a GEMM and whether the policy quantizes it.

    name: the parameter's name in the model ("backbone.layers.0.mixer.in_proj.weight"; routed experts: the
    stacked "backbone.layers.1.mixer.experts.up_proj", [experts, out, in], one matrix per expert on disk).
    module: the GEMM's module path in the precision plan. role: its role there ("mamba.in_proj", "moe.experts").
    """

    name: str
    module: str
    role: str
    quantized: bool
    shape: tuple[int, ...]

    @property
    def matrices(self) -> int:
        return self.shape[0] if len(self.shape) == 3 else 1


def _check_policy(policy: str) -> None:
    if policy not in EXPORT_POLICIES:
        raise ValueError(f"export policy must be one of {', '.join(EXPORT_POLICIES)}; got {policy!r}")


def export_plan(model: nn.Module, policy: str = "ultra") -> list[ExportWeight]:
    """Every GEMM weight of ``model`` (a HybridLM, possibly on the meta device) with its export decision."""
    _check_policy(policy)
    params = dict(model.named_parameters())
    weights = []
    for gemm in precision_plan(model, "nvfp4", "ultra"):
        if gemm.role in NEVER_QUANTIZED_ROLES:
            quantized = False
        elif policy == "ultra":
            quantized = gemm.format == "nvfp4"
        else:
            quantized = policy == "all" or gemm.role == "moe.experts"
        names = ([f"{gemm.name}.up_proj", f"{gemm.name}.down_proj"] if gemm.role == "moe.experts"
                 else [f"{gemm.name}.weight"])
        weights += [ExportWeight(name, gemm.name, gemm.role, quantized, tuple(params[name].shape)) for name in names]
    return weights


def router_tensor(name: str, plan: list[ExportWeight]) -> bool:
    """Whether a state-dict name belongs to a MoE router (kept in fp32)."""
    return any(w.role == "moe.gate" and name.startswith(w.module + ".") for w in plan)


@dataclass(frozen=True)
class WeightBytes:
    """A checkpoint's tensor bytes in one weight format under one policy (safetensors headers aside)."""

    weights: str
    policy: str
    total: int
    quantized_parameters: int  # elements stored in the low-precision format
    parameters: int  # every element of the state dict


def matrix_bytes(elements: int, matrices: int, weights: str) -> int:
    """Stored bytes of ``matrices`` weight matrices holding ``elements`` in all, in ``weights``' format."""
    if weights == "nvfp4":
        return elements // 2 + elements // NVFP4_GROUP + 2 * SCALAR_BYTES * matrices
    if weights == "fp8":
        return elements + 2 * SCALAR_BYTES * matrices
    return 2 * elements


def weight_bytes(model: nn.Module, weights: str = "nvfp4", policy: str = "ultra") -> WeightBytes:
    """Bytes of ``model``'s state dict exported in ``weights`` (nvfp4, fp8 or bf16) under ``policy``."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}; got {weights!r}")
    plan = export_plan(model, policy)
    quantized = {w.name: w for w in plan if w.quantized} if weights != "bf16" else {}
    total = low = parameters = 0
    for name, tensor in model.state_dict().items():
        n = tensor.numel()
        parameters += n
        if name in quantized:
            total += matrix_bytes(n, quantized[name].matrices, weights)
            low += n
        elif not tensor.is_floating_point():
            total += n * tensor.element_size()
        else:
            total += n * (SCALAR_BYTES if router_tensor(name, plan) else 2)
    return WeightBytes(weights=weights, policy=policy, total=total, quantized_parameters=low, parameters=parameters)
