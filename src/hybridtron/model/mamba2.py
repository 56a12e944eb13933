"""The Mamba-2 mixer: in_proj -> causal depthwise conv -> selective scan (SSD) -> gated group RMSNorm -> out_proj.

    [z | xBC | dt] = in_proj(h)                  widths [d, d + 2GN, heads], d = heads * head_dim
    xBC = SiLU(conv1d(xBC))                      causal, kernel K; z and dt are not convolved
    x, B, C = split(xBC)                         B and C per group; head i reads group i // (heads / groups)
    dt = clamp(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)
    S_t = exp(dt_t A) S_{t-1} + dt_t x_t (outer) B_t;  y_t = S_t C_t + D x_t
    out = out_proj(w * GroupRMS(y * SiLU(z)))

`forward` (training, prefill, any number of tokens) runs the chunked scan (`ops.ssd.ssd_chunked`); given a
`MambaState` (last K-1 conv inputs, SSM state) it continues from it and leaves its own final state in it. Given
`seq_idx` (packed rows, `model.documents`) each document's conv and scan start afresh (`document_conv`).
`decode_step` is one token of the recurrence with static shapes (`ops.ssd.ssd_step`), the form a compiled decode
step runs. The scan runs in fp32 whatever the activation dtype. Faster eager forms for CPU decoding (conv taps, the
state advanced in place, verification that keeps every state) are `hybridtron.infer.fastpath`'s.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridtron.config import ModelConfig
from hybridtron.model.norm import GatedGroupRMSNorm
from hybridtron.model.state import MambaState
from hybridtron.ops.ssd import ssd_chunked, ssd_ref, ssd_step


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
        self.conv_channels = config.conv_channels
        self.in_proj = nn.Linear(config.hidden_size, self.inner_size + self.conv_channels + self.num_heads,
                                 bias=config.use_bias)
        self.conv1d = nn.Conv1d(self.conv_channels, self.conv_channels, config.conv_kernel,
                                groups=self.conv_channels, bias=config.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedGroupRMSNorm(self.inner_size, self.inner_size // self.n_groups, config.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.inner_size, config.hidden_size, bias=config.use_bias)

    # ---- pieces shared by the forward, the decode step and the reference
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
        # channels last in memory: the conv's output is [B, C, T] underneath, and the scan's reductions over heads
        # and positions (dD among them) read a position-major layout in vector loops (compiled Mamba-2 block: -5%)
        xBC = xBC.contiguous()
        x, B, C = xBC.split_with_sizes([self.inner_size, group_width, group_width], dim=-1)
        return (x.unflatten(-1, (self.num_heads, self.head_dim)),
                B.unflatten(-1, (self.n_groups, self.state_size)),
                C.unflatten(-1, (self.n_groups, self.state_size)))

    def conv_input(self, xBC_BTC: torch.Tensor, state: MambaState | None) -> torch.Tensor:
        """The conv's input [B, C, K-1+T]: the K-1 inputs before the new tokens (the state's, or zeros), then theirs."""
        batch = xBC_BTC.shape[0]
        previous_BCK = state.conv_BCK.to(xBC_BTC.dtype) if state is not None else \
            xBC_BTC.new_zeros(batch, self.conv_channels, self.conv1d.kernel_size[0] - 1)
        return torch.cat([previous_BCK, xBC_BTC.transpose(1, 2)], dim=-1)

    def finish(self, y_BTHP: torch.Tensor, x_BTHP: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = torch.addcmul(y_BTHP, self.D.float()[:, None], x_BTHP.float())
        # the gated norm reads the fp32 scan output (as mamba_ssm and transformers do); only its result is cast down
        return self.out_proj(self.norm(y.flatten(-2), z).to(z.dtype))

    def conv(self, conv_input_BCT: torch.Tensor, seq_idx_BT: torch.Tensor | None = None) -> torch.Tensor:
        """The causal depthwise conv of [B, C, K-1+T] inputs -> [B, C, T]; with `seq_idx_BT` ([B, K-1+T]: the
        documents of the inputs) by `document_conv`."""
        if seq_idx_BT is None:
            return F.conv1d(conv_input_BCT, self.conv1d.weight, self.conv1d.bias, groups=self.conv_channels)
        return document_conv(conv_input_BCT, seq_idx_BT, self.conv1d.weight, self.conv1d.bias)

    # ---- the forward: any number of tokens, from a state or from zeros
    def forward(self, hidden_BTD: torch.Tensor, state: MambaState | None = None,
                seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        length = hidden_BTD.shape[1]
        if seq_idx is not None and state is not None:
            raise ValueError("Mamba-2: seq_idx (packed documents) is for training forwards, not a decoding state")
        z, xBC, dt_raw = self.split_projection(self.in_proj(hidden_BTD))
        conv_input_BCT = self.conv_input(xBC, state)
        # the K-1 zero inputs before the row belong to its first document
        conv_seq_BT = None if seq_idx is None else \
            torch.cat([seq_idx[:, :1].expand(-1, self.conv1d.kernel_size[0] - 1), seq_idx], dim=1)
        x, B, C = self.split_xbc(F.silu(self.conv(conv_input_BCT, conv_seq_BT)).transpose(1, 2))
        dt, A = self.discretize(dt_raw)
        # a copy: autograd may keep the initial state for the backward, and the state is overwritten below
        initial = state.read_ssm().clone() if state is not None else None
        y, final = ssd_chunked(x.float() * dt[..., None], dt * A, B.float(), C.float(), self.chunk_size, initial,
                               seq_idx)
        if state is not None:
            state.conv_BCK.copy_(conv_input_BCT[..., length:])
            state.write_ssm(final)
        return self.finish(y, x, z)

    # ---- one token, static shapes
    def decode_inputs(self, hidden_BD: torch.Tensor, state: MambaState):
        """One token's projection, conv (its window advanced in place) and discretization: (z, x, B, C, dt, A).

        The conv of one token is the K taps of its window, a product and a sum (no F.conv1d call)."""
        z, xBC, dt_raw = self.split_projection(self.in_proj(hidden_BD))
        window_BCK = torch.cat([state.conv_BCK.to(xBC.dtype), xBC[..., None]], dim=-1)
        state.conv_BCK.copy_(window_BCK[..., 1:])
        conv_BC = (window_BCK * self.conv1d.weight[:, 0]).sum(-1)
        if self.conv1d.bias is not None:
            conv_BC = conv_BC + self.conv1d.bias
        x, B, C = self.split_xbc(F.silu(conv_BC))
        return (z, x, B, C, *self.discretize(dt_raw))

    def decode_step(self, hidden_BD: torch.Tensor, state: MambaState) -> torch.Tensor:
        """`forward` of one token per sequence, [B, D] -> [B, D], advancing `state`: the SSM update as broadcast
        products (`ssd_step`), which a compiler fuses into one pass over the state, then copied into it."""
        z, x, B, C, dt, A = self.decode_inputs(hidden_BD, state)
        y, ssm = ssd_step(state.read_ssm(), x.float() * dt[..., None], dt * A, B.float(), C.float())
        state.write_ssm(ssm)
        return self.finish(y, x, z)


def document_conv(conv_input_BCT: torch.Tensor, seq_idx_BT: torch.Tensor, weight_C1K: torch.Tensor,
                  bias_C: torch.Tensor | None) -> torch.Tensor:
    """The causal depthwise conv of packed documents, [B, C, K-1+T] -> [B, C, T]: output t (input K-1+t) reads
    tap j's input only where it is in the same document (`seq_idx_BT` [B, K-1+T]), as K masked multiply-adds
    (F.conv1d has no per-output mask; K is 4)."""
    kernel, length = weight_C1K.shape[-1], conv_input_BCT.shape[-1] - weight_C1K.shape[-1] + 1
    own_BT = seq_idx_BT[:, kernel - 1:]
    out = None
    for tap in range(kernel):
        same_B1T = (seq_idx_BT[:, tap:tap + length] == own_BT)[:, None]
        term = conv_input_BCT[..., tap:tap + length] * weight_C1K[:, 0, tap, None] * same_B1T
        out = term if out is None else out + term
    return out if bias_C is None else out + bias_C[:, None]


def mamba2_mixer_ref(mixer: Mamba2Mixer, hidden_BTD: torch.Tensor,
                     initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
                     seq_idx_BT: torch.Tensor | None = None):
    """Token-by-token reference: explicit conv taps and the naive recurrence. Returns (out, (conv, ssm) state).
    With `seq_idx_BT` a tap reads zero across a document start and the state restarts there."""
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
    conv = 0
    for tap in range(kernel):
        term = padded[:, tap:tap + length] * weight_CK[:, tap]
        if seq_idx_BT is not None:  # input t - (K-1) + tap must be in t's document (before the row: the first's)
            source_T = (torch.arange(length, device=hidden_BTD.device) - (kernel - 1) + tap).clamp(min=0)
            term = term * (seq_idx_BT[:, source_T] == seq_idx_BT)[..., None]
        conv = conv + term
    if mixer.conv1d.bias is not None:
        conv = conv + mixer.conv1d.bias
    x, B, C = mixer.split_xbc(conv * torch.sigmoid(conv))
    dt, A = mixer.discretize(dt_raw)
    y, final = ssd_ref(x.float() * dt[..., None], dt * A, B.float(), C.float(),
                       initial_state_BHPN=initial_state[1] if initial_state is not None else None,
                       seq_idx_BT=seq_idx_BT)
    y = y + mixer.D.float()[:, None] * x.float()
    gated = y.flatten(-2) * (z.float() * torch.sigmoid(z.float()))
    groups = gated.unflatten(-1, (mixer.n_groups, -1))
    normed = (groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + mixer.norm.eps)).flatten(-2)
    out = (mixer.norm.weight * normed.to(z.dtype)) @ mixer.out_proj.weight.T
    if mixer.out_proj.bias is not None:
        out = out + mixer.out_proj.bias
    return out, (padded[:, -(kernel - 1):].transpose(1, 2), final)
