"""A pipeline stage's model after post-training quantization, measured as the pipeline measures every stage.

For one stage of a `hybridtron pipeline` directory (by default the last MOPD iteration, `mopd_2`), each variant is
written as a checkpoint and evaluated with the pipeline's own `[eval]` (hybridtron.recipe.evaluation): greedy math
pass@1 and the code pass rate on the held-out tasks, the validation loss of held-out conversations, and the MTP
acceptance length of greedy self-speculative decoding, whose backbone is the quantized one (the `ultra` policy keeps
the MTP block in BF16, as the report did). Variants: the fp32 source, the source rounded to BF16, and
`hybridtron quantize` at FP8 and NVFP4 (max and MSE scales) under the `ultra` export policy, NVFP4 with MSE scales
also under `all`. Beside each: the tensors' size on disk and the seconds `quantize` took by phase.

    python bench/quantized_eval.py --pipeline runs/pipe --stage mopd_2 --out runs/pipe-quantized
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from hybridtron.checkpoint import load_pretrained, save_pretrained
from hybridtron.deploy.quantize import quantize_checkpoint, tensor_bytes
from hybridtron.recipe.evaluation import eval_set, evaluate_model, format_row
from hybridtron.recipe.pipeline import config_from_file
from hybridtron.recipe.stages import CONFIG_FILE

QUANTIZED = (  # name, format, scales, policy
    ("fp8", "fp8", "max", "ultra"),
    ("nvfp4-max", "nvfp4", "max", "ultra"),
    ("nvfp4-mse", "nvfp4", "mse", "ultra"),
    ("nvfp4-mse-all", "nvfp4", "mse", "all"),
)


def bf16_copy(source: Path, out: Path) -> None:
    """The source's weights rounded to BF16 (stored as BF16), its other files beside them."""
    model = load_pretrained(source, dtype=torch.bfloat16)
    save_pretrained(model, out, overwrite=True)  # a rerun replaces its own copy
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and not (out / path.name).exists():
            shutil.copy(path, out / path.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", required=True, help="a pipeline directory (its pipeline_config.toml's [eval])")
    parser.add_argument("--stage", default="mopd_2")
    parser.add_argument("--out", required=True, help="where the variants' checkpoints and results.json go")
    parser.add_argument("--calib", type=int, default=32, help="calibration rows for quantize's input scales")
    parser.add_argument("--variants", nargs="*", help="a subset of: source bf16 " +
                        " ".join(name for name, *_ in QUANTIZED))
    args = parser.parse_args()
    config = config_from_file(Path(args.pipeline) / CONFIG_FILE)  # its [pipeline] and [eval]; no stage runs here
    source = Path(args.pipeline) / args.stage / "hf"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    material = eval_set(config)
    wanted = args.variants or ["source", "bf16", *(name for name, *_ in QUANTIZED)]
    results = {}
    for name in wanted:
        row = {}
        if name == "source":
            directory = source
        elif name == "bf16":
            directory = out / name
            bf16_copy(source, directory)
        else:
            fmt, scales, policy = next(spec[1:] for spec in QUANTIZED if spec[0] == name)
            directory = out / name
            if directory.exists():
                shutil.rmtree(directory)
            report = quantize_checkpoint(source, directory, fmt, scales=scales, policy=policy, calib=args.calib)
            row["quantize_seconds"] = report.seconds
            row["weight_error"] = report.weight_error
        row["tensor_mib"] = tensor_bytes(directory) / 2 ** 20
        row.update(evaluate_model(directory, config, material))
        results[name] = row
        print(f"{name}: {row['tensor_mib']:.2f} MiB, " + format_row(row), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print("\n| checkpoint | tensors (MiB) | math pass@1 | code pass rate | code pass@1 | val loss | acceptance "
          "(k = %d) | quantize s |" % config.eval.draft_length)
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in results.items():
        seconds = row.get("quantize_seconds")
        took = f"{seconds['calibrate'] + seconds['quantize']:.1f}" if seconds else "-"
        print(f"| {name} | {row['tensor_mib']:.2f} | {row['math_pass_at_1']:.1%} | {row['code_pass_rate']:.1%} | "
              f"{row['code_pass_at_1']:.1%} | {row['val_loss']:.4f} | {row['acceptance_length']:.2f} | {took} |")


if __name__ == "__main__":
    main()
