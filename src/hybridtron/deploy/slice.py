"""`hybridtron slice`: an N-layer slice of a checkpoint, or of a preset's config alone, for smoke tests.

    hybridtron slice --model runs/quickstart --layers 4 --out runs/quickstart-slice4
    hybridtron slice --model runs/quickstart/hf --layers 3 --keep 0,2,7 --out runs/quickstart-slice-027
    hybridtron slice --preset ultra3 --layers 4 --out runs/ultra3-slice4        # config.json only, no weights

A slice keeps some of the backbone's layers, in their order, and everything else whole: the embedding, norm_f,
lm_head and the MTP block. Each kept block's weights are copied unchanged under its new index, so the slice is, by
construction, the source model with the dropped blocks skipped (the residual stream passes them by). It is not a
compressed model (the kept layers were trained to read the dropped ones' outputs), but one with the source's real
shapes, layer kinds, tokenizer and MTP block: what a pipeline's smoke test needs (miles publishes a 4-layer slice of
Ultra for this).

Which layers: `--keep`, or by default `spread_layers`: N evenly spaced over the depth (the first and the last
included), then each layer kind the spread missed swapped in for the nearest kept layer of a kind kept more than
once, so the slice has every kind the source has. A windowed model's window stays on the same layers
(`sliding_window_layers` renumbered).

config.json records where the slice came from under `SLICED_FROM_KEY`: the source (a checkpoint's path or
`preset:NAME`), its layer count and the kept layers. `ModelConfig.from_hf` ignores the key and transformers keeps it
as a config attribute, so the slice loads in both, and `hybridtron plan --config` / `hybridtron memory --config`
read it. The write is atomic: the slice is assembled in a hidden sibling of `--out` (the weights by
`save_pretrained`) and renamed into place whole (`hybridtron.checkpoint.hf.staged_checkpoint`). `--out` is new or
empty, or holds a checkpoint that `--overwrite` replaces (its checkpoint files only; the rest is kept), and is never
the checkpoint being sliced, inside it or around it. `--model` is a checkpoint or a run directory (its hf/). A
quantized checkpoint is refused (it would load dequantized and be written unquantized): slice first, then quantize
the slice.

`--preset` builds the sliced model on the meta device: config.json alone, with the parameter counts and the bytes
its weights would take in bf16 (routers in fp32, as `save_pretrained` writes them) printed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from hybridtron.checkpoint.hf import (
    FP32_TENSORS, TOKENIZER_FILES, add_overwrite_argument, check_checkpoint_target, load_pretrained, quantization_algo,
    resolve_checkpoint_dir, save_pretrained, staged_checkpoint,
)
from hybridtron.config import ATTENTION, MAMBA, MLP, MOE, PRESETS, SLICED_FROM_KEY, ModelConfig, preset
from hybridtron.files import atomic_write_json
from hybridtron.infer.memory import human_bytes
from hybridtron.model.lm import HybridLM

BACKBONE_LAYER = re.compile(r"^backbone\.layers\.(\d+)\.(.*)$")
KIND_NAMES = {MAMBA: "Mamba", ATTENTION: "attention", MOE: "MoE", MLP: "MLP"}


# ------------------------------------------------------------------------------------------- which layers
def spread_layers(kinds: tuple[str, ...], layers: int) -> list[int]:
    """`layers` indices spread evenly over a backbone of `kinds` (first and last included), with at least one layer
    of each kind present: a kind the spread missed replaces the nearest kept layer whose kind is kept more than
    once. Increasing. Needs len(set(kinds)) <= layers <= len(kinds)."""
    depth = len(kinds)
    if layers == 1:
        chosen = [0]
    else:  # round half up: Python's round() sends 0.5 to the even side, which would skew the spread
        chosen = [int(i * (depth - 1) / (layers - 1) + 0.5) for i in range(layers)]
    for kind in dict.fromkeys(kinds):  # the kinds in order of first appearance
        if any(kinds[i] == kind for i in chosen):
            continue
        counts = {k: sum(kinds[i] == k for i in chosen) for k in set(kinds)}
        candidates = [i for i, k in enumerate(kinds) if k == kind]
        replaceable = [j for j in chosen if counts[kinds[j]] > 1]  # never empty: more layers than kinds kept
        _, new, old = min((abs(c - j), c, j) for c in candidates for j in replaceable)
        chosen = sorted(set(chosen) - {old} | {new})
    return chosen


def choose_layers(kinds: tuple[str, ...], layers: int | None, keep: list[int] | None) -> list[int]:
    """The backbone layers a slice keeps: `keep` checked against `kinds` and `layers`, else `spread_layers`."""
    depth, present = len(kinds), list(dict.fromkeys(kinds))
    if layers is None and keep is None:
        raise ValueError("give --layers N (and optionally --keep i,j,...: which layers)")
    if layers is not None and layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    if layers is not None and layers > depth:
        raise ValueError(f"--layers {layers} is more than the model's {depth} layers")
    if keep is None:
        if layers < len(present):
            raise ValueError(f"--layers {layers} is fewer than the model's {len(present)} layer kinds "
                             f"({', '.join(KIND_NAMES[kind] for kind in present)}): the minimum is {len(present)} "
                             f"(or choose the layers with --keep)")
        return spread_layers(kinds, layers)
    if layers is not None and len(keep) != layers:
        raise ValueError(f"--keep names {len(keep)} layers but --layers is {layers}")
    for index in keep:
        if not 0 <= index < depth:
            raise ValueError(f"--keep: layer {index} is out of range; the model's layers are 0..{depth - 1}")
    repeated = next((index for position, index in enumerate(keep) if index in keep[:position]), None)
    if repeated is not None:
        raise ValueError(f"--keep names layer {repeated} twice")
    if keep != sorted(keep):
        raise ValueError(f"--keep must list the layers in increasing order (a slice keeps the source's order), "
                         f"got {','.join(map(str, keep))}")
    return keep


def parse_keep(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--keep: expected comma-separated layer indices such as 0,3,7, got {text!r}") from None


# ----------------------------------------------------------------------------------------------- the slice
def slice_config(config: ModelConfig, keep: list[int]) -> ModelConfig:
    """`config` with only the backbone layers `keep`; a windowed model keeps its window on the same layers."""
    changes = {"layers_block_type": tuple(config.layers_block_type[i] for i in keep)}
    if config.sliding_window is not None:  # explicit: the default rule (3 of every 4) would pick other layers
        windowed = set(config.windowed_layers)
        changes["sliding_window_layers"] = tuple(new for new, old in enumerate(keep) if old in windowed)
    return config.replace(**changes)


def slice_model(model: HybridLM, keep: list[int]) -> HybridLM:
    """A model of `slice_config(model.config, keep)` holding `model`'s own tensors (not copies): each kept block's
    under its new index, the rest (embedding, norm_f, lm_head, MTP block) whole."""
    renumber = {str(old): str(new) for new, old in enumerate(keep)}
    state = {}
    for name, tensor in model.state_dict().items():
        match = BACKBONE_LAYER.match(name)
        if match is None:
            state[name] = tensor
        elif match.group(1) in renumber:
            state[f"backbone.layers.{renumber[match.group(1)]}.{match.group(2)}"] = tensor
    sliced = HybridLM.on_meta(slice_config(model.config, keep))
    sliced.load_state_dict(state, strict=True, assign=True)
    return sliced


@dataclass(frozen=True)
class SliceSummary:
    source: str  # a checkpoint's absolute path, or "preset:NAME"
    source_layers: int
    kept_layers: list[int]
    pattern: str  # the slice's layers, one character each (M Mamba, * attention, E MoE, - MLP)
    parameters: int  # backbone and lm_head, embedding included (HybridLM.num_parameters)
    active_parameters: int  # per token: the top-k experts, no embedding table
    mtp_parameters: int
    weight_bytes: int  # every tensor, MTP included: as written, or for a preset as bf16 with fp32 routers
    weights_written: bool

    def sliced_from(self) -> dict:
        return {"source": self.source, "source_layers": self.source_layers, "kept_layers": self.kept_layers}

    def lines(self, name: str, out: str) -> list[str]:
        """What the command prints; `name`: the source as the user named it."""
        weights = "weights" if self.weights_written else "weights in bf16 (routers fp32; config only, none written)"
        return [f"{name}: kept {len(self.kept_layers)} of {self.source_layers} layers, {self.kept_layers} "
                f"({self.pattern}) -> {out}",
                f"  parameters: {human_count(self.parameters)} total, {human_count(self.active_parameters)} active "
                f"per token (backbone and lm_head)",
                f"  MTP block: {human_count(self.mtp_parameters)} parameters",
                f"  {weights}: {human_bytes(self.weight_bytes)}"]


def human_count(n: int) -> str:
    """`14072149504` -> `14.07B (14,072,149,504)`."""
    for unit, size in (("B", 10 ** 9), ("M", 10 ** 6), ("K", 10 ** 3)):
        if n >= size:
            return f"{n / size:.2f}{unit} ({n:,})"
    return f"{n:,}"


def summarize(model: HybridLM, source: str, source_layers: int, keep: list[int], weights_written: bool):
    """The slice's counts; on the meta device its bytes are those of a bf16 checkpoint (fp32 routers)."""
    state = model.state_dict()
    if weights_written:
        weight_bytes = sum(tensor.nbytes for tensor in state.values())
    else:
        weight_bytes = sum(tensor.numel() * (4 if FP32_TENSORS.search(name) else 2) for name, tensor in state.items())
    total = model.num_parameters()
    return SliceSummary(source, source_layers, list(keep), model.config.hybrid_override_pattern, total,
                        model.num_parameters(active=True), model.num_parameters(include_mtp=True) - total,
                        weight_bytes, weights_written)


# --------------------------------------------------------------------------------------------------- writing
def slice_checkpoint(model_dir: str | Path, out: str | Path, layers: int | None = None,
                     keep: list[int] | None = None, *, overwrite: bool = False) -> SliceSummary:
    """Write the slice of the HF checkpoint (or run directory) `model_dir` to `out` (`staged_checkpoint`; with
    `overwrite` a checkpoint there is replaced): config.json, the safetensors in the source's dtypes, the tokenizer
    files; `layers` / `keep` as in `choose_layers`."""
    model_dir, _ = resolve_checkpoint_dir(model_dir)
    target = {"overwrite": overwrite, "option": "--out", "source": model_dir, "source_option": "--model"}
    check_checkpoint_target(out, **target)  # before the weights, as every check here: a mistake costs no load
    config = ModelConfig.from_hf(model_dir)
    algo = quantization_algo(model_dir)
    if algo is not None:  # it would load dequantized and be written unquantized: not what the user holds
        raise ValueError(f"--model {model_dir}: an {algo} checkpoint; slice the unquantized one, then quantize the "
                         f"slice (hybridtron quantize)")
    kept = choose_layers(config.layers_block_type, layers, keep)
    source = load_pretrained(model_dir, config=config)
    sliced = slice_model(source, kept)
    summary = summarize(sliced, str(model_dir.resolve()), source.config.num_hidden_layers, kept, True)
    with staged_checkpoint(out, **target) as staging:
        save_pretrained(sliced, staging, nemotron_h=False)  # a Marin model stays in hybridtron's own format
        add_sliced_from(staging / "config.json", summary)
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copy(model_dir / name, staging / name)
    return summary


def slice_preset(name: str, out: str | Path, layers: int | None = None,
                 keep: list[int] | None = None, *, overwrite: bool = False) -> SliceSummary:
    """Write the config.json of preset `name` sliced to `out` (as `slice_checkpoint`), the model built on the meta
    device for its counts; no weights."""
    check_checkpoint_target(out, overwrite=overwrite, option="--out")
    config = preset(name)
    kept = choose_layers(config.layers_block_type, layers, keep)
    sliced = HybridLM.on_meta(slice_config(config, kept))
    summary = summarize(sliced, f"preset:{name}", config.num_hidden_layers, kept, False)
    with staged_checkpoint(out, overwrite=overwrite, option="--out") as staging:
        atomic_write_json(staging / "config.json", {**sliced.config.to_hf(export=True),
                                                    SLICED_FROM_KEY: summary.sliced_from()})
    return summary


def add_sliced_from(config_path: Path, summary: SliceSummary) -> None:
    config = json.loads(config_path.read_text())
    config[SLICED_FROM_KEY] = summary.sliced_from()
    atomic_write_json(config_path, config)


# ---------------------------------------------------------------------------------------------- the command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="an HF checkpoint directory to slice (config.json + safetensors) or a run directory "
                             "(its hf/ export) (default: none; give --model or --preset)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="slice a preset's config alone, built on the meta device: config.json and the "
                             "parameter counts, no weights (default: none)")
    parser.add_argument("--layers", type=int, default=None,
                        help="backbone layers to keep (default: the length of --keep); without --keep, spread evenly "
                             "over the depth with at least one of each layer kind present (Mamba, attention, MoE, MLP)")
    parser.add_argument("--keep", default=None,
                        help="which backbone layers to keep: 0-based indices in increasing order, e.g. 0,3,7 "
                             "(default: the even spread)")
    parser.add_argument("--out", required=True,
                        help="the directory to write: new or empty, or a checkpoint to replace with --overwrite "
                             "(required)")
    add_overwrite_argument(parser)


def run(args) -> int:
    if (args.model is None) == (args.preset is None):
        raise ValueError("give --model DIR (a checkpoint to slice) or --preset NAME (its config alone), "
                         + ("not both" if args.model else "one of them"))
    keep = parse_keep(args.keep)
    if args.model is not None:
        summary = slice_checkpoint(args.model, args.out, args.layers, keep, overwrite=args.overwrite)
    else:
        summary = slice_preset(args.preset, args.out, args.layers, keep, overwrite=args.overwrite)
    print("\n".join(summary.lines(args.model or f"preset {args.preset}", args.out)))
    return 0
