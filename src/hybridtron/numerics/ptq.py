"""Post-training quantization of one weight matrix, as ModelOpt's unified checkpoint stores it.

NVFP4 (``[out, in]``, blocks of 16 along ``in``, the GEMM's reduction dimension)::

    weight          uint8 [out, in/2]    E2M1 codes, element 2j in the low nibble
    weight_scale    float8_e4m3fn [out, in/16]   block scales s_b
    weight_scale_2  fp32 scalar          the tensor's decode scale S_dec
    value = (e2m1 * s_b) * S_dec

With ``scales="max"`` the codes and scales are our NVFP4 emulation's (:func:`hybridtron.numerics.nvfp4.quantize`,
TE's recipe, round to nearest even) and ``weight_scale_2`` is its ``S_dec = 1 / (448 * 6 / amax)``; ModelOpt writes
``amax / (6 * 448)``, which can differ from it in the last bit (its block scales and codes then differ where a value
sits within an ulp of a decision point). Dequantizing gives exactly :func:`~hybridtron.numerics.nvfp4.fake_quantize`.

``scales="mse"`` searches each block's scale among the E4M3 values around the max scale (``MSE_CODE_STEPS``
codes below it to one above: factors of about 0.6 to 1.1) and keeps the one whose dequantized block has the smallest
squared error; the max scale is the first candidate and is replaced only by a strictly better one, so no block's
error exceeds max's. A smaller scale clips the block's largest element at 6 but gives the others a finer grid.

FP8 (per tensor)::

    weight          float8_e4m3fn [out, in]    round(w / weight_scale), RNE, |.| <= 448
    weight_scale    fp32 scalar                amax / 448 (1 for an all-zero tensor)
    value = fp8 * weight_scale

Activations: ``input_scale`` = calibrated amax / (6 * 448) for NVFP4 (the global scale of the input's dynamic
NVFP4 quantization) and amax / 448 for FP8, as ModelOpt defines them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hybridtron.numerics import nvfp4
from hybridtron.numerics.blocks import E4M3_MAX, check_finite

SCALE_METHODS = ("max", "mse")
MSE_CODE_STEPS = range(-6, 2)  # E4M3 codes around the max scale's: one step is 1/8 of a binade's width
_E4M3_LARGEST_CODE = 0x7E  # 448
_CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class QuantizedMatrix:
    """One matrix as the checkpoint stores it; ``weight_scale_2`` only for NVFP4."""

    weight: Tensor
    weight_scale: Tensor
    weight_scale_2: Tensor | None = None


def input_scale(amax: float, fmt: str) -> Tensor:
    """The fp32 ``input_scale`` of a calibrated input amax."""
    return torch.tensor(amax / (E4M3_MAX * (nvfp4.E2M1_MAX if fmt == "nvfp4" else 1.0)), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------- NVFP4
def _check_matrix(w: Tensor) -> None:
    if w.ndim != 2 or w.shape[1] % nvfp4.BLOCK_SIZE:
        raise ValueError(f"NVFP4 export needs a matrix whose input dimension is a multiple of {nvfp4.BLOCK_SIZE}, "
                         f"got shape {tuple(w.shape)}")


def e2m1_codes(y: Tensor) -> Tensor:
    """Unpacked E2M1 codes (uint8, sign << 3 | index) of fp32 ``y`` in [-6, 6]: nearest value, ties to the even
    index (TE's threshold table), the sign kept on values that round to zero."""
    return nvfp4.e2m1_index_rne(y.abs()) | (torch.signbit(y).to(torch.uint8) << 3)


def _scaled(blocks: Tensor, scale: Tensor, s_dec: Tensor) -> Tensor:
    """clamp(x * enc_b, -6, 6) with enc_b = 1 / (s_b * S_dec) (TE's element multiplier)."""
    encode = torch.clamp(torch.reciprocal(scale * s_dec), max=nvfp4.FLT_MAX)
    return torch.clamp(blocks * encode[..., None], -nvfp4.E2M1_MAX, nvfp4.E2M1_MAX)


def _block_error(blocks: Tensor, scale: Tensor, s_dec: Tensor) -> Tensor:
    values = nvfp4.e2m1_values(e2m1_codes(_scaled(blocks, scale, s_dec)))
    return ((values * scale[..., None]) * s_dec - blocks).square().sum(dim=-1)


def mse_block_scales(blocks: Tensor, max_scale_bytes: Tensor, s_dec: Tensor) -> Tensor:
    """E4M3 scale bytes [rows, blocks] minimizing each block's squared error, from the max scales' bytes."""
    best_bytes = max_scale_bytes.clone()
    best_error = _block_error(blocks, nvfp4.e4m3_from_bytes(best_bytes), s_dec)
    searchable = max_scale_bytes > 0  # an all-zero (or underflowing) block has nothing to trade
    base = max_scale_bytes.to(torch.int16)
    for step in MSE_CODE_STEPS:
        if step == 0:
            continue
        candidate = torch.clamp(base + step, 1, _E4M3_LARGEST_CODE).to(torch.uint8)
        error = _block_error(blocks, nvfp4.e4m3_from_bytes(candidate), s_dec)
        better = searchable & (error < best_error)
        best_bytes = torch.where(better, candidate, best_bytes)
        best_error = torch.where(better, error, best_error)
    return best_bytes


def quantize_nvfp4(w: Tensor, scales: str = "max") -> QuantizedMatrix:
    """``w`` [out, in] in NVFP4 with max or MSE-searched block scales (module docstring)."""
    if scales not in SCALE_METHODS:
        raise ValueError(f"scale method must be one of {', '.join(SCALE_METHODS)}; got {scales!r}")
    _check_matrix(w)
    q = nvfp4.quantize(w)
    s_dec = nvfp4.global_scales(q.amax)[1]
    codes, scale_bytes = q.codes, q.scales
    if scales == "mse":
        rows, cols = w.shape
        step = max(1, _CHUNK_ELEMENTS // cols)
        codes, scale_bytes = torch.empty_like(q.codes), torch.empty_like(q.scales)
        for r0 in range(0, rows, step):
            blocks = w[r0:r0 + step].float().view(-1, cols // nvfp4.BLOCK_SIZE, nvfp4.BLOCK_SIZE)
            chosen = mse_block_scales(blocks, q.scales[r0:r0 + step], s_dec)
            unpacked = e2m1_codes(_scaled(blocks, nvfp4.e4m3_from_bytes(chosen), s_dec)).view(blocks.shape[0], cols)
            codes[r0:r0 + step] = unpacked[:, 0::2] | (unpacked[:, 1::2] << 4)
            scale_bytes[r0:r0 + step] = chosen
    return QuantizedMatrix(weight=codes, weight_scale=scale_bytes.view(torch.float8_e4m3fn),
                           weight_scale_2=s_dec.reshape(()).clone())


def nvfp4_values(weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor) -> Tensor:
    """fp32 [out, in] values of a stored NVFP4 matrix: (e2m1 * s_b) * S_dec, each product in fp32."""
    values = nvfp4.e2m1_values(nvfp4.unpack_codes(weight))
    rows, cols = values.shape
    blocks = values.view(rows, cols // nvfp4.BLOCK_SIZE, nvfp4.BLOCK_SIZE)
    scale = nvfp4.e4m3_from_bytes(weight_scale.view(torch.uint8))
    return ((blocks * scale[:, :, None]) * weight_scale_2.float()).view(rows, cols)


def block_errors(w: Tensor, q: QuantizedMatrix) -> Tensor:
    """Squared error of each 16-element block of ``w`` after a round trip through ``q``, [out, in/16]."""
    rows, cols = w.shape
    diff = nvfp4_values(q.weight, q.weight_scale, q.weight_scale_2) - w.float()
    return diff.view(rows, cols // nvfp4.BLOCK_SIZE, nvfp4.BLOCK_SIZE).square().sum(dim=-1)


# ------------------------------------------------------------------------------------------------------ FP8
def quantize_fp8(w: Tensor) -> QuantizedMatrix:
    """``w`` in FP8 E4M3 with one fp32 scale amax / 448."""
    w = w.float()
    amax = w.abs().max()
    check_finite(amax, "FP8 quantize")
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    weight = torch.clamp(w / scale, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return QuantizedMatrix(weight=weight, weight_scale=scale.reshape(()).clone())


def fp8_values(weight: Tensor, weight_scale: Tensor) -> Tensor:
    """fp32 values of a stored FP8 matrix."""
    return weight.float() * weight_scale.float()
