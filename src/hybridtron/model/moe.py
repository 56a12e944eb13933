"""LatentMoE: a sigmoid router with aux-loss-free balancing bias, routed experts at latent width, a shared expert.

    s = sigmoid(x W_r^T)                                  fp32, full width
    choose top-k of s + b (b = e_score_correction_bias)   b steers selection only (group-limited if n_group > 1)
    w = s[chosen] / sum (norm_topk_prob) * routed_scaling_factor
    y = fc2_latent( sum_k w_k * down_e(relu(up_e(fc1_latent(x)))^2) ) + shared(x)

Without `moe_latent_size` the latent projections are absent and the experts work at full width. Two optional
RMSNorms (Marin's options, off by default): `moe_latent_norm` normalises fc1_latent's output before the routed
experts read it (`latent_norm`), `moe_output_norm` normalises the block's output y before the residual add
(`output_norm`). The router's weight and bias stay fp32 whatever the model dtype: the bias drifts to values near 2^6
where bf16 would erase the small differences that decide the selection. Routing replay (R3, for RL): a forward may
be given the experts to use per token; the weights then come from the current scores at those experts. Each forward
leaves its expert choices in `last_expert_ids`;
`last_expert_counts` counts the tokens routed to each expert (the balancing update and MaxVio read it).
`MoE.decode_step` is the form for a compiled decode step: no kept choices, no shape that depends on them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridtron.config import ModelConfig
from hybridtron.model.mlp import MLP, relu2
from hybridtron.model.norm import RMSNorm
from hybridtron.ops.autocast import fp32_island
from hybridtron.ops.grouped_mm import grouped_mm


class Router(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) moves the router between devices but never lowers it below fp32.
        weight32, bias32 = self.weight.data, self.e_score_correction_bias
        super()._apply(fn, recurse)
        if self.weight.dtype != torch.float32:
            self.weight.data = weight32.to(self.weight.device)
        if self.e_score_correction_bias.dtype != torch.float32:
            self.e_score_correction_bias = bias32.to(self.e_score_correction_bias.device)
        return self

    @fp32_island  # autocast would run the linear in bf16 even on fp32 inputs
    def forward(self, x_SD: torch.Tensor, forced_ids_SK: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert ids [S, k], routing weights [S, k] fp32).

        `forced_ids_SK`: routing replay (R3): use these experts instead of choosing, with the weights read from this
        router's own current scores, so the router still gets its gradient."""
        scores = torch.sigmoid(F.linear(x_SD.float(), self.weight))
        if forced_ids_SK is not None:
            expert_ids = forced_ids_SK.to(device=scores.device, dtype=torch.long)
        else:
            expert_ids = self.choose(scores)
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return expert_ids, weights * self.routed_scaling_factor

    def choose(self, scores_SE: torch.Tensor) -> torch.Tensor:
        """Top-k of the biased scores, within the top `topk_group` groups when routing is group-limited."""
        choice = scores_SE + self.e_score_correction_bias
        if self.topk_group < self.n_group:  # keeping every group would mask nothing
            grouped = choice.unflatten(-1, (self.n_group, -1))
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            kept_groups = group_scores.topk(self.topk_group, dim=-1).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
            choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).flatten(-2)
        return choice.topk(self.top_k, dim=-1).indices


class RoutedExperts(nn.Module):
    """E squared-ReLU experts stored stacked ([E, out, in]); tokens are sorted by expert and run as grouped GEMMs.

    `grouped_mm` is an attribute so that a precision converter can swap in a quantized grouped GEMM.
    """

    def __init__(self, num_experts: int, width: int, intermediate_size: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, width))
        self.down_proj = nn.Parameter(torch.empty(num_experts, width, intermediate_size))
        self.grouped_mm = grouped_mm

    def forward(self, x_SL: torch.Tensor, expert_ids_SK: torch.Tensor, weights_SK: torch.Tensor) -> torch.Tensor:
        top_k = expert_ids_SK.shape[1]
        flat_expert = expert_ids_SK.flatten()
        order = torch.argsort(flat_expert, stable=True)
        token_of_row = order // top_k
        group_sizes = torch.bincount(flat_expert, minlength=self.up_proj.shape[0])
        hidden = relu2(self.grouped_mm(x_SL[token_of_row], self.up_proj, group_sizes))
        rows = self.grouped_mm(hidden, self.down_proj, group_sizes)
        rows = rows * weights_SK.flatten()[order, None].to(rows.dtype)
        return torch.zeros_like(x_SL, dtype=rows.dtype).index_add_(0, token_of_row, rows)

    def decode_step(self, x_SL: torch.Tensor, expert_ids_SK: torch.Tensor, weights_SK: torch.Tensor) -> torch.Tensor:
        """The experts of each (token, expert) pair read by index, with static shapes (for a compiled decode
        step): no expert counts, no sorting, nothing read back to Python. Written as broadcast products and sums
        so that the compiler turns each into one reduction that loads the chosen expert's weights in place (an
        indirect load) instead of copying them out first."""
        up_SKLI = self.up_proj.transpose(1, 2)[expert_ids_SK]
        hidden_SKI = relu2((x_SL[:, None, :, None] * up_SKLI).sum(-2)) * weights_SK[..., None].to(x_SL.dtype)
        down_SKIL = self.down_proj.transpose(1, 2)[expert_ids_SK]
        return (hidden_SKI[..., None] * down_SKIL).sum((1, 2))


def routed_experts_ref(experts: RoutedExperts, x_SL, expert_ids_SK, weights_SK) -> torch.Tensor:
    """The loop over experts that defines the result."""
    out = torch.zeros_like(x_SL, dtype=torch.promote_types(x_SL.dtype, weights_SK.dtype))
    for e in range(experts.up_proj.shape[0]):
        token, slot = torch.where(expert_ids_SK == e)
        if token.numel():
            h = relu2(x_SL[token] @ experts.up_proj[e].T) @ experts.down_proj[e].T
            out.index_add_(0, token, h * weights_SK[token, slot, None])
    return out.to(x_SL.dtype)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = Router(config)
        self.latent = config.moe_latent_size is not None
        if self.latent:
            self.fc1_latent_proj = nn.Linear(config.hidden_size, config.moe_latent_size, bias=config.mlp_bias)
            self.fc2_latent_proj = nn.Linear(config.moe_latent_size, config.hidden_size, bias=config.mlp_bias)
        # None when off: a model without the options has the parameter names it always had
        self.latent_norm = RMSNorm(config.moe_latent_size, config.layer_norm_epsilon) \
            if config.moe_latent_norm else None
        self.experts = RoutedExperts(config.n_routed_experts, config.expert_width, config.moe_intermediate_size)
        self.shared_experts = MLP(config.hidden_size, config.moe_shared_expert_intermediate_size, config.mlp_bias)
        self.output_norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon) if config.moe_output_norm else None
        self.last_expert_ids: torch.Tensor | None = None

    @property
    def last_expert_counts(self) -> torch.Tensor | None:
        """Tokens routed to each expert by the last forward; counted when asked (decoding never asks)."""
        if self.last_expert_ids is None:
            return None
        return torch.bincount(self.last_expert_ids.flatten(), minlength=self.gate.num_experts)

    def counted_expert_counts(self, counted: torch.Tensor) -> torch.Tensor:
        """`last_expert_counts` over the tokens where `counted` (bool, the forward's leading shape) is True."""
        return torch.bincount(self.last_expert_ids[counted.flatten()].flatten(), minlength=self.gate.num_experts)

    def route(self, x_SD: torch.Tensor, forced_ids_SK: torch.Tensor | None = None):
        expert_ids, weights = self.gate(x_SD, forced_ids_SK)
        self.last_expert_ids = expert_ids
        return expert_ids, weights

    def forward(self, hidden_BTD: torch.Tensor, experts_fn=None, expert_ids=None) -> torch.Tensor:
        """`expert_ids` [..., k] (the leading shape of `hidden_BTD`): replay these routing choices (see Router)."""
        x_SD = hidden_BTD.flatten(0, -2)
        expert_ids, weights = self.route(x_SD, None if expert_ids is None else expert_ids.reshape(x_SD.shape[0], -1))
        routed = (experts_fn or self.experts)(self.expert_input(x_SD), expert_ids, weights)
        return self.combine(routed, x_SD).view_as(hidden_BTD)

    def expert_input(self, x_SD: torch.Tensor) -> torch.Tensor:
        """What the routed experts read: the (normalised) latent, or x itself without LatentMoE."""
        if not self.latent:
            return x_SD
        latent_SL = self.fc1_latent_proj(x_SD)
        return latent_SL if self.latent_norm is None else self.latent_norm(latent_SL)

    def combine(self, routed_SL: torch.Tensor, x_SD: torch.Tensor) -> torch.Tensor:
        """The block's output from the routed experts' sum: back to full width, plus the shared expert, normalised
        when `output_norm` is on."""
        routed_SD = self.fc2_latent_proj(routed_SL) if self.latent else routed_SL
        out_SD = routed_SD + self.shared_experts(x_SD)
        return out_SD if self.output_norm is None else self.output_norm(out_SD)

    def decode_step(self, x_SD: torch.Tensor) -> torch.Tensor:
        """`forward` on [tokens, D] for a compiled decode step: the choices are not kept (`last_expert_ids` is a
        side effect a compiled graph does not return) and the experts run by index (`RoutedExperts.decode_step`)."""
        expert_ids, weights = self.gate(x_SD)
        return self.combine(self.experts.decode_step(self.expert_input(x_SD), expert_ids, weights), x_SD)


def rms_norm_ref(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`w * x / sqrt(mean(x^2) + eps)`, normalised in fp32, as written."""
    x32 = x.float()
    return (norm.weight * (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps))).to(x.dtype)


def moe_ref(moe: MoE, hidden_BTD: torch.Tensor) -> torch.Tensor:
    """The module docstring's equation term by term: the loop over experts and the optional norms written out."""
    x_SD = hidden_BTD.flatten(0, -2)
    expert_ids, weights = moe.route(x_SD)
    routed_in = x_SD
    if moe.latent:
        routed_in = moe.fc1_latent_proj(x_SD)
        if moe.latent_norm is not None:
            routed_in = rms_norm_ref(moe.latent_norm, routed_in)
    routed = routed_experts_ref(moe.experts, routed_in, expert_ids, weights)
    if moe.latent:
        routed = moe.fc2_latent_proj(routed)
    out = routed + moe.shared_experts(x_SD)
    if moe.output_norm is not None:
        out = rms_norm_ref(moe.output_norm, out)
    return out.view_as(hidden_BTD)
