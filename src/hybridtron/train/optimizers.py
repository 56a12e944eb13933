"""The optimizers of `train.optimizer`: AdamW (the default), and three that give the matrices of the linear maps
their own update rule while every other tensor keeps AdamW.

    adamw   every tensor: torch's AdamW, weight decay on tensors of 2 or more dimensions
    adamh   matrices: AdamH, on the sphere of radius R       lm_head: AdamH      the rest: AdamW
    muonh   matrices: MuonH, on the sphere of radius R       lm_head: AdamH      the rest: AdamW
    muon    matrices: torch.optim.Muon's rule                lm_head: AdamW      the rest: AdamW

The hyperball step (Marin's AdamH and MuonH, levanter `optim/adamh.py`, `optim/muonh.py`), for a matrix p with
direction u (Adam's bias-corrected m / (sqrt(v) + eps), or Muon's Newton-Schulz-orthogonalized Nesterov momentum):

    p' = p - lr * R * u / ||u||_F          a step of relative length lr
    p  = R * p' / ||p'||_F                 back onto the sphere

R is the matrix's Frobenius norm when the optimizer first steps (its initialization in a fresh run), kept in the
optimizer state as `radius`, so a resume restores it bit for bit. A stack of expert weights [E, ...] is E matrices,
each with its own R, u-norm and projection. The sphere replaces weight decay: hyperball matrices have none.

"Matrices" (`matrix_rule`): every 2-D weight of a linear map (projections, the router's gate, MTP's eh_proj) and
each expert of a stacked expert weight. Not matrices: the embedding table (a lookup, not a linear map: levanter
leaves it to Adam), norms, biases, Mamba's A_log, D, dt_bias and its depthwise conv1d filters. lm_head: AdamH under
both hyperball optimizers (levanter's MuonH does the same: the output layer's rows are per-token classifiers, not
a hidden map for Muon's orthogonalization); under plain Muon it is AdamW, as Keller Jordan's Muon and torch's
documentation leave the input and output layers to AdamW.

Sharded matrices (FSDP2, TP, EP: DTensor parameters): norms are DTensor reductions over every shard; Newton-Schulz
runs on the whole matrix (each rank gathers it with `full_tensor`, orthogonalizes, and keeps its own shard of the
result) except for stacked experts sharded by expert only, which each rank orthogonalizes locally.

Departures from levanter: R is the stored initial norm, not the current ||p|| (which drifts from it by rounding
over a long run); the non-matrix tensors follow this repository's AdamW (weight decay on the embedding and conv1d
filters) instead of plain Adam, so choosing a hyperball optimizer changes the matrices only; MuonH's momentum is
torch.optim.Muon's (an exponential moving average, `lerp`), not levanter's undamped sum, which differs only by a
scale that the normalization u / ||u||_F removes.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.optim.adam import adam
# torch.optim.Muon's own pieces (private names of torch's module): its Newton-Schulz iteration and LR adjustment
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr, \
    _zeropower_via_newtonschulz

from hybridtron.distributed.state import canonical_name
from hybridtron.train.config import TrainConfig

ADAMW, ADAMH, MUONH, MUON = "adamw", "adamh", "muonh", "muon"
SPHERE_RULES = (ADAMH, MUONH)  # the update rules that keep each matrix on its sphere
NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
TINY_NORM = 1e-10  # a zero direction (a zero gradient) moves nothing instead of dividing by zero (levanter's floor)


# ------------------------------------------------------------------------------------------------ the split
def is_stacked(name: str, param: torch.Tensor) -> bool:
    """A stack of routed experts' weights [E, out, in]: E matrices."""
    return param.dim() == 3 and ".experts." in f".{canonical_name(name)}"


def matrix_rule(name: str, param: torch.Tensor, optimizer: str) -> str:
    """The update rule `optimizer` gives the parameter `name` (module docstring)."""
    name = canonical_name(name)
    if optimizer == ADAMW or "embeddings" in name or "conv1d" in name:
        return ADAMW
    if name.startswith("lm_head."):
        return ADAMW if optimizer == MUON else ADAMH
    if param.dim() == 2 or is_stacked(name, param):
        return optimizer
    return ADAMW


def parameter_split(model: torch.nn.Module, optimizer: str) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """Update rule -> the trainable (name, parameter) pairs it updates, in model order."""
    split: dict[str, list] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            split.setdefault(matrix_rule(name, param, optimizer), []).append((name, param))
    return split


def short_name(name: str) -> str:
    """`backbone.layers.3.mixer.in_proj.weight` -> `in_proj`: the name pattern a split summary lists."""
    skip = {"backbone", "layers", "mixer", "mtp", "weight"}
    return ".".join(part for part in canonical_name(name).split(".") if part not in skip and not part.isdigit())


def split_summary(model: torch.nn.Module, config: TrainConfig) -> str:
    """The block a run prints at its start: each update rule's tensors, parameters, learning rate and names."""
    lines = [f"[optimizer] {config.optimizer}"]
    for rule, named in parameter_split(model, config.optimizer).items():
        lr = config.lr if rule != ADAMW else adam_lr(config)
        patterns = ", ".join(dict.fromkeys(short_name(name) for name, _ in named))
        lines.append(f"  {rule:<6}{len(named):>4} tensors {sum(p.numel() for _, p in named):>12,} params  lr {lr:g}  "
                     f"{patterns}")
    return "\n".join(lines)


def adam_lr(config: TrainConfig) -> float:
    """The peak LR of what a matrix optimizer leaves to AdamW."""
    return config.lr if config.adam_lr is None else config.adam_lr


# ------------------------------------------------------------------------------------------------ building
def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """`train.optimizer`'s optimizer for `model`. AdamW: weight decay on matrices only (norm weights, biases and
    Mamba's per-head A, D, dt_bias are exempt); with `train.compile` in one process, torch's fused kernel (one pass
    over each tensor), otherwise foreach (the bit-for-bit reference, and what sharded DTensors take). The others:
    a `MatrixOptimizer` (module docstring); a hyperball matrix whose norm is zero (no sphere to keep it on) is a
    ValueError naming it, and so are muon and muonh on weights offloaded from an accelerator (`dist.offload_optimizer`
    on a GPU: their orthogonalized update would land on the device)."""
    if config.optimizer == ADAMW:
        decay, no_decay = [], []
        for param in model.parameters():
            if param.requires_grad:
                (decay if param.dim() >= 2 else no_decay).append(param)
        groups = [{"params": decay, "weight_decay": config.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        fused = config.compile and not (torch.distributed.is_available() and torch.distributed.is_initialized())
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                                 foreach=not fused, fused=fused)
    split = parameter_split(model, config.optimizer)
    # FSDP2's CPU offload on an accelerator: shards on the host, their mesh on the device
    offloaded_from = {param.device_mesh.device_type for param in model.parameters()
                      if isinstance(param, DTensor) and param.to_local().device.type != param.device_mesh.device_type}
    if offloaded_from and config.optimizer in (MUON, MUONH):
        raise ValueError(f"train.optimizer={config.optimizer} with dist.offload_optimizer on "
                         f"{offloaded_from.pop()}: Newton-Schulz gathers each matrix and places the result on the "
                         f"device, not on the host with the offloaded weights; use adamw or adamh there")
    for name, param in split.get(ADAMH, []) + split.get(MUONH, []):
        norms = frobenius_norm(param.detach(), is_stacked(name, param))
        if isinstance(norms, DTensor):
            norms = norms.full_tensor()
        if not bool((norms > 0).all()):
            raise ValueError(f"train.optimizer={config.optimizer}: {canonical_name(name)} has a zero initial norm "
                             f"(a matrix initialized to zero): the hyperball has no radius to keep it on")
    ratio = adam_lr(config) / config.lr
    groups = []
    for rule, named in split.items():
        params = [param for _, param in named]
        if rule == ADAMW:  # as the default optimizer trains them: decay on tensors of 2 or more dimensions
            groups += [{"rule": rule, "params": [p for p in params if p.dim() >= 2], "lr_ratio": ratio,
                        "weight_decay": config.weight_decay},
                       {"rule": rule, "params": [p for p in params if p.dim() < 2], "lr_ratio": ratio,
                        "weight_decay": 0.0}]
        else:
            groups.append({"rule": rule, "params": params,
                           "weight_decay": config.weight_decay if rule == MUON else 0.0})
    groups = [group for group in groups if group["params"]]
    return MatrixOptimizer(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                           momentum=config.momentum)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's LR of this step into every group (what a matrix optimizer leaves to AdamW: scaled by
    train.adam_lr / train.lr)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_ratio"] if "lr_ratio" in group else lr


# ------------------------------------------------------------------------------------------------ the math
def frobenius_norm(x: torch.Tensor, stacked: bool) -> torch.Tensor:
    """||x||_F kept as [1, 1] (a matrix) or [E, 1, 1] (each expert of a stack), so it broadcasts over x. For a
    DTensor the norm of the whole matrix, reduced over its shards, as a DTensor that broadcasts over x's shards."""
    norm = torch.linalg.vector_norm(x, dim=tuple(range(1 if stacked else 0, x.dim())), keepdim=True)
    if isinstance(norm, DTensor) and any(p.is_partial() for p in norm.placements):
        norm = norm.redistribute(placements=[Replicate() if p.is_partial() else p for p in norm.placements])
    return norm


def sphere_step_(param: torch.Tensor, direction: torch.Tensor, lr: float, radius: torch.Tensor,
                 stacked: bool) -> None:
    """p' = p - lr R u / ||u||_F, then p = R p' / ||p'||_F (in place; per expert for a stack)."""
    moved = param - direction * (lr * radius / frobenius_norm(direction, stacked).clamp_min(TINY_NORM))
    param.copy_(moved * (radius / frobenius_norm(moved, stacked)))


def newton_schulz(update: torch.Tensor, stacked: bool) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization (5 quintic Newton-Schulz steps in bf16; its output is bf16) of the
    matrix, or of each expert's. A DTensor is gathered whole and each rank keeps its shard of the result, unless
    it is a stack sharded by expert only (each rank then holds whole experts and orthogonalizes them alone)."""
    if isinstance(update, DTensor):
        by_expert = stacked and all(p.is_replicate() or (p.is_shard() and p.dim == 0) for p in update.placements)
        if by_expert:
            return DTensor.from_local(newton_schulz(update.to_local(), stacked), update.device_mesh,
                                      update.placements, shape=update.shape, stride=update.stride())
        whole = newton_schulz(update.full_tensor(), stacked)
        return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
    matrices = update if stacked else update.unsqueeze(0)
    orthogonal = [_zeropower_via_newtonschulz(m, NS_COEFFICIENTS, DEFAULT_NS_STEPS, EPS) for m in matrices]
    return torch.stack(orthogonal) if stacked else orthogonal[0]


def muon_adjusted_lr(lr: float, param: torch.Tensor, stacked: bool) -> float:
    """torch.optim.Muon's LR adjustment (sqrt(max(1, rows / cols))), of one expert's shape for a stack."""
    return _adjust_lr(lr, None, param.shape[1:] if stacked else param.shape)


# ------------------------------------------------------------------------------------------------ the optimizer
class MatrixOptimizer(torch.optim.Optimizer):
    """One optimizer over groups that each name their update rule (`group["rule"]`: adamw, adamh, muonh, muon), so
    the trainer, DCP's `get_state_dict` and the checkpoints see a single optimizer. Per-parameter state: `step`
    (every rule keeps it: the checkpoint load asks for it to know which parameters have state), Adam's `exp_avg`
    and `exp_avg_sq` (adamw, adamh), `momentum_buffer` (muon, muonh), and the sphere's `radius` (adamh, muonh).

    A group whose LR is 0 leaves its hyperball matrices untouched: torch's distributed `get_state_dict` creates a
    fresh optimizer's state by such a step, and the projection is not exactly the identity in floating point."""

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float, momentum: float):
        super().__init__(groups, {"lr": lr, "betas": betas, "eps": eps, "momentum": momentum, "weight_decay": 0.0})

    def state_of(self, param: torch.Tensor, group: dict) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            if group["rule"] in (ADAMW, ADAMH):
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
            else:
                state["momentum_buffer"] = torch.zeros_like(param)
            if group["rule"] in SPHERE_RULES:
                state["radius"] = frobenius_norm(param, stacked=param.dim() == 3)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            trained = [p for p in group["params"] if p.grad is not None]
            states = [self.state_of(p, group) for p in trained]
            if group["rule"] == ADAMW:
                beta1, beta2 = group["betas"]
                adam(trained, [p.grad for p in trained], [s["exp_avg"] for s in states],
                     [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], foreach=True,
                     decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                     weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
                continue
            update = {ADAMH: adamh_step_, MUONH: muonh_step_, MUON: muon_step_}[group["rule"]]
            for param, state in zip(trained, states):  # in a matrix group only a stack of experts has 3 dimensions
                update(param, param.grad, state, group, stacked=param.dim() == 3)
        return loss


def adamh_step_(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, stacked: bool) -> None:
    """AdamH: Adam's bias-corrected direction m / (sqrt(v) + eps), then the sphere step."""
    beta1, beta2 = group["betas"]
    state["step"] += 1
    step = float(state["step"])
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    direction = (state["exp_avg"] / (1 - beta1 ** step)) / ((state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt()
                                                           + group["eps"])
    if group["lr"]:
        sphere_step_(param, direction, group["lr"], state["radius"], stacked)


def nesterov_momentum(grad: torch.Tensor, state: dict, momentum: float) -> torch.Tensor:
    """torch.optim.Muon's Nesterov momentum: buf = lerp(buf, g, 1 - mu), then lerp(g, buf, mu)."""
    state["step"] += 1
    state["momentum_buffer"].lerp_(grad, 1 - momentum)
    return grad.lerp(state["momentum_buffer"], momentum)


def muonh_step_(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, stacked: bool) -> None:
    """MuonH: the orthogonalized Nesterov momentum, then the sphere step."""
    direction = newton_schulz(nesterov_momentum(grad, state, group["momentum"]), stacked).to(param.dtype)
    if group["lr"]:
        sphere_step_(param, direction, group["lr"], state["radius"], stacked)


def muon_step_(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, stacked: bool) -> None:
    """torch.optim.Muon's step (decoupled weight decay, the orthogonalized momentum at the adjusted LR), per
    expert for a stack."""
    update = newton_schulz(nesterov_momentum(grad, state, group["momentum"]), stacked)
    param.mul_(1 - group["lr"] * group["weight_decay"])
    param.add_(update, alpha=-muon_adjusted_lr(group["lr"], param, stacked))
