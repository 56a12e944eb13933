"""NVFP4 quantization: fast path == TE-chain reference bit for bit; agreement with torchao on normal data (and
its two documented differences on subnormal/zero blocks); 2D transpose invariance; stochastic rounding."""

from __future__ import annotations

import pytest
import torch

from hybridtron.numerics import blocks, nvfp4
from hybridtron.numerics.nvfp4 import FLT_MAX, NVFP4Quantized

torchao_nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns, so equality also distinguishes -0.0 from 0.0."""
    return t.contiguous().view(torch.int32)


def assert_same_quantized(a: NVFP4Quantized, b: NVFP4Quantized) -> None:
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales, b.scales)
    assert torch.equal(bits(a.amax.reshape(1)), bits(b.amax.reshape(1)))
    assert (a.shape, a.dim, a.block_2d) == (b.shape, b.dim, b.block_2d)


def special_blocks(with_max: bool) -> torch.Tensor:
    """Normal data plus an all-zero block and blocks whose E4M3 scale is subnormal or rounds to 0; optionally a
    block reaching finfo.max, which makes every other block's scale underflow."""
    x = torch.randn(32, 64) * 2
    x[0, :16] = 0.0
    ramp = torch.linspace(-1.0, 1.0, 16)
    x[1, :16] = 6e-5 * ramp  # block scale between 2^-9 and 2^-6: subnormal
    x[2, 32:48] = 2e-5 * ramp
    x[5, :16] = 1e-6 * ramp  # block scale below 2^-10: rounds to zero
    if with_max:
        x[3, 16:32] = torch.finfo(torch.float32).max * torch.linspace(-1, 1, 16)
    return x


CASES = [  # shape, dim, block_2d
    ((64, 256), -1, False),
    ((33, 50), -1, False),  # cols padded 50 -> 64
    ((40, 70), 0, False),  # blocks along dim 0, padded
    ((3, 5, 40), 1, False),  # 3-D, middle dim
    ((48, 64), -1, True),
    ((35, 77), -1, True),  # both dims padded for 16x16 tiles
    ((35, 77), 0, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,dim,block_2d", CASES)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("chunk_elements", [None, 200])
def test_fast_path_matches_reference_bit_for_bit(shape, dim, block_2d, dtype, stochastic, chunk_elements, monkeypatch):
    if chunk_elements is not None:  # many row chunks, the last one partial
        monkeypatch.setattr(blocks, "_CHUNK_ELEMENTS", chunk_elements)
    x = (torch.randn(shape) * 3).to(dtype)
    x.view(-1)[:24] = 0.0
    x.view(-1)[30:40] *= -1e-3  # small negatives: some round to -0 (code 8)

    def run(quantize_fn, fake_fn):
        g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
        q = quantize_fn(x, dim=dim, block_2d=block_2d, stochastic_rounding=stochastic, generator=g1)
        f = fake_fn(x, dim=dim, block_2d=block_2d, stochastic_rounding=stochastic, generator=g2)
        return q, f

    q_fast, f_fast = run(nvfp4.quantize, nvfp4.fake_quantize)
    q_ref, f_ref = run(nvfp4.quantize_ref, nvfp4.fake_quantize_ref)
    assert_same_quantized(q_fast, q_ref)
    d_fast, d_ref = nvfp4.dequantize(q_fast), nvfp4.dequantize_ref(q_ref)
    assert d_fast.shape == x.shape and d_fast.dtype == torch.float32
    assert torch.equal(bits(d_fast), bits(d_ref))
    assert torch.equal(bits(f_fast), bits(d_fast))  # the fused path is quantize -> dequantize exactly
    assert torch.equal(bits(f_ref), bits(d_ref))


GROUP_CASES = [  # shape, dim, block_2d, group rows (rows of the block matrix: all dims but `dim`)
    ((70, 50), -1, False, [7, 0, 40, 23]),  # an empty group; cols padded 50 -> 64
    ((3, 40, 24), 1, False, [24, 24, 24]),  # three [40, 24] weights quantized along their dim 0
    ((1200, 16), -1, False, [300, 1, 899]),  # the [blocks, 16] layout of the grouped GEMM's flat buffers
    ((64, 77), -1, True, [16, 32, 16]),  # 16x16 tiles: groups of whole tile rows
    ((40, 77), -1, True, [32, 8]),  # the last group may end in a partial tile row
]


def _group_slices(x: torch.Tensor, dim: int, group_rows: list[int]) -> list[torch.Tensor]:
    """Each group as a tensor of its own: the rows of x's block matrix (x with `dim` moved last, flattened)."""
    moved = x.movedim(dim, -1)
    rows = moved.reshape(-1, moved.shape[-1])
    starts = torch.tensor([0] + group_rows).cumsum(0).tolist()
    return [rows[a:b] for a, b in zip(starts[:-1], starts[1:])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,dim,block_2d,group_rows", GROUP_CASES)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("chunk_elements", [None, 200])
def test_group_rows_quantize_each_group_alone(shape, dim, block_2d, group_rows, dtype, stochastic, chunk_elements,
                                              monkeypatch):
    """group_rows == quantizing each group on its own by the reference (own amax), SR draws one after another."""
    if chunk_elements is not None:  # chunks that cut across groups
        monkeypatch.setattr(blocks, "_CHUNK_ELEMENTS", chunk_elements)
    x = torch.randn(shape) * torch.logspace(-3, 3, shape[-1])  # groups with different amaxes
    x.view(-1)[:20] = 0.0
    x = x.to(dtype)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    grouped = nvfp4.fake_quantize(x, dim=dim, block_2d=block_2d, stochastic_rounding=stochastic, generator=g1,
                                  group_rows=group_rows)
    expected = [nvfp4.fake_quantize_ref(part, block_2d=block_2d, stochastic_rounding=stochastic, generator=g2)
                for part in _group_slices(x, dim, group_rows)]
    assert grouped.shape == x.shape
    assert torch.equal(bits(torch.cat(_group_slices(grouped, dim, group_rows))), bits(torch.cat(expected)))
    assert torch.equal(g1.get_state(), g2.get_state())


def test_out_buffer_and_group_rows_validation():
    x = torch.randn(33, 50)
    out = torch.full((33 * 64,), float("nan"))
    result = nvfp4.fake_quantize(x, stochastic_rounding=True, generator=torch.Generator().manual_seed(1), out=out)
    assert result.data_ptr() == out.data_ptr()
    fresh = nvfp4.fake_quantize(x, stochastic_rounding=True, generator=torch.Generator().manual_seed(1))
    assert torch.equal(bits(result), bits(fresh))
    with pytest.raises(ValueError, match="out must be"):
        nvfp4.fake_quantize(x, out=torch.empty(33 * 50))
    with pytest.raises(ValueError, match="sum to"):
        nvfp4.fake_quantize(x, group_rows=[30, 2])
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.fake_quantize(torch.randn(48, 32), block_2d=True, group_rows=[8, 40])
    with pytest.raises(ValueError, match="NaN or Inf"):
        bad = torch.randn(32, 32)
        bad[20, 3] = float("nan")
        nvfp4.fake_quantize(bad, group_rows=[16, 16])


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("with_max", [False, True])
def test_subnormal_zero_and_max_blocks_follow_te_chain(block_2d, with_max):
    x = special_blocks(with_max)
    q, q_ref = nvfp4.quantize(x, block_2d=block_2d), nvfp4.quantize_ref(x, block_2d=block_2d)
    assert_same_quantized(q, q_ref)
    assert torch.equal(bits(nvfp4.dequantize(q)), bits(nvfp4.dequantize_ref(q_ref)))
    assert torch.equal(bits(nvfp4.fake_quantize(x, block_2d=block_2d)), bits(nvfp4.dequantize(q)))
    if with_max:
        # amax = FLT_MAX: S_enc = 2688 / FLT_MAX; the finfo.max block takes the largest scale 448 (0x7E) and
        # every ordinary block's scale underflows to 0, so those blocks dequantize to zero.
        assert q.amax.item() == FLT_MAX
        assert q.global_encode_scale.item() == (torch.tensor(2688.0) / FLT_MAX).item()
        assert q.scales[3, 1].item() == 0x7E
        if not block_2d:
            assert (q.scales[4:] == 0).all() and (nvfp4.dequantize(q)[4:] == 0).all()
    elif not block_2d:
        assert q.scales[0, 0] == 0 and (q.codes[0, :8] == 0).all()  # all-zero block: scale 0, codes 0
        assert 0 < q.scales[1, 0] < 8 and 0 < q.scales[2, 2] < 8  # subnormal E4M3 scales
        assert q.scales[5, 0] == 0  # a non-zero block whose scale rounds to zero


def test_torchao_floors_subnormal_and_zero_scales():
    """Documented differences: torchao floors block scales at 2^-6 (0x08), so subnormal and zero scales (an
    all-zero block included) become 0x08; every other scale byte is TE's."""
    x = special_blocks(with_max=False)
    q = nvfp4.quantize(x)
    assert (q.scales < 8).sum() >= 4
    ao = _torchao_quantize(x)
    assert torch.equal(ao.scale.view(torch.uint8), torch.clamp(q.scales, min=0x08))


def _torchao_quantize(x: torch.Tensor):
    amax = x.abs().max()
    return torchao_nvfp4.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=torchao_nvfp4.per_tensor_amax_to_scale(amax))


def _assert_matches_torchao(x: torch.Tensor) -> tuple[int, int]:
    """Compare with torchao, explaining every difference by the one documented cause: torchao computes the
    block scale as (block_amax/6)/pts and the element multiplier as (1/pts)/s_b (pts = amax/2688), where TE has
    block_amax*(S_enc*(1/6)) and 1/(s_b*S_dec). These agree to an ulp, so they round differently only when a
    value sits within an ulp of an E4M3 or E2M1 decision point. Returns (scale, code) mismatch counts."""
    q, ao = nvfp4.quantize(x), _torchao_quantize(x)
    rows, cols = x.shape
    blocks = x.float().view(rows, cols // 16, 16)
    block_amax = blocks.abs().amax(dim=-1)
    s_enc, s_dec = nvfp4.global_scales(q.amax)
    pts = torchao_nvfp4.per_tensor_amax_to_scale(x.abs().max())
    te_scale = torch.clamp(block_amax * (s_enc * torch.tensor(1 / 6)), max=448)
    ao_scale = torch.clamp((block_amax / 6) / pts, min=2**-6, max=448)
    ao_bytes = ao.scale.view(torch.uint8)
    assert torch.equal(ao_bytes, ao_scale.to(torch.float8_e4m3fn).view(torch.uint8))
    scale_differs = q.scales != ao_bytes
    assert not (scale_differs & (te_scale == ao_scale)).any()

    ours, theirs = nvfp4.unpack_codes(q.codes), nvfp4.unpack_codes(ao.qdata.view(torch.uint8))
    s_b = q.scales.view(torch.float8_e4m3fn).float()[:, :, None]
    te_scaled = torch.clamp(blocks * torch.clamp(1.0 / (s_b * s_dec), max=FLT_MAX), -6, 6).view(rows, cols)
    ao_s_b = ao_bytes.view(torch.float8_e4m3fn).float()[:, :, None]
    ao_scaled = torch.clamp(blocks * ((1.0 / pts) / ao_s_b), -6, 6).view(rows, cols)
    sign = torch.signbit(ao_scaled).to(torch.uint8) << 3
    assert torch.equal(nvfp4.e2m1_index_rne(ao_scaled.abs()) | sign, theirs)  # same E2M1 encoder
    same_scale = (~scale_differs).repeat_interleave(16, dim=1)
    code_differs = (ours != theirs) & same_scale
    assert not (code_differs & (te_scaled == ao_scaled)).any()
    return int(scale_differs.sum()), int(code_differs.sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torchao_on_normal_data(dtype):
    x = (torch.randn(256, 512) * 4).to(dtype)
    scale_mismatches, code_mismatches = _assert_matches_torchao(x)
    # Measured on this data: fp32 0 and 0; bf16 (coarse values hit decision points) 0.3% of scales, 0.1% of codes.
    assert scale_mismatches <= x.numel() // 16 // 100 and code_mismatches <= x.numel() // 200
    if dtype == torch.float32:
        assert scale_mismatches == 0 and code_mismatches <= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_te_boundary_pattern(dtype):
    """TE's boundary test: linspace(-12, 12, N/2) +- 1e-3, repeated over rows, lands next to every threshold."""
    rows, n = 32, 256
    base = torch.linspace(-12.0, 12.0, n // 2)
    x = torch.cat([base - 1e-3, base + 1e-3]).repeat(rows, 1).to(dtype)
    q = nvfp4.quantize(x)
    assert_same_quantized(q, nvfp4.quantize_ref(x))
    assert torch.equal(bits(nvfp4.dequantize(q)), bits(nvfp4.dequantize_ref(q)))
    _assert_matches_torchao(x)


def test_e2m1_rounding_thresholds_ties_to_even_code():
    """Every decision threshold, its fp32 neighbours and each grid value, through the fast rounding kernel,
    against TE's table and torchao's encoder."""
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked

    points = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 1e-30])
    around = torch.cat([points, torch.nextafter(points, torch.tensor(0.0)), torch.nextafter(points, torch.tensor(9.0))])
    y = torch.cat([around, -around]).repeat(1, 2)[:, :128]  # 128 columns = 8 blocks
    y = torch.nn.functional.pad(y, (0, 128 - y.shape[1]))
    values = torch.empty_like(y)
    work = torch.empty_like(y, dtype=torch.int32)
    nvfp4._round_chunk(y, torch.ones(1, 8), values, work, None, None)
    half = torch.empty_like(y, dtype=torch.float16)
    lo = torch.empty((1, 64), dtype=torch.int32)
    codes = torch.empty((1, 64), dtype=torch.uint8)
    nvfp4._pack_values(values.clone(), half, lo, torch.empty_like(lo), codes)
    clamped = y.clamp(-6, 6)
    expected = nvfp4.e2m1_index_rne(clamped.abs()) | (torch.signbit(clamped).to(torch.uint8) << 3)
    assert torch.equal(nvfp4.unpack_codes(codes), expected)
    assert torch.equal(expected, f32_to_f4_unpacked(clamped))
    assert torch.equal(bits(values), bits(nvfp4.e2m1_values(expected)))


def test_dequantize_every_byte():
    codes = torch.arange(256, dtype=torch.uint8).repeat(4, 1)  # [4, 256] -> 512 columns, 32 blocks per row
    scales = torch.randint(0, 0x7F, (4, 32), dtype=torch.uint8)
    scales[0, :8] = torch.arange(8, dtype=torch.uint8)  # zero and subnormal scales
    q = NVFP4Quantized(codes, scales, torch.tensor(3.7), torch.Size((4, 512)), 1, False)
    assert torch.equal(bits(nvfp4.dequantize(q)), bits(nvfp4.dequantize_ref(q)))


def test_two_d_blocks_are_transpose_invariant():
    w = torch.randn(40, 72) * torch.logspace(-2, 1, 72)  # column-varying magnitudes: scales differ per tile
    q, q_t = nvfp4.quantize(w, block_2d=True), nvfp4.quantize(w.t(), block_2d=True)
    assert torch.equal(bits(nvfp4.dequantize(q).t()), bits(nvfp4.dequantize(q_t)))
    assert torch.equal(nvfp4.unpack_codes(q.codes)[:, :72].t(), nvfp4.unpack_codes(q_t.codes)[:, :40])
    # One scale per 16x16 tile, repeated over the tile's rows; tile (i, j) of W is tile (j, i) of W^T.
    tiles = q.scales[::16]
    assert torch.equal(q.scales, tiles.repeat_interleave(16, dim=0)[:40])
    assert torch.equal(tiles, q_t.scales[::16].t())
    # Quantizing along dim 0 uses the same tiles, so the values are the same as along dim 1.
    assert torch.equal(bits(nvfp4.fake_quantize(w, dim=0, block_2d=True)), bits(nvfp4.dequantize(q)))


def test_one_d_blocks_are_not_transpose_invariant():
    w = torch.randn(32, 64) * torch.logspace(-2, 1, 64)
    assert not torch.equal(nvfp4.fake_quantize(w).t(), nvfp4.fake_quantize(w.t()))


def test_stochastic_rounding_is_unbiased():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=gen)
    draws = 400
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(draws):
        total += nvfp4.fake_quantize(x, stochastic_rounding=True, generator=gen)
    mean = total / draws
    # SR is unbiased for the scaled value clamp(x * enc_b, -6, 6) (the clamp saturates a block maximum whose
    # E4M3 scale rounded down), so the mean converges to that value times s_b * S_dec.
    q = nvfp4.quantize(x)
    s_b = q.scales.view(torch.float8_e4m3fn).double().repeat_interleave(16, dim=1)
    s_dec = q.global_decode_scale.double()
    encode = torch.clamp(1.0 / (s_b.float() * q.global_decode_scale), max=FLT_MAX)
    target = torch.clamp(x * encode, -6, 6).double() * s_b * s_dec
    # Each draw is one of the two grid points around the target, so its standard deviation is at most half the
    # local E2M1 step, which is at most 2 (between 4 and 6) times s_b * S_dec.
    sigma = s_b * s_dec
    assert ((mean - target).abs() <= 5 * sigma / draws**0.5).all()
    rne_error = (nvfp4.fake_quantize(x).double() - target).abs().mean()
    assert (mean - target).abs().mean() < rne_error / 4


def test_stochastic_rounding_beats_rne_on_average():
    """TE's criterion: with seed 12345 and x = randn*2-1, the mean of 50 SR dequantizations is closer (RMSE) to x
    than the RNE dequantization."""
    gen = torch.Generator().manual_seed(12345)
    x = torch.randn(256, 256, generator=gen) * 2 - 1
    sr_mean = torch.stack([nvfp4.fake_quantize(x, stochastic_rounding=True, generator=gen) for _ in range(50)]).mean(0)
    rmse_sr = (sr_mean - x).square().mean().sqrt()
    rmse_rne = (nvfp4.fake_quantize(x) - x).square().mean().sqrt()
    assert rmse_sr < rmse_rne


def test_stochastic_rounding_is_seeded_and_lands_on_neighbours():
    x = torch.randn(8, 64)
    a = nvfp4.fake_quantize(x, stochastic_rounding=True, generator=torch.Generator().manual_seed(3))
    b = nvfp4.fake_quantize(x, stochastic_rounding=True, generator=torch.Generator().manual_seed(3))
    c = nvfp4.fake_quantize(x, stochastic_rounding=True, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    q = nvfp4.quantize(x, stochastic_rounding=True, generator=torch.Generator().manual_seed(3))
    rne = nvfp4.unpack_codes(nvfp4.quantize(x).codes)
    index, rne_index = nvfp4.unpack_codes(q.codes) & 7, rne & 7
    assert ((index.int() - rne_index.int()).abs() <= 1).all()  # SR picks one of the two neighbours


@pytest.mark.parametrize("fn", [nvfp4.quantize, nvfp4.quantize_ref, nvfp4.fake_quantize, nvfp4.fake_quantize_ref])
@pytest.mark.parametrize("bad", [float("nan"), -float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_rejected(fn, bad):
    x = torch.randn(4, 32)
    x[2, 5] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        fn(x)


def test_user_errors():
    with pytest.raises(ValueError, match="floating-point"):
        nvfp4.quantize(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_2d"):
        nvfp4.quantize(torch.ones(2, 4, 16), block_2d=True)
    with pytest.raises(ValueError, match="dim=2"):
        nvfp4.quantize(torch.ones(4, 16), dim=2)


def test_global_scales_follow_te_kernel():
    s_enc, s_dec = nvfp4.global_scales(torch.tensor([0.0, 6.0, 1e-39, 2688.0]))
    assert s_enc.tolist() == [1.0, 448.0, FLT_MAX, 1.0]  # amax 0 -> 1; 2688/amax overflowing -> FLT_MAX
    assert torch.equal(s_dec, 1.0 / s_enc)


def test_zero_and_empty_tensors():
    q = nvfp4.quantize(torch.zeros(4, 32))
    assert q.amax.item() == 0 and q.global_encode_scale.item() == 1.0
    assert (q.codes == 0).all() and (q.scales == 0).all()
    assert torch.equal(nvfp4.dequantize(q), torch.zeros(4, 32))
    for shape in [(0, 32), (3, 0)]:
        assert nvfp4.fake_quantize(torch.zeros(shape)).shape == shape
        assert nvfp4.dequantize(nvfp4.quantize(torch.zeros(shape))).shape == shape
