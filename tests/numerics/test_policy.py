"""The precision policy converter: which module gets which format, on the tiny preset and on ultra3 (meta)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridtron.cli import main as cli_main
from hybridtron.config import ATTENTION, MAMBA, MLP, MOE, tiny, ultra3
from hybridtron.model.lm import HybridLM
from hybridtron.model.moe import RoutedExperts, Router
from hybridtron.numerics.grad_accum import MainGradLinear
from hybridtron.numerics.linear import QuantizedGroupedMM, QuantLinear
from hybridtron.numerics.policy import (
    apply_precision, convert_for_training, flop_shares, precision_plan, tail_layers,
)
from hybridtron.ops.grouped_mm import grouped_mm
from hybridtron.train.config import TrainConfig

MIXER_LINEARS = {MAMBA: ("in_proj", "out_proj"), ATTENTION: ("q_proj", "k_proj", "v_proj", "o_proj"),
                 MLP: ("up_proj", "down_proj")}


def fmt(module) -> str:
    """The format a linear or RoutedExperts runs in after conversion ("fp32" = left as it was)."""
    if isinstance(module, RoutedExperts):
        return module.grouped_mm.recipe.format if isinstance(module.grouped_mm, QuantizedGroupedMM) else "fp32"
    if isinstance(module, QuantLinear):
        return module.recipe.format
    assert isinstance(module, nn.Linear), type(module)
    return "fp32"


def mixer_formats(kind: str, mixer) -> dict[str, str]:
    if kind == MOE:
        out = {"fc1_latent_proj": fmt(mixer.fc1_latent_proj), "fc2_latent_proj": fmt(mixer.fc2_latent_proj),
               "experts": fmt(mixer.experts), "shared.up_proj": fmt(mixer.shared_experts.up_proj),
               "shared.down_proj": fmt(mixer.shared_experts.down_proj)}
        assert isinstance(mixer.gate, Router) and mixer.gate.weight.dtype == torch.float32
        return out
    return {name: fmt(getattr(mixer, name)) for name in MIXER_LINEARS[kind]}


ULTRA_BODY = {
    MAMBA: {"in_proj": "nvfp4", "out_proj": "mxfp8"},
    ATTENTION: {"q_proj": "bf16", "k_proj": "bf16", "v_proj": "bf16", "o_proj": "bf16"},
    MOE: {"fc1_latent_proj": "bf16", "fc2_latent_proj": "bf16", "experts": "nvfp4", "shared.up_proj": "nvfp4",
          "shared.down_proj": "nvfp4"},
    MLP: {"up_proj": "nvfp4", "down_proj": "nvfp4"},
}


def check_ultra_formats(model: HybridLM, tail_count: int) -> None:
    layers = model.backbone.layers
    tail = set(range(len(layers) - tail_count, len(layers)))
    for index, layer in enumerate(layers):
        got = mixer_formats(layer.kind, layer.mixer)
        expected = {k: "bf16" for k in got} if index in tail else ULTRA_BODY[layer.kind]
        assert got == expected, f"layer {index} ({layer.kind})"
    first = model.mtp.layers[0]
    assert fmt(first.eh_proj) == "bf16"
    for layer in model.mtp.layers:
        assert set(mixer_formats(layer.kind, layer.mixer).values()) == {"bf16"}
    assert fmt(model.lm_head) == "bf16"
    assert type(model.backbone.embeddings) is nn.Embedding


def test_ultra_policy_on_tiny():
    model = HybridLM(tiny())
    apply_precision(model, "nvfp4")
    assert list(tail_layers(8)) == [7]  # round(0.15 * 8) = 1
    check_ultra_formats(model, tail_count=1)
    kinds_before_tail = {layer.kind for layer in model.backbone.layers[:7]}
    assert kinds_before_tail == {MAMBA, ATTENTION, MOE, MLP}  # every rule of the policy is exercised


def test_ultra_policy_on_ultra3_meta():
    model = HybridLM.on_meta(ultra3())
    apply_precision(model, "nvfp4")
    assert list(tail_layers(108)) == list(range(92, 108))  # 16 of 108, as the report
    check_ultra_formats(model, tail_count=16)
    assert model.lm_head.weight.is_meta


def test_all_policy_quantizes_every_gemm_but_the_router(small_config):
    model = HybridLM(small_config())
    apply_precision(model, "nvfp4", "all")
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    assert linears and all(fmt(m) == "nvfp4" for m in linears)
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert len(experts) == 3 and all(fmt(m) == "nvfp4" for m in experts)  # 2 backbone MoE layers + MTP
    assert all(g.format == "fp32" for g in precision_plan(model, "nvfp4", "all") if g.role == "moe.gate")


def test_mxfp8_and_bf16_recipes(small_config):
    model = HybridLM(small_config())
    apply_precision(model, "mxfp8")
    mamba = model.backbone.layers[0].mixer
    assert (fmt(mamba.in_proj), fmt(mamba.out_proj), fmt(model.lm_head)) == ("mxfp8", "mxfp8", "bf16")
    apply_precision(model, "bf16")  # converting again re-targets the same parameters
    assert {fmt(m) for m in model.modules() if isinstance(m, (nn.Linear, QuantLinear, RoutedExperts))} == {"bf16"}


def test_nvfp4_switches_reach_every_nvfp4_gemm(small_config):
    model = HybridLM(small_config())
    apply_precision(model, "nvfp4", "all", stochastic_rounding=False, rht=False, two_d_weights=False, seed=7)
    recipes = [m.recipe for m in model.modules() if isinstance(m, QuantLinear)]
    recipes += [m.grouped_mm.recipe for m in model.modules() if isinstance(m, RoutedExperts)]
    assert all(not (r.stochastic_rounding or r.rht or r.two_d_weights) and r.seed == 7 for r in recipes)
    offsets = [m.seed_offset for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(set(offsets)) == len(offsets)  # each GEMM its own SR stream
    with pytest.raises(ValueError, match="nvfp4 switches"):
        apply_precision(HybridLM(small_config()), "mxfp8", rht=False)
    with pytest.raises(ValueError, match="policy must be one of"):
        apply_precision(HybridLM(small_config()), "nvfp4", "most")
    with pytest.raises(ValueError, match="recipe must be one of"):
        apply_precision(HybridLM(small_config()), "fp8")


def test_state_dict_and_parameters_unchanged(small_config):
    model = HybridLM(small_config())
    before = {name: p for name, p in model.named_parameters()}
    state_before = model.state_dict()
    apply_precision(model, "nvfp4")
    after = dict(model.named_parameters())
    assert list(after) == list(before)
    assert all(after[name] is before[name] for name in before)  # the same Parameter objects: optimizer state holds
    state_after = model.state_dict()
    assert list(state_after) == list(state_before)
    assert all(torch.equal(state_after[k], state_before[k]) for k in state_before)


def test_converted_forward_backward_runs_within_budget(small_config):
    """The converted model trains: finite loss and gradients everywhere, and its logits differ from fp32 by a
    quantization error budget relative to the BF16 conversion's: E4M3 (MXFP8) keeps 4 significant bits and
    E2M1 (NVFP4) 2 against BF16's 8, so their errors are about 2^4 and 2^6 times BF16's; block scaling (values
    below their block's maximum keep fewer bits) allows another factor of 2."""
    torch.manual_seed(0)
    reference = HybridLM(small_config())
    ids = torch.randint(0, 128, (2, 32))
    logits_fp32 = reference(ids).logits.detach()
    errors = {}
    for recipe in ("bf16", "mxfp8", "nvfp4"):
        model = HybridLM(small_config())
        model.load_state_dict(reference.state_dict())
        apply_precision(model, recipe, "all")
        out = model(ids, ids.roll(-1, 1))
        out.loss.backward()
        assert torch.isfinite(out.loss)
        assert all(p.grad is not None and torch.isfinite(p.grad).all()
                   for name, p in model.named_parameters() if not name.startswith("backbone.embeddings"))
        errors[recipe] = float((out.logits.detach() - logits_fp32).norm() / logits_fp32.norm())
    assert 0 < errors["bf16"] < 2e-2
    assert errors["bf16"] < errors["mxfp8"] <= 2 * 2 ** 4 * errors["bf16"]
    assert errors["mxfp8"] < errors["nvfp4"] <= 2 * 2 ** 6 * errors["bf16"]


def _independent_flops(model: HybridLM) -> int:
    """2 x the parameters one training token multiplies with: matrices only, top-k experts, MTP x depths,
    lm_head x (1 + depths); no embedding (a lookup), no conv1d or per-channel vectors."""
    config, depths = model.config, model.config.mtp_num_depths
    total = 0
    for name, param in model.named_parameters():
        if name.startswith("backbone.embeddings") or param.dim() < 2 or "conv1d" in name:
            continue
        count = param.numel()
        if ".experts." in name:
            count = count // config.n_routed_experts * config.num_experts_per_tok
        if name.startswith("mtp."):
            count *= depths
        if name.startswith("lm_head."):
            count *= 1 + depths
        total += 2 * count
    return total


@pytest.mark.parametrize("config_fn", [tiny, ultra3])
@pytest.mark.parametrize("recipe,policy", [("nvfp4", "ultra"), ("nvfp4", "all"), ("mxfp8", "ultra"), ("bf16", "ultra")])
def test_flop_shares_sum_to_one_and_match_a_parameter_count(config_fn, recipe, policy):
    model = HybridLM.on_meta(config_fn())
    plan = precision_plan(model, recipe, policy)
    shares = flop_shares(plan)
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-12)
    assert sum(g.flops_per_token for g in plan) == _independent_flops(model)
    expected_formats = {("nvfp4", "ultra"): {"nvfp4", "mxfp8", "bf16", "fp32"}, ("nvfp4", "all"): {"nvfp4", "fp32"},
                        ("mxfp8", "ultra"): {"mxfp8", "bf16", "fp32"}, ("bf16", "ultra"): {"bf16", "fp32"}}
    assert set(shares) == expected_formats[(recipe, policy)]


def test_ultra3_flop_shares():
    shares = flop_shares(precision_plan(HybridLM.on_meta(ultra3()), "nvfp4", "ultra"))
    # Most linear FLOPs are the experts and Mamba in_proj of the first 92 layers: NVFP4 carries about 5/8.
    assert 0.55 < shares["nvfp4"] < 0.70
    assert 0.05 < shares["mxfp8"] < 0.15
    assert shares["fp32"] < 0.01


def test_precision_command_prints_a_grouped_table(capsys):
    assert cli_main(["precision", "--preset", "ultra3"]) == 0
    text = capsys.readouterr().out
    assert "BF16 tail: layers 92-107 (the last 16 of 108)" in text
    assert len(text.splitlines()) < 50  # grouped by layer kind and range, not one line per module
    assert "mamba.in_proj                    0-91         41  nvfp4" in text
    assert "mamba.out_proj                   0-91         41  mxfp8" in text
    shares = {line.split()[0]: float(line.split()[1].rstrip("%")) for line in text.splitlines()
              if line.startswith("  ") and line.strip().endswith("%")}
    assert set(shares) == {"nvfp4", "bf16", "mxfp8", "fp32"}
    assert sum(shares.values()) == pytest.approx(100.0, abs=0.02)


def test_convert_for_training_follows_the_train_config(small_config):
    model = HybridLM(small_config())
    assert convert_for_training(model, TrainConfig(precision="bf16")) is None  # bf16 = autocast: no swap
    assert type(model.lm_head) is nn.Linear and model.backbone.layers[2].mixer.experts.grouped_mm is grouped_mm

    model = HybridLM(small_config())
    plan = convert_for_training(model, TrainConfig(precision="nvfp4", precision_policy="all", nvfp4_rht=False,
                                                   grad_accum_dtype="bf16"))
    assert {g.format for g in plan} == {"nvfp4", "fp32"}
    assert isinstance(model.lm_head, MainGradLinear) and model.lm_head.main_grad.dtype == torch.bfloat16
    assert model.lm_head.recipe.format == "nvfp4" and not model.lm_head.recipe.rht
    assert list(model.state_dict()) == list(HybridLM(small_config()).state_dict())  # names unchanged
    with pytest.raises(ValueError, match="before other converters"):
        apply_precision(model, "nvfp4")
