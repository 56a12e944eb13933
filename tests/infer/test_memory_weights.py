"""`hybridtron memory --weights`: a checkpoint's weight bytes by format and export policy, per GPU."""

import json

import pytest

from hybridtron.cli import main
from hybridtron.config import preset
from hybridtron.infer.memory import GiB, weights_table
from hybridtron.model.lm import HybridLM
from hybridtron.numerics.export_policy import export_plan, matrix_bytes, weight_bytes
from hybridtron.numerics.policy import precision_plan


def test_export_policies_on_the_tiny_preset():
    model = HybridLM.on_meta(preset("tiny"))
    trainer_nvfp4 = {g.name for g in precision_plan(model, "nvfp4", "ultra") if g.format == "nvfp4"}
    plans = {policy: export_plan(model, policy) for policy in ("ultra", "experts", "all")}
    assert {w.module for w in plans["ultra"] if w.quantized} == trainer_nvfp4
    assert {w.role for w in plans["experts"] if w.quantized} == {"moe.experts"}
    assert {w.role for w in plans["all"] if not w.quantized} == {"moe.gate", "lm_head"}
    ultra = {w.name: w.quantized for w in plans["ultra"]}
    assert ultra["backbone.layers.0.mixer.in_proj.weight"] and not ultra["backbone.layers.0.mixer.out_proj.weight"]
    assert not ultra["backbone.layers.7.mixer.experts.up_proj"]  # the BF16 tail: the last of 8 layers
    assert not any(v for k, v in ultra.items() if k.startswith("mtp."))
    with pytest.raises(ValueError, match="export policy must be one of ultra, experts, all; got 'most'"):
        export_plan(model, "most")


def test_weight_bytes_count_codes_scales_and_bf16():
    assert matrix_bytes(192 * 96, 1, "nvfp4") == 192 * 96 // 2 + 192 * 96 // 16 + 8
    assert matrix_bytes(8 * 192 * 96, 8, "fp8") == 8 * 192 * 96 + 8 * 8
    model = HybridLM.on_meta(preset("tiny"))
    bf16 = weight_bytes(model, "bf16", "all")
    routers = sum(t.numel() for n, t in model.state_dict().items() if ".gate." in n)
    assert bf16.total == 2 * bf16.parameters + 2 * routers and bf16.quantized_parameters == 0
    nvfp4 = weight_bytes(model, "nvfp4", "all")
    saved = sum(2 * t.numel() - matrix_bytes(t.numel(), t.shape[0] if t.ndim == 3 else 1, "nvfp4")
                for n, t in model.named_parameters()
                if n in {w.name for w in export_plan(model, "all") if w.quantized})
    assert bf16.total - nvfp4.total == saved
    with pytest.raises(ValueError, match="weights must be one of nvfp4, fp8, bf16; got 'int4'"):
        weight_bytes(model, "int4")


def test_ultra3_on_eight_h100s_against_the_report():
    """The report: FP8 ~540 GiB leaves ~10 GiB per GPU of 8 x 80 GiB, NVFP4 ~330 GiB ~40 GiB. Quantizing the
    routed experts alone lands within 3% of both totals (ultra3: 560B parameters); the trainer's policy keeps
    its BF16 tail's experts in BF16 too, about 105 GiB more."""
    experts = {row.weights: row for row in weights_table(preset("ultra3"), "experts", 8, 80)}
    assert 540 * GiB < experts["fp8"].total < 560 * GiB and 9 * GiB < experts["fp8"].left_per_gpu < 12 * GiB
    assert 330 * GiB < experts["nvfp4"].total < 345 * GiB and 36 * GiB < experts["nvfp4"].left_per_gpu < 40 * GiB
    assert experts["bf16"].left_per_gpu < 0  # 1 TiB of BF16 does not fit
    ultra = {row.weights: row for row in weights_table(preset("ultra3"), "ultra", 8, 80)}
    assert 100 * GiB < ultra["nvfp4"].total - experts["nvfp4"].total < 110 * GiB
    assert ultra["bf16"].total == experts["bf16"].total


def test_memory_command_prints_the_weights_table(capsys):
    """`--weights` alone prints the weights table alone (what docs/deployment.md shows); `--context` or
    `--budget-gib` adds the cache table before it."""
    assert main(["memory", "--preset", "ultra3", "--weights", "fp8", "--policy", "experts"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and lines[0] == "ultra3: weights under export policy 'experts' on 8 GPUs of 80 GiB"
    for cache in (["--context", "65536"], ["--budget-gib", "80"]):
        assert main(["memory", "--preset", "ultra3", "--weights", "fp8", "--policy", "experts", *cache]) == 0
        out = capsys.readouterr().out
        assert out.startswith("ultra3: 12 attention layers, 48 Mamba layers") and "KV cache (fp8) per token" in out
        assert out.splitlines()[-5] == "ultra3: weights under export policy 'experts' on 8 GPUs of 80 GiB"
    assert main(["memory", "--preset", "ultra3", "--weights", "fp8", "--policy", "experts", "--context", "65536"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines.index("ultra3: weights under export policy 'experts' on 8 GPUs of 80 GiB")
    fp8 = next(line for line in lines[header:] if line.strip().startswith("fp8"))
    assert fp8.split() == ["fp8", "554.4", "GiB", "69.3", "GiB", "10.7", "GiB", "<-"]
    assert main(["memory", "--preset", "ultra3", "--weights", "nvfp4", "--gpus", "4", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    rows = printed["weights"]
    assert [row["weights"] for row in rows] == ["nvfp4", "fp8", "bf16"] and rows[0]["gpus"] == 4
    assert list(printed) == ["weights"]
    assert main(["memory", "--preset", "tiny", "--weights", "nvfp4", "--gpus", "0"]) != 0
    assert capsys.readouterr().err.strip() == "hybridtron memory: error: --gpus: expected a number of GPUs >= 1, got 0"
