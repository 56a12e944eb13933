"""Expert parallelism: each rank of an EP group holds n_experts / ep experts; tokens travel to them by all-to-all.

`ExpertParallelExperts` is swapped in for a MoE layer's `RoutedExperts` (same call, same parameter names, so
checkpoints and the precision converter see the same module). Its parameters are DTensors sharded on dim 0 (the
expert) over the `ep` mesh; the router, the latent projections and the shared expert stay where they were.

Dropless dispatch (torchtitan's `ExpertParallel`, DeepSeek-V3), per MoE forward on every rank of the group:

    1. sort this rank's (token, choice) rows by expert: experts are laid out rank-major, so the rows for EP rank r
       are contiguous; count rows per global expert
    2. all-to-all the counts (each rank learns how many rows of each of its experts every peer sends); one host
       sync turns them into split sizes
    3. all-to-all the rows; they arrive source-rank-major and are permuted to expert-major
    4. the local experts' grouped GEMMs (`grouped_mm`, or the quantized one the precision policy swapped in)
    5. the inverse permutation, the reverse all-to-all, and on the source rank: scale by the routing weights and
       sum each token's k rows (exactly as `RoutedExperts` does)

Capacity-factor dispatch (static shapes, as Marin runs EP): each rank sends each expert at most
capacity = ceil(capacity_factor x local tokens x k / n_experts) rows, in token order; the excess is dropped (its
routed output is zero, the residual and the shared expert still carry the token). Every buffer then has a fixed
size, so neither counts nor a host sync are needed; the dropped rows are counted and logged as a share of the
routed ones (`ep_dropped/<router>`, `dropped_shares`).

Expert tensor parallelism (`dist.etp` = tp, Megatron's ETP): each expert's hidden width is split over the TP group
as well (up_proj's rows, down_proj's columns), so a rank holds n_experts / ep experts at 1 / etp of their width.
Each TP rank routed its own sequence shard, so the layer first all-gathers the TP group's tokens, choices and
routing weights; the EP dispatch above then runs on them among the ranks that share a TP coordinate, every TP rank
computing its slice of the hidden width for all of them; the outputs, partial sums over the width, are summed over
the TP group and each rank keeps its own tokens' (`collectives.sum_shares`). relu2 acts element by element on the
hidden width, so the split is exact.

The expert counts the balancing update reads are the router's choices (`MoE.last_expert_ids`), dropped or not.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hybridtron.distributed.collectives import gather_shares, sum_shares
from hybridtron.model.mlp import relu2
from hybridtron.model.moe import MoE, RoutedExperts


def expert_major_order(counts_RE: torch.Tensor) -> torch.Tensor:
    """Rows received as [source rank][local expert] blocks of sizes `counts_RE` -> the row indices that list them
    expert-major ([local expert][source rank]), each block's rows in their received order."""
    sizes = counts_RE.flatten()
    starts_RE = (torch.cumsum(sizes, 0) - sizes).view_as(counts_RE)
    block_starts, block_sizes = starts_RE.t().flatten(), counts_RE.t().flatten()
    block_of_row = torch.repeat_interleave(torch.arange(len(block_sizes), device=sizes.device), block_sizes)
    first_row_of_block = torch.cumsum(block_sizes, 0) - block_sizes
    offset_in_block = torch.arange(int(block_sizes.sum()), device=sizes.device) - first_row_of_block[block_of_row]
    return block_starts[block_of_row] + offset_in_block


class ExpertParallelExperts(nn.Module):
    """This rank's share of a MoE layer's routed experts, and the token dispatch to every rank's share.
    `mesh`: the (ep, etp) mesh of the experts; with etp 1 they are whole, on the ep dimension alone."""

    def __init__(self, experts: RoutedExperts, mesh: DeviceMesh, capacity_factor: float = 0.0):
        super().__init__()
        self.num_experts, width = experts.up_proj.shape[:2]
        self.ep_mesh, self.ep = mesh["ep"], mesh["ep"].size()
        self.etp = mesh["etp"].size()
        self.etp_group = mesh["etp"].get_group() if self.etp > 1 else None
        if self.num_experts % self.ep:
            raise ValueError(f"ep {self.ep} does not divide the {self.num_experts} experts")
        if width % self.etp:
            raise ValueError(f"etp {self.etp} does not divide the experts' hidden width {width}")
        self.local_experts = self.num_experts // self.ep
        # every rank built the same full model (same seed), so each takes its own slice without communication
        if self.etp == 1:
            placements = {"up_proj": (self.ep_mesh, [Shard(0)]), "down_proj": (self.ep_mesh, [Shard(0)])}
        else:  # up_proj [E, width, in], down_proj [E, out, width]
            placements = {"up_proj": (mesh, [Shard(0), Shard(1)]), "down_proj": (mesh, [Shard(0), Shard(2)])}
        for name, (weight_mesh, weight_placements) in placements.items():
            weight = getattr(experts, name).data
            setattr(self, name, nn.Parameter(distribute_tensor(weight, weight_mesh, weight_placements,
                                                               src_data_rank=None)))
        self.grouped_mm = experts.grouped_mm  # the plain or the precision policy's quantized grouped GEMM
        self.capacity_factor = capacity_factor
        # (token, expert) rows this rank dispatched and dropped in training forwards since `take_counts`
        self.routed, self.dropped = 0, torch.zeros((), dtype=torch.long)

    def extra_repr(self) -> str:
        mode = f"capacity_factor={self.capacity_factor:g}" if self.capacity_factor else "dropless"
        return f"experts={self.num_experts}, ep={self.ep}, etp={self.etp}, local={self.local_experts}, {mode}"

    def _local(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to_local() if isinstance(weight, DTensor) else weight

    def experts(self, rows_SL: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        hidden = relu2(self.grouped_mm(rows_SL, self._local(self.up_proj), group_sizes))
        return self.grouped_mm(hidden, self._local(self.down_proj), group_sizes)

    def forward(self, x_SL: torch.Tensor, expert_ids_SK: torch.Tensor, weights_SK: torch.Tensor) -> torch.Tensor:
        if self.etp == 1:
            return self._dispatch_and_combine(x_SL, expert_ids_SK, weights_SK)
        group = self.etp_group  # the TP group's tokens; each rank its slice of the width for all of them
        gathered = (gather_shares(t, 0, group) for t in (x_SL, expert_ids_SK, weights_SK))  # ids: no gradient
        partial_SL = self._dispatch_and_combine(*gathered)
        return sum_shares(partial_SL, 0, group)

    def _dispatch_and_combine(self, x_SL: torch.Tensor, expert_ids_SK: torch.Tensor, weights_SK: torch.Tensor
                              ) -> torch.Tensor:
        top_k = expert_ids_SK.shape[1]
        flat_expert = expert_ids_SK.flatten()
        order = torch.argsort(flat_expert, stable=True)
        token_of_row = order // top_k
        counts_E = torch.bincount(flat_expert, minlength=self.num_experts)
        rows = x_SL[token_of_row]
        if self.training:
            self.routed += flat_expert.numel()
        if self.capacity_factor:
            out_rows, kept = self._dispatch_capacity(rows, flat_expert[order], counts_E, x_SL.shape[0] * top_k)
            order, token_of_row = order[kept], token_of_row[kept]  # dropped rows add nothing to their token
        else:
            out_rows = self._dispatch_dropless(rows, counts_E)
        out_rows = out_rows * weights_SK.flatten()[order, None].to(out_rows.dtype)
        return torch.zeros_like(x_SL, dtype=out_rows.dtype).index_add_(0, token_of_row, out_rows)

    def _dispatch_dropless(self, rows_SL: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        group = self.ep_mesh.get_group()
        with torch.no_grad():
            received_E = all_to_all_single(counts_E, None, None, group=group)  # [source rank x local expert]
            received_RE = torch.ops._c10d_functional.wait_tensor(received_E).view(self.ep, self.local_experts)
            send_splits = counts_E.view(self.ep, self.local_experts).sum(1).tolist()
            receive_splits = received_RE.sum(1).tolist()  # the host sync of the dispatch
            order = expert_major_order(received_RE)
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(len(order), device=order.device)
        arrived = all_to_all_single_autograd(rows_SL, receive_splits, send_splits, group)
        out = self.experts(arrived[order], received_RE.sum(0))[inverse]
        return all_to_all_single_autograd(out, send_splits, receive_splits, group)

    def _dispatch_capacity(self, rows_SL: torch.Tensor, sorted_expert: torch.Tensor, counts_E: torch.Tensor,
                           pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fixed-size [experts, capacity] buffers each way; returns (the kept rows' outputs, which sorted rows were
        kept)."""
        capacity = max(1, math.ceil(self.capacity_factor * pairs / self.num_experts))
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        slot = torch.arange(len(sorted_expert), device=rows_SL.device) - starts_E[sorted_expert]
        kept = slot < capacity
        if self.training:  # a device tensor: counting needs no host sync
            self.dropped = self.dropped.to(kept.device) + (~kept).sum()
        width = rows_SL.shape[1]
        send = rows_SL.new_zeros(self.num_experts, capacity, width).index_put(
            (sorted_expert[kept], slot[kept]), rows_SL[kept])
        if self.ep > 1:
            arrived = all_to_all_single_autograd(send.flatten(0, 1), None, None, self.ep_mesh.get_group())
        else:
            arrived = send.flatten(0, 1)
        # [source rank, local expert, slot] -> [local expert, source rank, slot]: expert-major, zero rows padding
        grouped = arrived.view(self.ep, self.local_experts, capacity, width).transpose(0, 1).flatten(0, 2)
        sizes = torch.full((self.local_experts,), self.ep * capacity, dtype=torch.long, device=rows_SL.device)
        out = self.experts(grouped, sizes).view(self.local_experts, self.ep, capacity, width).transpose(0, 1)
        if self.ep > 1:
            back = all_to_all_single_autograd(out.flatten(0, 2), None, None, self.ep_mesh.get_group())
        else:
            back = out.flatten(0, 2)
        back = back.view(self.num_experts, capacity, width)
        return back[sorted_expert[kept], slot[kept]], kept

    def take_counts(self) -> tuple[int, int]:
        """(rows routed, rows dropped) by this rank since the last call, which resets them. The training forward
        of a step counts (a recomputed forward, under activation checkpointing, counts both again)."""
        values = (self.routed, int(self.dropped))
        self.routed, self.dropped = 0, torch.zeros((), dtype=torch.long)
        return values


def dropped_shares(model: nn.Module, group) -> dict[str, float]:
    """`ep_dropped/<router>`: the share of (token, expert) rows each capacity-limited MoE layer dropped since
    the last call, over the ranks of `group` (the pipeline stage's); {} when no layer drops by capacity."""
    layers = {name: moe.experts for name, moe in model.routers().items()
              if isinstance(moe.experts, ExpertParallelExperts) and moe.experts.capacity_factor}
    if not layers:
        return {}
    counts = torch.tensor([layer.take_counts() for layer in layers.values()], dtype=torch.float64)
    dist.all_reduce(counts, group=group)
    return {f"ep_dropped/{name}": float(dropped / max(routed, 1.0))
            for name, (routed, dropped) in zip(layers, counts.tolist())}


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, capacity_factor: float = 0.0) -> list[str]:
    """Swap every MoE layer's RoutedExperts for its expert-parallel share on the (ep, etp) `mesh`; returns the
    swapped module names."""
    swapped = []
    for name, module in model.named_modules():
        if isinstance(module, MoE) and isinstance(module.experts, RoutedExperts):
            module.experts = ExpertParallelExperts(module.experts, mesh, capacity_factor)
            swapped.append(f"{name}.experts")
    return swapped
