"""SSM state quantization: stochastic rounding is unbiased, round-to-nearest is not; int8 block handling."""

import math

import pytest
import torch

from hybridtron.infer.state_quant import (
    INT8_BLOCK, MODES, dequantize_state, quantize_state, roundtrip, stochastic_round_float,
)

DRAWS = 2000


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def repeat(x: torch.Tensor) -> torch.Tensor:
    """DRAWS independent copies of x along a new first axis (blocks never span copies)."""
    return x.expand(DRAWS, *x.shape).contiguous()


def neighbours(x: torch.Tensor, dtype):
    """The representable values of `dtype` just below and just above each x (equal when x is representable)."""
    down = x.to(dtype)
    down = torch.where(down.float() > x, torch.nextafter(down, torch.tensor(-math.inf, dtype=dtype)), down)
    up = torch.where(down.float() < x, torch.nextafter(down, torch.tensor(math.inf, dtype=dtype)), down)
    return down.float(), up.float()


@pytest.mark.parametrize("fmt,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_float_sr_picks_a_neighbour_and_is_unbiased(fmt, dtype):
    x = torch.randn(512, generator=gen(1)) * torch.logspace(-6, 3, 512)  # normals and fp16 subnormals
    lo, hi = neighbours(x, dtype)
    draws = roundtrip(repeat(x), f"{fmt}_sr", gen(100))
    assert ((draws == lo) | (draws == hi)).all()
    # mean of Bernoulli draws between lo and hi: standard error <= (hi - lo) / (2 sqrt(N)); allow 6 of them
    tolerance = 6 * (hi - lo) / (2 * math.sqrt(DRAWS))
    assert ((draws.mean(0) - x).abs() <= tolerance).all()
    # the fraction rounded up matches (x - lo) / (hi - lo)
    gap = hi > lo
    up_share = (draws == hi).float().mean(0)[gap]
    expected = ((x - lo) / (hi - lo))[gap]
    assert (up_share - expected).abs().max() < 6 * 0.5 / math.sqrt(DRAWS)


@pytest.mark.parametrize("fmt,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_float_rtn_is_biased_where_sr_is_not(fmt, dtype):
    """x a quarter of the way from 1.0 to the next value: RTN always rounds down (bias -ulp/4), SR averages out."""
    ulp = float(torch.finfo(dtype).eps)
    x = torch.full((4096,), 1.0 + ulp / 4)
    rtn = roundtrip(x, f"{fmt}_rtn")
    assert torch.equal(rtn, torch.ones_like(x))
    sr = roundtrip(x, f"{fmt}_sr", gen(3))
    assert abs(float(sr.mean()) - (1.0 + ulp / 4)) < 6 * ulp * math.sqrt(3 / 16) / math.sqrt(4096)
    assert 0.2 < float((sr > 1).float().mean()) < 0.3


def test_accumulation_rtn_stalls_sr_tracks_fp32():
    """A state h <- h + 2.4e-4 stored in fp16 every step: each increment is below half an ulp at 1.0 (4.9e-4), so
    RTN never moves, while SR follows the fp32 sum in expectation (the mechanism behind Table 16)."""
    steps, walkers, increment = 400, 256, 2.4e-4
    h_rtn = torch.ones(walkers)
    h_sr = torch.ones(walkers)
    generator = gen(4)
    for _ in range(steps):
        h_rtn = roundtrip(h_rtn + increment, "fp16_rtn")
        h_sr = roundtrip(h_sr + increment, "fp16_sr", generator)
    exact = 1.0 + steps * increment
    assert torch.equal(h_rtn, torch.ones(walkers))
    assert abs(float(h_sr.mean()) - exact) < 2e-3
    int8_state = torch.zeros(walkers, INT8_BLOCK)
    int8_state[:, 0] = 127.0  # fixes the block scale at 1.0
    rtn_int8, sr_int8 = int8_state.clone(), int8_state.clone()
    for _ in range(100):
        rtn_int8[:, 1] += 0.3
        sr_int8[:, 1] += 0.3
        rtn_int8 = roundtrip(rtn_int8, "int8_rtn")
        sr_int8 = roundtrip(sr_int8, "int8_sr", generator)
    assert torch.equal(rtn_int8[:, 1], torch.zeros(walkers))
    assert abs(float(sr_int8[:, 1].mean()) - 30.0) < 1.0


def test_float_saturates_instead_of_overflowing():
    x = torch.tensor([1e6, -1e6, 65504.0, 70000.0])
    for mode in ("fp16_sr", "fp16_rtn"):
        out = roundtrip(x, mode, gen(0))
        assert torch.equal(out, torch.tensor([65504.0, -65504.0, 65504.0, 65504.0]))


def test_int8_sr_unbiased_and_rtn_biased_on_crafted_block():
    x = torch.zeros(INT8_BLOCK)
    x[0] = 127.0  # scale 1.0
    x[1:] = 0.3  # RTN stores 0 for every one of them: bias -0.3
    rtn = roundtrip(x, "int8_rtn")
    assert torch.equal(rtn[1:], torch.zeros(INT8_BLOCK - 1)) and rtn[0] == 127.0
    draws = roundtrip(repeat(x), "int8_sr", gen(0))
    assert ((draws[:, 1:] == 0) | (draws[:, 1:] == 1)).all()
    tolerance = 6 * 0.5 / math.sqrt(DRAWS)
    assert (draws.mean(0)[1:] - 0.3).abs().max() < tolerance


def test_int8_sr_unbiased_on_random_states():
    x = torch.randn(4, 3, 200, generator=gen(7)) * torch.logspace(-3, 1, 200)
    stored = quantize_state(x, "int8_sr", gen(0))
    scales = stored.scales
    assert scales.shape == (4, 3, 2) and stored.values.dtype == torch.int8 and stored.values.shape == x.shape
    step = torch.repeat_interleave(scales, INT8_BLOCK, dim=-1)[..., :200]
    draws = roundtrip(repeat(x), "int8_sr", gen(10))
    assert ((draws - x).abs() <= step * (1 + 1e-5)).all()  # within one quantization step
    assert ((draws.mean(0) - x).abs() <= 6 * step / (2 * math.sqrt(DRAWS)) + 1e-7).all()


@pytest.mark.parametrize("n", [1, 5, 127, 128, 129, 300])
def test_int8_blocks_of_any_length(n):
    x = torch.randn(2, n, generator=gen(n))
    x[1, -1] = 50.0  # an outlier in the last (partial) block sets only that block's scale
    for mode in ("int8_rtn", "int8_sr"):
        stored = quantize_state(x, mode, gen(1))
        blocks = math.ceil(n / INT8_BLOCK)
        assert stored.scales.shape == (2, blocks) and stored.values.shape == (2, n)
        expected_scales = torch.stack([x[:, i * INT8_BLOCK:(i + 1) * INT8_BLOCK].abs().amax(-1) / 127
                                       for i in range(blocks)], dim=-1)
        torch.testing.assert_close(stored.scales, expected_scales, rtol=0, atol=0)
        back = dequantize_state(stored)
        # the absmax of every block is stored exactly; every value within one step (SR) or half a step (RTN)
        step = torch.repeat_interleave(stored.scales, INT8_BLOCK, dim=-1)[:, :n]
        bound = step * (0.5 if mode == "int8_rtn" else 1.0) * (1 + 1e-5)
        assert ((back - x).abs() <= bound).all()
        assert back[1, -1] == pytest.approx(50.0, rel=1e-6)
        assert stored.nbytes == 2 * n + 2 * blocks * 4


def test_int8_zero_blocks_and_zero_state():
    x = torch.zeros(3, 256)
    x[1, 200] = -4.0  # row 1: first block zero, second block not
    for mode in ("int8_rtn", "int8_sr"):
        stored = quantize_state(x, mode, gen(0))
        assert torch.equal(stored.scales[0], torch.zeros(2)) and stored.scales[1, 0] == 0
        assert torch.isfinite(dequantize_state(stored)).all()
        assert torch.equal(dequantize_state(stored), x)


def test_modes_roundtrip_dtype_and_errors():
    x = torch.randn(2, 4, 8, 128, generator=gen(2))
    for mode in MODES:
        out = roundtrip(x, mode, gen(0))
        assert out.shape == x.shape and out.dtype == torch.float32
        assert (out - x).abs().max() <= x.abs().max() / 100  # every mode keeps ~2 digits or better
    assert torch.equal(roundtrip(x, "fp32"), x)
    assert quantize_state(x, "bf16_rtn").values.dtype == torch.bfloat16
    assert roundtrip(x.double(), "fp16_sr", gen(0)).dtype == torch.float64
    with pytest.raises(ValueError, match="int4"):
        quantize_state(x, "int4_sr")


def test_seeded_sr_is_reproducible():
    x = torch.randn(1000, generator=gen(5))
    for mode in ("fp16_sr", "bf16_sr", "int8_sr"):
        assert torch.equal(roundtrip(x, mode, gen(9)), roundtrip(x, mode, gen(9)))
        assert not torch.equal(roundtrip(x, mode, gen(9)), roundtrip(x, mode, gen(10)))


def test_stochastic_round_float_exact_values_are_kept():
    x = torch.tensor([0.0, -0.0, 1.0, -2.5, 65504.0, 2.0 ** -24])  # all representable in fp16
    for seed in range(5):
        assert torch.equal(stochastic_round_float(x, torch.float16, gen(seed)).float(), x)
