"""Checkpoints in the Hugging Face layout, the canonical one: config.json + safetensors named as NVIDIA's are.

On disk each routed expert is its own pair of tensors (`...mixer.experts.{e}.up_proj.weight`); in memory we stack
them ([E, out, in]) for grouped GEMMs. The MTP block is stored under `mtp.layers.*` (transformers drops those keys;
Megatron-Bridge and vLLM read them). Above `max_shard_bytes` the tensors are split into numbered shards with a
`model.safetensors.index.json`. Router weight and bias are written and kept in fp32 whatever the model dtype.

Loading also accepts what transformers itself may write: `model.` instead of `backbone.` and stacked experts.
Every problem is reported at once: missing, unexpected and mis-shaped tensors, by name. A post-training quantized
checkpoint in NVIDIA Model Optimizer's unified format (`hybridtron quantize`: `hf_quant_config.json`, NVFP4 or FP8
weights with their scales) loads dequantized, into an ordinary model in `dtype` (by default its unquantized
tensors' dtype).

An export is for `nemotron_h` readers, so `save_pretrained` refuses a model they would misread
(`ModelConfig.nemotron_h_blocker`): the Marin options (`moe_latent_norm`, `moe_output_norm`: weights transformers has
no place for; `sliding_window`: transformers' NemotronH keeps the field but attends in full on every layer), unless
asked for hybridtron's own format (`nemotron_h=False`: model_type "hybridtron_h", which transformers refuses to
load and `load_pretrained` reads; a training run's final export uses it). Training checkpoints (DCP) hold any
model.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hybridtron.config import HYBRIDTRON_H, ModelConfig
from hybridtron.model.lm import HybridLM
from hybridtron.numerics import ptq

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024 ** 3
STACKED_EXPERT = re.compile(r"^(.*\.experts)\.(up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")
FP32_TENSORS = re.compile(r"\.gate\.(weight|e_score_correction_bias)$")
HF_QUANT_CONFIG = "hf_quant_config.json"  # NVIDIA Model Optimizer's unified checkpoint (hybridtron.deploy.quantize)
QUANT_ALGOS = ("NVFP4", "FP8")
# the KV cache's FP8 scales too (kv_cache_quant_algo): hybridtron's cache keeps the dtype it is given
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message lists every offending tensor."""


def to_disk_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our state dict with the stacked experts split per expert, as NVIDIA checkpoints store them."""
    out = {}
    for name, tensor in model.state_dict().items():
        match = STACKED_EXPERT.match(name)
        if match:
            prefix, proj = match.groups()
            for e, expert_weight in enumerate(tensor.unbind(0)):
                out[f"{prefix}.{e}.{proj}.weight"] = expert_weight
        else:
            out[name] = tensor
    return out


def check_exportable(config: ModelConfig) -> None:
    """One line naming the first field a `nemotron_h` reader (transformers' NemotronHConfig) cannot express."""
    blocker = config.nemotron_h_blocker()
    if blocker is not None:
        raise ValueError(f"HF export: {blocker}; keep a training checkpoint, or the run's own export "
                         f"(model_type {HYBRIDTRON_H!r}, which only hybridtron loads)")


def save_pretrained(model, directory: str | Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    dtype: torch.dtype | None = None, nemotron_h: bool = True) -> None:
    """Write config.json and the safetensors (sharded above `max_shard_bytes`) into `directory`, atomically:
    the files are written into a temporary sibling directory which then replaces the target. The directory and its
    files get the permissions the umask gives new ones (0o755 / 0o644 under umask 022), so another user or a
    serving container can read the export. `nemotron_h=False` writes a model nemotron_h cannot express in
    hybridtron's own format (module docstring) instead of refusing it."""
    if nemotron_h:
        check_exportable(model.config)
    state = {}
    for name, tensor in to_disk_state(model).items():
        if dtype is not None and tensor.is_floating_point() and not FP32_TENSORS.search(name):
            tensor = tensor.to(dtype)
        state[name] = tensor.detach().contiguous().cpu()

    config_dict = model.config.to_hf(export=True)
    config_dict["torch_dtype"] = str(dtype or next(model.parameters()).dtype).removeprefix("torch.")
    write_checkpoint(directory, config_dict, state, max_shard_bytes=max_shard_bytes)


def write_checkpoint(directory: str | Path, config_dict: dict, state: dict[str, torch.Tensor], *,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, extra_files: dict[str, bytes] | None = None
                     ) -> None:
    """Write config.json, the tensors of `state` (disk names, sharded above `max_shard_bytes`) and `extra_files`
    ({file name: contents}: a tokenizer, a quantization config) into `directory`, atomically (`save_pretrained`)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    shards, current, current_bytes = [], {}, 0
    for name, tensor in state.items():
        if current and current_bytes + tensor.nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = {}, 0
        current[name] = tensor
        current_bytes += tensor.nbytes
    shards.append(current)

    # not tempfile.mkdtemp: its directory is private (0o700) whatever the umask, and the rename would publish that
    staging = directory.with_name(f".{directory.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    staging.mkdir()
    (staging / "config.json").write_text(json.dumps(config_dict, indent=2))
    for filename, contents in (extra_files or {}).items():
        (staging / filename).write_bytes(contents)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], staging / SINGLE_FILE, metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, staging / filename, metadata=metadata)
            weight_map.update({name: filename for name in shard})
        index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())}, "weight_map": weight_map}
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=2))
    # safetensors writes its files 0o600: give every file the mode a new file gets, 0o666 less the umask, read off
    # the directory just made (0o777 less the umask)
    file_mode = stat.S_IMODE(staging.stat().st_mode) & 0o666
    for path in staging.iterdir():
        os.chmod(path, file_mode)
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old")
        if old.exists():
            _remove_tree(old)
        os.replace(directory, old)
        os.replace(staging, directory)
        _remove_tree(old)
    else:
        os.replace(staging, directory)


def _remove_tree(path: Path) -> None:
    for child in path.iterdir():
        _remove_tree(child) if child.is_dir() else child.unlink()
    path.rmdir()


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    index_path, single = directory / INDEX_FILE, directory / SINGLE_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a safetensors index (expected JSON with a 'weight_map' "
                                  f"object; {type(exc).__name__}: {exc})") from None
        files = sorted(set(weight_map.values()))
    elif single.is_file():
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    absent = [filename for filename in files if not (directory / filename).is_file()]
    if absent:
        raise FileNotFoundError(f"{directory}: shards listed in {INDEX_FILE} are missing: {', '.join(absent)}")
    tensors = {}
    for filename in files:
        path = directory / filename
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name)
    return tensors


def from_disk_state(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Rename `model.` to `backbone.` and stack per-expert tensors into [E, out, in]."""
    out, experts = {}, {}
    for name, tensor in tensors.items():
        if name.startswith("model."):
            name = "backbone." + name[len("model."):]
        match = PER_EXPERT.match(name)
        if match:
            prefix, e, proj = match.groups()
            experts.setdefault(f"{prefix}.{proj}", {})[int(e)] = tensor
        else:
            out[name] = tensor
    for name, per_expert in experts.items():
        missing = [e for e in range(num_experts) if e not in per_expert]
        extra = [e for e in per_expert if e >= num_experts]
        if missing or extra:
            raise CheckpointError(f"{name}: expert tensors missing for experts {missing}, unexpected for {extra} "
                                  f"(config has n_routed_experts={num_experts})")
        out[name] = torch.stack([per_expert[e] for e in range(num_experts)])
    return out


def quantization_algo(directory: Path) -> str | None:
    """The quant_algo of a ModelOpt checkpoint (its hf_quant_config.json, else config.json's quantization_config);
    None for an unquantized one. CheckpointError for a quantization hybridtron does not read."""
    path = directory / HF_QUANT_CONFIG
    if path.is_file():
        try:
            algo = json.loads(path.read_text())["quantization"]["quant_algo"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: expected JSON with quantization.quant_algo ({type(exc).__name__}: "
                                  f"{exc})") from None
    else:
        config_path = directory / "config.json"
        quant = json.loads(config_path.read_text()).get("quantization_config") if config_path.is_file() else None
        if not quant:
            return None
        if not isinstance(quant, dict) or quant.get("quant_method") != "modelopt":
            method = quant.get("quant_method") if isinstance(quant, dict) else quant
            raise CheckpointError(f"{config_path}: quantization_config.quant_method is {method!r}; hybridtron reads "
                                  f"NVIDIA Model Optimizer checkpoints (quant_method 'modelopt')")
        algo, path = quant.get("quant_algo"), config_path
    if algo not in QUANT_ALGOS:
        raise CheckpointError(f"{path}: quant_algo {algo!r}; hybridtron reads {' and '.join(QUANT_ALGOS)}")
    return algo


def dequantize_tensors(tensors: dict[str, torch.Tensor], algo: str, where: Path) -> dict[str, torch.Tensor]:
    """A ModelOpt checkpoint's tensors with each quantized `X.weight` replaced by its fp32 values and the scales
    dropped (`hybridtron.numerics.ptq` describes the layout)."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_SUFFIXES):
            continue
        scale = tensors.get(name + "_scale")
        if name.endswith(".weight") and scale is not None:
            if algo == "NVFP4":
                global_scale = tensors.get(name + "_scale_2")
                if tensor.dtype != torch.uint8 or global_scale is None:
                    raise CheckpointError(f"{where}: {name} is {tensor.dtype} with weight_scale"
                                          f"{'' if global_scale is not None else ' and no weight_scale_2'}; an "
                                          f"NVFP4 weight is uint8 with weight_scale and weight_scale_2")
                tensor = ptq.nvfp4_values(tensor, scale, global_scale)
            else:
                if tensor.dtype != torch.float8_e4m3fn:
                    raise CheckpointError(f"{where}: {name} is {tensor.dtype}; an FP8 weight is float8_e4m3fn")
                tensor = ptq.fp8_values(tensor, scale)
        out[name] = tensor
    return out


def load_pretrained(directory: str | Path, *, dtype: torch.dtype | None = None, device="cpu",
                    config: ModelConfig | None = None, **config_overrides):

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a checkpoint directory")
    config = config or ModelConfig.from_hf(directory)
    if config_overrides:
        config = config.replace(**config_overrides)
    tensors = read_tensors(directory)
    algo = quantization_algo(directory)
    if algo is not None:  # dequantized weights are fp32: by default the model takes the unquantized tensors' dtype
        dtype = dtype or next(t.dtype for name, t in tensors.items() if name.endswith("embeddings.weight"))
        tensors = dequantize_tensors(tensors, algo, directory)
    state = from_disk_state(tensors, config.n_routed_experts)
    if not config.has_mtp:  # a checkpoint with an MTP block loads into a model configured without one
        state = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    model = HybridLM.on_meta(config)
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshaped = sorted(f"{k}: checkpoint {tuple(state[k].shape)}, model {tuple(expected[k].shape)}"
                       for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    if missing or unexpected or misshaped:
        lines = [f"{directory}: checkpoint does not match its config.json"]
        for title, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if names:
                more = " ..." if len(names) > 20 else ""
                lines.append(f"  {title} ({len(names)}): " + ", ".join(names[:20]) + more)
        if any(name.startswith("mtp.") for name in missing) and not any(name.startswith("mtp.") for name in state):
            lines.append("  hint: the checkpoint has no MTP block (transformers drops the mtp.* tensors when it "
                         "saves); load it without one: from_pretrained(directory, num_nextn_predict_layers=0)")
        raise CheckpointError("\n".join(lines))
    for name, tensor in state.items():
        target_dtype = torch.float32 if FP32_TENSORS.search(name) else (dtype or tensor.dtype)
        state[name] = tensor.to(device=device, dtype=target_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model
