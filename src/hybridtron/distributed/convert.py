"""`hybridtron convert`: a sharded training checkpoint (DCP) to the HF layout, and an HF checkpoint to DCP.

    hybridtron convert --from runs/x/checkpoints/step_000400 --to runs/x/hf-400      # DCP -> HF
    hybridtron convert --from runs/x/hf --to ckpt/dcp                                  # HF -> DCP (the weights)

DCP -> HF reads the model tensors of a checkpoint written by any world size and layout (DCP stores them in the
single-process layout, `hybridtron.distributed.state`) into one process and writes config.json and safetensors; the
model config comes from `--config`, else the config.json beside the checkpoint (what HF -> DCP writes), else the
run's run_config.json (two levels up from the step directory). The tokenizer files come from beside the
checkpoint, else the run's HF export, or, for a post-training run still in progress, from the model it began with
(run_config.json's `base_model`; MOPD's `student`). The optimizer state and the trainer state are left behind.

HF -> DCP writes `{"model": state dict}` as a DCP checkpoint: a model-only checkpoint that `dcp.load` reads into a
sharded model at any world size (`torch.distributed.checkpoint.state_dict.set_model_state_dict`), with the HF
config.json and, when the HF directory has them, the tokenizer files beside it; so its own output converts back,
DCP -> HF -> DCP -> HF, to the same weights bit for bit.

Either way `--to` is written atomically and never over what hybridtron did not write
(`hybridtron.checkpoint.hf.staged_checkpoint`): a new or empty directory, or one holding a checkpoint that
`--overwrite` replaces (its checkpoint files only; every other file there is kept); never `--from` itself, a
directory inside it or one that holds it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp

from hybridtron.checkpoint.hf import (
    TOKENIZER_FILES, add_overwrite_argument, load_pretrained, save_pretrained, staged_checkpoint,
)
from hybridtron.config import ModelConfig
from hybridtron.files import RUN_CONFIG
from hybridtron.model.lm import HybridLM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="source", required=True,
                        help="a DCP checkpoint directory (step_NNNNNN, with .metadata) or an HF checkpoint "
                             "directory (config.json + safetensors) (required)")
    parser.add_argument("--to", dest="target", required=True,
                        help="the directory to write: new or empty, or a checkpoint to replace with --overwrite "
                             "(required)")
    parser.add_argument("--config", default=None,
                        help="DCP -> HF: the run_config.json or HF config.json of the model (default: the run's "
                             "run_config.json two levels above --from)")
    add_overwrite_argument(parser)


def model_config_of(source: Path, config: str | None) -> ModelConfig:
    """The model config of the DCP checkpoint `source`: `config` (a run_config.json or an HF config.json), else the
    config.json beside it, else its run's run_config.json."""
    candidates = [Path(config)] if config else [source / "config.json", source.parent.parent / RUN_CONFIG]
    path = next((candidate for candidate in candidates if candidate.is_file()), None)
    if path is None:
        raise FileNotFoundError(f"{candidates[-1]}: no model config for {source} (pass --config with a "
                                f"run_config.json or an HF config.json)")
    raw = json.loads(path.read_text())
    return ModelConfig.from_hf(raw["model"] if "model" in raw and "train" in raw else raw)


def load_dcp_model(source: Path, config: str | ModelConfig | None = None) -> HybridLM:
    """The model of the DCP checkpoint `source`, whole in this process (fp32, as trained); `config`: its
    ModelConfig, or where to read it (`model_config_of`)."""
    model_config = config if isinstance(config, ModelConfig) else model_config_of(source, config)
    model = HybridLM(model_config, init=False)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # DCP warns that it runs in one process: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(source))
    model.load_state_dict(state["model"])
    return model


def dcp_to_hf(source: Path, target: Path, config: str | None = None, *, overwrite: bool = False) -> None:
    tokenizer = source if (source / "tokenizer.json").is_file() else tokenizer_dir_of(source.parent.parent)
    with staged_checkpoint(target, **target_rules(source, overwrite)) as staging:
        save_pretrained(load_dcp_model(source, config), staging)
        for name in TOKENIZER_FILES:
            if tokenizer is not None and (tokenizer / name).is_file():
                shutil.copy(tokenizer / name, staging / name)
    if tokenizer is None:
        print(f"convert: no tokenizer found for {source} (no {source.parent.parent / 'hf'} with tokenizer.json, no "
              f"base_model or student in its run_config.json): copy tokenizer.json and tokenizer_config.json into "
              f"{target} to decode with it")


def target_rules(source: Path, overwrite: bool) -> dict:
    """`staged_checkpoint`'s arguments for `--to` (its checks name the command's options)."""
    return {"overwrite": overwrite, "option": "--to", "source": source, "source_option": "--from"}


def tokenizer_dir_of(run_dir: Path) -> Path | None:
    """Where a run's tokenizer files are: its HF export, else the model a post-training run began with."""
    if (run_dir / "hf" / "tokenizer.json").is_file():
        return run_dir / "hf"
    config = run_dir / RUN_CONFIG
    raw = json.loads(config.read_text()) if config.is_file() else {}
    base = raw.get("base_model") or raw.get("student")
    if base and (Path(base) / "tokenizer.json").is_file():
        return Path(base)
    return None


def hf_to_dcp(source: Path, target: Path, *, overwrite: bool = False) -> None:
    with staged_checkpoint(target, **target_rules(source, overwrite)) as staging:
        model = load_pretrained(source)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(staging))
        shutil.copy(source / "config.json", staging / "config.json")
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy(source / name, staging / name)


def run(args) -> int:
    source, target = Path(args.source), Path(args.target)
    if (source / ".metadata").is_file():
        dcp_to_hf(source, target, args.config, overwrite=args.overwrite)
        print(f"{source} (DCP) -> {target} (HF)")
    elif (source / "config.json").is_file():
        if args.config:
            raise ValueError("--config applies to DCP -> HF; an HF checkpoint carries its own config.json")
        hf_to_dcp(source, target, overwrite=args.overwrite)
        print(f"{source} (HF) -> {target} (DCP, model only)")
    else:
        raise FileNotFoundError(f"{source}: neither a DCP checkpoint (no .metadata) nor an HF checkpoint "
                                f"(no config.json)")
    return 0
