"""`hybridtron quantize`: post-training quantization of an HF checkpoint to NVFP4 or FP8, in NVIDIA Model Optimizer's
unified checkpoint format (`hybridtron.deploy.modelopt_format`), which TensorRT-LLM, vLLM and SGLang load.

    hybridtron quantize --model runs/quickstart --format nvfp4 --out runs/quickstart-nvfp4
    hybridtron quantize --model runs/quickstart --format fp8 --out runs/quickstart-fp8 --policy experts
    hybridtron quantize --model runs/quickstart --format nvfp4 --scales mse --calib 64 --out runs/quickstart-mse

Steps: load the checkpoint in fp32; decide per weight by the export policy (`hybridtron.numerics.export_policy`:
`ultra` follows the trainer's precision policy, `experts` quantizes the routed experts only, `all` every linear);
calibrate: run `--calib` held-out rows through the model with a hook on each quantized linear (and on each routed
expert's grouped GEMM, split by expert) recording its input's amax, for `input_scale`; quantize each weight
(`hybridtron.numerics.ptq`: max or MSE block scales for NVFP4, amax/448 for FP8); write the checkpoint atomically
with the source's tokenizer files. `load_pretrained` reads the result back, dequantized.

`--out` is checked before anything is loaded (`hybridtron.checkpoint.hf.check_checkpoint_target`): new or empty, or
holding a checkpoint that `--overwrite` replaces (its checkpoint files only); never the checkpoint being read, a
directory inside it or one that holds it.

Calibration rows are the held-out split of the data the model was trained on: for a run's export (`RUN/hf`, or
`RUN` itself) the run's `[data]` section, otherwise the default data (the standard library); tokenized with the
checkpoint's own tokenizer. A routed expert no calibration token reached takes the largest input amax of its
layer's experts (vLLM uses one input scale per layer's experts anyway).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from hybridtron.checkpoint.hf import (
    HF_QUANT_CONFIG, INDEX_FILE, add_overwrite_argument, check_checkpoint_target, is_checkpoint_file, load_pretrained,
    quantization_algo, resolve_checkpoint_dir, write_checkpoint,
)
from hybridtron.data.build import DataConfig, build_data
from hybridtron.deploy.modelopt_format import (
    FORMATS, excluded_modules, hf_quant_config, quantization_config, quantized_state,
)
from hybridtron.files import RUN_CONFIG
from hybridtron.numerics.export_policy import EXPORT_POLICIES, ExportWeight, export_plan, weight_bytes
from hybridtron.numerics.ptq import SCALE_METHODS

DEFAULT_CALIBRATION_ROWS = 32
CALIBRATION_BATCH_ROWS = 8
DEFAULT_SEQ_LEN = 256  # calibration row length outside a run (a run's own data.seq_len otherwise)


@dataclass(frozen=True)
class QuantizeReport:
    """What `hybridtron quantize` did; seconds per stage, bytes of the tensor files."""

    format: str
    scales: str
    policy: str
    quantized: int  # weight matrices quantized (each routed expert's counted once per projection)
    excluded: list[str]
    calibration_rows: int
    calibration_tokens: int
    weight_error: float  # relative squared error of the quantized weights: sum (w_hat - w)^2 / sum w^2
    max_weight_error: float | None  # the same with max scales, when --scales mse
    seconds: dict[str, float]
    source_bytes: int
    bf16_bytes: int  # the same checkpoint in BF16 (`export_policy.weight_bytes`), safetensors headers aside
    out_bytes: int


# ------------------------------------------------------------------------------------------------ calibration
def calibration_data_config(checkpoint_dir: Path) -> DataConfig:
    """The data whose held-out split calibrates: a run's `[data]` section when the checkpoint is its export, else
    the default data; tokenized with the checkpoint's tokenizer."""
    tokenizer = checkpoint_dir / "tokenizer.json"
    if not tokenizer.is_file():
        raise ValueError(f"{checkpoint_dir}: no tokenizer.json beside the model; calibration runs held-out text "
                         f"through it, tokenized as in training")
    data = DataConfig(seq_len=DEFAULT_SEQ_LEN)
    run_config = checkpoint_dir.parent / RUN_CONFIG
    if checkpoint_dir.resolve().name == "hf" and run_config.is_file():
        section = json.loads(run_config.read_text()).get("data")
        if isinstance(section, dict):
            known = {f.name for f in fields(DataConfig)}
            data = DataConfig(**{key: tuple(value) if isinstance(value, list) else value
                                 for key, value in section.items() if key in known})
    return replace(data, tokenizer=str(tokenizer), val_batches=None)


def calibration_rows(checkpoint_dir: Path, rows: int) -> torch.Tensor:
    """[rows, seq_len] token ids: the first `rows` rows of the held-out split; ValueError when it has fewer."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"--calib: expected a number of rows >= 1, got {rows!r}")
    data = calibration_data_config(checkpoint_dir)
    held_out = build_data(data).val_batches
    ids = torch.cat([batch.input_ids for batch in held_out]) if held_out else torch.empty(0, data.seq_len)
    if rows > len(ids):
        raise ValueError(f"--calib {rows}: the held-out split of {', '.join(data.source)} has {len(ids)} rows of "
                         f"{data.seq_len} tokens; ask for at most {len(ids)}")
    return ids[:rows].long()


def _expert_recorder(experts: torch.nn.Module, module: str, amax: dict[str, float]):
    """A grouped GEMM that records each expert's input amax (rows are sorted by expert, `group_sizes` of each)
    under `{module}.{e}.{up_proj|down_proj}`, then runs the original."""
    original = experts.grouped_mm

    def recording(x, weight, group_sizes, *args, **kwargs):
        proj = "up_proj" if weight is experts.up_proj else "down_proj"
        count = group_sizes.numel()
        expert_of_row = torch.repeat_interleave(torch.arange(count, device=x.device), group_sizes)
        per_expert = torch.zeros(count, device=x.device).scatter_reduce_(
            0, expert_of_row, x.detach().abs().amax(dim=1).float(), "amax")
        for e, value in enumerate(per_expert.tolist()):
            key = f"{module}.{e}.{proj}"
            amax[key] = max(amax.get(key, 0.0), value)
        return original(x, weight, group_sizes, *args, **kwargs)

    return original, recording


@torch.no_grad()
def calibrate(model: torch.nn.Module, plan: list[ExportWeight], ids: torch.Tensor,
              batch_rows: int = CALIBRATION_BATCH_ROWS) -> dict[str, float]:
    """Input amax of every quantized linear over `ids`, by module name on disk (each routed expert its own)."""
    amax: dict[str, float] = {}
    handles, restore = [], []

    def hook(name):
        def record(module, inputs):
            amax[name] = max(amax.get(name, 0.0), float(inputs[0].detach().abs().max()))
        return record

    try:
        for weight in plan:
            if not weight.quantized:
                continue
            module = model.get_submodule(weight.module)
            if weight.role == "moe.experts":
                if not any(experts is module for experts, _ in restore):
                    original, recording = _expert_recorder(module, weight.module, amax)
                    restore.append((module, original))
                    module.grouped_mm = recording
            else:
                handles.append(module.register_forward_pre_hook(hook(weight.module)))
        mtp = model.mtp is not None and any(w.quantized and w.module.startswith("mtp.") for w in plan)
        for batch in ids.split(batch_rows):
            model(batch, mtp=mtp)
    finally:
        for handle in handles:
            handle.remove()
        for experts, original in restore:
            experts.grouped_mm = original
    _fill_unrouted_experts(plan, amax, model.config.n_routed_experts, len(ids))
    return amax


def _fill_unrouted_experts(plan: list[ExportWeight], amax: dict[str, float], experts: int, rows: int) -> None:
    for weight in plan:
        if not (weight.quantized and weight.role == "moe.experts"):
            continue
        proj = weight.name.rpartition(".")[2]
        keys = [f"{weight.module}.{e}.{proj}" for e in range(experts)]
        largest = max(amax.get(key, 0.0) for key in keys)
        if largest == 0.0:
            raise ValueError(f"--calib {rows}: no calibration token reached {weight.module}; calibrate on more rows")
        for key in keys:
            if amax.get(key, 0.0) == 0.0:
                amax[key] = largest


# ------------------------------------------------------------------------------------------------ quantize
def tensor_bytes(directory: Path) -> int:
    """Bytes of a checkpoint's safetensors files."""
    return sum(path.stat().st_size for path in directory.glob("*.safetensors"))


def quantize_checkpoint(model_dir: str | Path, out: str | Path, fmt: str = "nvfp4", *, scales: str = "max",
                        policy: str = "ultra", calib: int = DEFAULT_CALIBRATION_ROWS,
                        overwrite: bool = False) -> QuantizeReport:
    """Quantize the checkpoint (or run directory) `model_dir` into `out` (module docstring); `overwrite`: replace
    the checkpoint `out` holds."""
    for value, choices, what in ((fmt, tuple(FORMATS), "--format"), (scales, SCALE_METHODS, "--scales"),
                                 (policy, EXPORT_POLICIES, "--policy")):
        if value not in choices:
            raise ValueError(f"{what}: expected one of {', '.join(choices)}, got {value!r}")
    if fmt == "fp8" and scales != "max":
        raise ValueError(f"--scales {scales}: chooses NVFP4's block scales; FP8 has one scale per tensor (amax / 448)")
    checkpoint_dir, _ = resolve_checkpoint_dir(model_dir)
    algo = quantization_algo(checkpoint_dir)
    if algo is not None:
        raise ValueError(f"{checkpoint_dir} is already quantized ({algo}); quantize the unquantized checkpoint it "
                         f"was made from")
    out = Path(out)
    check_checkpoint_target(out, overwrite=overwrite, option="--out", source=checkpoint_dir, source_option="--model")
    source_bytes = tensor_bytes(checkpoint_dir)
    seconds = {}
    clock = time.perf_counter()
    ids = calibration_rows(checkpoint_dir, calib)
    model = load_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    seconds["load"] = time.perf_counter() - clock

    clock = time.perf_counter()
    plan = export_plan(model, policy)
    amax = calibrate(model, plan, ids)
    seconds["calibrate"] = time.perf_counter() - clock

    clock = time.perf_counter()
    state, errors = quantized_state(model, plan, fmt, scales, amax)
    seconds["quantize"] = time.perf_counter() - clock

    clock = time.perf_counter()
    excluded = excluded_modules(plan)
    quant = hf_quant_config(fmt, excluded)
    config_dict = json.loads((checkpoint_dir / "config.json").read_text())
    config_dict["torch_dtype"] = "bfloat16"
    config_dict["quantization_config"] = quantization_config(quant)
    skipped = {"config.json", INDEX_FILE}
    extra = {path.name: path.read_bytes() for path in sorted(checkpoint_dir.iterdir())  # tokenizer, generation
             if path.is_file() and is_checkpoint_file(path.name) and path.name not in skipped
             and path.suffix != ".safetensors"}
    extra[HF_QUANT_CONFIG] = json.dumps(quant, indent=2).encode()
    write_checkpoint(out, config_dict, state, extra_files=extra, overwrite=overwrite)
    seconds["write"] = time.perf_counter() - clock

    return QuantizeReport(
        format=fmt, scales=scales, policy=policy,
        quantized=sum(w.matrices for w in plan if w.quantized), excluded=excluded,
        calibration_rows=len(ids), calibration_tokens=ids.numel(), weight_error=errors["weight_error"],
        max_weight_error=errors.get("max_weight_error"), seconds=seconds,
        source_bytes=source_bytes, bf16_bytes=weight_bytes(model, "bf16", policy).total,
        out_bytes=tensor_bytes(out))


def format_report(report: QuantizeReport, out: Path) -> str:
    r = report
    mib = 1024 ** 2
    error = f"{r.weight_error:.3e}"
    if r.max_weight_error is not None:
        error += f" (max scales: {r.max_weight_error:.3e}, {1 - r.weight_error / r.max_weight_error:.1%} less)"
    lines = [
        f"{out}: {FORMATS[r.format]}{f' ({r.scales} scales)' if r.format == 'nvfp4' else ''}, policy {r.policy}",
        f"  quantized weight matrices: {r.quantized:,}; left in BF16: {len(r.excluded)} modules "
        f"(listed in {out / HF_QUANT_CONFIG})",
        f"  calibration: {r.calibration_rows} held-out rows, {r.calibration_tokens:,} tokens",
        f"  weight error (relative, squared): {error}",
        f"  tensors: {r.source_bytes / mib:,.2f} MiB -> {r.out_bytes / mib:,.2f} MiB "
        f"({r.out_bytes / r.source_bytes:.1%}; {r.out_bytes / r.bf16_bytes:.1%} of the model in BF16)",
        "  seconds: " + ", ".join(f"{stage} {value:.2f}" for stage, value in r.seconds.items()),
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="an HF checkpoint directory or a run directory (its hf/ export) (required)")
    parser.add_argument("--format", required=True, choices=tuple(FORMATS),
                        help="nvfp4: E2M1 weights, E4M3 scales per 16, an fp32 scale per tensor; fp8: E4M3 "
                             "weights, an fp32 scale per tensor (required)")
    parser.add_argument("--out", required=True,
                        help="the quantized checkpoint's directory: new or empty, or a checkpoint to replace with "
                             "--overwrite (required)")
    parser.add_argument("--calib", type=int, default=DEFAULT_CALIBRATION_ROWS,
                        help="held-out rows run through the model to calibrate the input scales "
                             "(default: %(default)s)")
    parser.add_argument("--scales", choices=SCALE_METHODS, default="max",
                        help="NVFP4 block scales: max = block amax / 6; mse = the E4M3 scale around it with the "
                             "least squared error per block (default: %(default)s)")
    parser.add_argument("--policy", choices=EXPORT_POLICIES, default="ultra",
                        help="which weights are quantized: ultra = where the trainer's ultra policy uses NVFP4 "
                             "(the BF16 tail, Mamba out_proj, attention, latent projections and MTP stay BF16); "
                             "experts = the routed experts only; all = every linear (default: %(default)s)")
    add_overwrite_argument(parser)


def run(args) -> int:
    report = quantize_checkpoint(args.model, args.out, args.format, scales=args.scales, policy=args.policy,
                                 calib=args.calib, overwrite=args.overwrite)
    print(format_report(report, Path(args.out)))
    return 0
