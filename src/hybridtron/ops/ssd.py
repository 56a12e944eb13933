"""The Mamba-2 selective state-space scan (SSD), chunked for prefill and training, and its naive reference.

Per head h, with a scalar decay a_t = dt_t * A_h (A_h < 0) and the token's input already scaled by dt:

    S_t = exp(a_t) * S_{t-1} + x_t (outer) B_t          S: [P, N] per head
    y_t = S_t C_t

`ssd_chunked` is the Mamba-2 paper's Listing 1 (state-space duality): inside a chunk of `chunk` tokens the
recurrence is a masked, decayed attention-like product (one matmul); across chunks only the [P, N] states pass.
Heads share B and C within a group (head h uses group h // (heads / groups)); we keep the group axis instead of
copying B and C per head, so the quadratic part is one [chunk, chunk] product per group.

Shapes (suffix legend): B batch, T time, H heads, P head dim, G groups, N state size, C chunks, L/S positions in
a chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = a[..., j+1] + ... + a[..., i] for j <= i, -inf above the diagonal (stable: no differences)."""
    length = a.shape[-1]
    a = a[..., None].expand(*a.shape, length)  # a[..., i, j] = a_i
    strictly_lower = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    sums = torch.cumsum(a.masked_fill(~strictly_lower, 0), dim=-2)
    lower = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~lower, float("-inf"))


def ssd_chunked(
    x_BTHP: torch.Tensor,
    a_BTH: torch.Tensor,
    B_BTGN: torch.Tensor,
    C_BTGN: torch.Tensor,
    chunk: int,
    initial_state_BHPN: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y [B,T,H,P], final state [B,H,P,N]). `x` is already multiplied by dt; `a` = dt * A."""
    batch, length, heads, head_dim = x_BTHP.shape
    groups, state_size = B_BTGN.shape[-2:]
    heads_per_group = heads // groups
    pad = -length % chunk
    if pad:  # zero input and zero decay leave the state untouched
        x_BTHP, a_BTH, B_BTGN, C_BTGN = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in
                                         (x_BTHP, a_BTH, B_BTGN, C_BTGN))
    chunks = x_BTHP.shape[1] // chunk
    x = x_BTHP.reshape(batch, chunks, chunk, groups, heads_per_group, head_dim)
    Bm = B_BTGN.reshape(batch, chunks, chunk, groups, state_size)
    Cm = C_BTGN.reshape(batch, chunks, chunk, groups, state_size)
    a_BHCL = a_BTH.reshape(batch, chunks, chunk, heads).permute(0, 3, 1, 2)
    a_cumsum = torch.cumsum(a_BHCL, dim=-1)

    # 1. outputs inside each chunk: y = (C B^T * decay mask) x
    CB_BCGLS = torch.einsum("bclgn,bcsgn->bcgls", Cm, Bm)
    decay_BHCLS = torch.exp(segment_sum(a_BHCL))
    scores = CB_BCGLS.unsqueeze(3) * decay_BHCLS.reshape(batch, groups, heads_per_group, chunks, chunk, chunk) \
        .permute(0, 3, 1, 2, 4, 5)  # [B, C, G, H/G, L, S]
    y_diag = torch.einsum("bcgjls,bcsgjp->bclgjp", scores, x)

    # 2. the state each chunk leaves behind (from its own tokens only)
    decay_to_end = torch.exp(a_cumsum[..., -1:] - a_cumsum)  # [B, H, C, L]
    x_decayed = x * decay_to_end.reshape(batch, groups, heads_per_group, chunks, chunk) \
        .permute(0, 3, 4, 1, 2).unsqueeze(-1)
    chunk_states = torch.einsum("bclgn,bclgjp->bcgjpn", Bm, x_decayed)  # [B, C, G, H/G, P, N]
    chunk_states = chunk_states.reshape(batch, chunks, heads, head_dim, state_size)

    # 3. pass states between chunks (a short recurrence over chunk totals, written as one product)
    if initial_state_BHPN is None:
        initial_state_BHPN = x_BTHP.new_zeros(batch, heads, head_dim, state_size)
    states = torch.cat([initial_state_BHPN.to(chunk_states.dtype).unsqueeze(1), chunk_states], dim=1)
    chunk_decay = torch.exp(segment_sum(F.pad(a_cumsum[..., -1], (1, 0))))  # [B, H, C+1, C+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    states_in, final_state = states[:, :-1], states[:, -1]

    # 4. contribution of the state entering each chunk to that chunk's outputs
    decay_from_start = torch.exp(a_cumsum)  # [B, H, C, L]
    states_in = states_in.reshape(batch, chunks, groups, heads_per_group, head_dim, state_size)
    y_off = torch.einsum("bclgn,bcgjpn->bclgjp", Cm, states_in)
    y_off = y_off * decay_from_start.reshape(batch, groups, heads_per_group, chunks, chunk) \
        .permute(0, 3, 4, 1, 2).unsqueeze(-1)

    y = (y_diag + y_off).reshape(batch, chunks * chunk, heads, head_dim)[:, :length]
    return y, final_state


def ssd_step(
    state_BHPN: torch.Tensor, x_BHP: torch.Tensor, a_BH: torch.Tensor, B_BGN: torch.Tensor, C_BGN: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence: returns (y [B,H,P], new state [B,H,P,N])."""
    heads, groups = x_BHP.shape[1], B_BGN.shape[1]
    B_BHN = B_BGN.repeat_interleave(heads // groups, dim=1)
    C_BHN = C_BGN.repeat_interleave(heads // groups, dim=1)
    state_BHPN = state_BHPN * torch.exp(a_BH)[..., None, None] + x_BHP[..., None] * B_BHN[:, :, None, :]
    y_BHP = torch.einsum("bhpn,bhn->bhp", state_BHPN, C_BHN)
    return y_BHP, state_BHPN


def ssd_ref(
    x_BTHP: torch.Tensor,
    a_BTH: torch.Tensor,
    B_BTGN: torch.Tensor,
    C_BTGN: torch.Tensor,
    chunk: int | None = None,
    initial_state_BHPN: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive per-token recurrence; same signature as `ssd_chunked` (`chunk` is unused)."""
    batch, length, heads, head_dim = x_BTHP.shape
    state = initial_state_BHPN if initial_state_BHPN is not None else \
        x_BTHP.new_zeros(batch, heads, head_dim, B_BTGN.shape[-1])
    ys = []
    for t in range(length):
        y_t, state = ssd_step(state, x_BTHP[:, t], a_BTH[:, t], B_BTGN[:, t], C_BTGN[:, t])
        ys.append(y_t)
    return torch.stack(ys, dim=1), state
