"""Precision policy: which GEMM of a HybridLM runs in which number format, applied by a converter.

The model never branches on precision. :func:`apply_precision` walks it once and swaps each ``nn.Linear`` for a
:class:`~hybridtron.numerics.linear.QuantLinear` (the same Parameter objects, so state-dict names and optimizer
state are unchanged) and each ``RoutedExperts.grouped_mm`` for a quantized grouped matmul, as the policy says.

Recipes (the format of the low-precision GEMMs): ``nvfp4``, ``mxfp8``, ``bf16`` (every GEMM in BF16).

Policy ``ultra`` (Nemotron 3 Ultra report and the Nemotron 3 white paper), for the nvfp4 recipe::

    BF16   the last 15% of the backbone layers (round(0.15 * 108) = 16 of 108), every GEMM in them;
           attention q/k/v/o projections, LatentMoE latent projections (fc1/fc2_latent_proj),
           the MTP block (eh_proj and its layers), lm_head
    MXFP8  Mamba out_proj (NVFP4 flushed up to 40% of its values to zero in the white paper)
    NVFP4  Mamba in_proj, routed experts, shared experts, dense MLPs
    FP32   the MoE router (gate), always: its scores decide the routing

With the mxfp8 recipe the same split holds with MXFP8 in NVFP4's place. Policy ``all`` (the ablation) puts
every linear and grouped matmul in the recipe's format, the router still excepted. The embedding is a lookup,
not a GEMM: it stays unquantized under every policy.

FLOPs per token of a GEMM are 2 * in * out per application. The routed experts count their top-k experts; the
MTP block counts once per depth and lm_head 1 + depths times (a training token passes through each).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridtron.config import ATTENTION, KIND_TO_PATTERN_CHAR, MAMBA, MLP, MOE, PRESETS, preset
from hybridtron.model.lm import HybridLM
from hybridtron.numerics.grad_accum import apply_output_grad_accumulation
from hybridtron.numerics.linear import QuantLinear, QuantRecipe, quantized_grouped_mm

if TYPE_CHECKING:  # the converters import torch when they run: `precision --help` and `plan` read this module
    from torch import nn

    from hybridtron.numerics.linear import QuantRecipe

RECIPES = ("bf16", "mxfp8", "nvfp4")
POLICIES = ("ultra", "all")
ULTRA_TAIL_FRACTION = 0.15
ROUTER_FORMAT = "fp32"

# Under policy "ultra", outside the BF16 tail: "low" means the recipe's format (NVFP4 for nvfp4).
_ULTRA_ROLE_FORMATS = {
    "mamba.in_proj": "low",
    "mamba.out_proj": "mxfp8",
    "attention.q_proj": "bf16",
    "attention.k_proj": "bf16",
    "attention.v_proj": "bf16",
    "attention.o_proj": "bf16",
    "moe.fc1_latent_proj": "bf16",
    "moe.fc2_latent_proj": "bf16",
    "moe.experts": "low",
    "moe.shared_experts.up_proj": "low",
    "moe.shared_experts.down_proj": "low",
    "mlp.up_proj": "low",
    "mlp.down_proj": "low",
}
_KIND_NAMES = {MAMBA: "mamba", ATTENTION: "attention", MOE: "moe", MLP: "mlp"}


@dataclass(frozen=True)
class GemmAssignment:
    """One GEMM-bearing module and the format the policy gives it.

    name: module path in the model ("backbone.layers.3.mixer.in_proj"; routed experts name the RoutedExperts).
    part: "backbone", "mtp" or "head".  layer: backbone layer index (None elsewhere).
    role: "<block kind>.<module>" ("mamba.in_proj", "moe.experts", "moe.gate", "mtp.eh_proj", "lm_head").
    flops_per_token: 2 * in * out per application, times applications per training token.
    """

    name: str
    part: str
    layer: int | None
    kind: str | None
    role: str
    format: str
    flops_per_token: int


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(choices)}; got {value!r}")


def tail_layers(num_layers: int, tail_fraction: float = ULTRA_TAIL_FRACTION) -> range:
    """The last round(tail_fraction * num_layers) layers: 16 of Ultra's 108 at 15%, 1 of the tiny preset's 8."""
    if not 0.0 <= tail_fraction <= 1.0:
        raise ValueError(f"tail_fraction must be in [0, 1], got {tail_fraction}")
    return range(num_layers - round(tail_fraction * num_layers), num_layers)


def _linear_flops(module: nn.Module) -> int:
    out_features, in_features = module.weight.shape
    return 2 * in_features * out_features


def _mixer_gemms(kind: str, mixer: nn.Module, prefix: str, top_k: int) -> list[tuple[str, str, int]]:
    """(module path, role, FLOPs per application) of one mixer's GEMMs."""
    role_kind = _KIND_NAMES[kind]
    if kind == MOE:
        gemms = [(f"{prefix}.gate", "moe.gate", 2 * mixer.gate.weight.numel())]
        if mixer.latent:
            for proj in ("fc1_latent_proj", "fc2_latent_proj"):
                gemms.append((f"{prefix}.{proj}", f"moe.{proj}", _linear_flops(getattr(mixer, proj))))
        experts = mixer.experts
        per_expert = 2 * experts.up_proj[0].numel() + 2 * experts.down_proj[0].numel()
        gemms.append((f"{prefix}.experts", "moe.experts", top_k * per_expert))
        for proj in ("up_proj", "down_proj"):
            module = getattr(mixer.shared_experts, proj)
            gemms.append((f"{prefix}.shared_experts.{proj}", f"moe.shared_experts.{proj}", _linear_flops(module)))
        return gemms
    names = {MAMBA: ("in_proj", "out_proj"), ATTENTION: ("q_proj", "k_proj", "v_proj", "o_proj"),
             MLP: ("up_proj", "down_proj")}[kind]
    return [(f"{prefix}.{name}", f"{role_kind}.{name}", _linear_flops(getattr(mixer, name))) for name in names]


def precision_plan(model: nn.Module, recipe: str = "nvfp4", policy: str = "ultra", *,
                   tail_fraction: float = ULTRA_TAIL_FRACTION) -> list[GemmAssignment]:
    """Every GEMM of ``model`` (a HybridLM, possibly on the meta device) with its format under recipe/policy."""
    _check_choice(recipe, RECIPES, "recipe")
    _check_choice(policy, POLICIES, "policy")
    config = model.config
    layers = model.backbone.layers
    tail = set(tail_layers(len(layers), tail_fraction))
    depths = config.mtp_num_depths if model.mtp is not None else 0

    def format_of(role: str, layer: int | None, part: str) -> str:
        if role == "moe.gate":
            return ROUTER_FORMAT
        if recipe == "bf16":
            return "bf16"
        if policy == "all":
            return recipe
        if part != "backbone" or layer in tail:
            return "bf16"
        wanted = _ULTRA_ROLE_FORMATS[role]
        return recipe if wanted == "low" else wanted

    plan = []
    for index, layer in enumerate(layers):
        for name, role, flops in _mixer_gemms(layer.kind, layer.mixer, f"backbone.layers.{index}.mixer",
                                              config.num_experts_per_tok):
            plan.append(GemmAssignment(name, "backbone", index, layer.kind, role,
                                       format_of(role, index, "backbone"), flops))
    if model.mtp is not None:
        first = model.mtp.layers[0]
        plan.append(GemmAssignment("mtp.layers.0.eh_proj", "mtp", None, None, "mtp.eh_proj",
                                   format_of("mtp.eh_proj", None, "mtp"), depths * _linear_flops(first.eh_proj)))
        for index, layer in enumerate(model.mtp.layers):
            for name, role, flops in _mixer_gemms(layer.kind, layer.mixer, f"mtp.layers.{index}.mixer",
                                                  config.num_experts_per_tok):
                plan.append(GemmAssignment(name, "mtp", None, layer.kind, role,
                                           format_of(role, None, "mtp"), depths * flops))
    plan.append(GemmAssignment("lm_head", "head", None, None, "lm_head", format_of("lm_head", None, "head"),
                               (1 + depths) * _linear_flops(model.lm_head)))
    return plan


def recipe_for(fmt: str, *, stochastic_rounding: bool = True, rht: bool = True, two_d_weights: bool = True,
               seed: int = 0) -> QuantRecipe:
    """The QuantRecipe of one format; the NVFP4 switches apply to nvfp4 GEMMs only."""

    if fmt == "nvfp4":
        return QuantRecipe(format="nvfp4", stochastic_rounding=stochastic_rounding, rht=rht,
                           two_d_weights=two_d_weights, seed=seed)
    return QuantRecipe(format=fmt, seed=seed)


def apply_precision(model: nn.Module, recipe: str = "nvfp4", policy: str = "ultra", *,
                    stochastic_rounding: bool = True, rht: bool = True, two_d_weights: bool = True,
                    seed: int = 0, tail_fraction: float = ULTRA_TAIL_FRACTION) -> list[GemmAssignment]:
    """Convert ``model`` in place to run its GEMMs as :func:`precision_plan` says; returns the plan.

    Linears (``nn.Linear`` or an earlier ``QuantLinear``: converting twice re-targets) become QuantLinear
    around the same Parameters; RoutedExperts get a quantized ``grouped_mm``; the router is left in fp32.
    Each quantized GEMM draws its stochastic rounding from its own stream (``seed`` + its index in the plan).
    ``stochastic_rounding``/``rht``/``two_d_weights`` switch those NVFP4 ingredients off for ablations.
    """
    from torch import nn


    if recipe != "nvfp4" and not (stochastic_rounding and rht and two_d_weights):
        raise ValueError(f"stochastic_rounding/rht/two_d_weights are nvfp4 switches; recipe is {recipe!r}")
    plan = precision_plan(model, recipe, policy, tail_fraction=tail_fraction)
    for offset, gemm in enumerate(plan):
        if gemm.format == ROUTER_FORMAT:
            continue
        quant = recipe_for(gemm.format, stochastic_rounding=stochastic_rounding, rht=rht,
                           two_d_weights=two_d_weights, seed=seed)
        parent_name, _, child_name = gemm.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, child_name)
        if gemm.role == "moe.experts":
            module.grouped_mm = quantized_grouped_mm(quant, seed_offset=offset)
        elif isinstance(module, (nn.Linear, QuantLinear)):
            setattr(parent, child_name, QuantLinear(module.weight, module.bias, quant, seed_offset=offset))
        else:
            raise ValueError(f"apply_precision: {gemm.name} is a {type(module).__name__}, expected nn.Linear or "
                             f"QuantLinear (apply the precision policy before other converters, e.g. the "
                             f"output layer's gradient accumulation)")
    return plan


def flop_shares(plan: list[GemmAssignment]) -> dict[str, float]:
    """Share of linear FLOPs per token in each format (sums to 1), largest first."""
    totals: dict[str, int] = defaultdict(int)
    for gemm in plan:
        totals[gemm.format] += gemm.flops_per_token
    grand = sum(totals.values())
    return {fmt: flops / grand for fmt, flops in sorted(totals.items(), key=lambda item: -item[1])}


# ------------------------------------------------------------------------------------------------ report
def _layer_runs(indices: list[int], formats: list[str]) -> list[tuple[int, int, int, str]]:
    """Consecutive layers (in the order of one kind) with the same format -> (first, last, count, format)."""
    runs: list[tuple[int, int, int, str]] = []
    for index, fmt in zip(indices, formats):
        if runs and runs[-1][3] == fmt:
            first, _, count, _ = runs[-1]
            runs[-1] = (first, index, count + 1, fmt)
        else:
            runs.append((index, index, 1, fmt))
    return runs


def describe_precision(model: nn.Module, plan: list[GemmAssignment], recipe: str, policy: str,
                       preset_name: str = "") -> str:
    """A readable table: one row per (layer kind, module, run of layers with one format), then FLOP shares."""
    config = model.config
    total_flops = sum(g.flops_per_token for g in plan)
    layers = len(model.backbone.layers)
    kinds = defaultdict(int)
    for kind in config.layers_block_type:
        kinds[KIND_TO_PATTERN_CHAR[kind]] += 1
    depths = config.mtp_num_depths if model.mtp is not None else 0
    tail = tail_layers(layers)
    lines = [f"{preset_name + ': ' if preset_name else ''}{layers} layers ("
             + ", ".join(f"{char} {count}" for char, count in kinds.items()) + ")"
             + (f", MTP block applied {depths}x" if depths else "")
             + f"; recipe {recipe}, policy {policy}"]
    if recipe != "bf16" and policy == "ultra" and len(tail):
        span = f"layers {tail.start}-{tail.stop - 1}" if len(tail) > 1 else f"layer {tail.start}"
        lines.append(f"BF16 tail: {span} (the last {len(tail)} of {layers})")
    lines.append("")
    scale, unit = (1e9, "GFLOP") if total_flops >= 1e9 else (1e6, "MFLOP")
    header = (f"{'part':<9} {'module':<32} {'layers':<9} {'count':>5}  {'format':<6} {unit + '/token':>12} "
              f"{'share':>7}")
    lines += [header, "-" * len(header)]
    lines.append(f"{'backbone':<9} {'embeddings':<32} {'-':<9} {1:>5}  {'-':<6} {'lookup':>12}")

    def row(part, module, layer_text, count, fmt, flops):
        share = f"{flops / total_flops:7.2%}" if total_flops else ""
        lines.append(f"{part:<9} {module:<32} {layer_text:<9} {count:>5}  {fmt:<6} {flops / scale:>12.3f} {share}")

    backbone = [g for g in plan if g.part == "backbone"]
    for kind in (MAMBA, ATTENTION, MOE, MLP):
        roles = list(dict.fromkeys(g.role for g in backbone if g.kind == kind))
        for role in roles:
            gemms = [g for g in backbone if g.role == role]
            start = 0
            for first, last, count, fmt in _layer_runs([g.layer for g in gemms], [g.format for g in gemms]):
                flops = sum(g.flops_per_token for g in gemms[start:start + count])
                start += count
                row("backbone", role, f"{first}-{last}" if first != last else str(first), count, fmt, flops)
    for gemm in plan:
        if gemm.part != "backbone":
            module = gemm.role if gemm.part == "head" or gemm.role.startswith("mtp.") else f"mtp.{gemm.role}"
            row(gemm.part, module, "-", 1, gemm.format, gemm.flops_per_token)
    lines.append("")
    applied = f"; MTP x{depths}, lm_head x{1 + depths}" if depths else ""
    lines.append(f"linear FLOPs per training token: {total_flops / scale:.3f} {unit} (routed experts: top-"
                 f"{config.num_experts_per_tok}{applied})")
    for fmt, share in flop_shares(plan).items():
        lines.append(f"  {fmt:<6} {share:7.2%}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="ultra3", choices=sorted(PRESETS),
                        help="model preset (default: ultra3); built on the meta device, nothing is allocated")
    parser.add_argument("--recipe", default="nvfp4", choices=RECIPES,
                        help="format of the low-precision GEMMs (default: nvfp4)")
    parser.add_argument("--policy", default="ultra", choices=POLICIES,
                        help="ultra: Nemotron 3 Ultra's mixed policy; all: every linear in the recipe's format "
                             "(default: ultra)")


def run(args) -> int:

    model = HybridLM.on_meta(preset(args.preset))
    plan = precision_plan(model, args.recipe, args.policy)
    print(describe_precision(model, plan, args.recipe, args.policy, preset_name=args.preset))
    return 0


def convert_for_training(model: nn.Module, train) -> list[GemmAssignment] | None:
    """The numerics converters a training run applies from its ``[train]`` section (a TrainConfig), in order:
    the precision policy for ``precision`` nvfp4/mxfp8 (fp32 and bf16, which is autocast, leave the GEMMs as
    they are), then the output layer's gradient accumulation in ``grad_accum_dtype``. Returns the plan."""

    plan = None
    if train.precision in ("nvfp4", "mxfp8"):
        plan = apply_precision(model, train.precision, train.precision_policy,
                               stochastic_rounding=train.nvfp4_stochastic_rounding, rht=train.nvfp4_rht,
                               two_d_weights=train.nvfp4_2d_weights, seed=train.seed)
    apply_output_grad_accumulation(model, train.grad_accum_dtype)
    return plan
