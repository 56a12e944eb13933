"""`hybridtron quantize`: NVFP4 / FP8 post-training quantization into ModelOpt's unified checkpoint, read back."""

import importlib.util
import json
import struct

import pytest
import torch
from safetensors import safe_open

from hybridtron.checkpoint import load_pretrained
from hybridtron.checkpoint.hf import FP32_TENSORS, HF_QUANT_CONFIG
from hybridtron.cli import main
from hybridtron.deploy.quantize import quantize_checkpoint
from hybridtron.numerics import nvfp4, ptq
from hybridtron.numerics.export_policy import export_plan, weight_bytes

torchao_nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")

EXPERT = "backbone.layers.1.mixer.experts.up_proj"


@pytest.fixture(scope="module")
def source(trained_run):
    """The trained run's HF export in fp32, eval mode."""
    return load_pretrained(trained_run / "hf", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def nvfp4_out(trained_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("quantized") / "nvfp4"
    report = quantize_checkpoint(trained_run, out, "nvfp4", calib=8)
    return out, report


def real_weight(model) -> torch.Tensor:
    return model.get_parameter(EXPERT)[0].detach()  # [192, 96]: one routed expert's up_proj


def test_nvfp4_codes_and_scales_equal_the_emulation_and_torchao(source):
    w = real_weight(source)
    q, emulated = ptq.quantize_nvfp4(w, "max"), nvfp4.quantize(w)
    assert torch.equal(q.weight, emulated.codes)
    assert torch.equal(q.weight_scale.view(torch.uint8), emulated.scales)
    assert q.weight_scale_2.item() == nvfp4.global_scales(emulated.amax)[1].item()
    assert torch.equal(ptq.nvfp4_values(q.weight, q.weight_scale, q.weight_scale_2), nvfp4.fake_quantize(w))

    amax = w.abs().max()
    ao = torchao_nvfp4.NVFP4Tensor.to_nvfp4(w, per_tensor_scale=torchao_nvfp4.per_tensor_amax_to_scale(amax))
    assert torch.equal(q.weight, ao.qdata.view(torch.uint8))
    assert torch.equal(q.weight_scale.view(torch.uint8), ao.scale.view(torch.uint8))
    # torchao's (and ModelOpt's) amax / 2688 against TE's 1 / (2688 / amax): equal or one ulp apart
    assert abs(q.weight_scale_2.item() - (amax / 2688).item()) <= torch.finfo(torch.float32).eps * q.weight_scale_2


@pytest.mark.slow  # importing modelopt takes 20-50 s on 2 cores
@pytest.mark.skipif(importlib.util.find_spec("modelopt") is None,
                    reason="nvidia-modelopt is not installed (pip install nvidia-modelopt: it runs on a CPU)")
def test_nvfp4_equals_modelopt(source):
    from modelopt.torch.quantization.qtensor import NVFP4QTensor  # optional dependency, heavy to import

    w = real_weight(source)
    packed, block_scales, global_scale = NVFP4QTensor.quantize(w, 16)
    q = ptq.quantize_nvfp4(w, "max")
    assert torch.equal(q.weight, packed._quantized_data)
    assert torch.equal(q.weight_scale.view(torch.uint8), block_scales.view(torch.uint8))
    assert abs(q.weight_scale_2.item() - global_scale.item()) <= torch.finfo(torch.float32).eps * global_scale
    dequantized = packed.dequantize(torch.float32, scale=block_scales, double_scale=global_scale,
                                    block_sizes={-1: 16})
    assert torch.allclose(dequantized, ptq.nvfp4_values(q.weight, q.weight_scale, q.weight_scale_2),
                          rtol=2 * torch.finfo(torch.float32).eps, atol=0)


def test_mse_scales_never_worse_than_max_on_any_block(source):
    for name in (EXPERT, "backbone.layers.0.mixer.in_proj.weight"):
        w = source.get_parameter(name).detach()
        w = w[0] if w.ndim == 3 else w
        max_errors = ptq.block_errors(w, ptq.quantize_nvfp4(w, "max"))
        mse_errors = ptq.block_errors(w, ptq.quantize_nvfp4(w, "mse"))
        assert (mse_errors <= max_errors).all()
        assert mse_errors.sum() < 0.95 * max_errors.sum()  # measured: 10-20% less on these weights


def test_e2m1_rounding_of_the_mse_path_matches_the_fast_path():
    x = torch.cat([torch.randn(32, 256), torch.linspace(-12, 12, 256).repeat(8, 1)]) * 0.01
    q = nvfp4.quantize(x)
    s_dec = nvfp4.global_scales(q.amax)[1]
    blocks = x.view(-1, 16, 16)
    codes = ptq.e2m1_codes(ptq._scaled(blocks, nvfp4.e4m3_from_bytes(q.scales), s_dec)).view(x.shape)
    assert torch.equal(codes[:, 0::2] | (codes[:, 1::2] << 4), q.codes)


def tensor_file_bytes(directory) -> int:
    """model.safetensors less its header: what export_policy.weight_bytes counts."""
    path = directory / "model.safetensors"
    return path.stat().st_size - 8 - struct.unpack("<Q", path.read_bytes()[:8])[0]


def fake_quantized(model, policy, fmt):
    """The model's weights as the quantized checkpoint holds them: quantized ones fake-quantized by the emulation
    (each expert its own tensor), the rest rounded to bf16 (the router stays fp32)."""
    quantized = {w.name for w in export_plan(model, policy) if w.quantized}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in quantized:
                for matrix in (param if param.ndim == 3 else [param]):
                    if fmt == "nvfp4":
                        matrix.copy_(nvfp4.fake_quantize(matrix))
                    else:
                        q = ptq.quantize_fp8(matrix)
                        matrix.copy_(q.weight.float() * q.weight_scale)
            elif not FP32_TENSORS.search(name):
                param.copy_(param.to(torch.bfloat16))
    return model


def test_nvfp4_checkpoint_files_and_logits(trained_run, nvfp4_out):
    out, report = nvfp4_out
    quant = json.loads((out / HF_QUANT_CONFIG).read_text())
    assert quant["producer"]["name"] == "hybridtron"
    assert quant["quantization"]["quant_algo"] == "NVFP4" and quant["quantization"]["group_size"] == 16
    excluded = quant["quantization"]["exclude_modules"]
    assert excluded == report.excluded
    for name in ("lm_head", "backbone.layers.0.mixer.out_proj", "backbone.layers.2.mixer.q_proj",
                 "backbone.layers.1.mixer.fc1_latent_proj", "backbone.layers.1.mixer.gate",
                 "backbone.layers.7.mixer.experts*", "mtp.layers.0.eh_proj"):
        assert name in excluded
    assert "backbone.layers.0.mixer.in_proj" not in excluded and "backbone.layers.1.mixer.experts*" not in excluded
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "modelopt" and config["quant_algo"] == "NVFP4"
    assert config["ignore"] == excluded
    assert config["config_groups"]["group_0"]["weights"] == {"dynamic": False, "num_bits": 4, "type": "float",
                                                             "group_size": 16}
    assert (out / "tokenizer.json").read_bytes() == (trained_run / "hf" / "tokenizer.json").read_bytes()

    with safe_open(out / "model.safetensors", framework="pt") as f:
        prefix = "backbone.layers.1.mixer.experts.3.up_proj"
        assert f.get_tensor(f"{prefix}.weight").dtype == torch.uint8
        assert f.get_tensor(f"{prefix}.weight").shape == (192, 48)
        assert f.get_tensor(f"{prefix}.weight_scale").dtype == torch.float8_e4m3fn
        assert f.get_tensor(f"{prefix}.weight_scale").shape == (192, 6)
        assert f.get_tensor(f"{prefix}.weight_scale_2").shape == ()
        assert f.get_tensor(f"{prefix}.input_scale").item() > 0
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
        assert f.get_tensor("backbone.layers.1.mixer.gate.weight").dtype == torch.float32
    loaded = load_pretrained(out, dtype=torch.float32).eval()
    assert tensor_file_bytes(out) == weight_bytes(loaded, "nvfp4", "ultra").total

    reference = fake_quantized(load_pretrained(trained_run / "hf", dtype=torch.float32), "ultra", "nvfp4").eval()
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = loaded(ids), reference(ids)
    assert torch.equal(got.logits, want.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.mtp_logits, want.mtp_logits))


def test_fp8_experts_policy_logits(trained_run, tmp_path, capsys):
    assert main(["quantize", "--model", str(trained_run / "hf"), "--format", "fp8", "--policy", "experts",
                 "--calib", "4", "--out", str(tmp_path / "fp8")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"{tmp_path / 'fp8'}: FP8, policy experts"
    # four MoE layers (the tail's and the MTP block's too) x up/down x 8 experts
    assert printed[1].startswith("  quantized weight matrices: 64; left in BF16: ")
    assert printed[2] == "  calibration: 4 held-out rows, 256 tokens"
    quant = json.loads((tmp_path / "fp8" / HF_QUANT_CONFIG).read_text())["quantization"]
    assert quant["quant_algo"] == "FP8" and "group_size" not in quant
    assert "backbone.layers.0.mixer.in_proj" in quant["exclude_modules"]
    loaded = load_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    assert tensor_file_bytes(tmp_path / "fp8") == weight_bytes(loaded, "fp8", "experts").total
    reference = fake_quantized(load_pretrained(trained_run / "hf", dtype=torch.float32), "experts", "fp8").eval()
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_input_scales_come_from_calibration(nvfp4_out):
    out, report = nvfp4_out
    with safe_open(out / "model.safetensors", framework="pt") as f:
        scales = {k: f.get_tensor(k).item() for k in f.keys() if k.endswith(".input_scale")}
    assert len(scales) == report.quantized
    # layer 0's in_proj reads the normed embeddings; every expert of a layer has a scale of its own or its layer's max
    assert all(0 < value < 1 for value in scales.values())
    assert report.calibration_rows == 8 and report.seconds["quantize"] > 0


def test_bad_input_one_line(trained_run, nvfp4_out, tmp_path, capsys):
    out, _ = nvfp4_out
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(out, tmp_path / "again", "nvfp4")
    with pytest.raises(ValueError, match="--format: expected one of nvfp4, fp8, got 'int4'"):
        quantize_checkpoint(trained_run, tmp_path / "x", "int4")
    with pytest.raises(ValueError, match="--scales: expected one of max, mse, got 'l1'"):
        quantize_checkpoint(trained_run, tmp_path / "x", "nvfp4", scales="l1")
    with pytest.raises(ValueError, match="--scales mse: chooses NVFP4's block scales; FP8 has one scale per tensor"):
        quantize_checkpoint(trained_run, tmp_path / "x", "fp8", scales="mse")
    with pytest.raises(ValueError, match="--policy: expected one of ultra, experts, all, got 'most'"):
        quantize_checkpoint(trained_run, tmp_path / "x", "nvfp4", policy="most")
    with pytest.raises(ValueError, match=r"--calib 1000000: the held-out split of .* has \d+ rows of 64 tokens"):
        quantize_checkpoint(trained_run, tmp_path / "x", "nvfp4", calib=1_000_000)
    assert main(["quantize", "--model", str(tmp_path / "nowhere"), "--format", "nvfp4",
                 "--out", str(tmp_path / "y")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"hybridtron quantize: error: --model {tmp_path / 'nowhere'}: no such directory (expected an HF "
                   f"checkpoint directory or a run directory)"]
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
