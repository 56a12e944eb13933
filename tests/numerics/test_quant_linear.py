"""Emulated quantized GEMMs: forward and each backward GEMM equal the matmul of reference-dequantized operands
exactly, gradients stay within an error budget relative to BF16, and the module/grouped-matmul wrappers keep
the model's contracts."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridtron.numerics import (
    QuantizedGroupedMM,
    QuantLinear,
    QuantRecipe,
    emulated_linear,
    quantized_grouped_mm,
    set_underflow_tracking,
)
from hybridtron.numerics import mxfp8, nvfp4
from hybridtron.numerics.hadamard import random_hadamard_transform
from hybridtron.numerics.linear import GeneratorSource, load_sr_generator_states, sr_generator_states


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def run(layer_or_recipe, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, bias=None):
    """(y, dx, dw) of y = x w^T (+ bias) backpropagating the upstream gradient g."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    if layer_or_recipe is None:
        y = F.linear(x, w, bias)
    else:
        y = emulated_linear(x, w, bias, layer_or_recipe)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def wgrad_operand(t: torch.Tensor, rht: bool, **kwargs) -> torch.Tensor:
    """The recipe's wgrad operand built from the reference quantizer: tokens padded to 16, RHT, 1x16 blocks
    along tokens."""
    if rht:
        t = random_hadamard_transform(F.pad(t, (0, 0, 0, (-t.shape[0]) % 16)), dim=0)
    return nvfp4.fake_quantize_ref(t, dim=0, **kwargs)


def test_recipe_defaults_and_validation():
    r = QuantRecipe()
    assert (r.format, r.stochastic_rounding, r.rht, r.two_d_weights) == ("nvfp4", True, True, True)
    m = QuantRecipe(format="mxfp8")
    assert (m.stochastic_rounding, m.rht, m.two_d_weights) == (False, False, False)
    assert not QuantRecipe(rht=False).rht
    with pytest.raises(ValueError, match="format"):
        QuantRecipe(format="fp4")
    with pytest.raises(ValueError, match="rht"):
        QuantRecipe(format="bf16", rht=True)
    with pytest.raises(ValueError, match="stochastic_rounding"):
        QuantRecipe(stochastic_rounding=1)
    with pytest.raises(Exception):
        r.format = "bf16"  # frozen


@pytest.mark.parametrize("two_d", [True, False])
@pytest.mark.parametrize("rht", [True, False])
def test_nvfp4_gemms_equal_dequantize_then_matmul(two_d, rht):
    """With SR off every GEMM (forward, dgrad, wgrad) is exactly the matmul of the operands of the recipe table,
    dequantized by the reference quantizer."""
    recipe = QuantRecipe(stochastic_rounding=False, rht=rht, two_d_weights=two_d)
    x, w, g = torch.randn(37, 72), torch.randn(40, 72) / 8, torch.randn(37, 40)  # 37 tokens: padded to 48
    bias = torch.randn(40)
    y, dx, dw = run(recipe, x, w, g, bias)

    fq = nvfp4.fake_quantize_ref
    x_q = fq(x, dim=-1)
    w_fprop = fq(w, block_2d=True) if two_d else fq(w, dim=1)
    w_dgrad = w_fprop if two_d else fq(w, dim=0)
    assert torch.equal(bits(y), bits(x_q @ w_fprop.t() + bias))
    assert torch.equal(bits(dx), bits(fq(g, dim=-1) @ w_dgrad))
    assert torch.equal(bits(dw), bits(wgrad_operand(g, rht).t() @ wgrad_operand(x, rht)))


def test_stochastic_rounding_draws_from_a_seeded_stream():
    x, w, g = torch.randn(32, 64), torch.randn(48, 64) / 8, torch.randn(32, 48)
    recipe = QuantRecipe(seed=5)
    _, dx_a, dw_a = run(recipe, x, w, g)
    _, dx_b, dw_b = run(recipe, x, w, g)
    assert torch.equal(dx_a, dx_b) and torch.equal(dw_a, dw_b)
    _, dx_c, _ = run(QuantRecipe(seed=6), x, w, g)
    _, dx_rne, _ = run(QuantRecipe(stochastic_rounding=False), x, w, g)
    assert not torch.equal(dx_a, dx_c) and not torch.equal(dx_a, dx_rne)
    # The same draws as quantizing dY with a generator seeded like the layer's (dgrad draws first).
    gen = torch.Generator().manual_seed(5)
    fq = nvfp4.fake_quantize_ref
    expected_dx = fq(g, dim=-1, stochastic_rounding=True, generator=gen) @ fq(w, block_2d=True)
    assert torch.equal(bits(dx_a), bits(expected_dx))
    expected_dw = wgrad_operand(g, True, stochastic_rounding=True, generator=gen).t() @ wgrad_operand(x, True)
    assert torch.equal(bits(dw_a), bits(expected_dw))


def test_other_formats_equal_dequantize_then_matmul():
    x, w, g = torch.randn(40, 96), torch.randn(64, 96) / 8, torch.randn(40, 64)
    y, dx, dw = run(QuantRecipe(format="bf16"), x, w, g)
    to_bf16 = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    assert torch.equal(bits(y), bits(to_bf16(x) @ to_bf16(w).t()))
    assert torch.equal(bits(dx), bits(to_bf16(g) @ to_bf16(w)))
    assert torch.equal(bits(dw), bits(to_bf16(g).t() @ to_bf16(x)))
    y, dx, dw = run(QuantRecipe(format="mxfp8"), x, w, g)
    fq = mxfp8.fake_quantize_ref
    assert torch.equal(bits(y), bits(fq(x, dim=-1) @ fq(w, dim=1).t()))
    assert torch.equal(bits(dx), bits(fq(g, dim=-1) @ fq(w, dim=0)))
    assert torch.equal(bits(dw), bits(fq(g, dim=0).t() @ fq(x, dim=0)))


# Relative error of a format with p significant bits scales as 2^-p: BF16 has 8, E4M3 4, E2M1 2, so the expected
# error ratios to BF16 are 2^4 = 16 (MXFP8) and 2^6 = 64 (NVFP4). Measured over 5 seeds: 15.9-16.1 for MXFP8;
# 62-63 (fprop) and 70-76 (dgrad/wgrad: SR adds variance) for NVFP4. Budgets: 1.25x and 1.5x the theory.
ERROR_BUDGET = {"mxfp8": (8, 20), "nvfp4": (32, 96)}  # (floor, ceiling) of |q - fp32| / |bf16 - fp32|


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_error_budget_relative_to_bf16(fmt):
    x, w, g = torch.randn(256, 512), torch.randn(384, 512) / 512**0.5, torch.randn(256, 384)
    exact = run(None, x.double(), w.double(), g.double())
    bf16 = run(QuantRecipe(format="bf16"), x, w, g)
    quantized = run(QuantRecipe(format=fmt), x, w, g)
    floor, ceiling = ERROR_BUDGET[fmt]
    for name, q, b, e in zip(("y", "dx", "dw"), quantized, bf16, exact):
        ratio = (q.double() - e).norm() / (b.double() - e).norm()
        # The floor shows the operands really are quantized (not passed through in high precision).
        assert floor <= ratio <= ceiling, f"{fmt} {name}: error ratio {ratio:.1f} outside [{floor}, {ceiling}]"


def test_quant_linear_wraps_the_same_parameters():
    lin = nn.Linear(64, 32)
    q = QuantLinear.from_linear(lin, QuantRecipe(format="bf16"))
    assert q.weight is lin.weight and q.bias is lin.bias
    assert list(q.state_dict()) == ["weight", "bias"]
    assert (q.in_features, q.out_features) == (64, 32)
    x = torch.randn(2, 5, 64)
    y = q(x)
    assert y.shape == (2, 5, 32)
    y.sum().backward()
    assert lin.weight.grad is not None and lin.bias.grad is not None
    assert torch.allclose(lin.bias.grad, torch.full((32,), 10.0))  # bias gradient in full precision
    no_bias = QuantLinear.from_linear(nn.Linear(64, 32, bias=False), QuantRecipe())
    assert list(no_bias.state_dict()) == ["weight"]
    with pytest.raises(ValueError, match="nn.Linear"):
        QuantLinear.from_linear(nn.Conv1d(4, 4, 1), QuantRecipe())


def test_quant_linear_layers_draw_independent_streams():
    lin = nn.Linear(64, 32)
    x, g = torch.randn(16, 64), torch.randn(16, 32)
    grads = []
    for offset in (0, 0, 1):
        layer = QuantLinear.from_linear(lin, QuantRecipe(seed=3), seed_offset=offset)
        lin.weight.grad = None
        layer(x).backward(g)
        grads.append(lin.weight.grad.clone())
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])


def quantized_model() -> nn.ModuleDict:
    """A QuantLinear and a module holding a quantized grouped matmul: the two owners of SR generators."""
    torch.manual_seed(0)
    experts = nn.Module()
    experts.grouped_mm = quantized_grouped_mm(QuantRecipe(seed=2), seed_offset=1)
    return nn.ModuleDict({"proj": QuantLinear.from_linear(nn.Linear(32, 24), QuantRecipe(seed=2)),
                          "experts": experts})


def sr_step(model: nn.ModuleDict, device) -> list[torch.Tensor]:
    """One forward and backward through both quantized GEMMs; the gradients, which carry the SR draws."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 32, generator=gen).to(device).requires_grad_()
    w = (torch.randn(3, 16, 32, generator=gen) / 8).to(device).requires_grad_()
    y = torch.cat([model["proj"](x), model["experts"].grouped_mm(x, w, torch.tensor([7, 0, 13]))], dim=1)
    model["proj"].weight.grad = None
    y.backward(torch.randn(y.shape, generator=gen).to(device))
    return [x.grad, w.grad, model["proj"].weight.grad]


def through_a_checkpoint(states: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(states, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # plain data: a device name and a byte tensor per module


def test_sr_generator_states_resume_the_stream_on_their_device():
    model = quantized_model()
    sr_step(model, "cpu")
    states = through_a_checkpoint(sr_generator_states(model))
    assert set(states) == {"proj", "experts.grouped_mm"}
    assert [state["device"] for state in states.values()] == ["cpu", "cpu"]
    resumed, fresh = quantized_model(), quantized_model()
    load_sr_generator_states(resumed, states)
    assert sr_generator_states(resumed)["proj"]["device"] == "cpu"  # the restored generator's own device
    next_step, resumed_step, fresh_step = sr_step(model, "cpu"), sr_step(resumed, "cpu"), sr_step(fresh, "cpu")
    for a, b in zip(next_step, resumed_step):
        assert torch.equal(a, b)
    assert not torch.equal(next_step[0], fresh_step[0])  # without the states the stream starts over


def test_an_sr_state_from_a_device_this_process_lacks_is_a_clear_error():
    model = quantized_model()
    sr_step(model, "cpu")
    states = sr_generator_states(model)
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU (there is none on a CPU machine)
    states["proj"] = {"device": missing, "state": states["proj"]["state"]}
    with pytest.raises(ValueError, match=f"'proj'.*saved on {missing}, which this process does not have"):
        load_sr_generator_states(quantized_model(), states)
    with pytest.raises(ValueError, match="'device' and 'state'"):
        GeneratorSource(0).set_state({"state": states["experts.grouped_mm"]["state"]})


def test_a_bare_sr_state_is_a_cpu_generator_state():
    """Checkpoints written before the device was recorded hold the CPU generator's state alone."""
    cpu = torch.device("cpu")
    source = GeneratorSource(seed=3)
    torch.rand(5, generator=source(cpu))
    restored = GeneratorSource(seed=99)
    restored.set_state(source.get_state()["state"])
    assert torch.equal(torch.rand(4, generator=restored(cpu)), torch.rand(4, generator=source(cpu)))
    restored.set_state(None)
    assert restored.get_state() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sr_generator_states_resume_the_stream_on_the_gpu():
    device = torch.device("cuda", torch.cuda.current_device())
    model = quantized_model().to(device)
    sr_step(model, device)
    states = through_a_checkpoint(sr_generator_states(model))
    assert [state["device"] for state in states.values()] == [str(device)] * 2
    resumed = quantized_model().to(device)
    load_sr_generator_states(resumed, states)
    assert sr_generator_states(resumed)["proj"]["device"] == str(device)
    for a, b in zip(sr_step(model, device), sr_step(resumed, device)):
        assert torch.equal(a, b)


def test_bf16_activations_keep_their_dtype():
    lin = nn.Linear(32, 16)
    q = QuantLinear.from_linear(lin, QuantRecipe())
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    y = q(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and lin.weight.grad.dtype == torch.float32


def test_quantized_grouped_mm_is_per_expert_emulated_linear():
    recipe = QuantRecipe(stochastic_rounding=False)
    gm = quantized_grouped_mm(recipe)
    assert isinstance(gm, QuantizedGroupedMM)
    x = torch.randn(30, 64, requires_grad=True)
    w = (torch.randn(4, 24, 64) / 8).requires_grad_()
    sizes = torch.tensor([7, 0, 18, 5])
    y = gm(x, w, sizes)
    assert y.shape == (30, 24)
    g = torch.randn(30, 24)
    y.backward(g)
    start = 0
    for e, n in enumerate(sizes.tolist()):
        if n:
            ye, dxe, dwe = run(recipe, x[start : start + n], w[e], g[start : start + n])
            assert torch.equal(bits(y[start : start + n].detach()), bits(ye))
            assert torch.equal(bits(x.grad[start : start + n]), bits(dxe))
            assert torch.equal(bits(w.grad[e]), bits(dwe))
        else:
            assert (w.grad[e] == 0).all()
        start += n
    empty = gm(x[:0], w, torch.zeros(4, dtype=torch.long))
    assert empty.shape == (0, 24) and empty.requires_grad
    with pytest.raises(ValueError, match="group_sizes"):
        gm(x, w, torch.tensor([7, 0, 18, 4]))
    with pytest.raises(ValueError, match="grouped_mm expects"):
        gm(x, w[:, :, :32], sizes)


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor of any dtype (bit-exact comparison, -0.0 != 0.0)."""
    return t.detach().contiguous().view(-1).view(torch.uint8)


GROUPED_RECIPES = {
    "nvfp4": QuantRecipe(seed=1),
    "nvfp4 no rht": QuantRecipe(rht=False, seed=2),
    "nvfp4 1d weights": QuantRecipe(two_d_weights=False, seed=3),
    "mxfp8": QuantRecipe(format="mxfp8"),
    "bf16": QuantRecipe(format="bf16"),
}


def reference_expert_gemms(recipe: QuantRecipe, x, w, g, generator):
    """(y, dx, dw) of one expert from the recipe table's operands, each quantized alone by the reference
    quantizers (stochastic rounding: the dgrad operand's draws, then the wgrad operand's)."""
    dy = g.float()
    if recipe.format == "bf16":
        to_bf16 = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
        x_q, w_q, dy_q = to_bf16(x), to_bf16(w), to_bf16(dy)
        return x_q @ w_q.t(), dy_q @ w_q, dy_q.t() @ x_q
    if recipe.format == "mxfp8":
        fq = mxfp8.fake_quantize_ref
        return fq(x, dim=-1) @ fq(w, dim=1).t(), fq(dy, dim=-1) @ fq(w, dim=0), fq(dy, dim=0).t() @ fq(x, dim=0)
    fq = nvfp4.fake_quantize_ref
    w_fprop = fq(w, block_2d=True) if recipe.two_d_weights else fq(w, dim=1)
    w_dgrad = w_fprop if recipe.two_d_weights else fq(w, dim=0)
    sr = {"stochastic_rounding": recipe.stochastic_rounding, "generator": generator}
    dx = fq(dy, dim=-1, **sr) @ w_dgrad
    dw = wgrad_operand(dy, recipe.rht, **sr).t() @ wgrad_operand(x, recipe.rht)
    return fq(x, dim=-1) @ w_fprop.t(), dx, dw


@pytest.mark.parametrize("name", list(GROUPED_RECIPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [[7, 0, 18, 5], [0, 30, 0, 0], [13, 1, 2, 14]])
def test_grouped_mm_equals_reference_expert_gemms(name, dtype, sizes):
    """Every expert's three GEMMs equal the matmuls of its own operands from the reference quantizers; the SR
    stream is drawn expert by expert in expert order, skipping experts without rows (each: dgrad, then wgrad)."""
    recipe = GROUPED_RECIPES[name]
    gm = quantized_grouped_mm(recipe, seed_offset=4)
    # 24 outputs and 72 inputs: not multiples of 16 (padding, and slices at unaligned addresses, where MKL picks
    # the same summation order as for fresh tensors at these shapes; see linear.py's docstring).
    x = (torch.randn(30, 72) * 2).to(dtype).requires_grad_()
    w = (torch.randn(4, 24, 72) / 8).requires_grad_()
    g = torch.randn(30, 24).to(dtype)
    y = gm(x, w, torch.tensor(sizes))
    y.backward(g)

    generator = torch.Generator().manual_seed(recipe.seed + 4)
    starts = torch.tensor([0] + sizes).cumsum(0).tolist()
    experts = [e for e, n in enumerate(sizes) if n]
    expected_y, expected_dx = torch.empty(30, 24, dtype=dtype), torch.empty(30, 72, dtype=dtype)
    expected_dw = torch.zeros(4, 24, 72)
    for e in experts:
        rows = slice(starts[e], starts[e + 1])
        y_e, dx_e, dw_e = reference_expert_gemms(recipe, x.detach()[rows], w.detach()[e], g[rows], generator)
        expected_y[rows], expected_dx[rows], expected_dw[e] = y_e, dx_e, dw_e
    assert torch.equal(raw(y), raw(expected_y))
    assert torch.equal(raw(x.grad), raw(expected_dx))
    assert torch.equal(raw(w.grad), raw(expected_dw))
    if recipe.stochastic_rounding:
        assert torch.equal(gm.sr_generators.get_state()["state"], generator.get_state())


def per_expert_mlp(recipe, sr_generators, stats, x, up, down, sizes, dy):
    """The expert MLP ``down(relu(up(x))^2)`` as one emulated linear per expert with rows, all drawing from one
    SR stream, backpropagating ``dy``: layer by layer from the output, each layer's experts in order (the
    documented draw order). Returns y and the gradients of x, up and down."""
    starts = torch.tensor([0] + sizes).cumsum(0).tolist()
    experts = [e for e, n in enumerate(sizes) if n]
    rows = {e: slice(starts[e], starts[e + 1]) for e in experts}
    leaves, hidden, y = {}, {}, torch.empty(x.shape[0], down.shape[1])
    for e in experts:
        x_e, up_e, down_e = (t.detach().requires_grad_() for t in (x[rows[e]], up[e], down[e]))
        hidden[e] = F.relu(emulated_linear(x_e, up_e, None, recipe, sr_generators, stats)) ** 2
        hidden_e = hidden[e].detach().requires_grad_()
        y_e = emulated_linear(hidden_e, down_e, None, recipe, sr_generators, stats)
        y[rows[e]] = y_e.detach()
        leaves[e] = (x_e, up_e, hidden_e, down_e, y_e)
    d_hidden, d_down = {}, torch.zeros_like(down)
    for e in experts:  # the down projection's backward, expert by expert
        _, _, hidden_e, down_e, y_e = leaves[e]
        d_hidden[e], d_down[e] = torch.autograd.grad(y_e, (hidden_e, down_e), dy[rows[e]])
    d_x, d_up = torch.empty_like(x), torch.zeros_like(up)
    for e in experts:  # then the up projection's
        x_e, up_e, *_ = leaves[e]
        d_x[rows[e]], d_up[e] = torch.autograd.grad(hidden[e], (x_e, up_e), d_hidden[e])
    return y, d_x, d_up, d_down


@pytest.mark.parametrize("name", list(GROUPED_RECIPES))
def test_grouped_mm_equals_the_per_expert_loop_bit_for_bit(name):
    """An up -> relu^2 -> down expert MLP through one grouped GEMM module (both GEMMs draw from its stream),
    twice (the stream goes on): outputs, gradients, the stream and the underflow counts equal those of one
    emulated linear per expert whose backward runs in expert order."""
    recipe = GROUPED_RECIPES[name]
    sizes = [9, 0, 33, 1, 21]
    x0 = torch.randn(64, 48)
    w_up, w_down = torch.randn(5, 80, 48) / 7, torch.randn(5, 48, 80) / 9
    results = []
    for batched in (True, False):
        gm = quantized_grouped_mm(recipe, seed_offset=7)
        gm.stats.enabled = True
        x, up, down = (t.clone().requires_grad_() for t in (x0, w_up, w_down))
        outputs, grads = [], [None, None, None]
        for step in range(2):
            dy = torch.randn(64, 48, generator=torch.Generator().manual_seed(step))
            if batched:
                y = gm(F.relu(gm(x, up, torch.tensor(sizes))) ** 2, down, torch.tensor(sizes))
                y.backward(dy)
                y, step_grads = y.detach(), (x.grad, up.grad, down.grad)
                x.grad = up.grad = down.grad = None
            else:
                y, *step_grads = per_expert_mlp(recipe, gm.sr_generators, gm.stats, x, up, down, sizes, dy)
            outputs.append(y)
            grads = [g if total is None else total + g for total, g in zip(grads, step_grads)]
        state = gm.sr_generators.get_state()
        results.append((outputs, grads, state, gm.stats.input_zero_fraction, gm.stats.weight_zero_fraction))
    (out_a, grads_a, state_a, in_a, w_a), (out_b, grads_b, state_b, in_b, w_b) = results
    for a, b in zip(out_a + grads_a, out_b + grads_b):
        assert torch.equal(raw(a), raw(b))
    assert (state_a is None) == (state_b is None)
    assert state_a is None or torch.equal(state_a["state"], state_b["state"])
    assert (in_a, w_a) == (in_b, w_b)


def test_underflow_stats_count_flushed_fprop_operands():
    lin = nn.Linear(64, 16)
    q = QuantLinear.from_linear(lin, QuantRecipe())
    x = torch.randn(8, 64)
    x[:, ::16] = 1e4  # one outlier per block: many of its 15 neighbours flush to zero
    q(x)
    assert q.stats.zero_fraction == 0.0  # off by default: nothing recorded
    found = set_underflow_tracking(q, True)
    assert found == [q.stats]
    q(x)
    x_q = nvfp4.fake_quantize_ref(x)
    expected_input = ((x != 0) & (x_q == 0)).sum().item() / (x != 0).sum().item()
    assert expected_input > 0.3
    assert q.stats.input_zero_fraction == pytest.approx(expected_input)
    w_q = nvfp4.fake_quantize_ref(lin.weight.detach(), block_2d=True)
    expected_weight = ((lin.weight != 0) & (w_q == 0)).sum().item() / lin.weight.numel()
    assert q.stats.weight_zero_fraction == pytest.approx(expected_weight)
    q(x)  # running: a second identical call leaves the fractions unchanged
    assert q.stats.input_zero_fraction == pytest.approx(expected_input)
    set_underflow_tracking(q, False)
    assert not q.stats.enabled and q.stats.zero_fraction == 0.0


def test_underflow_tracking_finds_grouped_mm_on_modules():
    experts = nn.Module()
    experts.grouped_mm = quantized_grouped_mm(QuantRecipe())
    model = nn.ModuleDict({"experts": experts, "proj": QuantLinear.from_linear(nn.Linear(8, 8), QuantRecipe())})
    found = set_underflow_tracking(model)
    assert len(found) == 2 and all(s.enabled for s in found)
