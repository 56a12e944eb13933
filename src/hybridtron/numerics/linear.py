"""Emulated low-precision GEMMs for training: the NVFP4 recipe, with MXFP8 and BF16 for comparison.

Each GEMM quantizes its two operands from the high-precision tensors (never by transposing a quantized
tensor), dequantizes them and multiplies in fp32 -- the accumulation precision of the tensor cores.

NVFP4 recipe (TE ``NVFP4BlockScaling``, arXiv 2509.25149, Nemotron 3 Ultra), for ``Y = X W^T``::

    GEMM               operand   blocks               rounding     RHT
    fprop  Y  = X W^T  X         1x16 along K         RNE          no
                       W         16x16                RNE          no
    dgrad  dX = dY W   dY        1x16 along N (out)   stochastic   no
                       W         16x16 (same values)  RNE          no
    wgrad  dW = dY^T X dY^T      1x16 along tokens    stochastic   yes
                       X^T       1x16 along tokens    RNE          yes

Stochastic rounding is for gradients only (SR on activations or weights diverges in the paper's ablations);
the RHT (:mod:`hybridtron.numerics.hadamard`) is for wgrad only (on fprop/dgrad it hurts). Bias, its
gradient and everything outside the GEMM stay in high precision. ``QuantRecipe`` switches each ingredient
off for ablations: ``two_d_weights=False`` quantizes W in 1x16 blocks along the reduction dim of each GEMM
(K for fprop, N for dgrad); ``rht=False`` and ``stochastic_rounding=False`` drop those steps.

``format="mxfp8"``: every operand in MXFP8 (E4M3, 1x32 blocks along the GEMM's reduction dim, RNE).
``format="bf16"``: every operand rounded to bfloat16, fp32 accumulation (what a BF16 GEMM computes).

Swapping in: ``module.lin = QuantLinear.from_linear(module.lin, recipe)`` keeps the same Parameter objects
(state-dict names ``weight``/``bias`` unchanged), and ``experts.grouped_mm = quantized_grouped_mm(recipe)``
replaces a RoutedExperts' grouped matmul (docs/MODEL_API.md contract).

Underflow monitoring: every QuantLinear / quantized grouped matmul has ``stats`` (:class:`UnderflowStats`),
off by default; when ``stats.enabled`` it keeps running counts of fprop operand values that were non-zero
before quantization and zero after (the white paper saw NVFP4 flush up to 40% of Mamba out_proj values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from hybridtron.numerics import mxfp8, nvfp4
from hybridtron.numerics.hadamard import RHT_SIZE, random_hadamard_transform

FORMATS = ("nvfp4", "mxfp8", "bf16")
_NVFP4_OPTIONS = ("stochastic_rounding", "rht", "two_d_weights")


@dataclass(frozen=True, kw_only=True)
class QuantRecipe:
    """How the GEMMs of a layer are emulated.

    format: "nvfp4", "mxfp8" or "bf16".
    stochastic_rounding: SR on the gradient operands (dgrad dY, wgrad dY^T). nvfp4 only; default on for nvfp4.
    rht: 16-point Random Hadamard Transform on both wgrad operands. nvfp4 only; default on for nvfp4.
    two_d_weights: 16x16 weight blocks shared by fprop and dgrad. nvfp4 only; default on for nvfp4.
    seed: seeds the SR generator (a module adds its own ``seed_offset`` so layers draw different streams).
    """

    format: str = "nvfp4"
    stochastic_rounding: bool | None = None
    rht: bool | None = None
    two_d_weights: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"QuantRecipe.format must be one of {FORMATS}, got {self.format!r}")
        is_nvfp4 = self.format == "nvfp4"
        for name in _NVFP4_OPTIONS:
            value = getattr(self, name)
            if value is None:
                object.__setattr__(self, name, is_nvfp4)
            elif not isinstance(value, bool):
                raise ValueError(f"QuantRecipe.{name} must be a bool or None, got {value!r}")
            elif value and not is_nvfp4:
                raise ValueError(f"QuantRecipe.{name}=True is an nvfp4 option, but format is {self.format!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"QuantRecipe.seed must be an int, got {self.seed!r}")


class UnderflowStats:
    """Running share of fprop operand values flushed to zero by quantization (off until ``enabled``).

    Zero stays zero under every format, so ``flushed = nonzero(before) - nonzero(after)``: two counting
    passes per operand, kept as device tensors (no host sync until a fraction is read).
    """

    OPERANDS = ("input", "weight")

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.reset()

    def reset(self) -> None:
        self._nonzero: dict[str, Tensor | int] = {op: 0 for op in self.OPERANDS}
        self._flushed: dict[str, Tensor | int] = {op: 0 for op in self.OPERANDS}

    def record(self, operand: str, before: Tensor, after: Tensor) -> None:
        nonzero_before = torch.count_nonzero(before)
        self._nonzero[operand] = self._nonzero[operand] + nonzero_before
        self._flushed[operand] = self._flushed[operand] + (nonzero_before - torch.count_nonzero(after))

    def _fraction(self, operands) -> float:
        nonzero = sum(int(self._nonzero[op]) for op in operands)
        flushed = sum(int(self._flushed[op]) for op in operands)
        return flushed / nonzero if nonzero else 0.0

    @property
    def zero_fraction(self) -> float:
        """Flushed / non-zero over both fprop operands since the last reset."""
        return self._fraction(self.OPERANDS)

    @property
    def input_zero_fraction(self) -> float:
        return self._fraction(("input",))

    @property
    def weight_zero_fraction(self) -> float:
        return self._fraction(("weight",))


# ----------------------------------------------------------------------------------------------------------
# Operand quantization (all return fp32 values)
# ----------------------------------------------------------------------------------------------------------


def _quantize_1d(t: Tensor, recipe: QuantRecipe, dim: int, generator=None, stochastic=False) -> Tensor:
    if recipe.format == "nvfp4":
        return nvfp4.fake_quantize(t, dim=dim, stochastic_rounding=stochastic, generator=generator)
    if recipe.format == "mxfp8":
        return mxfp8.fake_quantize(t, dim=dim)
    return t.to(torch.bfloat16).to(torch.float32)


def _quantize_weight(weight: Tensor, recipe: QuantRecipe, reduction_dim: int) -> Tensor:
    """W for a GEMM reducing over ``reduction_dim`` (1: fprop over K, 0: dgrad over N)."""
    if recipe.format == "nvfp4" and recipe.two_d_weights:
        return nvfp4.fake_quantize(weight, block_2d=True)
    return _quantize_1d(weight, recipe, reduction_dim)


def _quantize_wgrad_operand(t: Tensor, recipe: QuantRecipe, generator=None, stochastic=False) -> Tensor:
    """[tokens, features] -> quantized along tokens (after the RHT, on tokens zero-padded to a multiple of 16,
    when it is on). Returns [tokens (padded), features]."""
    if not recipe.rht:
        return _quantize_1d(t, recipe, 0, generator, stochastic)
    tokens, features = t.shape
    # One transposing copy gives the [features, tokens] layout that both the RHT and 1x16 blocks along tokens
    # read contiguously.
    t_T = t.new_empty((features, tokens + (-tokens) % RHT_SIZE), dtype=torch.float32)
    t_T[:, :tokens].copy_(t.t())
    t_T[:, tokens:].zero_()
    rotated = random_hadamard_transform(t_T, dim=1)
    return _quantize_1d(rotated, recipe, 1, generator, stochastic).t()


class _EmulatedLinear(torch.autograd.Function):
    """Y = X W^T with each of the three GEMMs on quantized operands (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, recipe: QuantRecipe, sampler, stats: UnderflowStats | None):
        x_q = _quantize_1d(x, recipe, dim=-1)
        w_q = _quantize_weight(weight, recipe, reduction_dim=1)
        if stats is not None and stats.enabled:
            stats.record("input", x, x_q)
            stats.record("weight", weight, w_q)
        reuse_weight = recipe.format == "nvfp4" and recipe.two_d_weights
        ctx.save_for_backward(x, weight, w_q if reuse_weight else None)
        ctx.recipe, ctx.sampler = recipe, sampler
        return x_q @ w_q.t()

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, w_q = ctx.saved_tensors
        recipe: QuantRecipe = ctx.recipe
        sr = recipe.stochastic_rounding
        generator = ctx.sampler(dy.device) if sr else None
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dy_q = _quantize_1d(dy, recipe, dim=-1, generator=generator, stochastic=sr)
            w_dgrad = w_q if w_q is not None else _quantize_weight(weight, recipe, reduction_dim=0)
            dx = (dy_q @ w_dgrad).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dy_t = _quantize_wgrad_operand(dy, recipe, generator, stochastic=sr)
            x_t = _quantize_wgrad_operand(x, recipe)
            dw = (dy_t.t() @ x_t).to(weight.dtype)
        return dx, dw, None, None, None


class GeneratorSource:
    """One SR generator per (module, device), seeded with ``recipe.seed + seed_offset``; made on first use.

    Its state is part of a training checkpoint (`sr_generator_states`), so a resumed run draws the same
    stochastic-rounding noise as an uninterrupted one."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generator: torch.Generator | None = None

    def __call__(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def get_state(self) -> Tensor | None:
        return None if self._generator is None else self._generator.get_state()

    def set_state(self, state: Tensor | None) -> None:
        if state is None:
            self._generator = None
        else:
            self(torch.device("cpu")).set_state(state)


def emulated_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    recipe: QuantRecipe,
    generator_source=None,
    stats: UnderflowStats | None = None,
) -> Tensor:
    """``x @ weight.T + bias`` through the emulated GEMMs; x [..., K], weight [O, K]; returns x's dtype.

    ``generator_source(device) -> torch.Generator`` supplies the SR generator (default: a fresh one seeded
    with ``recipe.seed`` per call, which repeats the same noise -- modules keep their own).
    """
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"emulated_linear: input has {x.shape[-1]} features but weight is {tuple(weight.shape)}")
    source = generator_source if generator_source is not None else GeneratorSource(recipe.seed)
    y = _EmulatedLinear.apply(x.reshape(-1, x.shape[-1]), weight, recipe, source, stats)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)


class QuantLinear(nn.Module):
    """A linear layer whose GEMMs run through the emulated recipe; holds the wrapped layer's Parameters.

    Build with :meth:`from_linear` so the Parameter objects (and thus optimizer state and state-dict names
    ``weight``/``bias``) stay those of the original ``nn.Linear``.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, recipe: QuantRecipe, seed_offset: int = 0):
        super().__init__()
        if weight.ndim != 2:
            raise ValueError(f"QuantLinear weight must be [out_features, in_features], got {tuple(weight.shape)}")
        if not isinstance(recipe, QuantRecipe):
            raise ValueError(f"QuantLinear recipe must be a QuantRecipe, got {type(recipe).__name__}")
        self.weight = weight
        self.register_parameter("bias", bias)
        self.recipe = recipe
        self.seed_offset = seed_offset
        self.stats = UnderflowStats()
        self.sr_generators = GeneratorSource(recipe.seed + seed_offset)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: QuantRecipe, seed_offset: int = 0) -> "QuantLinear":
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"QuantLinear.from_linear expects an nn.Linear, got {type(linear).__name__}")
        return cls(linear.weight, linear.bias, recipe, seed_offset)

    def forward(self, x: Tensor) -> Tensor:
        return emulated_linear(x, self.weight, self.bias, self.recipe, self.sr_generators, self.stats)

    def extra_repr(self) -> str:
        r = self.recipe
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"format={r.format}, stochastic_rounding={r.stochastic_rounding}, rht={r.rht}, "
            f"two_d_weights={r.two_d_weights}"
        )


class QuantizedGroupedMM:
    """Grouped matmul (docs/MODEL_API.md contract) with each expert's GEMMs emulated under ``recipe``.

    ``(x_SK [S, K], w_EOK [E, O, K], group_sizes [E]) -> y [S, O]``; rows of x are sorted by expert and
    ``y_rows = x_rows @ w[e].T``. Each expert's operands are quantized on their own (per-expert amax), as TE's
    grouped linear does; experts with no rows are skipped.
    """

    def __init__(self, recipe: QuantRecipe, seed_offset: int = 0) -> None:
        if not isinstance(recipe, QuantRecipe):
            raise ValueError(f"quantized_grouped_mm recipe must be a QuantRecipe, got {type(recipe).__name__}")
        self.recipe = recipe
        self.stats = UnderflowStats()
        self.sr_generators = GeneratorSource(recipe.seed + seed_offset)

    def __call__(self, x_SK: Tensor, w_EOK: Tensor, group_sizes: Tensor) -> Tensor:
        if x_SK.ndim != 2 or w_EOK.ndim != 3 or x_SK.shape[1] != w_EOK.shape[2]:
            raise ValueError(
                f"grouped_mm expects x [S, K] and w [E, O, K], got {tuple(x_SK.shape)} and {tuple(w_EOK.shape)}"
            )
        sizes = [int(n) for n in group_sizes.tolist()]
        if len(sizes) != w_EOK.shape[0] or sum(sizes) != x_SK.shape[0] or min(sizes, default=0) < 0:
            raise ValueError(
                f"grouped_mm group_sizes {sizes} must be {w_EOK.shape[0]} non-negative counts "
                f"summing to {x_SK.shape[0]}"
            )
        outputs, start = [], 0
        for expert, rows in enumerate(sizes):
            if rows:
                x_e = x_SK[start : start + rows]
                outputs.append(
                    emulated_linear(x_e, w_EOK[expert], None, self.recipe, self.sr_generators, self.stats)
                )
            start += rows
        if not outputs:  # S == 0: an empty [0, O] result that still hangs on the autograd graph
            return x_SK @ w_EOK.sum(dim=0).t().to(x_SK.dtype)
        return torch.cat(outputs, dim=0)

    def __repr__(self) -> str:
        return f"QuantizedGroupedMM({self.recipe})"


def quantized_grouped_mm(recipe: QuantRecipe, seed_offset: int = 0) -> QuantizedGroupedMM:
    """A grouped-matmul callable for ``RoutedExperts.grouped_mm`` that emulates ``recipe``."""
    return QuantizedGroupedMM(recipe, seed_offset)


def sr_generator_states(model: nn.Module) -> dict[str, Tensor | None]:
    """The stochastic-rounding generator state of every quantized GEMM under `model`, keyed by module name."""
    states = {}
    for name, sub in model.named_modules():
        for key, candidate in ((name, sub), (f"{name}.grouped_mm", getattr(sub, "grouped_mm", None))):
            source = getattr(candidate, "sr_generators", None)
            if isinstance(source, GeneratorSource):
                states[key] = source.get_state()
    return states


def load_sr_generator_states(model: nn.Module, states: dict[str, Tensor | None]) -> None:
    for name, sub in model.named_modules():
        for key, candidate in ((name, sub), (f"{name}.grouped_mm", getattr(sub, "grouped_mm", None))):
            source = getattr(candidate, "sr_generators", None)
            if isinstance(source, GeneratorSource) and key in states:
                source.set_state(states[key])


def set_underflow_tracking(module: nn.Module, enabled: bool = True, reset: bool = True) -> list[UnderflowStats]:
    """Switch ``stats`` on or off for every QuantLinear and quantized grouped matmul under ``module``."""
    found = []
    for sub in module.modules():
        for candidate in (sub, getattr(sub, "grouped_mm", None)):
            stats = getattr(candidate, "stats", None)
            if isinstance(candidate, (QuantLinear, QuantizedGroupedMM)) and isinstance(stats, UnderflowStats):
                stats.enabled = enabled
                if reset:
                    stats.reset()
                found.append(stats)
    return found
