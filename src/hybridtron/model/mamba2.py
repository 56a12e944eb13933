"""The Mamba-2 mixer: in_proj -> causal depthwise conv -> selective scan (SSD) -> gated group RMSNorm -> out_proj.

    [z | xBC | dt] = in_proj(h)                  widths [d, d + 2GN, heads], d = heads * head_dim
    xBC = SiLU(conv1d(xBC))                      causal, kernel K; z and dt are not convolved
    x, B, C = split(xBC)                         B and C per group; head i reads group i // (heads / groups)
    dt = clamp(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)
    S_t = exp(dt_t A) S_{t-1} + dt_t x_t (outer) B_t;  y_t = S_t C_t + D x_t
    out = out_proj(w * GroupRMS(y * SiLU(z)))

Prefill and training use the chunked scan (`ops.ssd.ssd_chunked`); decoding uses the one-token recurrence
(`ops.ssd.ssd_step_`; the compiled decode step its broadcast form `ops.ssd.ssd_step`), and speculative
verification the few-token scan that keeps every state (`ops.ssd.ssd_steps`). All continue from a `MambaState`
(last K-1 conv inputs, SSM state) when one is given, and leave theirs in it. The scan runs in fp32 whatever the
activation dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridtron.config import ModelConfig
from hybridtron.infer.cache import MambaState
from hybridtron.model.norm import GatedGroupRMSNorm
from hybridtron.ops.ssd import ssd_chunked, ssd_ref, ssd_step, ssd_step_, ssd_steps

CONV_TAPS_MAX_TOKENS = 16


class Mamba2Mixer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.n_groups = config.n_groups
        self.state_size = config.ssm_state_size
        self.chunk_size = config.chunk_size
        self.time_step_limit = config.time_step_limit
        self.inner_size = config.mamba_inner_size
        self.conv_channels = self.inner_size + 2 * self.n_groups * self.state_size
        self.in_proj = nn.Linear(config.hidden_size, self.inner_size + self.conv_channels + self.num_heads,
                                 bias=config.use_bias)
        self.conv1d = nn.Conv1d(self.conv_channels, self.conv_channels, config.conv_kernel,
                                groups=self.conv_channels, bias=config.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedGroupRMSNorm(self.inner_size, self.inner_size // self.n_groups, config.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.inner_size, config.hidden_size, bias=config.use_bias)

    # ---- pieces shared by the fast path and the reference
    def split_projection(self, zxbcdt: torch.Tensor):
        return zxbcdt.split_with_sizes([self.inner_size, self.conv_channels, self.num_heads], dim=-1)

    def discretize(self, dt_raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dt [.., heads] fp32, A [heads] fp32)."""
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())
        if self.time_step_limit != (0.0, math.inf):  # softplus is never below 0: the default limit clamps nothing
            dt = dt.clamp(min=self.time_step_limit[0], max=self.time_step_limit[1])
        return dt, -torch.exp(self.A_log.float())

    def split_xbc(self, xBC: torch.Tensor):
        group_width = self.n_groups * self.state_size
        x, B, C = xBC.split_with_sizes([self.inner_size, group_width, group_width], dim=-1)
        return (x.unflatten(-1, (self.num_heads, self.head_dim)),
                B.unflatten(-1, (self.n_groups, self.state_size)),
                C.unflatten(-1, (self.n_groups, self.state_size)))

    def finish(self, y_BTHP: torch.Tensor, x_BTHP: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = torch.addcmul(y_BTHP, self.D.float()[:, None], x_BTHP.float())
        # the gated norm reads the fp32 scan output (as mamba_ssm and transformers do); only its result is cast down
        return self.out_proj(self.norm(y.flatten(-2), z).to(z.dtype))

    @staticmethod
    def initial_ssm(state: MambaState) -> torch.Tensor:
        """The cache's own fp32 state (decoding advances it in place), or a copy where autograd may save it or the
        cache stores another dtype."""
        initial = state.ssm_BHPN.float()
        return initial.clone() if torch.is_grad_enabled() else initial

    def causal_conv(self, conv_input_BCT: torch.Tensor) -> torch.Tensor:
        """The depthwise causal conv of [B, C, K-1+T] inputs (the K-1 before the new tokens first) -> [B, C, T].

        A few tokens (decoding, speculative verification) take the K taps of each output as a product and a sum
        over the unfolded inputs instead of F.conv1d, whose call costs about 40 us at any size on a CPU."""
        kernel = self.conv1d.kernel_size[0]
        weight_C1K, bias = self.conv1d.weight, self.conv1d.bias
        if conv_input_BCT.shape[-1] - (kernel - 1) > CONV_TAPS_MAX_TOKENS:
            return F.conv1d(conv_input_BCT, weight_C1K, bias, groups=self.conv_channels)
        out = (conv_input_BCT.unfold(-1, kernel, 1) * weight_C1K).sum(-1)
        return out if bias is None else out + bias[:, None]

    # ---- fast path
    def forward(self, hidden_BTD: torch.Tensor, state: MambaState | None = None) -> torch.Tensor:
        batch, length, _ = hidden_BTD.shape
        if state is not None and length == 1 and not state.record_steps:
            return self.step(hidden_BTD, state)
        z, xBC, dt_raw = self.split_projection(self.in_proj(hidden_BTD))
        kernel = self.conv1d.kernel_size[0]
        previous_BCK = state.conv_BCK.to(xBC.dtype) if state is not None else \
            xBC.new_zeros(batch, self.conv_channels, kernel - 1)
        conv_input_BCT = torch.cat([previous_BCK, xBC.transpose(1, 2)], dim=-1)
        x, B, C = self.split_xbc(F.silu(self.causal_conv(conv_input_BCT)).transpose(1, 2))
        dt, A = self.discretize(dt_raw)
        x_dt, a = x.float() * dt[..., None], dt * A
        if state is None:
            return self.finish(ssd_chunked(x_dt, a, B.float(), C.float(), self.chunk_size)[0], x, z)

        ssm = self.initial_ssm(state)
        if state.record_steps:  # keep every intermediate state (speculative verification)
            y, ssm_steps = ssd_steps(x_dt, a, B.float(), C.float(), ssm)
            ssm = ssm_steps[:, -1]
            state.ssm_steps = ssm_steps.to(state.ssm_BHPN.dtype)
            state.conv_steps = conv_input_BCT.unfold(-1, kernel - 1, 1)[:, :, 1:].permute(0, 2, 1, 3).contiguous()
        else:
            y, ssm = ssd_chunked(x_dt, a, B.float(), C.float(), self.chunk_size, ssm)
        state.conv_BCK.copy_(conv_input_BCT[..., length:])
        state.ssm_BHPN.copy_(ssm)
        return self.finish(y, x, z)

    def step_inputs(self, hidden_BD: torch.Tensor, state: MambaState):
        """One token's projection, conv (its window advanced in place) and discretization: (z, x, B, C, dt, A)."""
        z, xBC, dt_raw = self.split_projection(self.in_proj(hidden_BD))
        window_BCK = torch.cat([state.conv_BCK.to(xBC.dtype), xBC[..., None]], dim=-1)
        state.conv_BCK.copy_(window_BCK[..., 1:])
        x, B, C = self.split_xbc(F.silu(self.causal_conv(window_BCK)[..., 0]))
        return (z, x, B, C, *self.discretize(dt_raw))

    def step(self, hidden_B1D: torch.Tensor, state: MambaState) -> torch.Tensor:
        """One token from a MambaState (decoding): `forward` in [batch, features] shapes, with fewer calls, and the
        state advanced in place."""
        z, x, B, C, dt, A = self.step_inputs(hidden_B1D[:, 0], state)
        ssm = self.initial_ssm(state)
        y = ssd_step_(ssm, x.float() * dt[..., None], dt * A, B.float(), C.float())
        state.ssm_BHPN.copy_(ssm)
        return self.finish(y, x, z)[:, None]

    def static_step(self, hidden_BD: torch.Tensor, state: MambaState) -> torch.Tensor:
        """`step` on [B, D] for a compiled decode step: the SSM update as broadcast products (`ssd_step`), which the
        compiler fuses into one pass over the state, then copied into the cache."""
        z, x, B, C, dt, A = self.step_inputs(hidden_BD, state)
        y, ssm = ssd_step(state.ssm_BHPN.float(), x.float() * dt[..., None], dt * A, B.float(), C.float())
        state.ssm_BHPN.copy_(ssm)
        return self.finish(y, x, z)


def mamba2_mixer_ref(mixer: Mamba2Mixer, hidden_BTD: torch.Tensor,
                     initial_state: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Token-by-token reference: explicit conv taps and the naive recurrence. Returns (out, (conv, ssm) state)."""
    batch, length, _ = hidden_BTD.shape
    zxbcdt = hidden_BTD @ mixer.in_proj.weight.T
    if mixer.in_proj.bias is not None:
        zxbcdt = zxbcdt + mixer.in_proj.bias
    z, xBC, dt_raw = mixer.split_projection(zxbcdt)
    kernel = mixer.conv1d.kernel_size[0]
    previous = initial_state[0].transpose(1, 2) if initial_state is not None else \
        xBC.new_zeros(batch, kernel - 1, mixer.conv_channels)
    padded = torch.cat([previous, xBC], dim=1)  # [B, K-1+T, C]
    weight_CK = mixer.conv1d.weight[:, 0, :]
    conv = sum(padded[:, tap:tap + length] * weight_CK[:, tap] for tap in range(kernel))
    if mixer.conv1d.bias is not None:
        conv = conv + mixer.conv1d.bias
    x, B, C = mixer.split_xbc(conv * torch.sigmoid(conv))
    dt, A = mixer.discretize(dt_raw)
    y, final = ssd_ref(x.float() * dt[..., None], dt * A, B.float(), C.float(),
                       initial_state_BHPN=initial_state[1] if initial_state is not None else None)
    y = y + mixer.D.float()[:, None] * x.float()
    gated = y.flatten(-2) * (z.float() * torch.sigmoid(z.float()))
    groups = gated.unflatten(-1, (mixer.n_groups, -1))
    normed = (groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + mixer.norm.eps)).flatten(-2)
    out = (mixer.norm.weight * normed.to(z.dtype)) @ mixer.out_proj.weight.T
    if mixer.out_proj.bias is not None:
        out = out + mixer.out_proj.bias
    return out, (padded[:, -(kernel - 1):].transpose(1, 2), final)
