"""Context parallelism (`dist.cp`): each of the cp ranks of a group holds one contiguous share of every sequence.

Everything that acts token by token (norms, MLPs, MoE, the loss) runs on the local share unchanged. Only the three
places where a position reads earlier positions exchange data over the cp group, and `apply_context_parallel`
swaps those modules' classes for the forms below (their parameters and names stay):

- Attention (`ContextParallelAttention`): the keys and values of the whole sequence are all-gathered; each rank's
  queries attend to them under the causal mask shifted by the share's offset. (Ring attention would overlap the
  exchange with compute; the all-gather is what torchtitan's allgather CP rotation does, and is exact.)
- Mamba-2 (`ContextParallelMamba2Mixer`): the scan is linear in its state, so each share scans from a zero state,
  then the shares' final states and total decays are all-gathered and each rank adds what the state entering its
  share contributes: y_t += exp(sum of a up to t) C_t . S_in, with S_in the earlier shares' states carried through
  their decays. The causal conv reads the previous share's last K-1 inputs (also all-gathered). This is the
  sequence-parallel scan of Mamba-2's paper (section 8), with the states passed by one all-gather.
- MTP reads the embedding of token t+k: the data loader hands each share the ids that follow it
  (`shard_sequence`), and the model embeds them itself (`HybridLM.forward(following_ids=...)`).

Under TP as well, these forms are swapped in first and TP then runs them on its local shards
(`tensor_parallel.LocalShardParallel`): each TP rank's mixer sees the whole cp share of its own heads and Mamba
groups, and exchanges them with the cp ranks of its TP coordinate (the cp group is the mesh's cp dimension).
Under PP each pipeline is one cp coordinate's, and carries its share's following ids (`pipeline.Pipeline.step`).

Shares are contiguous, not zig-zag: the Mamba state passes from share to share in order, so causal attention's
work is unbalanced across ranks (the last share attends to the most keys); for a hybrid model whose attention is a
few layers in ten that is the smaller cost. The all-gathers (`collectives.gather_shares`) sum their gradient over the
ranks in the backward; every rank uses every gathered tensor in its graph, so every rank runs every backward
collective, in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridtron.dist.collectives import gather_shares
from hybridtron.model.attention import Attention
from hybridtron.model.mamba2 import Mamba2Mixer
from hybridtron.ops.ssd import ssd_chunked


class _ContextParallel:
    """The cp group a swapped module exchanges over, and its place in it."""

    cp_group: dist.ProcessGroup
    cp_rank: int
    cp_size: int

    def _check_training_forward(self, cache) -> None:
        if cache is not None:
            raise ValueError(f"{type(self).__name__}: context parallelism runs training forwards only (no cache); "
                             "decode with the unsharded model (the HF export)")


class ContextParallelAttention(_ContextParallel, Attention):
    def forward(self, hidden_BTD: torch.Tensor, kv=None, lengths=None) -> torch.Tensor:
        self._check_training_forward(kv)
        q, k, v = self.project(hidden_BTD)  # [B, heads, T, head_dim]
        k_all, v_all = gather_shares(k, 2, self.cp_group), gather_shares(v, 2, self.cp_group)
        length = q.shape[2]
        positions_T = self.cp_rank * length + torch.arange(length, device=q.device)
        visible_TS = torch.arange(k_all.shape[2], device=q.device)[None, :] <= positions_T[:, None]
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=visible_TS, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class ContextParallelMamba2Mixer(_ContextParallel, Mamba2Mixer):
    def forward(self, hidden_BTD: torch.Tensor, state=None) -> torch.Tensor:
        self._check_training_forward(state)
        z, xBC, dt_raw = self.split_projection(self.in_proj(hidden_BTD))
        conv_input_BCT = torch.cat([self._previous_conv_inputs(xBC).transpose(1, 2), xBC.transpose(1, 2)], dim=-1)
        conv_BCT = F.conv1d(conv_input_BCT, self.conv1d.weight, self.conv1d.bias, groups=self.conv_channels)
        x, B, C = self.split_xbc(F.silu(conv_BCT).transpose(1, 2))
        dt, A = self.discretize(dt_raw)
        x_dt, a = x.float() * dt[..., None], dt * A
        y, final = ssd_chunked(x_dt, a, B.float(), C.float(), self.chunk_size)
        y = y + self._incoming_state_output(final, a, C.float())
        return self.finish(y, x, z)

    def _previous_conv_inputs(self, xBC_BTC: torch.Tensor) -> torch.Tensor:
        """The last K-1 conv inputs of the previous share [B, K-1, C] (zeros for the first share)."""
        taps = self.conv1d.kernel_size[0] - 1
        if xBC_BTC.shape[1] < taps:
            raise ValueError(f"context parallelism: a share of {xBC_BTC.shape[1]} positions is shorter than the conv's "
                             f"{taps} previous inputs; use a longer data.seq_len or a smaller dist.cp")
        tails_BSC = gather_shares(xBC_BTC[:, -taps:], 1, self.cp_group)
        shifted_BSC = torch.cat([torch.zeros_like(tails_BSC[:, :taps]), tails_BSC], dim=1)
        return shifted_BSC[:, self.cp_rank * taps:(self.cp_rank + 1) * taps]

    def _incoming_state_output(self, final_BHPN: torch.Tensor, a_BTH: torch.Tensor, C_BTGN: torch.Tensor
                               ) -> torch.Tensor:
        """exp(cumsum a)_t * C_t . S_in [B, T, H, P]: the output of the state entering this share, S_in =
        sum over earlier shares j of exp(the decays of shares j+1 .. rank-1) * final_j."""
        finals_RBHPN = gather_shares(final_BHPN[None], 0, self.cp_group)
        decays_RBH = gather_shares(a_BTH.sum(1)[None], 0, self.cp_group)  # each share's total log-decay
        ranks_R = torch.arange(self.cp_size, device=a_BTH.device)
        # the log-decay from the end of share j to the start of this one: the sum over the shares in between (a
        # masked sum, not a difference of prefix sums, which would round away small carries next to large ones)
        between_RR = (ranks_R[:, None] < ranks_R[None, :]) & (ranks_R[None, :] < self.cp_rank)
        log_carry_RBH = torch.einsum("ji,ibh->jbh", between_RR.to(decays_RBH.dtype), decays_RBH)
        earlier_R11 = (ranks_R < self.cp_rank)[:, None, None]
        carry_RBH = torch.exp(torch.where(earlier_R11, log_carry_RBH, float("-inf")))
        incoming_BHPN = (carry_RBH[..., None, None] * finals_RBHPN).sum(0)
        batch, length, heads = a_BTH.shape
        groups = C_BTGN.shape[2]
        incoming_BGJPN = incoming_BHPN.unflatten(1, (groups, heads // groups))
        out_BTGJP = torch.einsum("btgn,bgjpn->btgjp", C_BTGN, incoming_BGJPN)
        return out_BTGJP.flatten(2, 3) * torch.exp(a_BTH.cumsum(1))[..., None]


CONTEXT_PARALLEL_FORMS = {Attention: ContextParallelAttention, Mamba2Mixer: ContextParallelMamba2Mixer}


def apply_context_parallel(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Swap every attention and Mamba-2 mixer of `model` (the MTP block's too) for its context-parallel form over
    `group` (its class only: the parameters and their names stay)."""
    for module in model.modules():
        form = CONTEXT_PARALLEL_FORMS.get(type(module))
        if form is not None:
            module.__class__ = form
            module.cp_group, module.cp_rank, module.cp_size = group, dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(input_ids_BT: torch.Tensor, labels_BT: torch.Tensor, rank: int, size: int, lookahead: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Share `rank` of `size` of a micro-batch: (its ids, its labels and the `lookahead` labels after them, the
    `lookahead` ids after them). Past the sequence's end both run short; the model and the objective pad them as
    they pad the end of an unsharded sequence. `lookahead` is the model's MTP depths: depth k at position t reads
    token t+k and is scored against label t+k."""
    length = input_ids_BT.shape[1]
    if length % size:
        raise ValueError(f"context parallelism: a sequence of {length} positions does not split over cp {size}")
    start, end = rank * length // size, (rank + 1) * length // size
    return input_ids_BT[:, start:end], labels_BT[:, start:end + lookahead], input_ids_BT[:, end:end + lookahead]

