"""The SSM state stored in lower precision, with stochastic rounding.

A Mamba state is rounded every time it is stored, once per decoded token, and carried forward by h <- a h + b.
Round-to-nearest (RTN) makes the same choice every time, so its error accumulates as a bias: an increment below
half a unit in the last place is lost for good. Stochastic rounding (SR) rounds up with probability equal to the
distance from the lower neighbour, so the stored value is unbiased (E[round(x)] = x) and the errors average out.
The report (Table 16, on Super, vs an fp32 cache): FP16 SR -0.32% accuracy / +1.13% verbosity; INT8 SR block 128
0.00% / +2.03%; FP16 RTN 2.32% / 10.84%; INT8 RTN 2.87% / 10.72%.

Modes:
  fp32                        stored as is (the baseline).
  fp16_sr / bf16_sr           the two representable neighbours lo <= x <= hi of the format; store hi with probability
                              (x - lo) / (hi - lo). Values beyond the format's largest finite number saturate to it.
  fp16_rtn / bf16_rtn         the plain cast (round to nearest even), saturated the same way.
  int8_sr                     blocks of 128 along the last axis (the state axis N of [.., heads, head_dim, N]),
                              s = absmax / 127 per block (fp32), q = clamp(floor(x / s + U[0,1)), -127, 127),
                              dequantized q * s. A last partial block is its own block; an all-zero block has s = 0
                              and stores zeros.
  int8_rtn                    the same blocks, q = clamp(round(x / s), -127, 127) (half to even).

Pure torch. The serving cache (`hybridtron.infer.cache.StoredMambaState`) holds `quantize_state`'s values and
scales (`stored_layout`: their dtype and shapes) and reads them back with `dequantize_state`; `roundtrip` is the
reference it is tested against: the same rounding, kept in an fp32 buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridtron.model.memory import INT8_BLOCK

INT8_MAX = 127
FLOAT_FORMATS = {"fp16": torch.float16, "bf16": torch.bfloat16}
MODES = ("fp32", "fp16_sr", "fp16_rtn", "bf16_sr", "bf16_rtn", "int8_sr", "int8_rtn")


@dataclass(frozen=True)
class StoredState:
    """A state as the cache holds it. `values` has the state's shape (fp32, fp16, bf16 or int8); `scales` is
    [..., ceil(N / 128)] fp32 for the int8 modes, None otherwise."""

    mode: str
    values: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + (0 if self.scales is None else self.scales.nbytes)


def stored_layout(shape: tuple[int, ...], mode: str) -> tuple[torch.dtype, tuple[int, ...] | None]:
    """(the dtype of the stored values, the shape of the int8 modes' scales or None) of a state of `shape` stored
    in `mode` (not fp32): what `quantize_state` returns for it, so a cache can preallocate both."""
    _check_mode(mode)
    fmt = mode.split("_")[0]
    if fmt == "int8":
        return torch.int8, (*shape[:-1], -(-shape[-1] // INT8_BLOCK))
    return FLOAT_FORMATS[fmt], None


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"state quantization mode {mode!r} is unknown; expected one of {', '.join(MODES)}")


def _uniform_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)


def stochastic_round_float(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator | None = None
                           ) -> torch.Tensor:
    """Round fp32 values to fp16/bf16 neighbours, up with probability (x - lo) / (hi - lo); saturates at ±max."""
    limit = torch.finfo(dtype).max
    x = x.float().clamp(-limit, limit)
    nearest = x.to(dtype)
    above = nearest.float() > x
    # The neighbour on the other side of x: one step down from a rounded-up value, one step up otherwise.
    other = torch.nextafter(nearest, torch.where(above, -torch.inf, torch.inf).to(dtype))
    lo = torch.where(above, other, nearest).float()
    hi = torch.where(above, nearest, other).float()
    # Both neighbours and x are fp32-exact, so x - lo and hi - lo are exact; an exact x gives probability 0.
    # At x = max, hi is inf and the probability 0 / inf = 0.
    prob_up = (x - lo) / (hi - lo)
    return torch.where(_uniform_like(x, generator) < prob_up, hi, lo).to(dtype)


def round_nearest_float(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The plain cast, saturated at the format's largest finite value like the stochastic mode."""
    limit = torch.finfo(dtype).max
    return x.float().clamp(-limit, limit).to(dtype)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[..., N] fp32 -> [..., ceil(N/128), 128], the last block zero-padded (padding never raises an absmax)."""
    n = x.shape[-1]
    padded = F.pad(x.float(), (0, (-n) % INT8_BLOCK))
    return padded.reshape(*x.shape[:-1], -1, INT8_BLOCK)


def quantize_int8(x: torch.Tensor, stochastic: bool, generator: torch.Generator | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-128 int8 along the last axis: (q int8 [..., N], scales fp32 [..., ceil(N/128)])."""
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"int8 state quantization needs a non-empty last axis, got shape {tuple(x.shape)}")
    blocks = _blocks(x)
    scales = blocks.abs().amax(dim=-1) / INT8_MAX
    # A zero block keeps s = 0 (it dequantizes to zeros); divide it by 1 instead, its values are all 0.
    scaled = blocks / torch.where(scales == 0, 1.0, scales).unsqueeze(-1)
    if stochastic:
        q = torch.floor(scaled + _uniform_like(scaled, generator))
    else:
        q = torch.round(scaled)
    q = q.clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    n = x.shape[-1]
    return q.reshape(*x.shape[:-1], -1)[..., :n], scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q * the scale of its block, fp32 [..., N], contiguous. Each element's scale is gathered by index: the padded
    block form (pad, reshape, multiply, slice) and a repeat_interleave of the scales both give wrong values
    compiled by inductor on a CPU (torch 2.13), and the compiled decode step reads the state through this."""
    block_of = torch.arange(q.shape[-1], device=q.device) // INT8_BLOCK
    return q.float() * scales[..., block_of]


def quantize_state(x: torch.Tensor, mode: str, generator: torch.Generator | None = None) -> StoredState:
    """Store a state in `mode` (see the module docstring); the generator drives the stochastic modes."""
    _check_mode(mode)
    if mode == "fp32":
        return StoredState(mode, x.float())
    fmt, rounding = mode.split("_")
    if fmt == "int8":
        q, scales = quantize_int8(x, rounding == "sr", generator)
        return StoredState(mode, q, scales)
    dtype = FLOAT_FORMATS[fmt]
    values = stochastic_round_float(x, dtype, generator) if rounding == "sr" else round_nearest_float(x, dtype)
    return StoredState(mode, values)


def dequantize_state(stored: StoredState, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The stored state back in `dtype` (fp32 by default, the dtype the SSM update runs in)."""
    if stored.scales is not None:
        return dequantize_int8(stored.values, stored.scales).to(dtype)
    return stored.values.to(dtype)


def roundtrip(x: torch.Tensor, mode: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """What the state becomes after being stored and read back, in x's dtype."""
    return dequantize_state(quantize_state(x, mode, generator), x.dtype)
