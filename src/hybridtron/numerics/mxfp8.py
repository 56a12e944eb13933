"""MXFP8 (OCP microscaling, the comparison format): E4M3 elements, 32-element 1D blocks, UE8M0 scales.

Recipe (NVIDIA's cuBLAS/TE MXFP8 scaling, torchao ``ScaleCalculationMode.RCEIL``)::

    e     = clamp(ceil(log2(block_amax / 448)), -127, 127)     scale byte = e + 127 (UE8M0)
    q_i   = e4m3_rne(x_i * 2^-e)                               |x_i * 2^-e| <= 448 by construction
    x_hat = e4m3_value(q_i) * 2^e

There is no per-tensor scale. Rounding the scale up means no element saturates; the price is up to one
binade of range at the bottom of each block. ``ceil(log2(.))`` is computed exactly (frexp) from the fp32
``block_amax / 448`` (an all-zero block gets e = -127).

Against torchao's ``MXTensor.to_mx(..., scaling_mode=RCEIL)`` on CPU: torchao takes ``ceil(torch.log2(.))``,
whose fp32 log2 can round a quotient a few ulps above a power of two down to the power itself (one binade
off), and for scale byte 0 it multiplies by 1 instead of 2^127. Neither occurs on ordinary data.

Layout: the block matrix of :mod:`hybridtron.numerics.blocks` (rows are all dims but ``dim``, blocks run
along ``dim``, zero-padded to a multiple of 32). ``data`` holds E4M3 bytes [rows, cols_padded], ``scales``
UE8M0 bytes [rows, cols_padded/32]. ``quantize``/``dequantize``/``fake_quantize`` work on its cache-sized row
chunks and round with its exact fp32 E4M3 bit trick; the ``*_ref`` twins read the exponent from the fp32 bit
fields, divide by ``torch.pow`` scales and use torch's float8 casts both ways.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hybridtron.numerics.blocks import (
    E4M3_MAX,
    blockwise_amax,
    check_finite,
    e4m3_from_bytes,
    e4m3_round_,
    from_block_matrix,
    output_matrix,
    restore_zero_signs_,
    row_chunks,
    scratch,
    to_block_matrix,
)

BLOCK_SIZE = 32
E8M0_BIAS = 127


@dataclass(frozen=True)
class MXFP8Quantized:
    """An MXFP8-quantized tensor: E4M3 element bytes and UE8M0 block-scale bytes."""

    data: Tensor  # uint8 [rows, cols_padded], E4M3 bytes
    scales: Tensor  # uint8 [rows, cols_padded // 32], biased exponents
    shape: torch.Size
    dim: int


def _scale_exponent(block_amax: Tensor) -> Tensor:
    """int32 ``clamp(ceil(log2(block_amax / 448)), -127, 127)``, exact (frexp: q = m * 2^k, m in [0.5, 1))."""
    quotient = block_amax / E4M3_MAX
    mantissa, exponent = torch.frexp(quotient)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # exact powers of two: log2 is exponent - 1
    exponent = torch.where(quotient == 0, torch.full_like(exponent, -E8M0_BIAS), exponent)
    return exponent.clamp_(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def _pow2(exponent: Tensor) -> Tensor:
    """fp32 2^exponent for int32 exponents in [-127, 127] (2^-127 is subnormal: built by halving 2^-126)."""
    normal = torch.bitwise_left_shift(exponent.clamp(min=-126) + 127, 23).view(torch.float32)
    return torch.where(exponent < -126, normal * 0.5, normal)


def _blocks(x: Tensor, dim: int) -> tuple[Tensor, int, Tensor]:
    """(padded fp32 matrix, normalized dim, per-block scale exponents)."""
    matrix, d = to_block_matrix(x, dim, BLOCK_SIZE, use_scratch=True)
    block_amax = blockwise_amax(matrix, BLOCK_SIZE)
    if block_amax.numel():
        check_finite(block_amax.max(), "MXFP8 quantize")
    return matrix, d, _scale_exponent(block_amax)


def quantize(x: Tensor, *, dim: int = -1) -> MXFP8Quantized:
    """Quantize ``x`` to MXFP8 with 32-element blocks along ``dim``."""
    matrix, d, exponent = _blocks(x, dim)
    rows, cols = matrix.shape
    data = torch.empty((rows, cols), dtype=torch.uint8, device=x.device)
    scale_inv = _pow2(-exponent)[:, :, None]
    for r0, r1 in row_chunks(matrix):
        scaled = matrix[r0:r1].view(r1 - r0, -1, BLOCK_SIZE) * scale_inv[r0:r1]  # exact: a power of two
        data[r0:r1].view(torch.float8_e4m3fn).copy_(scaled.view(r1 - r0, cols))  # torch's cast is RNE
    return MXFP8Quantized(data=data, scales=(exponent + E8M0_BIAS).to(torch.uint8), shape=x.shape, dim=d)


def dequantize(q: MXFP8Quantized, dtype: torch.dtype = torch.float32) -> Tensor:
    """Values ``e4m3_value * 2^e`` in the original shape."""
    rows, cols = q.data.shape
    out = torch.empty((rows, cols), dtype=torch.float32, device=q.data.device)
    scale = _pow2(q.scales.to(torch.int32) - E8M0_BIAS)[:, :, None]
    for r0, r1 in row_chunks(out):
        values = e4m3_from_bytes(q.data[r0:r1]).view(r1 - r0, -1, BLOCK_SIZE)
        torch.mul(values, scale[r0:r1], out=out[r0:r1].view(r1 - r0, -1, BLOCK_SIZE))
    return from_block_matrix(out, q.shape, q.dim).to(dtype)


def fake_quantize(x: Tensor, *, dim: int = -1, out: Tensor | None = None) -> Tensor:
    """``dequantize(quantize(x))`` in one pass without the byte encoding; fp32, in x's shape. ``out``: as for
    :func:`hybridtron.numerics.nvfp4.fake_quantize`."""
    matrix, d, exponent = _blocks(x, dim)
    rows, cols = matrix.shape
    out = output_matrix(matrix, out)
    scale, scale_inv = _pow2(exponent)[:, :, None], _pow2(-exponent)[:, :, None]
    chunks = row_chunks(matrix)
    work = scratch("work", (chunks[0][1], cols), torch.int32, x.device) if chunks else None
    for r0, r1 in chunks:
        x_blocks = matrix[r0:r1].view(r1 - r0, -1, BLOCK_SIZE)
        y = out[r0:r1].view(r1 - r0, -1, BLOCK_SIZE)
        torch.mul(x_blocks, scale_inv[r0:r1], out=y)
        chunk_work = work[: r1 - r0].view(y.shape)
        e4m3_round_(y, chunk_work)  # |y| <= 448 by the choice of scale
        restore_zero_signs_(y, x_blocks, chunk_work)  # -0 for small negatives, as the cast gives
        y.mul_(scale[r0:r1])
    return from_block_matrix(out, x.shape, d)


def quantize_ref(x: Tensor, *, dim: int = -1) -> MXFP8Quantized:
    """Reference twin of :func:`quantize`: exponent from the fp32 bit fields, torch's float8 cast."""
    matrix, d = to_block_matrix(x, dim, BLOCK_SIZE)
    rows, cols = matrix.shape
    blocks = matrix.view(rows, cols // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = blocks.abs().amax(dim=-1) if blocks.numel() else blocks.new_zeros(blocks.shape[:2])
    if block_amax.numel():
        check_finite(block_amax.max(), "MXFP8 quantize")
    quotient_bits = (block_amax / E4M3_MAX).view(torch.int32).long()
    biased_exponent, fraction = quotient_bits >> 23, quotient_bits & 0x7FFFFF
    # ceil(log2(q)) for normal q: exponent, plus one unless q is a power of two. Subnormal or zero q
    # (below 2^-126) all clamp to the bottom of the range, except q in (2^-127, 2^-126) -> -126.
    ceil_log2 = torch.where(
        biased_exponent > 0,
        biased_exponent - 127 + (fraction != 0).long(),
        torch.where(fraction > (1 << 22), torch.full_like(fraction, -126), torch.full_like(fraction, -127)),
    )
    exponent = ceil_log2.clamp(-E8M0_BIAS, E8M0_BIAS)
    scale = torch.pow(2.0, exponent.double()).float()
    elements = (blocks * (1.0 / scale)[:, :, None]).to(torch.float8_e4m3fn)
    return MXFP8Quantized(
        data=elements.view(torch.uint8).view(rows, cols),
        scales=(exponent + E8M0_BIAS).to(torch.uint8),
        shape=x.shape,
        dim=d,
    )


def dequantize_ref(q: MXFP8Quantized, dtype: torch.dtype = torch.float32) -> Tensor:
    """Reference twin of :func:`dequantize`."""
    rows = q.data.shape[0]
    values = q.data.view(torch.float8_e4m3fn).to(torch.float32).view(rows, -1, BLOCK_SIZE)
    scale = torch.pow(2.0, q.scales.double() - E8M0_BIAS).float()
    return from_block_matrix((values * scale[:, :, None]).view(rows, -1), q.shape, q.dim).to(dtype)


def fake_quantize_ref(x: Tensor, *, dim: int = -1) -> Tensor:
    """Reference twin of :func:`fake_quantize`."""
    return dequantize_ref(quantize_ref(x, dim=dim))
