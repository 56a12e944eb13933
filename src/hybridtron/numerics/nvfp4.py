"""NVFP4: E2M1 elements, E4M3 block scales, an fp32 tensor scale -- bit-faithful to Transformer Engine.

Recipe (TE's reference quantizer ``NVFP4QuantizerRef`` and its CUDA kernels, arXiv 2509.25149 App. B)::

    amax  = max|x|                                   fp32, over the whole tensor
    S_enc = min(448*6 / amax, FLT_MAX)               1 when amax == 0
    S_dec = 1 / S_enc
    s_b   = e4m3_rne(min(block_amax * (S_enc * fp32(1/6)), 448))   no lower clamp: subnormal or 0
    enc_b = min(1 / (s_b * S_dec), FLT_MAX)          all-zero block: s_b = 0, enc_b = FLT_MAX
    q_i   = e2m1_round(clamp(x_i * enc_b, -6, 6))    RNE (ties to the even code) or stochastic
    x_hat = (e2m1_value(q_i) * s_b) * S_dec

Each step is one fp32 IEEE operation, in the order of TE's reference quantizer. Two details
follow TE's code rather than the usual shorthand (``s_b = block_amax * S_enc / 6``, ``S_enc = 1`` when
``448*6/amax`` is not finite): the block scale multiplies by ``S_enc * fp32(1/6)`` (TE folds the 1/6 into the
global multiplier) and a tiny amax whose ``448*6/amax`` overflows gives ``S_enc = FLT_MAX`` (TE's ``fminf``).
The sign of a value that rounds to zero is kept (code 8 is -0), as the hardware conversion and torchao do.

Element E2M1: code = sign<<3 | index, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; two codes per byte with element
2j in the low nibble. Blocks are 16 consecutive elements along ``dim`` (1x16), or 16x16 tiles of a matrix
(``block_2d``) whose one scale is repeated for each of the tile's 16 rows, so W and W^T quantize to the same
values. A block dimension that is not a multiple of 16 is zero-padded (padding never changes an amax);
codes and scales keep the padded columns, dequantize crops them.

Stochastic rounding rounds |y| up to the next E2M1 value with probability equal to its fractional distance
(``u < frac`` with ``u = torch.rand`` drawn once for the padded matrix from the caller's generator).

Non-finite input has no defined hardware behaviour, so it is rejected with a ValueError.

Layout: the block matrix of :mod:`hybridtron.numerics.blocks` (rows are all other dims, in order, after
moving ``dim`` last; columns run along ``dim``). ``codes`` is uint8 [rows, cols_padded/2], ``scales`` uint8
[rows, cols_padded/16] holding E4M3 bytes.

Against torchao's ``NVFP4Tensor`` (with ``per_tensor_scale = pts = amax/2688``): torchao floors block
scales at 2^-6, so subnormal and zero scales (an all-zero block too) become 0x08. It also computes the block
scale as ``(block_amax/6)/pts`` and the element multiplier as ``(1/pts)/s_b``; these agree with TE's values to
an ulp, so they round differently only for a value within an ulp of an E4M3 or E2M1 decision point: on
Gaussian fp32 data about 1 code in 10^7 and no scale byte; on bf16 data, whose coarse grid lands on decision
points far more often, up to ~0.1% of codes and ~0.3% of scale bytes, depending on amax. torchao dequantizes
with ``pts * s_b`` rounded first (TE's chain: ``(v * s_b) * S_dec``), so values can differ in the last bit.

Fast path vs reference: ``quantize``/``dequantize``/``fake_quantize`` are vectorized over the row chunks of
:mod:`hybridtron.numerics.blocks` in reused scratch buffers (stochastic rounding draws each chunk's uniforms as
it rounds it: the same stream), take block maxima over the integer bits of |x|, and round with exact fp32 bit
tricks (magic-number addition for RNE, fp16 subnormals to map E2M1/E4M3 values to their codes, the sign bit
copied with integer ops). ``fake_quantize(..., group_rows=...)`` quantizes consecutive row groups with a
tensor scale each, as if each were a tensor of its own (the experts of a grouped GEMM in one pass).
``quantize_ref``/``dequantize_ref``/``fake_quantize_ref`` spell the chain out with TE's threshold table and
torch's float8 cast; the tests require the two to agree bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridtron.numerics.blocks import (
    E4M3_MAX,
    FP32_EXPONENT_MASK,
    blockwise_amax,
    check_finite,
    chunk_rows,
    e4m3_from_bytes,
    e4m3_round,
    from_block_matrix,
    output_matrix,
    restore_zero_signs_,
    row_chunks,
    scratch,
    to_block_matrix,
)

BLOCK_SIZE = 16
E2M1_MAX = 6.0
FLT_MAX = torch.finfo(torch.float32).max
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# fp32 bit patterns used by the rounding tricks.
_ONE_BITS = 0x3F800000  # 1.0: smallest normal E2M1 value
_E2M1_MAGIC_OFFSET = (22 << 23) | 0x400000  # turns 2^e into 1.5 * 2^(e+22): ulp = 2^(e-1)
_RCP6 = torch.tensor(1.0 / 6.0, dtype=torch.float32)  # fp32(1/6), as TE's constexpr 1.0f/6.0f


@dataclass(frozen=True)
class NVFP4Quantized:
    """An NVFP4-quantized tensor: packed E2M1 codes, E4M3 block-scale bytes and the fp32 tensor amax.

    ``shape`` and ``dim`` describe the original tensor; ``block_2d`` whether scales belong to 16x16 tiles.
    """

    codes: Tensor  # uint8 [rows, cols_padded // 2]
    scales: Tensor  # uint8 [rows, cols_padded // 16], E4M3 bytes
    amax: Tensor  # fp32 scalar
    shape: torch.Size
    dim: int
    block_2d: bool

    @property
    def global_encode_scale(self) -> Tensor:
        return global_scales(self.amax)[0]

    @property
    def global_decode_scale(self) -> Tensor:
        return global_scales(self.amax)[1]


def global_scales(amax: Tensor) -> tuple[Tensor, Tensor]:
    """TE's per-tensor scales ``(S_enc, S_dec)`` for an fp32 amax (S_enc = 1 when amax == 0)."""
    amax = amax.to(torch.float32)
    s_enc = torch.clamp(torch.full_like(amax, E4M3_MAX * E2M1_MAX) / amax, max=FLT_MAX)
    s_enc = torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)
    return s_enc, torch.reciprocal(s_enc)


# ----------------------------------------------------------------------------------------------------------
# Layout: any tensor <-> a padded fp32 matrix with blocks along its rows
# ----------------------------------------------------------------------------------------------------------


def _block_matrix(x: Tensor, dim: int, block_2d: bool, use_scratch: bool = False) -> tuple[Tensor, int]:
    """:func:`~hybridtron.numerics.blocks.to_block_matrix` with 1x16 blocks along ``dim``; 16x16 tiles
    (``block_2d``) need a matrix."""
    if block_2d and x.ndim != 2:
        raise ValueError(f"block_2d (16x16 tiles) needs a 2-D tensor, got shape {tuple(x.shape)}")
    return to_block_matrix(x, dim, BLOCK_SIZE, use_scratch=use_scratch)


def _tile_amax(block_amax: Tensor) -> Tensor:
    """[rows, col_blocks] 1x16 amaxes -> each 16x16 tile's amax, repeated for the tile's 16 rows."""
    rows, col_blocks = block_amax.shape
    padded = F.pad(block_amax, (0, 0, 0, (-rows) % BLOCK_SIZE))
    tiles = padded.view(-1, BLOCK_SIZE, col_blocks).amax(dim=1)
    return tiles.repeat_interleave(BLOCK_SIZE, dim=0)[:rows]


def _new_uniform(matrix: Tensor, generator: torch.Generator | None) -> Tensor:
    """U[0, 1) draws for every element of the padded matrix, in row order (the fast path draws the same stream
    chunk by chunk: consecutive draws continue one sequence)."""
    return torch.rand(matrix.shape, generator=generator, dtype=torch.float32, device=matrix.device)


# ----------------------------------------------------------------------------------------------------------
# Fast path
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _BlockScales:
    amax: Tensor  # fp32 scalar, or [groups] with group rows
    s_dec: Tensor  # fp32 scalar, or [groups]
    scale: Tensor  # fp32 [rows, col_blocks]: E4M3 block scale values s_b
    encode: Tensor  # fp32 [rows, col_blocks]: enc_b
    group_bounds: list[int] | None = None  # first row of each group, then the row count

    def decode_(self, values: Tensor, r0: int) -> None:
        """values (rows r0:r0 + len(values), already times s_b) *= their group's S_dec, in place."""
        if self.group_bounds is None:
            values.mul_(self.s_dec)
            return
        r1 = r0 + values.shape[0]
        for group, (start, end) in enumerate(zip(self.group_bounds[:-1], self.group_bounds[1:])):
            lo, hi = max(start, r0), min(end, r1)
            if lo < hi:
                values[lo - r0 : hi - r0].mul_(self.s_dec[group])


def _block_scales(matrix: Tensor, block_2d: bool, group_rows: list[int] | None = None) -> _BlockScales:
    """Block scales of ``matrix``, with one tensor scale, or one per run of ``group_rows`` rows: the same
    fp32 operations per element, on each row's group's S_enc and S_dec."""
    block_amax = blockwise_amax(matrix, BLOCK_SIZE)
    if block_2d:
        block_amax = _tile_amax(block_amax)
    if group_rows is None:
        amax = block_amax.max() if block_amax.numel() else matrix.new_zeros(())
        check_finite(amax, "NVFP4 quantize")
        s_enc, s_dec = global_scales(amax)
        multiplier, row_s_dec, bounds = s_enc * _RCP6.to(matrix.device), s_dec, None
    else:
        bounds = [0]
        for rows in group_rows:
            bounds.append(bounds[-1] + rows)
        zero = matrix.new_zeros(())
        amax = torch.stack([block_amax[a:b].max() if b > a and block_amax.shape[1] else zero
                            for a, b in zip(bounds[:-1], bounds[1:])])
        check_finite(amax.max() if amax.numel() else zero, "NVFP4 quantize")
        s_enc, s_dec = global_scales(amax)
        lengths = torch.tensor(group_rows, device=matrix.device)
        multiplier, row_s_dec = (v.repeat_interleave(lengths, output_size=bounds[-1])[:, None]
                                 for v in (s_enc * _RCP6.to(matrix.device), s_dec))
    scale = e4m3_round(torch.clamp(block_amax * multiplier, max=E4M3_MAX))
    encode = torch.clamp(torch.reciprocal(scale * row_s_dec), max=FLT_MAX)
    return _BlockScales(amax=amax, s_dec=s_dec, scale=scale, encode=encode, group_bounds=bounds)


def _round_chunk(
    x: Tensor, encode: Tensor, y: Tensor, work: Tensor, uniform: Tensor | None, spare: Tensor | None
) -> None:
    """y <- e2m1_round(clamp(x * encode, -6, 6)) with x's sign on zeros; x, y, work: [n, cols]."""
    n, cols = x.shape
    blocks = cols // BLOCK_SIZE
    torch.mul(x.view(n, blocks, BLOCK_SIZE), encode[:, :, None], out=y.view(n, blocks, BLOCK_SIZE))
    y.clamp_(-E2M1_MAX, E2M1_MAX)
    # 2^floor(log2|y|), floored at 1.0: below 1 the E2M1 grid is uniform with spacing 0.5.
    torch.bitwise_and(y.view(torch.int32), FP32_EXPONENT_MASK, out=work)
    work.clamp_(min=_ONE_BITS)
    if uniform is None:
        magic = work.add_(_E2M1_MAGIC_OFFSET).view(torch.float32)
        y.add_(magic).sub_(magic)
    else:
        spacing = work.sub_(1 << 23).view(torch.float32)  # 0.5, 1 or 2: the grid step around |y|
        assert spare is not None
        quotient = torch.abs(y, out=spare).div_(spacing)  # exact: spacing is a power of two
        torch.floor(quotient, out=y)
        # Round up when u < frac: ceil(frac - u) is exactly that indicator (1, or 0 / -0), as a float in place.
        y.add_(quotient.sub_(y).sub_(uniform).ceil_()).mul_(spacing)
    restore_zero_signs_(y, x, work)


def _round_matrix(
    matrix: Tensor, scales: _BlockScales, stochastic_rounding: bool, generator: torch.Generator | None, emit
) -> None:
    """Round ``matrix`` chunk by chunk; ``emit(row0, row1, values)`` consumes each chunk's signed E2M1 values.
    Stochastic rounding draws each chunk's uniforms just before rounding it, so they stay in cache."""
    chunks = row_chunks(matrix)
    if not chunks:
        return
    n, cols = chunks[0][1], matrix.shape[1]
    y = scratch("values", (n, cols), torch.float32, matrix.device)
    work = scratch("work", (n, cols), torch.int32, matrix.device)
    if stochastic_rounding:
        uniform = scratch("uniform", (n, cols), torch.float32, matrix.device)
        spare = scratch("spare", (n, cols), torch.float32, matrix.device)
    for r0, r1 in chunks:
        m = r1 - r0
        u = s = None
        if stochastic_rounding:
            u, s = torch.rand((m, cols), generator=generator, out=uniform[:m]), spare[:m]
        _round_chunk(matrix[r0:r1], scales.encode[r0:r1], y[:m], work[:m], u, s)
        emit(r0, r1, y[:m])


def _pack_values(values: Tensor, half: Tensor, lo: Tensor, hi: Tensor, out: Tensor) -> None:
    """Signed E2M1 values [n, cols] -> packed code bytes [n, cols/2] (element 2j in the low nibble).

    ``values * 2^-14`` maps E2M1's smallest normal 1.0 onto fp16's 2^-14: 0.5 becomes an fp16 subnormal and
    each code's index sits in fp16 bits 9..11 with the sign in bit 15. Two fp16 words read as one int32 hold
    an element pair; the shifts below gather the two nibbles into the low byte.
    """
    half.copy_(values.mul_(2.0**-14))
    pair = half.view(torch.int32)  # [n, cols/2]
    torch.bitwise_right_shift(pair, 3, out=lo).bitwise_and_(0x10001000)  # sign bits 15, 31 -> 12, 28
    torch.bitwise_and(pair, 0x0E000E00, out=hi).bitwise_or_(lo)  # nibbles at bits 9..12 and 25..28
    hi.bitwise_right_shift_(9)  # nibbles at 0..3 and 16..19
    torch.bitwise_right_shift(hi, 12, out=lo).bitwise_or_(hi)
    out.copy_(lo)  # int32 -> uint8 keeps the low byte


def quantize(
    x: Tensor,
    *,
    dim: int = -1,
    block_2d: bool = False,
    stochastic_rounding: bool = False,
    generator: torch.Generator | None = None,
) -> NVFP4Quantized:
    """Quantize ``x`` (fp32/bf16/fp16) to NVFP4 with 1x16 blocks along ``dim`` (or 16x16 tiles)."""
    matrix, d = _block_matrix(x, dim, block_2d, use_scratch=True)
    scales = _block_scales(matrix, block_2d)
    rows, cols = matrix.shape
    codes = torch.empty((rows, cols // 2), dtype=torch.uint8, device=x.device)
    n = min(rows, chunk_rows(matrix)) if codes.numel() else 0
    half = scratch("half", (n, cols), torch.float16, x.device)
    lo = scratch("lo", (n, cols // 2), torch.int32, x.device)
    hi = scratch("hi", (n, cols // 2), torch.int32, x.device)

    def emit(r0: int, r1: int, values: Tensor) -> None:
        m = r1 - r0
        _pack_values(values, half[:m], lo[:m], hi[:m], codes[r0:r1])

    _round_matrix(matrix, scales, stochastic_rounding, generator, emit)
    return NVFP4Quantized(
        codes=codes,
        scales=scales.scale.to(torch.float8_e4m3fn).view(torch.uint8),  # exact: already E4M3 values
        amax=scales.amax,
        shape=x.shape,
        dim=d,
        block_2d=block_2d,
    )


def dequantize(q: NVFP4Quantized, dtype: torch.dtype = torch.float32) -> Tensor:
    """Values ``(e2m1 * s_b) * S_dec`` of ``q`` in its original shape (fp32 unless ``dtype`` is given)."""
    rows, cols = q.codes.shape[0], q.codes.shape[1] * 2
    blocks = cols // BLOCK_SIZE
    # s_b * 2^14 undoes the 2^-14 of the fp16 encoding below; both products are exact.
    scale = e4m3_from_bytes(q.scales).mul_(2.0**14)
    s_dec = global_scales(q.amax)[1]
    out = torch.empty((rows, cols), dtype=torch.float32, device=q.codes.device)
    chunks = row_chunks(out)
    n = chunks[0][1] if chunks else 0
    byte = scratch("lo", (n, cols // 2), torch.int32, q.codes.device)
    sign = scratch("hi", (n, cols // 2), torch.int32, q.codes.device)
    for r0, r1 in chunks:
        m = r1 - r0
        b = byte[:m]
        b.copy_(q.codes[r0:r1])
        # One multiply copies the byte to two offsets at once (the copies do not overlap, so no carries):
        # index bits 0..2 -> 9..11 and 4..6 -> 25..27, sign bits 3 -> 15 and 7 -> 31. The result read as two
        # fp16 words is the element pair scaled by 2^-14 (see _pack_values).
        s = torch.mul(b, (1 << 12) | (1 << 24), out=sign[:m]).bitwise_and_(-0x7FFF8000)  # 0x80008000
        b.mul_((1 << 9) | (1 << 21)).bitwise_and_(0x0E000E00).bitwise_or_(s)
        o = out[r0:r1]
        o.copy_(b.view(torch.float16))
        o.view(m, blocks, BLOCK_SIZE).mul_(scale[r0:r1, :, None])
        o.mul_(s_dec)
    return from_block_matrix(out, q.shape, q.dim).to(dtype)


def fake_quantize(
    x: Tensor,
    *,
    dim: int = -1,
    block_2d: bool = False,
    stochastic_rounding: bool = False,
    generator: torch.Generator | None = None,
    group_rows: list[int] | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """``dequantize(quantize(x, ...))`` fused into one pass over the data; fp32, in x's shape.

    ``group_rows`` splits the rows (all dims but ``dim``, in order) into consecutive groups that each get their
    own tensor scale, exactly as if each group were quantized on its own (with 16x16 tiles, every group but the
    last must have a multiple of 16 rows); the stochastic-rounding draws cover the whole padded matrix in row
    order, i.e. the groups' draws one after another. This lets many small tensors (the experts of a grouped
    GEMM) be quantized in one pass.

    ``out``: a contiguous fp32 buffer with as many elements as the padded matrix (a reused one spares the
    allocation); the result is then a view of it.
    """
    matrix, d = _block_matrix(x, dim, block_2d, use_scratch=True)
    if group_rows is not None:
        if sum(group_rows) != matrix.shape[0] or min(group_rows, default=0) < 0:
            raise ValueError(f"group_rows {group_rows} must be non-negative and sum to the {matrix.shape[0]} rows")
        if block_2d and any(rows % BLOCK_SIZE for rows in group_rows[:-1]):
            raise ValueError(f"group_rows {group_rows}: with 16x16 tiles each group but the last needs a multiple "
                             f"of {BLOCK_SIZE} rows")
    scales = _block_scales(matrix, block_2d, group_rows)
    rows, cols = matrix.shape
    out = output_matrix(matrix, out)
    blocks = cols // BLOCK_SIZE

    def emit(r0: int, r1: int, values: Tensor) -> None:
        o = out[r0:r1]
        shape = (r1 - r0, blocks, BLOCK_SIZE)
        torch.mul(values.view(shape), scales.scale[r0:r1, :, None], out=o.view(shape))  # exact: v * s_b
        scales.decode_(o, r0)

    _round_matrix(matrix, scales, stochastic_rounding, generator, emit)
    return from_block_matrix(out, x.shape, d)


# ----------------------------------------------------------------------------------------------------------
# Reference (TE's chain written out; slow, readable)
# ----------------------------------------------------------------------------------------------------------


def e2m1_index_rne(magnitude: Tensor) -> Tensor:
    """E2M1 index 0..7 of |y| <= 6 by TE's threshold table (ties go to the even index): the reference quantizer's
    rounding, and post-training quantization's (numerics.ptq)."""
    thresholds_up_to_even = (  # (threshold, a tie rounds up)
        (0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)
    )
    index = torch.zeros(magnitude.shape, dtype=torch.uint8, device=magnitude.device)
    for threshold, tie_up in thresholds_up_to_even:
        index += (magnitude >= threshold) if tie_up else (magnitude > threshold)
    return index


def _e2m1_index_sr_ref(magnitude: Tensor, uniform: Tensor) -> Tensor:
    """Stochastic E2M1 index: round up with probability (|y| - lo) / (hi - lo)."""
    grid = torch.tensor(E2M1_MAGNITUDES, device=magnitude.device)
    lower = torch.searchsorted(grid, magnitude, right=True) - 1
    upper = torch.clamp(lower + 1, max=len(E2M1_MAGNITUDES) - 1)
    lo, hi = grid[lower], grid[upper]
    fraction = torch.where(hi > lo, (magnitude - lo) / (hi - lo), torch.zeros_like(magnitude))
    return (lower + (uniform < fraction).long()).to(torch.uint8)


def quantize_ref(
    x: Tensor,
    *,
    dim: int = -1,
    block_2d: bool = False,
    stochastic_rounding: bool = False,
    generator: torch.Generator | None = None,
) -> NVFP4Quantized:
    """Reference twin of :func:`quantize` (same arguments, same random draws, same result bit for bit)."""
    matrix, d = _block_matrix(x, dim, block_2d)
    rows, cols = matrix.shape
    blocks = matrix.view(rows, cols // BLOCK_SIZE, BLOCK_SIZE)
    block_amax = blocks.abs().amax(dim=-1) if blocks.numel() else blocks.new_zeros(blocks.shape[:2])
    if block_2d:
        block_amax = _tile_amax(block_amax)
    amax = matrix.abs().max() if matrix.numel() else matrix.new_zeros(())
    check_finite(amax, "NVFP4 quantize")
    s_enc, s_dec = global_scales(amax)
    scale_e4m3 = torch.clamp(block_amax * (s_enc * _RCP6.to(x.device)), max=E4M3_MAX).to(torch.float8_e4m3fn)
    encode = torch.clamp(1.0 / (scale_e4m3.to(torch.float32) * s_dec), max=FLT_MAX)
    scaled = torch.clamp(blocks * encode[:, :, None], -E2M1_MAX, E2M1_MAX).view(rows, cols)
    if stochastic_rounding:
        index = _e2m1_index_sr_ref(scaled.abs(), _new_uniform(matrix, generator))
    else:
        index = e2m1_index_rne(scaled.abs())
    codes = index | (torch.signbit(scaled).to(torch.uint8) << 3)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return NVFP4Quantized(
        codes=packed,
        scales=scale_e4m3.view(torch.uint8),
        amax=amax,
        shape=x.shape,
        dim=d,
        block_2d=block_2d,
    )


def unpack_codes(codes: Tensor) -> Tensor:
    """Packed bytes [..., n] -> E2M1 codes [..., 2n] (uint8, 0..15), element 2j from the low nibble."""
    return torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)


def e2m1_values(codes: Tensor) -> Tensor:
    """fp32 values of unpacked E2M1 codes (code 8 is -0.0)."""
    table = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), device=codes.device)
    return table[codes.long()]


def dequantize_ref(q: NVFP4Quantized, dtype: torch.dtype = torch.float32) -> Tensor:
    """Reference twin of :func:`dequantize`."""
    values = e2m1_values(unpack_codes(q.codes))
    rows, cols = values.shape
    scale = q.scales.view(torch.float8_e4m3fn).to(torch.float32)
    s_dec = global_scales(q.amax)[1]
    blocks = values.view(rows, cols // BLOCK_SIZE, BLOCK_SIZE)
    out = (blocks * scale[:, :, None]) * s_dec
    return from_block_matrix(out.view(rows, cols), q.shape, q.dim).to(dtype)


def fake_quantize_ref(
    x: Tensor,
    *,
    dim: int = -1,
    block_2d: bool = False,
    stochastic_rounding: bool = False,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Reference twin of :func:`fake_quantize`."""
    q = quantize_ref(x, dim=dim, block_2d=block_2d, stochastic_rounding=stochastic_rounding, generator=generator)
    return dequantize_ref(q)
