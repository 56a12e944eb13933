"""NVIDIA Model Optimizer's unified HF checkpoint, the format TensorRT-LLM, vLLM and SGLang load quantized models in.

A quantized checkpoint is the HF checkpoint (same tensor names, config.json, tokenizer) in which every quantized
linear `X` stores, instead of a floating `X.weight` (layout in :mod:`hybridtron.numerics.ptq`)::

    NVFP4   X.weight uint8 [out, in/2], X.weight_scale float8_e4m3fn [out, in/16], X.weight_scale_2 fp32 [],
            X.input_scale fp32 []
    FP8     X.weight float8_e4m3fn [out, in], X.weight_scale fp32 [], X.input_scale fp32 []

Each routed expert is its own linear (`...mixer.experts.{e}.up_proj`), with its own scales. Unquantized tensors are
BF16, the router's fp32. Two files describe it: `hf_quant_config.json`::

    {"producer": {"name": "hybridtron", "version": ...},
     "quantization": {"quant_algo": "NVFP4" | "FP8", "kv_cache_quant_algo": null, "group_size": 16 (NVFP4),
                      "exclude_modules": [every linear left unquantized, by module name]}}

and the same in config.json's `quantization_config`, in the compressed-tensors-like form ModelOpt writes there:
`config_groups.group_0` (weights and input activations: float, 4 bits in groups of 16, or 8 bits; `targets`
["Linear"]), `ignore` (the exclude list), `quant_algo`, `producer` and `quant_method` "modelopt", by which vLLM
and SGLang recognise the checkpoint. The exclude list names modules exactly (routed experts as `...experts*`, a
pattern the readers match with fnmatch-style wildcards), so a reader never has to infer a policy.
"""

from __future__ import annotations

import torch
from torch import Tensor

import hybridtron
from hybridtron.checkpoint.hf import FP32_TENSORS, PER_EXPERT, to_disk_state
from hybridtron.numerics import ptq
from hybridtron.numerics.export_policy import NVFP4_GROUP, ExportWeight

FORMATS = {"nvfp4": "NVFP4", "fp8": "FP8"}
PRODUCER = "hybridtron"


def excluded_modules(plan: list[ExportWeight]) -> list[str]:
    """Module names of the linears the plan leaves unquantized, in model order (routed experts as `X.experts*`)."""
    names: dict[str, None] = {}
    for weight in plan:
        if not weight.quantized:
            names[f"{weight.module}*" if weight.role == "moe.experts" else weight.module] = None
    return list(names)


def hf_quant_config(fmt: str, excluded: list[str]) -> dict:
    """The contents of hf_quant_config.json."""
    quantization = {"quant_algo": FORMATS[fmt], "kv_cache_quant_algo": None}
    if fmt == "nvfp4":
        quantization["group_size"] = NVFP4_GROUP
    quantization["exclude_modules"] = list(excluded)
    return {"producer": {"name": PRODUCER, "version": hybridtron.__version__}, "quantization": quantization}


def quantization_config(quant_config: dict) -> dict:
    """config.json's `quantization_config` for an hf_quant_config.json's contents."""
    quantization = quant_config["quantization"]
    algo = quantization["quant_algo"]
    if algo == "NVFP4":
        tensor = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": quantization["group_size"]}
    else:
        tensor = {"dynamic": False, "num_bits": 8, "type": "float"}
    group = {"input_activations": dict(tensor), "weights": dict(tensor), "targets": ["Linear"]}
    return {"config_groups": {"group_0": group}, "ignore": list(quantization["exclude_modules"]),
            "quant_algo": algo, "producer": dict(quant_config["producer"]), "quant_method": "modelopt"}


def plan_name(disk_name: str) -> str:
    """The model's parameter name of a disk tensor: per-expert `X.experts.{e}.up_proj.weight` -> `X.experts.up_proj`."""
    match = PER_EXPERT.match(disk_name)
    return f"{match.group(1)}.{match.group(3)}" if match else disk_name


def quantized_state(model: torch.nn.Module, plan: list[ExportWeight], fmt: str, scales: str,
                    input_amax: dict[str, float]) -> tuple[dict[str, Tensor], dict[str, float]]:
    """The checkpoint's tensors (disk names) with the plan's quantized weights in `fmt`, and the weights' relative
    squared error {"weight_error": ..., with MSE scales also "max_weight_error": max scales' on the same weights}.

    `input_amax`: each quantized linear's calibrated input amax, by module name on disk
    (`backbone.layers.0.mixer.in_proj`, `backbone.layers.1.mixer.experts.3.up_proj`)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {fmt!r}")
    quantized = {w.name for w in plan if w.quantized}
    state: dict[str, Tensor] = {}
    squared = {"error": 0.0, "max_error": 0.0, "norm": 0.0}
    for name, tensor in to_disk_state(model).items():
        tensor = tensor.detach()
        if plan_name(name) in quantized:
            module = name.removesuffix(".weight")
            if module not in input_amax:
                raise ValueError(f"{module}: no calibrated input amax (its input never reached it)")
            q = ptq.quantize_nvfp4(tensor, scales) if fmt == "nvfp4" else ptq.quantize_fp8(tensor)
            state[name] = q.weight
            state[f"{module}.weight_scale"] = q.weight_scale
            if q.weight_scale_2 is not None:
                state[f"{module}.weight_scale_2"] = q.weight_scale_2
            state[f"{module}.input_scale"] = ptq.input_scale(input_amax[module], fmt)
            _add_errors(squared, tensor.float(), q, fmt, scales)
        elif tensor.is_floating_point():
            state[name] = tensor.to(torch.float32 if FP32_TENSORS.search(name) else torch.bfloat16).contiguous()
        else:
            state[name] = tensor.contiguous()
    norm = squared["norm"] or 1.0
    errors = {"weight_error": squared["error"] / norm}
    if fmt == "nvfp4" and scales == "mse":
        errors["max_weight_error"] = squared["max_error"] / norm
    return state, errors


def _add_errors(squared: dict[str, float], w: Tensor, q: ptq.QuantizedMatrix, fmt: str, scales: str) -> None:
    squared["norm"] += float(w.square().sum())
    if fmt == "fp8":
        squared["error"] += float((ptq.fp8_values(q.weight, q.weight_scale) - w).square().sum())
        return
    squared["error"] += float(ptq.block_errors(w, q).sum())
    if scales == "mse":
        squared["max_error"] += float(ptq.block_errors(w, ptq.quantize_nvfp4(w, "max")).sum())
