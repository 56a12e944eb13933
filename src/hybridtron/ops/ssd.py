"""The Mamba-2 selective state-space scan (SSD), chunked for prefill and training, and its naive reference.

Per head h, with a scalar decay a_t = dt_t * A_h (A_h < 0) and the token's input already scaled by dt:

    S_t = exp(a_t) * S_{t-1} + x_t (outer) B_t          S: [P, N] per head
    y_t = S_t C_t

`ssd_chunked` is the Mamba-2 paper's Listing 1 (state-space duality): inside a chunk of `chunk` tokens the
recurrence is a masked, decayed attention-like product (one matmul); across chunks only the [P, N] states pass.
Heads share B and C within a group (head h uses group h // (heads / groups)); we keep the group axis instead of
copying B and C per head, so C B^T is one [chunk, chunk] product per group.

Where it departs from the listing, for speed on CPUs (same math; tests compare it with `ssd_ref`):
- The decay inside a chunk is exp(cumsum[l] - cumsum[s]), a broadcast difference (as mamba_ssm's kernels do),
  not the listing's segment sum (a cumsum over a [chunk, chunk] tensor, ~3x the elementwise work forward and
  backward). Its fp32 error is that of the cumsum: ~1e-7 relative to |cumsum|, which stays below 3e-5 relative
  on the outputs even for heads whose chunk decays reach exp(-16000) (measured against float64).
- Chunk states pass through a Python loop over chunks (the recurrence is sequential and each step is one
  multiply-add of [P, N] states) instead of a [chunks, chunks] decay matrix, which grows quadratically.
- Heads are laid out as [batch, group, head in group, chunk, position] so every product is a batched matmul
  without copying B or C per head.

Every function here runs with autocast off (`ops.autocast.fp32_island`): the scan is specified in fp32, and a
caller's bf16 autocast region would otherwise run its matmuls in bf16.

Shapes (suffix legend): B batch, T time, H heads, P head dim, G groups, J heads per group, N state size,
C chunks, L/S positions in a chunk, X batch x groups, R heads per group x head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridtron.ops.autocast import fp32_island


@fp32_island
def ssd_chunked(
    x_BTHP: torch.Tensor,
    a_BTH: torch.Tensor,
    B_BTGN: torch.Tensor,
    C_BTGN: torch.Tensor,
    chunk: int,
    initial_state_BHPN: torch.Tensor | None = None,
    seq_idx_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y [B,T,H,P], final state [B,H,P,N]). `x` is already multiplied by dt; `a` = dt * A.

    `seq_idx_BT` (document masking, see `model.documents`): each document starts from a zero state, the initial
    state reaches only the row's first document, and the final state is the last document's. Four masks do it,
    each where a chunk of the listing would mix two documents: the intra-chunk product (l and s in one document),
    each chunk's own state (its positions in its last document), the carry through a chunk (only a chunk with no
    document start), and the entering state's output (the positions of the document it belongs to)."""
    batch, length, heads, head_dim = x_BTHP.shape
    groups, state_size = B_BTGN.shape[-2:]
    per_group = heads // groups
    pad = -length % chunk
    if pad:  # zero input and zero decay leave the state untouched
        x_BTHP, a_BTH, B_BTGN, C_BTGN = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in
                                         (x_BTHP, a_BTH, B_BTGN, C_BTGN))
        if seq_idx_BT is not None:  # the padding continues the last document
            seq_idx_BT = torch.cat([seq_idx_BT, seq_idx_BT[:, -1:].expand(-1, pad)], dim=1)
    chunks = x_BTHP.shape[1] // chunk
    x_BGJCLP = x_BTHP.reshape(batch, chunks, chunk, groups, per_group, head_dim).permute(0, 3, 4, 1, 2, 5)
    B_BGCLN = B_BTGN.reshape(batch, chunks, chunk, groups, state_size).permute(0, 3, 1, 2, 4)
    C_BGCLN = C_BTGN.reshape(batch, chunks, chunk, groups, state_size).permute(0, 3, 1, 2, 4)
    a_cumsum_BGJCL = a_BTH.reshape(batch, chunks, chunk, groups, per_group).permute(0, 3, 4, 1, 2).cumsum(-1)

    # 1. outputs inside each chunk: y = (C B^T * decay) x, decay[l, s] = exp(cumsum[l] - cumsum[s]) for s <= l.
    # Written as (cumsum[l] + mask) + (-cumsum[s]) so that the backward reduces, instead of negating, [L, S] tensors.
    above_diagonal_LS = torch.full((chunk, chunk), float("-inf"), dtype=a_cumsum_BGJCL.dtype,
                                   device=a_cumsum_BGJCL.device).triu(1)
    decay_BGJCLS = torch.exp((a_cumsum_BGJCL[..., :, None] + above_diagonal_LS) + (-a_cumsum_BGJCL)[..., None, :])
    CB_BGCLS = C_BGCLN @ B_BGCLN.transpose(-1, -2)
    if seq_idx_BT is not None:
        seq_BCL = seq_idx_BT.reshape(batch, chunks, chunk)
        # the document the state entering each chunk belongs to: the previous chunk's last (the first chunk's own)
        entering_BC = torch.cat([seq_BCL[:, :1, 0], seq_BCL[:, :-1, -1]], dim=1)
        CB_BGCLS = CB_BGCLS.masked_fill((seq_BCL[..., :, None] != seq_BCL[..., None, :])[:, None], 0.0)
    y_BGJCLP = (CB_BGCLS[:, :, None] * decay_BGJCLS) @ x_BGJCLP

    # 2. the state each chunk leaves behind from its own tokens: sum_l exp(cumsum[end] - cumsum[l]) x_l (outer) B_l
    decay_to_end_BGJCL = torch.exp(a_cumsum_BGJCL[..., -1:] - a_cumsum_BGJCL)
    if seq_idx_BT is not None:  # only the chunk's last document's positions
        decay_to_end_BGJCL = decay_to_end_BGJCL * (seq_BCL == seq_BCL[..., -1:])[:, None, None]
    chunk_states_BGJCPN = (x_BGJCLP * decay_to_end_BGJCL[..., None]).transpose(-1, -2) @ B_BGCLN[:, :, None]

    # 3. pass states between chunks: S_in[c+1] = exp(total decay of chunk c) * S_in[c] + chunk_state[c]
    chunk_decay_BGJC = torch.exp(a_cumsum_BGJCL[..., -1])
    if seq_idx_BT is not None:  # a document starting inside chunk c ends the entering state's document there
        chunk_decay_BGJC = chunk_decay_BGJC * (seq_BCL[..., -1] == entering_BC)[:, None, None]
    if initial_state_BHPN is None:
        state_BGJPN = x_BGJCLP.new_zeros(batch, groups, per_group, head_dim, state_size)
    else:
        state_BGJPN = initial_state_BHPN.reshape(batch, groups, per_group, head_dim, state_size).to(x_BTHP.dtype)
    states_in = []
    for chunk_state, chunk_decay in zip(chunk_states_BGJCPN.unbind(3), chunk_decay_BGJC.unbind(-1)):
        states_in.append(state_BGJPN)
        state_BGJPN = torch.addcmul(chunk_state, state_BGJPN, chunk_decay[..., None, None])
    states_in_BGJCPN = torch.stack(states_in, dim=3)

    # 4. contribution of the state entering each chunk: exp(cumsum[l]) * C_l S_in
    entering_decay_BGJCL = torch.exp(a_cumsum_BGJCL)
    if seq_idx_BT is not None:  # only to the positions of the document it belongs to
        entering_decay_BGJCL = entering_decay_BGJCL * (seq_BCL == entering_BC[..., None])[:, None, None]
    y_BGJCLP = y_BGJCLP + (C_BGCLN[:, :, None] @ states_in_BGJCPN.transpose(-1, -2)) * entering_decay_BGJCL[..., None]

    y_BTHP = y_BGJCLP.permute(0, 3, 4, 1, 2, 5).reshape(batch, chunks * chunk, heads, head_dim)[:, :length]
    return y_BTHP, state_BGJPN.reshape(batch, heads, head_dim, state_size)


@fp32_island
def ssd_step_(
    state_BHPN: torch.Tensor, x_BHP: torch.Tensor, a_BH: torch.Tensor, B_BGN: torch.Tensor, C_BGN: torch.Tensor
) -> torch.Tensor:
    """One token of the recurrence, advancing `state` (contiguous) in place; returns y [B,H,P].

    In place because the state is the largest tensor a decode step touches (bench22m: 128 KB per layer, more than
    the layer's other activations together), and a new one per token costs as much memory traffic again. The heads
    of a group share its B and C, so a group's [heads in group x head dim] rows take x (outer) B and S C as one
    batched matrix product each, without copying B or C per head.
    """
    batch, heads, head_dim, state_size = state_BHPN.shape
    groups = B_BGN.shape[1]
    rows = heads // groups * head_dim
    state_BHPN.mul_(torch.exp(a_BH)[..., None, None])
    state_XRN = state_BHPN.view(batch * groups, rows, state_size)
    state_XRN.baddbmm_(x_BHP.reshape(batch * groups, rows, 1), B_BGN.reshape(batch * groups, 1, state_size))
    return torch.bmm(state_XRN, C_BGN.reshape(batch * groups, state_size, 1)).view(batch, heads, head_dim)


@fp32_island
def ssd_step(
    state_BHPN: torch.Tensor, x_BHP: torch.Tensor, a_BH: torch.Tensor, B_BGN: torch.Tensor, C_BGN: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence as broadcast products, out of place: (y [B,H,P], new state [B,H,P,N]).

    The form for a compiled decode step, where the compiler fuses the decay, the outer product and S C into one
    pass over the state and the caller's copy into the cache (a bench22m Mamba layer, compiled: 67 us against
    75 us with `ssd_step_`'s batched products). Eager, it would allocate [B,H,P,N] temporaries: use `ssd_step_`.
    """
    batch, heads, head_dim, state_size = state_BHPN.shape
    groups = B_BGN.shape[1]
    per_group = heads // groups
    state_BGJPN = state_BHPN.view(batch, groups, per_group, head_dim, state_size)
    new_BGJPN = state_BGJPN * torch.exp(a_BH).view(batch, groups, per_group, 1, 1) + \
        x_BHP.view(batch, groups, per_group, head_dim, 1) * B_BGN.view(batch, groups, 1, 1, state_size)
    y_BGJP = (new_BGJPN * C_BGN.view(batch, groups, 1, 1, state_size)).sum(-1)
    return y_BGJP.view(batch, heads, head_dim), new_BGJPN.view(batch, heads, head_dim, state_size)


@fp32_island
def ssd_steps(
    x_BTHP: torch.Tensor,
    a_BTH: torch.Tensor,
    B_BTGN: torch.Tensor,
    C_BTGN: torch.Tensor,
    initial_state_BHPN: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence over a few tokens, keeping the state after each: (y [B,T,H,P], states [B,T,H,P,N]).

    For speculative verification, which restarts from any of these states. Every state is written out anyway, so
    they are computed at once rather than token by token: S_t = exp(cumsum[t]) S_0 + sum_{s<=t} exp(cumsum[t] -
    cumsum[s]) x_s (outer) B_s, a [T, T] decay matrix per head (the chunked scan's step 1, applied to states).
    """
    batch, length, heads, head_dim = x_BTHP.shape
    groups, state_size = B_BTGN.shape[-2:]
    per_group = heads // groups
    x_BGJPT = x_BTHP.reshape(batch, length, groups, per_group, head_dim).permute(0, 2, 3, 4, 1)
    a_cumsum_BGJT = a_BTH.reshape(batch, length, groups, per_group).permute(0, 2, 3, 1).cumsum(-1)
    above_diagonal_TS = torch.full((length, length), float("-inf"), dtype=a_cumsum_BGJT.dtype,
                                   device=a_cumsum_BGJT.device).triu(1)
    decay_BGJTS = torch.exp((a_cumsum_BGJT[..., :, None] + above_diagonal_TS) - a_cumsum_BGJT[..., None, :])
    B_BG11SN = B_BTGN.transpose(1, 2)[:, :, None, None]
    from_inputs_BGJTPN = (decay_BGJTS[..., :, None, :] * x_BGJPT[..., None, :, :]) @ B_BG11SN
    initial_BGJ1PN = initial_state_BHPN.reshape(batch, groups, per_group, 1, head_dim, state_size)
    states_BGJTPN = torch.addcmul(from_inputs_BGJTPN, torch.exp(a_cumsum_BGJT)[..., None, None], initial_BGJ1PN)
    y_BGJTP1 = states_BGJTPN @ C_BTGN.transpose(1, 2)[:, :, None, :, :, None]
    return (y_BGJTP1.permute(0, 3, 1, 2, 4, 5).reshape(batch, length, heads, head_dim),
            states_BGJTPN.permute(0, 3, 1, 2, 4, 5).reshape(batch, length, heads, head_dim, state_size))


@fp32_island
def ssd_ref(
    x_BTHP: torch.Tensor,
    a_BTH: torch.Tensor,
    B_BTGN: torch.Tensor,
    C_BTGN: torch.Tensor,
    chunk: int | None = None,
    initial_state_BHPN: torch.Tensor | None = None,
    seq_idx_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive per-token recurrence, B and C copied per head; same signature as `ssd_chunked` (`chunk` is
    unused). With `seq_idx_BT` the state is zeroed wherever a new document starts."""
    batch, length, heads, head_dim = x_BTHP.shape
    per_group = heads // B_BTGN.shape[-2]
    state = initial_state_BHPN if initial_state_BHPN is not None else \
        x_BTHP.new_zeros(batch, heads, head_dim, B_BTGN.shape[-1])
    ys = []
    for t in range(length):
        if seq_idx_BT is not None and t > 0:
            state = state * (seq_idx_BT[:, t] == seq_idx_BT[:, t - 1])[:, None, None, None]
        B_BHN = B_BTGN[:, t].repeat_interleave(per_group, dim=1)
        C_BHN = C_BTGN[:, t].repeat_interleave(per_group, dim=1)
        state = state * torch.exp(a_BTH[:, t])[..., None, None] + x_BTHP[:, t, ..., None] * B_BHN[:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, C_BHN))
    return torch.stack(ys, dim=1), state
