"""Process groups for a run: check the layout with the planner's rules, then build the device meshes.

One world mesh, viewed three ways (torchtitan's ParallelDims, with the expert dimensions of `plan.py`):

    dense    (pp, dp_replicate, dp_shard, cp, tp)        attention, Mamba, MLPs, embedding, lm_head
             flattened: dp_shard_cp (FSDP of dense weights), data = dp_replicate x dp_shard x cp (loss and metric
             sums), tokens = data x tp (every rank of a stage that holds its own tokens: expert counts),
             dp_shard_cp_tp (FSDP of the weights that act token by token on sequence-parallel activations)
    experts  (pp, dp_replicate, efsdp, ep, etp)          routed experts: Shard(0) over ep, their hidden width
             Shard over etp, FSDP over efsdp; efsdp x ep x etp = dp_shard x cp x tp. etp = 1: ep innermost (an
             EP group is ep consecutive ranks, and may span TP ranks); etp = tp: the etp dimension is the TP
             group, and an EP group strides over the ranks that share a TP coordinate

Ranks are pp-major with tp innermost, as the planner places them, so a TP group is tp consecutive ranks.
`init_parallel` reads torchrun's environment (WORLD_SIZE, RANK, LOCAL_RANK). A plain process, and one torchrun
process on CPU unless `dist.backend` names a backend, is a world of one without any process group
(`Parallel.single_process`, as torchtitan's `ParallelDims` at world_size 1: every degree 1, every collective the
identity), and trains on the same trainer, step and export path as many. One torchrun process on a GPU is a world of
one with a process group: a one-GPU run trains on the same path as many. A layout the planner rejects fails here
with the planner's one-line reason, before any process group exists.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybridtron.config import ModelConfig
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.costs import cluster_for
from hybridtron.distributed.layout import Layout, Workload, check_layout

DENSE_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_DIMS = ("pp", "dp_replicate", "efsdp", "ep", "etp")


def world_from_env() -> tuple[int, int, int]:
    """(world size, rank, local rank) as torchrun sets them; (1, 0, 0) for a plain process."""
    return (int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")),
            int(os.environ.get("LOCAL_RANK", "0")))


def launched_by_torchrun() -> bool:
    """torchrun (or another torchelastic agent) started this process: it set the rendezvous environment."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_ADDR" in os.environ


def run_device(config: DistConfig) -> torch.device:
    """The device this process trains on: cuda:LOCAL_RANK under torchrun where CUDA is present and the backend is
    not gloo, else the CPU (a plain process, or one torchrun process on CPU)."""
    world, _, local_rank = world_from_env()
    if torch.cuda.is_available() and config.backend != "gloo" and (world > 1 or launched_by_torchrun()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def without_process_group(config: DistConfig, world: int) -> bool:
    """This process trains with no process group, so with no FSDP: a plain process, or one torchrun process on CPU
    with `backend=auto` (one torchrun process on CUDA, or with a named backend, is a world of one)."""
    return world == 1 and not (launched_by_torchrun() and (run_device(config).type == "cuda"
                                                           or config.backend != "auto"))


def check_run_layout(config: DistConfig, model: ModelConfig, world: int, *, batch_size: int, grad_accum: int,
                     seq_len: int, context_parallel: bool = False) -> Layout:
    """The layout of `config` on `world` processes, or a ValueError with the reason it cannot run: the planner's
    structural rules first (`layout.check_layout`, the one-line reasons `hybridtron plan --layout` gives), then what
    training itself needs (whole rows per data-parallel rank, whole sequence shards per TP rank, CP chunks that
    split over TP and are no shorter than the conv's reach), then what it does not implement (context parallelism
    where the run does not take it, `context_parallel=False`)."""
    config.validate()
    if config.offload_optimizer and without_process_group(config, world):
        raise ValueError("dist.offload_optimizer=true: the offload is FSDP2's, and this process trains without FSDP "
                         "(a plain process, or one torchrun process on CPU with dist.backend=auto); launch it with "
                         "torchrun (one process per GPU; on a CPU with dist.backend=gloo)")
    layout = Layout(**config.degrees(world))
    workload = Workload(seq_len=seq_len, tokens_per_iter=seq_len * batch_size * grad_accum,
                        micro_batch=max(1, batch_size // layout.dp))
    rejected = check_layout(model, cluster_for("h100", world, gpus_per_node=world, nvlink_domain=world), workload, layout)
    if rejected is not None:
        raise ValueError(f"dist layout {layout} on {world} processes: {rejected.reason}")
    if batch_size % layout.dp:
        raise ValueError(f"data.batch_size {batch_size} does not split over dp_replicate x dp_shard = {layout.dp} "
                         f"data-parallel ranks (each takes batch_size / dp whole rows)")
    if layout.tp > 1 and seq_len % layout.tp:
        raise ValueError(f"data.seq_len {seq_len} does not split over tp {layout.tp} (sequence parallelism gives "
                         f"each TP rank seq_len / tp positions)")
    if layout.cp > 1:
        if not context_parallel:
            raise ValueError(f"dist.cp={layout.cp}: context parallelism splits the fixed-length rows of pretraining "
                             f"and SFT; this command's batches are not split by position; use cp=1")
        chunks = 2 * layout.cp
        if layout.tp > 1 and seq_len % (chunks * layout.tp):
            raise ValueError(f"data.seq_len {seq_len} does not split over 2 x cp {layout.cp} x tp {layout.tp} (each "
                             f"of the 2 x cp head-and-tail chunks is cut into tp sequence shards)")
        taps = model.conv_kernel - 1
        if seq_len // chunks < max(taps, 1):
            raise ValueError(f"data.seq_len {seq_len} over 2 x cp {layout.cp} leaves chunks of {seq_len // chunks} "
                             f"positions; the Mamba conv reads the previous {taps}")
    return layout


@dataclass
class Parallel:
    """A run's process groups and where this rank sits in them. `Trainer(parallel=...)` and `parallelize` read it."""

    config: DistConfig
    layout: Layout
    rank: int
    world: int
    device: torch.device
    meshes: dict[str, DeviceMesh]  # "dense" (DENSE_DIMS), "experts" (EXPERT_DIMS) and their views (build_meshes)
    pipeline: object | None = None  # pp > 1: the `pipeline.Pipeline` that `parallelize` built for this rank

    @classmethod
    def single_process(cls, device: torch.device | str = "cpu", config: DistConfig | None = None) -> Parallel:
        """One process as a world of one with no process group (torchtitan's `ParallelDims` at world_size 1): every
        degree 1, rank 0 the main rank, no meshes, and every collective the identity, so a plain process runs the
        same trainer, step and export code as a distributed one."""
        config = DistConfig() if config is None else config
        return cls(config=config, layout=Layout(**config.degrees(1)), rank=0, world=1, device=torch.device(device),
                   meshes={})

    @property
    def distributed(self) -> bool:
        """A process group exists, so the model is FSDP-wrapped and its gradients are sharded (a world of one
        under torchrun included); False for `single_process`."""
        return bool(self.meshes)

    # ------------------------------------------------------------------------------------------------ ranks
    @property
    def is_main(self) -> bool:
        """Global rank 0: the one that writes metrics, events, the report and the HF export."""
        return self.rank == 0

    def describe(self) -> str:
        """One line for the run's log: how many processes, on which device and backend, in which layout."""
        backend = dist.get_backend() if self.distributed else "no process group"
        line = f"{self.world} process{'es' if self.world > 1 else ''} on {self.device.type} " \
               f"({backend}), layout {self.layout}"
        if self.config.offload_optimizer:
            line += ("; optimizer offload: fp32 weight shards, gradients and AdamW state in pinned host memory, the "
                     "optimizer step on the CPU" if self.device.type == "cuda" else
                     "; optimizer offload: FSDP2's CPU offload path, no memory moved (the device is the CPU)")
        return line

    def coordinate(self, dim: str) -> int:
        return self.meshes["dense"].get_local_rank(dim) if self.distributed else 0

    @property
    def data_rank(self) -> int:
        """This rank's index among the dp_replicate x dp_shard data-parallel ranks (which rows it reads)."""
        return self.coordinate("dp_replicate") * self.layout.dp_shard + self.coordinate("dp_shard")

    @property
    def pp_rank(self) -> int:
        return self.coordinate("pp")

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of a dense mesh dimension or flattened view (`data`, `tokens`, `tp`, `pp`, ...); None
        in a single process, which has no groups."""
        return self.meshes[name].get_group() if self.distributed else None

    # --------------------------------------------------------------------------------------- collectives
    def sum_over_data(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over the ranks that split the batch (dp_replicate x dp_shard x cp); TP and PP peers of a
        rank hold the same rows, so they are not summed over."""
        if self.layout.dp * self.layout.cp > 1:
            dist.all_reduce(tensor, group=self.group("data"))
        return tensor

    def sum_over_context(self, tensor: torch.Tensor) -> torch.Tensor:
        """In-place sum over the cp ranks that share this rank's rows (each holds a share of their positions)."""
        if self.layout.cp > 1:
            dist.all_reduce(tensor, group=self.group("cp"))
        return tensor

    def broadcast_object(self, obj, src: int = 0):
        """`obj` of global rank `src` on every rank."""
        if self.world == 1:
            return obj
        holder = [obj if self.rank == src else None]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    def gather_objects(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, obj)
        return everyone

    def merge_over_stages(self, values: dict) -> dict:
        """Under PP, every stage's `values` merged in stage order (each stage measures its own layers); as is
        otherwise."""
        if self.layout.pp == 1:
            return values
        merged = {}
        for part in self.gather_objects(values):
            merged.update(part)
        return merged

    def max_over_world(self, value: int) -> int:
        """The largest of every rank's `value`."""
        if self.world == 1:
            return value
        flag = torch.tensor([value], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag)

    def mean_over_tokens(self, values: list[float]) -> list[float]:
        """The mean of each value over the ranks of this rank's pipeline stage (each holds as many of its own
        tokens)."""
        if self.world == 1 or not values:
            return values
        means = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(means, group=self.group("tokens"))
        return (means / dist.get_world_size(self.group("tokens"))).tolist()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    @contextlib.contextmanager
    def main_first(self):
        """Global rank 0 runs the block first (e.g. building a data cache), the others after it, from its cache."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def close(self) -> None:
        """At the end of a run, on every rank: wait until every rank's collectives are done (a rank that tears its
        gloo connections down while a peer still reads from them, or exits with collective work pending, can abort
        the interpreter at exit), then destroy the process groups."""
        if self.distributed and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # ------------------------------------------------------------------------------------------- meshes
    def fsdp_mesh(self, region: str) -> DeviceMesh:
        """The mesh FSDP shards a region's weights over: `dense` (dp_shard x cp; each TP rank its own TP shard),
        `tokens` (also over tp: weights applied token by token to sequence-parallel activations, whose gradients
        sum over the TP ranks), `experts` (efsdp). HSDP (a 2-D mesh) when dp_replicate > 1."""
        shard = {"dense": "dp_shard_cp", "tokens": "dp_shard_cp_tp", "experts": "efsdp"}[region]
        return self.meshes[f"hsdp_{region}"] if self.layout.dp_replicate > 1 else self.meshes[shard]


def _backend(config: DistConfig, device: torch.device) -> str:
    if config.backend != "auto":
        return config.backend
    if device.type != "cuda":
        return "gloo"
    # Offloaded, the gradients, the optimizer state and the master weights are host tensors, and their collectives
    # (the global gradient norm, the matrix optimizers' norms, gathering a full state) run on gloo beside NCCL
    # (torchtitan's `enable_cpu_backend` under CPU offload)
    return "cuda:nccl,cpu:gloo" if config.offload_optimizer else "nccl"


def init_parallel(config: DistConfig, model: ModelConfig, *, batch_size: int, grad_accum: int, seq_len: int,
                  timeout_s: float = 600.0, context_parallel: bool = False) -> Parallel:
    """Check the layout, then start the process group on this rank's device (cuda:LOCAL_RANK where CUDA is present
    and `backend` is not gloo, else the CPU) and build the meshes. A plain process, and one torchrun process on CPU
    with `backend=auto`, get `Parallel.single_process`: a world of one with no process group. One torchrun process
    on CUDA (a one-GPU run), or with a named backend, is a world of one with a process group."""
    world, rank, _ = world_from_env()
    layout = check_run_layout(config, model, world, batch_size=batch_size, grad_accum=grad_accum, seq_len=seq_len,
                              context_parallel=context_parallel)
    device = run_device(config)
    if without_process_group(config, world):
        return Parallel.single_process(device, config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = _backend(config, device)
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("dist.backend=nccl needs CUDA devices; this machine has none (use gloo or auto)")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None,
                                **_attempt_store(world, rank, timeout))
    return Parallel(config=config, layout=layout, rank=rank, world=world, device=device,
                    meshes=build_meshes(layout, device.type))


def _attempt_store(world: int, rank: int, timeout: datetime.timedelta) -> dict:
    """After a torchrun restart (`--max-restarts`), the process group's store under a prefix of its own. torchrun
    shares its rendezvous store with the workers, and that store still holds the failed attempt's keys, so a
    restarted worker reads the addresses of dead peers and gloo's connect is refused (pytorch/pytorch#135712; also
    avoided by launching with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). The restart count is the agents' own: it
    agrees across nodes as long as every agent restarted the same number of times."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return {"store": dist.PrefixStore(f"hybridtron/attempt_{restart}", store), "rank": rank, "world_size": world}


def build_meshes(layout: Layout, device_type: str) -> dict[str, DeviceMesh]:
    """Every view of one world mesh that the run uses, by name (module docstring)."""
    world_mesh = init_device_mesh(device_type, (layout.world,), mesh_dim_names=("world",))
    L = layout
    dense = world_mesh._unflatten(0, (L.pp, L.dp_replicate, L.dp_shard, L.cp, L.tp), DENSE_DIMS)
    meshes = {"dense": dense, "tp": dense["tp"], "pp": dense["pp"], "cp": dense["cp"]}
    for name, dims in (("dp_shard_cp", ("dp_shard", "cp")), ("dp_shard_cp_tp", ("dp_shard", "cp", "tp")),
                       ("data", ("dp_replicate", "dp_shard", "cp")), ("tokens", ("dp_replicate", "dp_shard", "cp", "tp"))):
        meshes[name] = dense[dims]._flatten(name)
    efsdp = L.dp_shard * L.cp * L.tp // (L.ep * L.etp)
    meshes["experts"] = world_mesh._unflatten(0, (L.pp, L.dp_replicate, efsdp, L.ep, L.etp), EXPERT_DIMS)
    for name in ("ep", "etp", "efsdp"):
        meshes[name] = meshes["experts"][name]
    meshes["ep_etp"] = meshes["experts"]["ep", "etp"]
    if L.dp_replicate > 1:  # HSDP: FSDP over a 2-D (replicate, shard) mesh
        meshes["hsdp_dense"] = world_mesh._unflatten(
            0, (L.pp, L.dp_replicate, L.dp_shard * L.cp, L.tp), ("pp", "dp_replicate", "hsdp_shard", "hsdp_tp")
        )["dp_replicate", "hsdp_shard"]
        meshes["hsdp_tokens"] = world_mesh._unflatten(
            0, (L.pp, L.dp_replicate, L.dp_shard * L.cp * L.tp), ("pp", "dp_replicate", "hsdp_token_shard")
        )["dp_replicate", "hsdp_token_shard"]
        meshes["hsdp_experts"] = meshes["experts"]["dp_replicate", "efsdp"]
    return meshes
