"""fp32 islands under `torch.autocast`: the router and the SSD scan compute in fp32 inside a bf16 autocast region
(autocast picks an op's dtype by its name, so `F.linear(x.float(), w)` alone would run in bf16)."""

from __future__ import annotations

import torch

from hybridtron.model.lm import HybridLM
from hybridtron.ops.ssd import ssd_chunked, ssd_ref, ssd_step, ssd_step_, ssd_steps


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_router_scores_are_fp32_under_autocast(small_config):
    moe = HybridLM(small_config()).moe_layers()[0]
    x = torch.randn(37, moe.gate.weight.shape[1])
    expected_ids, expected_weights = moe.gate(x)
    with bf16_autocast():
        ids, weights = moe.gate(x)
    assert weights.dtype == torch.float32
    assert torch.equal(ids, expected_ids) and torch.equal(weights, expected_weights)


def scan_inputs(batch=2, length=19, heads=4, head_dim=8, groups=2, state=8):
    x = torch.randn(batch, length, heads, head_dim)
    a = -torch.rand(batch, length, heads)
    B, C = torch.randn(batch, length, groups, state), torch.randn(batch, length, groups, state)
    return x, a, B, C, torch.randn(batch, heads, head_dim, state)


def test_every_scan_is_fp32_and_bit_identical_under_autocast():
    x, a, B, C, initial = scan_inputs()
    outside = [ssd_chunked(x, a, B, C, 8, initial), ssd_ref(x, a, B, C, None, initial), ssd_steps(x, a, B, C, initial),
               ssd_step(initial, x[:, 0], a[:, 0], B[:, 0], C[:, 0])]
    state = initial.clone()
    outside.append((ssd_step_(state, x[:, 0], a[:, 0], B[:, 0], C[:, 0]), state))
    with bf16_autocast():
        inside = [ssd_chunked(x, a, B, C, 8, initial), ssd_ref(x, a, B, C, None, initial),
                  ssd_steps(x, a, B, C, initial), ssd_step(initial, x[:, 0], a[:, 0], B[:, 0], C[:, 0])]
        state = initial.clone()
        inside.append((ssd_step_(state, x[:, 0], a[:, 0], B[:, 0], C[:, 0]), state))
    for (y_out, s_out), (y_in, s_in) in zip(outside, inside):
        assert y_in.dtype == torch.float32 and s_in.dtype == torch.float32
        assert torch.equal(y_in, y_out) and torch.equal(s_in, s_out)


def test_model_under_autocast_routes_as_in_fp32_where_the_inputs_agree(small_config):
    """Inside a bf16 autocast forward the router sees bf16-rounded activations but scores them in fp32: its
    scores equal an fp32 router's on the same (rounded) inputs, and the backward reaches the fp32 router weight."""
    model = HybridLM(small_config())
    moe = model.moe_layers()[0]
    seen = {}
    moe.gate.register_forward_hook(lambda module, args, out: seen.update(x=args[0], out=out))
    ids = torch.randint(0, 128, (2, 16))
    with bf16_autocast():
        out = model(ids, ids)
    out.loss.backward()
    ids_ref, weights_ref = moe.gate(seen["x"].detach())
    assert seen["out"][1].dtype == torch.float32
    assert torch.equal(seen["out"][0], ids_ref) and torch.equal(seen["out"][1].detach(), weights_ref)
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.dtype == torch.float32
