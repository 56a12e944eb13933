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

Grouped GEMMs: a linear and a RoutedExperts' grouped matmul run through one autograd Function, a linear as
one group. Each expert's operands get their own tensor scales, as if it were a GEMM of its own, but all
experts' operands are quantized together (few passes, no per-expert loop of small tensors). Each expert's GEMM
then multiplies views into the shared buffers: a BLAS may sum in another order at another address (MKL does,
for some odd shapes), so a grouped GEMM equals per-expert GEMMs of the same operands to fp32 rounding, and bit
for bit wherever the BLAS picks the same kernel.

Stochastic-rounding draws: each quantized module (a QuantLinear, a quantized grouped matmul) has one generator,
seeded ``recipe.seed + seed_offset``, made on the device of its gradients and checkpointed with that device
(:func:`sr_generator_states`); every call of the module draws from it. A backward draws U[0, 1) values group by
group in expert order 0..E-1 (experts without rows have no group): for the group's dgrad operand dY
[rows, O padded to 16], then for its wgrad operand dY^T [O, tokens padded to 16] (after the RHT), each in row
order. So a linear draws for dY, then dY^T; a grouped GEMM draws what one emulated linear per expert would if
their backward ran in expert order. Across modules the order is autograd's, fixed for a given model.

Underflow monitoring: every QuantLinear / quantized grouped matmul has ``stats`` (:class:`UnderflowStats`),
off by default; when ``stats.enabled`` it keeps running counts of fprop operand values that were non-zero
before quantization and zero after (the white paper saw NVFP4 flush up to 40% of Mamba out_proj values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridtron.numerics import mxfp8, nvfp4
from hybridtron.numerics.blocks import scratch
from hybridtron.numerics.hadamard import RHT_SIZE, hadamard_chunks_

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
# Operand quantization. A linear is a grouped GEMM with one group; the routed experts have a group per expert
# with rows. Each group's operands get their own tensor scales (as TE's grouped linear), but all groups are
# quantized together, in a few passes instead of a few per expert.
# ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Group:
    """Rows ``start:start + rows`` of X multiply weight[expert]."""

    expert: int
    start: int
    rows: int

    @property
    def slice(self) -> slice:
        return slice(self.start, self.start + self.rows)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _group_rows(rows: list[int]) -> list[int] | None:
    """Rows per tensor scale for the quantizer; None (one scale: the plain path) for a single group."""
    return rows if len(rows) > 1 else None


def _mm_into(a: Tensor, b: Tensor, out: Tensor) -> None:
    """``out <- a @ b``, accumulated in fp32 (then converted to out's dtype)."""
    if out.dtype == torch.float32 and out.is_contiguous():
        torch.mm(a, b, out=out)
    else:
        out.copy_(a @ b)


def _scratch(name: str, shape: tuple[int, ...], like: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """A reused buffer (:func:`~hybridtron.numerics.blocks.scratch`: on a CPU, fresh memory's page faults cost
    more than the arithmetic) for a temporary that never leaves one forward or backward call. A name must not be
    used twice in one call; in use: forward x_q, w_q; backward dy, dy.q, dy.q.bf16, dgrad.q, staging, x, x.q,
    w_q."""
    return scratch(f"gemm.{name}", shape, dtype, like.device)


def _matrices(name: str, shapes: list[tuple[int, int]], like: Tensor) -> tuple[Tensor, list[Tensor]]:
    """A scratch buffer holding fp32 matrices of ``shapes`` back to back (to be quantized in one pass), and a
    view of each."""
    sizes = [rows * cols for rows, cols in shapes]
    flat = _scratch(name, (sum(sizes),), like)
    return flat, [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]


def _split_views(values: Tensor, shapes: list[tuple[int, int]]) -> list[Tensor]:
    """Views of a contiguous buffer laid out by :func:`_matrices` (e.g. its quantized values)."""
    sizes = [rows * cols for rows, cols in shapes]
    return [part.view(shape) for part, shape in zip(values.reshape(-1).split(sizes), shapes)]


def _copy_padded(dst: Tensor, src: Tensor) -> None:
    """dst[:, :n] <- src [m, n], zeros in dst's remaining columns."""
    n = src.shape[1]
    dst[:, :n].copy_(src)
    dst[:, n:].zero_()


def _copy_transposed(dst: Tensor, rows: Tensor, rht: bool) -> None:
    """dst [F, tokens padded] <- rows [tokens, F] transposed, tokens zero-padded, then rotated by the RHT along
    tokens when ``rht`` (TE: transpose, pad, chunks of 16 tokens @ H)."""
    if not rht:
        _copy_padded(dst, rows.t())
        return
    staging = _scratch("staging", tuple(dst.shape), dst)
    _copy_padded(staging, rows.t())
    hadamard_chunks_(staging.view(-1, RHT_SIZE), out=dst.view(-1, RHT_SIZE))


def _to_bf16_values(t: Tensor, scratch: str | None = None) -> Tensor:
    """t rounded to bf16, as fp32 (into scratch buffers when ``scratch`` names a temporary)."""
    if scratch is None:
        return t.to(torch.bfloat16).to(torch.float32)
    rounded = _scratch(f"{scratch}.bf16", tuple(t.shape), t, torch.bfloat16).copy_(t)
    return _scratch(scratch, tuple(t.shape), t).copy_(rounded)


def _padded_shape(t: Tensor, block: int) -> tuple[int, int]:
    """The quantizer's block matrix of t [..., K] with blocks along K: [rows, K padded to ``block``]."""
    return math.prod(t.shape[:-1]), _round_up(t.shape[-1], block)


def _quantize_input(x: Tensor, groups: tuple[_Group, ...], recipe: QuantRecipe) -> Tensor:
    """fprop's X [S, K] -> fp32 values, blocks along K (bf16's are kept for wgrad: fresh; else scratch)."""
    if recipe.format == "nvfp4":
        out = _scratch("x_q", _padded_shape(x, nvfp4.BLOCK_SIZE), x)
        return nvfp4.fake_quantize(x, dim=-1, group_rows=_group_rows([g.rows for g in groups]), out=out)
    if recipe.format == "mxfp8":
        return mxfp8.fake_quantize(x, dim=-1, out=_scratch("x_q", _padded_shape(x, mxfp8.BLOCK_SIZE), x))
    return _to_bf16_values(x)


def _quantize_weights(weights: Tensor, recipe: QuantRecipe, reduction_dim: int) -> Tensor:
    """W [G, O, K] -> fp32 values for GEMMs reducing over ``reduction_dim`` of each weight (2: fprop over K,
    1: dgrad over O). Values that both GEMMs use (bf16's, NVFP4's 16x16 tiles) are fresh tensors, kept for dgrad;
    the others are scratch."""
    count, out_features, in_features = weights.shape
    if recipe.format == "nvfp4" and recipe.two_d_weights:
        # 16x16 tiles, the same values for fprop and dgrad. Zero rows pad each weight to a multiple of 16 rows so
        # that no tile spans two weights (padding never changes an amax).
        rows = out_features if count == 1 else _round_up(out_features, nvfp4.BLOCK_SIZE)
        padded = weights if rows == out_features else F.pad(weights, (0, 0, 0, rows - out_features))
        values = nvfp4.fake_quantize(padded.reshape(count * rows, in_features), block_2d=True,
                                     group_rows=_group_rows([rows] * count))
        return values.view(count, rows, in_features)[:, :out_features]
    if recipe.format == "bf16":
        return _to_bf16_values(weights)
    block = nvfp4.BLOCK_SIZE if recipe.format == "nvfp4" else mxfp8.BLOCK_SIZE
    out = _scratch("w_q", _padded_shape(weights.movedim(reduction_dim, -1), block), weights)
    if recipe.format == "nvfp4":
        rows = in_features if reduction_dim == 1 else out_features  # rows of each weight's block matrix
        return nvfp4.fake_quantize(weights, dim=reduction_dim, group_rows=_group_rows([rows] * count), out=out)
    return mxfp8.fake_quantize(weights, dim=reduction_dim, out=out)


def _wgrad_operands(t: Tensor, groups: tuple[_Group, ...], recipe: QuantRecipe, name: str) -> list[Tensor]:
    """wgrad's operand [F, tokens] of each group from t [S, F] (RNE), blocks along tokens, in scratch buffers
    ``name``.

    With the RHT the GEMM reduces over the zero-padded tokens too (TE's); without it, over the real tokens only."""
    block = mxfp8.BLOCK_SIZE if recipe.format == "mxfp8" else nvfp4.BLOCK_SIZE
    shapes = [(t.shape[1], _round_up(g.rows, block)) for g in groups]
    flat, views = _matrices(name, shapes, t)
    for group, view in zip(groups, views):
        _copy_transposed(view, t[group.slice], recipe.rht)
    out = _scratch(f"{name}.q", tuple(flat.shape), t)
    if recipe.format == "nvfp4":
        values = nvfp4.fake_quantize(flat.view(-1, block), out=out,
                                     group_rows=_group_rows([rows * cols // block for rows, cols in shapes]))
    else:
        values = mxfp8.fake_quantize(flat.view(-1, block), out=out)  # no tensor scale: blocks are independent
    views = _split_views(values, shapes)
    return views if recipe.rht else [view[:, : g.rows] for view, g in zip(views, groups)]


def _nvfp4_gradient_operands(dy: Tensor, groups: tuple[_Group, ...], recipe: QuantRecipe, generator,
                             need_dgrad: bool, need_wgrad: bool) -> tuple[list, list]:
    """dY's operands of each group, quantized in one pass: dgrad [rows, O] (1x16 along O) and wgrad
    [O, tokens] (1x16 along tokens, after the RHT).

    The padded operands lie back to back in the order stochastic rounding draws for them (module docstring):
    group by group in expert order, each group's dgrad operand, then its wgrad operand."""
    out_features = dy.shape[1]
    layout = []  # (group index, is dgrad, shape), in drawing order
    for index, group in enumerate(groups):
        if need_dgrad:
            layout.append((index, True, (group.rows, _round_up(out_features, nvfp4.BLOCK_SIZE))))
        if need_wgrad:
            layout.append((index, False, (out_features, _round_up(group.rows, RHT_SIZE))))
    shapes = [shape for _, _, shape in layout]
    flat, views = _matrices("dy", shapes, dy)
    for (index, is_dgrad, _), view in zip(layout, views):
        if is_dgrad:
            _copy_padded(view, dy[groups[index].slice])
        else:
            _copy_transposed(view, dy[groups[index].slice], recipe.rht)
    values = nvfp4.fake_quantize(
        flat.view(-1, nvfp4.BLOCK_SIZE), stochastic_rounding=recipe.stochastic_rounding, generator=generator,
        group_rows=_group_rows([rows * cols // nvfp4.BLOCK_SIZE for rows, cols in shapes]),
        out=_scratch("dy.q", tuple(flat.shape), dy),
    )
    dgrad, wgrad = [None] * len(groups), [None] * len(groups)
    for (index, is_dgrad, _), view in zip(layout, _split_views(values, shapes)):
        if is_dgrad:
            dgrad[index] = view[:, :out_features]
        else:
            wgrad[index] = view if recipe.rht else view[:, : groups[index].rows]
    return dgrad, wgrad


def _gradient_operands(dy: Tensor, groups: tuple[_Group, ...], recipe: QuantRecipe, sampler, need_dgrad: bool,
                       need_wgrad: bool) -> tuple[list | None, list | None]:
    """dY's operands of each group: dgrad [rows, O] and wgrad [O, tokens] (None where not needed)."""
    if recipe.format == "nvfp4":
        generator = sampler(dy.device) if recipe.stochastic_rounding else None
        return _nvfp4_gradient_operands(dy, groups, recipe, generator, need_dgrad, need_wgrad)
    if recipe.format == "mxfp8":
        dgrad = wgrad = None
        if need_dgrad:
            out = _scratch("dgrad.q", _padded_shape(dy, mxfp8.BLOCK_SIZE), dy)
            values = mxfp8.fake_quantize(dy, dim=-1, out=out)
            dgrad = [values[g.slice] for g in groups]
        if need_wgrad:
            wgrad = _wgrad_operands(dy, groups, recipe, "dy")
        return dgrad, wgrad
    values = _to_bf16_values(dy, scratch="dy.q")  # one rounding serves both GEMMs
    return [values[g.slice] for g in groups], [values[g.slice].t() for g in groups]


def _weights_of(weight: Tensor, groups: tuple[_Group, ...]) -> Tensor:
    """[G, O, K]: the weight of each group (experts without rows take no part in the GEMMs)."""
    experts = [g.expert for g in groups]
    return weight if experts == list(range(weight.shape[0])) else weight[experts]


class _EmulatedGroupedLinear(torch.autograd.Function):
    """Y[g rows] = X[g rows] W[g.expert]^T for each group g, with each of the three GEMMs on quantized operands
    (see the module docstring); x [S, K], weight [E, O, K]; returns fp32 [S, O]."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, groups: tuple[_Group, ...], recipe: QuantRecipe, sampler,
                stats: UnderflowStats | None):
        weights = _weights_of(weight, groups)
        x_q = _quantize_input(x, groups, recipe)
        w_q = _quantize_weights(weights, recipe, reduction_dim=2)
        if stats is not None and stats.enabled:
            stats.record("input", x, x_q)
            stats.record("weight", weights, w_q)
        y = x.new_empty((x.shape[0], weight.shape[1]), dtype=torch.float32)
        for index, group in enumerate(groups):
            _mm_into(x_q[group.slice], w_q[index].t(), y[group.slice])
        # Operands that another GEMM uses unchanged are kept: bf16's X and W, NVFP4's 16x16-tile W.
        bf16 = recipe.format == "bf16"
        reuse_weight = bf16 or (recipe.format == "nvfp4" and recipe.two_d_weights)
        ctx.save_for_backward(x_q if bf16 else x, weight, w_q if reuse_weight else None)
        ctx.x_dtype, ctx.groups, ctx.recipe, ctx.sampler = x.dtype, groups, recipe, sampler
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, w_q = ctx.saved_tensors
        recipe: QuantRecipe = ctx.recipe
        groups: tuple[_Group, ...] = ctx.groups
        need_dx, need_dw = ctx.needs_input_grad[:2]
        dgrad_dy, wgrad_dy = _gradient_operands(dy, groups, recipe, ctx.sampler, need_dx, need_dw)
        dx = dw = None
        if need_dx:
            if w_q is None:
                w_q = _quantize_weights(_weights_of(weight, groups), recipe, reduction_dim=1)
            dx = dy.new_empty((dy.shape[0], weight.shape[2]), dtype=ctx.x_dtype)
            for index, group in enumerate(groups):
                _mm_into(dgrad_dy[index], w_q[index], dx[group.slice])
        if need_dw:
            if recipe.format == "bf16":
                wgrad_x = [x[g.slice] for g in groups]
            else:
                wgrad_x = [operand.t() for operand in _wgrad_operands(x, groups, recipe, "x")]
            all_experts = len(groups) == weight.shape[0]
            dw = weight.new_empty(weight.shape) if all_experts else weight.new_zeros(weight.shape)
            for index, group in enumerate(groups):
                _mm_into(wgrad_dy[index], wgrad_x[index], dw[group.expert])
        return dx, dw, None, None, None, None


class GeneratorSource:
    """The SR generator of one quantized module, seeded ``seed``: made on first use on the device of the
    gradients (and made anew, seeded again, if they move to another device).

    Its state, with the device it lives on, is part of a training checkpoint (:func:`sr_generator_states`), so a
    resumed run draws the same stochastic-rounding noise as an uninterrupted one, on a CPU or an accelerator."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._generator: torch.Generator | None = None

    def __call__(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.seed)
        return self._generator

    def get_state(self) -> dict | None:
        """``{"device": "cuda:0", "state": uint8 CPU tensor}``; None before the first draw."""
        if self._generator is None:
            return None
        return {"device": str(self._generator.device), "state": self._generator.get_state()}

    def set_state(self, state: dict | Tensor | None) -> None:
        """Restore a :meth:`get_state` on the device it was saved from. A bare tensor (checkpoints written
        before the device was recorded, which could only be restored on the CPU) is a CPU generator's state."""
        if state is None:
            self._generator = None
            return
        if isinstance(state, Tensor):
            state = {"device": "cpu", "state": state}
        if not isinstance(state, dict) or set(state) != {"device", "state"}:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"an SR generator state must be a dict with keys 'device' and 'state', got {got}")
        generator = _new_generator(state["device"])
        generator.set_state(state["state"])
        self._generator = generator


def _new_generator(device_name: str) -> torch.Generator:
    """A generator on the device named ``device_name`` ("cpu", "cuda:1", ...), or a ValueError if this process
    has no such device (torch would make a generator for a GPU index that does not exist)."""
    unusable = ValueError(f"the SR generator was saved on {device_name}, which this process does not have; "
                          "resume on the device the run was saved from")
    try:
        device = torch.device(device_name)
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise unusable
        return torch.Generator(device=device)
    except RuntimeError as error:
        raise unusable from error


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
    x_2d = x.reshape(-1, x.shape[-1])
    group = _Group(expert=0, start=0, rows=x_2d.shape[0])
    y = _EmulatedGroupedLinear.apply(x_2d, weight.unsqueeze(0), (group,), recipe, source, stats)
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
    ``y_rows = x_rows @ w[e].T``. Each expert's operands get their own tensor scales (per-expert amax), as TE's
    grouped linear does, but all experts are quantized together; experts with no rows are skipped.
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
        groups, start = [], 0
        for expert, rows in enumerate(sizes):
            if rows:
                groups.append(_Group(expert, start, rows))
            start += rows
        if not groups:  # S == 0: an empty [0, O] result that still hangs on the autograd graph
            return x_SK @ w_EOK.sum(dim=0).t().to(x_SK.dtype)
        y = _EmulatedGroupedLinear.apply(x_SK, w_EOK, tuple(groups), self.recipe, self.sr_generators, self.stats)
        return y.to(x_SK.dtype)

    def __repr__(self) -> str:
        return f"QuantizedGroupedMM({self.recipe})"


def quantized_grouped_mm(recipe: QuantRecipe, seed_offset: int = 0) -> QuantizedGroupedMM:
    """A grouped-matmul callable for ``RoutedExperts.grouped_mm`` that emulates ``recipe``."""
    return QuantizedGroupedMM(recipe, seed_offset)


def _generator_sources(model: nn.Module):
    """(name, GeneratorSource) of every quantized GEMM under ``model``: QuantLinears by module name, the
    grouped matmul of a module as ``<module name>.grouped_mm``."""
    for name, sub in model.named_modules():
        for key, candidate in ((name, sub), (f"{name}.grouped_mm", getattr(sub, "grouped_mm", None))):
            source = getattr(candidate, "sr_generators", None)
            if isinstance(source, GeneratorSource):
                yield key, source


def sr_generator_states(model: nn.Module) -> dict[str, dict | None]:
    """The stochastic-rounding generator state of every quantized GEMM under ``model``, keyed by module name:
    ``{"device": ..., "state": ...}`` (:meth:`GeneratorSource.get_state`), or None where nothing was drawn yet."""
    return {key: source.get_state() for key, source in _generator_sources(model)}


def load_sr_generator_states(model: nn.Module, states: dict[str, dict | Tensor | None]) -> None:
    """Restore :func:`sr_generator_states` on the devices they were saved from (modules absent from ``states``
    keep their generators)."""
    for key, source in _generator_sources(model):
        if key in states:
            try:
                source.set_state(states[key])
            except ValueError as error:
                raise ValueError(f"stochastic-rounding state of {key!r}: {error}") from error


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
