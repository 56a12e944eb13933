"""The block-quantization core that NVFP4 and MXFP8 share: the block matrix, block maxima, row chunks, E4M3
rounding, finite checks and CPU scratch buffers.

Block matrix: a tensor quantized with blocks along ``dim`` is viewed as a matrix whose rows are all other dims
(in order, after moving ``dim`` last) and whose columns run along ``dim``, zero-padded to a multiple of the
block size (padding never changes an amax). Blocks are then consecutive runs of columns in a row.

Chunks: on a CPU the elementwise passes run over cache-sized runs of rows (about 1 MiB of fp32 each), so that
a chunk stays in cache from its first pass to its last; on an accelerator the whole matrix is one chunk (each
extra kernel launch costs more than the memory traffic it saves).

E4M3 (the element format of MXFP8 and the block-scale format of NVFP4): torch's fp32 -> float8 cast is RNE and
fast, its reverse is slow on a CPU, so values are rounded with an exact fp32 magic-number addition
(:func:`e4m3_round_`) and bytes decoded through fp16 (:func:`e4m3_from_bytes`).
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

E4M3_MAX = 448.0
FP32_EXPONENT_MASK = 0x7F800000

_SIGN_BIT = -(1 << 31)  # 0x80000000 as an int32
_E4M3_MIN_NORMAL_BITS = 0x3C800000  # 2^-6
_E4M3_MAGIC_OFFSET = (20 << 23) | 0x400000  # turns 2^e into 1.5 * 2^(e+20): ulp = 2^(e-3)
_CHUNK_ELEMENTS = 1 << 18  # CPU: rows are processed in chunks of about this many elements (1 MiB of fp32)


# ----------------------------------------------------------------------------------------------------------
# Scratch buffers
# ----------------------------------------------------------------------------------------------------------


class Scratch(threading.local):
    """Per-thread CPU scratch buffers, reused across calls and grown to the largest request.

    On a CPU the first touch of freshly allocated memory (page faults, once glibc has trimmed or unmapped a
    freed block) can cost more than the arithmetic of a whole quantization, so the fast paths take their
    temporaries from here; what they return is always freshly allocated. Accelerators have caching
    allocators, so there a plain allocation is returned.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype], Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        size = math.prod(shape)
        buffer = self.buffers.get((name, dtype))
        if buffer is None or buffer.numel() < size:
            buffer = torch.empty(size, dtype=dtype)
            self.buffers[(name, dtype)] = buffer
        return buffer[:size].view(shape)


_SCRATCH = Scratch()


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A temporary of ``shape`` from the reused buffer ``name`` (see :class:`Scratch`). Its contents are
    undefined, and it is overwritten by the next request of the same name: use it within one call only."""
    return _SCRATCH.get(name, shape, dtype, device)


# ----------------------------------------------------------------------------------------------------------
# Layout: any tensor <-> a padded fp32 matrix with blocks along its rows
# ----------------------------------------------------------------------------------------------------------


def normalize_dim(x: Tensor, dim: int) -> int:
    if not -x.ndim <= dim < max(x.ndim, 1):
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.ndim


def to_block_matrix(x: Tensor, dim: int, block_size: int, *, use_scratch: bool = False) -> tuple[Tensor, int]:
    """x -> (fp32 contiguous [rows, cols padded to block_size], normalized dim). x itself when it already is
    one (fp32, contiguous, ``dim`` last and a multiple of the block size); else a copy, in a scratch buffer when
    ``use_scratch`` (for callers that only read it)."""
    if not x.is_floating_point():
        raise ValueError(f"quantize expects a floating-point tensor, got dtype {x.dtype}")
    if x.ndim == 0:
        raise ValueError("quantize expects a tensor with at least one dimension, got a scalar")
    d = normalize_dim(x, dim)
    moved = x.movedim(d, -1)
    cols = moved.shape[-1]
    rows = moved.numel() // cols if cols else math.prod(moved.shape[:-1])
    padded_cols = -(-cols // block_size) * block_size
    if padded_cols == cols and moved.dtype == torch.float32 and moved.is_contiguous():
        return moved.reshape(rows, cols), d
    shape = (rows, padded_cols)
    if use_scratch:
        matrix = scratch("matrix", shape, torch.float32, x.device)
    else:
        matrix = torch.empty(shape, dtype=torch.float32, device=x.device)
    matrix[:, :cols].copy_(moved.reshape(rows, cols))
    matrix[:, cols:].zero_()
    return matrix, d


def from_block_matrix(matrix: Tensor, shape: torch.Size, dim: int) -> Tensor:
    """Inverse of :func:`to_block_matrix`: crop the padding, restore shape and dim order (a view)."""
    moved_shape = list(shape)
    moved_shape.append(moved_shape.pop(dim))
    cropped = matrix[:, : moved_shape[-1]]
    return cropped.reshape(moved_shape).movedim(-1, dim)


def output_matrix(matrix: Tensor, out: Tensor | None) -> Tensor:
    """A result matrix shaped like ``matrix``: fresh, or the caller's fp32 buffer ``out`` viewed so."""
    if out is None:
        return torch.empty_like(matrix)
    if out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != matrix.numel():
        raise ValueError(f"out must be a contiguous fp32 tensor of {matrix.numel()} elements (the padded matrix "
                         f"{tuple(matrix.shape)}), got {out.dtype} {tuple(out.shape)}")
    return out.view(matrix.shape)


def chunk_rows(matrix: Tensor) -> int:
    """Rows per chunk of a block matrix: cache-sized on a CPU, all of them on an accelerator."""
    rows, cols = matrix.shape
    if matrix.device.type != "cpu":
        return max(rows, 1)
    return max(1, _CHUNK_ELEMENTS // max(cols, 1))


def row_chunks(matrix: Tensor) -> list[tuple[int, int]]:
    """(row0, row1) of each chunk, covering the matrix in order (none for an empty matrix)."""
    if matrix.numel() == 0:
        return []
    rows, step = matrix.shape[0], chunk_rows(matrix)
    return [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]


def blockwise_amax(matrix: Tensor, block_size: int) -> Tensor:
    """max|x| of each 1 x block_size block, [rows, cols/block_size], chunk by chunk. The maximum is taken
    over the bits of |x| as int32 (the order of non-negative floats; NaN's bits exceed Inf's, so NaN
    propagates): a CPU reduces integers over a 16-wide inner dim several times faster than floats."""
    rows, cols = matrix.shape
    blocks = cols // block_size
    out = matrix.new_empty((rows, blocks))
    chunks = row_chunks(matrix)
    if not chunks:
        return out.zero_()
    magnitude = scratch("magnitude", (chunks[0][1], blocks, block_size), torch.float32, matrix.device)
    out_bits = out.view(torch.int32)
    for r0, r1 in chunks:
        level = torch.abs(matrix[r0:r1].view(r1 - r0, blocks, block_size), out=magnitude[: r1 - r0])
        torch.amax(level.view(torch.int32), dim=-1, out=out_bits[r0:r1])
    return out


def check_finite(amax: Tensor, what: str) -> None:
    """ValueError naming ``what`` when ``amax`` (a max|x|) is NaN or Inf: non-finite input has no defined
    hardware behaviour."""
    if not bool(torch.isfinite(amax)):
        raise ValueError(
            f"{what}: input contains NaN or Inf (max|x| = {amax.item()}); only finite values can be quantized"
        )


def restore_zero_signs_(y: Tensor, x: Tensor, work: Tensor) -> None:
    """Give y's zeros the sign of x, in place (y elsewhere already carries x's sign, as a rounding of x times a
    positive scale does): ``copysign(y, x)`` in two integer passes, which beat ``torch.copysign`` on a CPU.
    ``work``: an int32 buffer of y's shape."""
    torch.bitwise_and(x.view(torch.int32), _SIGN_BIT, out=work)
    y.view(torch.int32).bitwise_or_(work)


# ----------------------------------------------------------------------------------------------------------
# E4M3
# ----------------------------------------------------------------------------------------------------------


def e4m3_round(x: Tensor) -> Tensor:
    """Round fp32 values to the nearest E4M3 value (ties to even, subnormals down to 2^-9); fp32 out.

    |x| must be at most 448 (callers clamp). Adding ``M = 1.5 * 2^20 * max(2^floor(log2|x|), 2^-6)`` puts the
    sum in a binade whose ulp is exactly the E4M3 spacing at x, so the fp32 adder does the RNE rounding;
    subtracting M back is exact. Zero results are +0.
    """
    y = x.clone()
    e4m3_round_(y, torch.empty_like(y, dtype=torch.int32))
    return y


def e4m3_round_(y: Tensor, work: Tensor) -> None:
    """In-place :func:`e4m3_round` of fp32 ``y`` using an int32 buffer of its shape."""
    torch.bitwise_and(y.view(torch.int32), FP32_EXPONENT_MASK, out=work)
    magic = work.clamp_(min=_E4M3_MIN_NORMAL_BITS).add_(_E4M3_MAGIC_OFFSET).view(torch.float32)
    y.add_(magic).sub_(magic)


def e4m3_round_ref(x: Tensor) -> Tensor:
    """Reference for :func:`e4m3_round`: torch's float8_e4m3fn cast (RNE); fp32 out."""
    return x.to(torch.float8_e4m3fn).to(torch.float32)


def e4m3_from_bytes(codes: Tensor) -> Tensor:
    """fp32 values of E4M3 bytes (uint8; 0x7F/0xFF, NaN, never produced here, are not decoded).

    Several times faster on a CPU than torch's float8 -> fp32 cast: the byte's exponent and mantissa are moved
    to fp16 bits 7..13, which maps E4M3's smallest normal 2^-6 onto fp16's 2^-14 (E4M3 subnormals become fp16
    subnormals), and the fp16 -> fp32 conversion is exact; the factor 2^8 undoes the shift of exponents.
    """
    b = codes.to(torch.int16)
    h = torch.bitwise_and(b, 0x7F).bitwise_left_shift_(7)
    h.bitwise_or_(torch.bitwise_and(b, 0x80).bitwise_left_shift_(8))
    return h.view(torch.float16).to(torch.float32).mul_(2.0**8)
