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

Writing never deletes what hybridtron did not write (`staged_checkpoint`, used by every writer: `save_pretrained`,
quantize, slice, convert, a run's export): the target must be new or empty, or hold a checkpoint that the caller
asks to replace (`overwrite=True`, the commands' `--overwrite`); then only the checkpoint's own files are replaced
(`is_checkpoint_file`) and the rest of the directory is kept. A directory holding anything else is refused, naming
what it holds, and so is an output that is, lies inside or holds the checkpoint being read.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# The files a checkpoint consists of, HF (as hybridtron and transformers write it) or model-only DCP (`hybridtron
# convert`), besides the numbered shards: what replacing a checkpoint replaces. Every other entry of its directory
# is the user's and is kept.
CHECKPOINT_FILES = frozenset({"config.json", "generation_config.json", "chat_template.jinja", HF_QUANT_CONFIG,
                              SINGLE_FILE, INDEX_FILE, *TOKENIZER_FILES, ".metadata"})
CHECKPOINT_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors|__\d+_\d+\.distcp")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message lists every offending tensor."""


def to_disk_state(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict (a model's, or the one given) with the stacked experts split per expert, as NVIDIA checkpoints
    store them."""
    out = {}
    for name, tensor in (model if isinstance(model, Mapping) else model.state_dict()).items():
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
                    dtype: torch.dtype | None = None, nemotron_h: bool = True, overwrite: bool = False) -> None:
    """Write config.json and the safetensors (sharded above `max_shard_bytes`) into `directory`, atomically
    (`staged_checkpoint`: a new or empty directory, or with `overwrite` one holding a checkpoint, whose own files are
    replaced and whose other files are kept). The directory and its files get the permissions the umask gives new
    ones (0o755 / 0o644 under umask 022), so another user or a serving container can read the export.
    `nemotron_h=False` writes a model nemotron_h cannot express in hybridtron's own format (module docstring)
    instead of refusing it."""
    if nemotron_h:
        check_exportable(model.config)
    state = {}
    for name, tensor in to_disk_state(model).items():
        if dtype is not None and tensor.is_floating_point() and not FP32_TENSORS.search(name):
            tensor = tensor.to(dtype)
        state[name] = tensor.detach().contiguous().cpu()

    config_dict = model.config.to_hf(export=True)
    config_dict["torch_dtype"] = str(dtype or next(model.parameters()).dtype).removeprefix("torch.")
    write_checkpoint(directory, config_dict, state, max_shard_bytes=max_shard_bytes, overwrite=overwrite)


def write_checkpoint(directory: str | Path, config_dict: dict, state: dict[str, torch.Tensor], *,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, extra_files: dict[str, bytes] | None = None,
                     overwrite: bool = False) -> None:
    """Write config.json, the tensors of `state` (disk names, sharded above `max_shard_bytes`) and `extra_files`
    ({file name: contents}: a tokenizer, a quantization config; checkpoint files, `is_checkpoint_file`) into
    `directory`, atomically (`save_pretrained`)."""
    shards, current, current_bytes = [], {}, 0
    for name, tensor in state.items():
        if current and current_bytes + tensor.nbytes > max_shard_bytes:
            shards.append(current)
            current, current_bytes = {}, 0
        current[name] = tensor
        current_bytes += tensor.nbytes
    shards.append(current)

    with staged_checkpoint(directory, overwrite=overwrite) as staging:
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
        # safetensors writes its files 0o600: give every file the mode a new file gets, 0o666 less the umask, read
        # off the directory just made (0o777 less the umask)
        file_mode = stat.S_IMODE(staging.stat().st_mode) & 0o666
        for path in staging.iterdir():
            os.chmod(path, file_mode)


# ---------------------------------------------------------------------------------- where a checkpoint is written
def is_checkpoint_file(name: str) -> bool:
    """Whether a file named `name` is part of a checkpoint (`CHECKPOINT_FILES`, `CHECKPOINT_SHARD`): what
    replacing a checkpoint replaces."""
    return name in CHECKPOINT_FILES or CHECKPOINT_SHARD.fullmatch(name) is not None


def holds_checkpoint(directory: Path) -> bool:
    """An HF checkpoint (config.json; a preset's slice is that alone) or a DCP one (.metadata)."""
    return (directory / "config.json").is_file() or (directory / ".metadata").is_file()


def add_overwrite_argument(parser) -> None:
    """`--overwrite`, the same for every command that writes a checkpoint (`check_checkpoint_target`)."""
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the checkpoint the output directory already holds: its checkpoint files "
                             "(config.json, safetensors, index, tokenizer and quantization files) are replaced, "
                             "every other file there is kept (default: refuse a directory that is not empty)")


def check_checkpoint_target(directory: str | Path, *, overwrite: bool = False, option: str | None = None,
                            source: str | Path | None = None, source_option: str | None = None) -> None:
    """ValueError, in one line, unless a checkpoint may be written to `directory`: absent, an empty directory, or
    one holding a checkpoint when `overwrite`; never a directory that holds something else, and never the
    checkpoint `source` being read, a directory inside it or one around it. `option` / `source_option`: the
    command's options naming the two (the remedy is then `--overwrite`; without, the API's `overwrite=True`)."""
    directory = Path(directory)
    where = f"{option} {directory}" if option else str(directory)
    if source is not None:
        read = f"{source_option} {source}" if source_option else str(source)
        out, src = directory.resolve(), Path(source).resolve()
        remedy = ("is", "write to another directory") if out == src else \
            ("is inside", "write outside it") if src in out.parents else \
            ("holds", "write beside it, not around it") if out in src.parents else None
        if remedy is not None:
            raise ValueError(f"{where} {remedy[0]} {read}, the checkpoint being read: {remedy[1]}")
    if not directory.exists():
        return
    if not directory.is_dir():
        raise ValueError(f"{where} is a file, not a directory: choose an empty or new directory")
    entries = sorted(directory.iterdir())
    if not entries:
        return
    if not holds_checkpoint(directory):
        raise ValueError(f"{where} is not empty and holds no checkpoint ({_listing(entries)}): choose an empty or "
                         f"new directory")
    if not overwrite:
        flag = "--overwrite" if option else "overwrite=True"
        raise ValueError(f"{where} already holds a checkpoint ({_listing(entries)}): pass {flag} to replace its "
                         f"checkpoint files (the other files there are kept), or choose an empty or new directory")


def _listing(entries: list[Path], shown: int = 6) -> str:
    names = [entry.name + ("/" if entry.is_dir() else "") for entry in entries]
    return ", ".join(names[:shown]) + (f", ... ({len(names)} entries)" if len(names) > shown else "")


@contextmanager
def staged_checkpoint(directory: str | Path, *, overwrite: bool = False, option: str | None = None,
                      source: str | Path | None = None, source_option: str | None = None) -> Iterator[Path]:
    """Checked by `check_checkpoint_target` first (the arguments are its), an empty hidden sibling of `directory`
    to write a checkpoint's files into (`is_checkpoint_file` names only); when the block ends without an exception
    they are published at `directory` in renames (`_publish`), otherwise discarded. A crash at any moment leaves
    the old checkpoint or the new one at `directory`, never a mix, and never loses a file of the user's."""
    check_checkpoint_target(directory, overwrite=overwrite, option=option, source=source, source_option=source_option)
    target = Path(directory).resolve()  # a symlink's directory is the one written, not the link replaced
    target.parent.mkdir(parents=True, exist_ok=True)
    # not tempfile.mkdtemp: its directory is private (0o700) whatever the umask, and the rename would publish that
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    staging.mkdir()
    try:
        yield staging
        # again: another writer may have filled the directory meanwhile
        check_checkpoint_target(directory, overwrite=overwrite, option=option)
        _publish(staging, target)
    except BaseException:
        _discard(staging)
        raise


def _publish(staging: Path, target: Path) -> None:
    """Put the checkpoint in `staging` at `target`: a rename where `target` is absent or empty; over a checkpoint,
    `target`'s other entries (the user's) are moved into `staging`, then the two directories swap, so that until
    the swap `target` holds the old checkpoint whole, and after it the new one (between the two renames, none: the
    old one waits whole in a hidden sibling, then is removed)."""
    if not target.exists() or not any(target.iterdir()):
        os.replace(staging, target)  # rename(2) replaces an empty directory
        return
    kept = [entry.name for entry in target.iterdir() if not is_checkpoint_file(entry.name)]
    assert not any((staging / name).exists() for name in kept), f"{staging}: a checkpoint writes only its own files"
    old = target.with_name(f".{target.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
    moved = []
    try:
        for name in kept:
            os.rename(target / name, staging / name)
            moved.append(name)
        os.rename(target, old)
        try:
            os.rename(staging, target)
        except BaseException:
            os.rename(old, target)
            raise
    except BaseException:  # the user's entries back where they were
        for name in moved:
            os.rename(staging / name, target / name)
        raise
    shutil.rmtree(old)


def _discard(staging: Path) -> None:
    """Remove a staged checkpoint's files, and the directory unless something else is left in it (a user's entry
    that a failed `_publish` could not move back stays there, with the directory)."""
    if not staging.is_dir():  # published: only removing the old checkpoint failed
        return
    for entry in staging.iterdir():
        if is_checkpoint_file(entry.name):
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    if not any(staging.iterdir()):
        staging.rmdir()


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


def resolve_checkpoint_dir(path: str | Path, option: str = "--model") -> tuple[Path, str]:
    """(the checkpoint directory, the model's name) of what a user passed as `option`: an HF checkpoint directory, or
    a run directory (`hybridtron pretrain --out`), whose HF export is `path/hf`. A training checkpoint (a DCP step
    directory) or anything else is refused in one line saying what was expected and, for the former, how to
    convert it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{option} {path}: no such directory (expected an HF checkpoint directory or a run "
                                f"directory)")
    if not path.is_dir():
        raise ValueError(f"{option} {path}: a file, not a directory (expected an HF checkpoint directory or a run "
                         f"directory)")
    if (path / "config.json").is_file():
        name = path.resolve().name
        return path, path.resolve().parent.name if name == "hf" else name
    if (path / "hf" / "config.json").is_file():  # a run directory (`hybridtron pretrain --out`)
        return path / "hf", path.resolve().name
    if (path / ".metadata").is_file():  # torch.distributed.checkpoint's (hybridtron.checkpoint.dcp)
        raise ValueError(f"{option} {path} is a training checkpoint (DCP), not an HF checkpoint: pass its run "
                         f"directory (its hf/ export), or convert this step with `hybridtron convert --from {path} "
                         f"--to DIR` and pass DIR")
    if (path / "checkpoints").is_dir():
        raise ValueError(f"{option} {path}: a run directory without an HF export (no {path / 'hf'}; the run has not "
                         f"finished): convert one of its checkpoints with `hybridtron convert --from "
                         f"{path / 'checkpoints'}/step_NNNNNN --to DIR` and pass DIR")
    raise ValueError(f"{option} {path} holds no checkpoint: expected config.json there, or in {path / 'hf'} (the HF "
                     f"export of a run directory)")


def read_model_config(path: str | Path, option: str = "--config") -> ModelConfig:
    """The model configuration a user passed as `option`: a config.json file, or a directory by
    `resolve_checkpoint_dir`'s rules (an HF checkpoint, a run directory's export)."""
    return ModelConfig.from_hf(path if Path(path).is_file() else resolve_checkpoint_dir(path, option)[0])


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
