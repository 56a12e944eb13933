"""What every backend of the role pipeline (hybridtron.post.rl.roles) shares: roles and how to build them
(`Role`, `RoleSpec`), the messages that travel down the chain, a role's replicas and their share of the work
(`WorkShare`, `ReplicaPlace`), one stage's message handling (`Stage`), and the interface a backend implements
(`RoleBackend`: start, send, receive, close).
"""

from __future__ import annotations

import sys
import traceback
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

ITEM, WEIGHTS, STATE, STOP, ERROR = "item", "weights", "state", "stop", "error"


class RoleError(RuntimeError):
    """A role raised (or its process died); the message names the role and carries its traceback."""


class RoleDied(RoleError):
    """A role's process or actor is gone: the pipeline closes before it raises this (an error a role reported, or
    a wait that timed out, leaves the closing to the learner)."""


class RoleStopped(ValueError):
    """A role's failure that its message explains in one line, cause and fix (a rollout engine missing, failing to
    start or dying: hybridtron.post.rl.engines): the learner raises it again as itself, naming the role, without
    the traceback (a ValueError: `hybridtron.cli` prints one line)."""


def error_message(name: str) -> "Message":
    """The ERROR message of the exception being handled: (role, traceback, its one line if a RoleStopped)."""
    exc = sys.exc_info()[1]
    return Message(ERROR, (name, traceback.format_exc(), str(exc) if isinstance(exc, RoleStopped) else None))


class Role:
    """Base class of a pipeline stage. Override `step`; the rest are optional."""

    name = "role"

    def step(self, item: Any) -> Any:
        raise NotImplementedError(f"role {self.name!r} has no step()")

    def load_weights(self, version: int, state_dict: dict) -> None:
        raise ValueError(f"role {self.name!r} holds no policy: it takes no weights")

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned (a resumed run)."""

    def close(self) -> None:
        """Release what the role holds (child processes, files)."""


@dataclass(frozen=True)
class RoleSpec:
    """How to build a role in whichever process runs it: `factory(**kwargs)` (a class or function importable by
    module path, so that spawn and Ray can find it). `name` keys the role's weights and state (default: the
    factory's `name`); `resources`: Ray actor options (`num_cpus`, `num_gpus`, `resources`, ...) of each replica,
    ignored by the other backends; `replicas`: processes (or actors) sharing the role's work, each built with a
    `share=WorkShare` keyword (see the module docstring)."""

    factory: Callable[..., Role]
    kwargs: dict = field(default_factory=dict)
    name: str | None = None
    resources: dict = field(default_factory=dict)
    replicas: int = 1

    def __post_init__(self):
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"role {self.role_name!r}: replicas must be an integer >= 1, got {self.replicas!r}")

    @property
    def role_name(self) -> str:
        return self.name or getattr(self.factory, "name", None) or self.factory.__name__

    def build(self, share: "WorkShare | None" = None) -> Role:
        role = self.factory(**({**self.kwargs, "share": share} if share is not None else self.kwargs))
        if not callable(getattr(role, "step", None)):
            raise TypeError(f"{self.factory!r} built {type(role).__name__}, which has no step() method")
        return role


@dataclass
class Message:
    kind: str  # ITEM, WEIGHTS, STATE, STOP, ERROR
    payload: Any = None
    target: str | None = None  # the role a WEIGHTS or STATE message is for
    states: dict = field(default_factory=dict)  # ITEM: each role's state_dict() after it stepped this item


@dataclass
class Delivery:
    """One output of the pipeline: the last role's result for one submitted item, and the state of every role
    right after it (role name -> state_dict)."""

    item: Any
    states: dict[str, dict]


# ------------------------------------------------------------------------------------------- replicas
class WorkShare:
    """This process's part of a role's work among the processes of a torch.distributed `group` (default: the
    default group): the torchrun ranks when every rank runs the roles inline (the synchronous mode), or a role's
    replicas (`ReplicaPlace.join`). `span(n)` is this process's contiguous slice of n items; `gather(part)` every
    process's part, in rank order, so concatenated the shares are in the order of the items."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def span(self, n: int) -> tuple[int, int]:
        """[start, stop) of this process's share of `n` items."""
        return self.rank * n // self.world, (self.rank + 1) * n // self.world

    def gather(self, part):
        import torch.distributed as dist

        everyone = [None] * self.world
        dist.all_gather_object(everyone, part, group=self.group)
        return everyone


@dataclass(frozen=True)
class ReplicaPlace:
    """Replica `rank` of a role's `world` replicas, and where they meet: the learner's TCP store at `host`:`port`
    (under the role's name, so each replicated role has its own group), waiting at most `timeout_s` for a peer."""

    role: str
    rank: int
    world: int
    host: str
    port: int
    timeout_s: float

    @property
    def label(self) -> str:
        return self.role if self.world == 1 else f"{self.role} (replica {self.rank} of {self.world})"

    def join(self) -> WorkShare:
        """Join the replicas' gloo group (as this process's default group: a role process belongs to one role) and
        return this replica's share. Gloo whatever the device: the replicas exchange Python objects."""
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(self.role, store), rank=self.rank,
                                world_size=self.world, timeout=timeout)
        return WorkShare()


def replica_places(spec: RoleSpec, host: str, port: int, timeout_s: float) -> list[ReplicaPlace | None]:
    """One place per replica of `spec`; [None] for a role with a single process."""
    if spec.replicas == 1:
        return [None]
    return [ReplicaPlace(spec.role_name, rank, spec.replicas, host, port, timeout_s) for rank in range(spec.replicas)]


def check_replicas(section: str, replicas: dict[str, int], *, async_rollouts: bool, backend: str) -> None:
    """The replica counts of a [grpo] or [mopd] section (`replicas`: field -> count): at least 1, and more only
    where the roles run in processes or Ray actors."""
    for name, count in replicas.items():
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"{section}.{name} must be an integer >= 1, got {count!r}")
        if count > 1 and (not async_rollouts or backend == "inline"):
            raise ValueError(f"{section}.{name}={count}: replicas are processes (or Ray actors) of the asynchronous "
                             f"mode; set {section}.async_rollouts=true with {section}.rollout_backend=process or ray "
                             f"(the synchronous mode under torchrun splits the roles' work over the ranks already)")


# ------------------------------------------------------------------------------------------- one stage
class Stage:
    """A role and the message handling every backend shares: step items, apply what is addressed to the role,
    pass the rest on. `handle` returns the message for the next stage (or the learner), or None. A replica other
    than the first (`replica.rank` > 0) passes on only its errors: replica 0 passes on what they all computed."""

    def __init__(self, spec: RoleSpec, replica: ReplicaPlace | None = None):
        self.name, self.replica = spec.role_name, replica
        self.leads = replica is None or replica.rank == 0
        self.role = spec.build(replica.join() if replica is not None else None)

    def handle(self, message: Message) -> Message | None:
        out = self._handle(message)
        return out if self.leads or out is None or out.kind == ERROR else None

    def _handle(self, message: Message) -> Message | None:
        if message.kind == ITEM:
            try:
                output = self.role.step(message.payload)
                states = {**message.states, self.name: self.role.state_dict()}
            except Exception:  # the learner re-raises it as a RoleError naming this role
                return self._error()
            return Message(ITEM, output, states=states)
        if message.kind in (WEIGHTS, STATE) and message.target == self.name:
            try:
                if message.kind == WEIGHTS:
                    version, state_dict = message.payload
                    self.role.load_weights(version, state_dict)
                else:
                    self.role.load_state_dict(message.payload)
            except Exception:
                return self._error()
            return None
        return message  # for a later role, STOP, or an earlier role's ERROR

    def _error(self) -> Message:
        return error_message(self.replica.label if self.replica is not None else self.name)

    def close(self) -> None:
        self.role.close()
        if self.replica is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- a backend
class RoleBackend(ABC):
    """Where and how the stages of `specs` run (one module per backend: hybridtron.post.rl.roles.inline, .process,
    .ray). `send` takes the learner's messages in order; `receive` returns the last role's next ITEM or an ERROR,
    waiting at most `timeout_s` (RoleError), and raises RoleDied if a role's process or actor is gone. `capacity`
    bounds each queue between roles."""

    def __init__(self, specs: list[RoleSpec], *, capacity: int, timeout_s: float):
        self.specs, self.capacity, self.timeout_s = specs, capacity, timeout_s
        self.names = [spec.role_name for spec in specs]
        self.store = None  # where replicated roles meet (`places`), held until the backend closes

    @abstractmethod
    def start(self) -> None:
        """Build every role (in this process or others)."""

    @abstractmethod
    def send(self, message: Message) -> None:
        """Pass `message` to the first role, after everything sent before it."""

    @abstractmethod
    def receive(self) -> Message:
        """The next ITEM (or ERROR) out of the last role, waiting for it."""

    @abstractmethod
    def close(self) -> None:
        """Stop every role (an in-flight item is abandoned)."""

    def places(self, host: str) -> list[list[ReplicaPlace | None]]:
        """Each role's replica places; for replicated roles this starts the TCP store where they meet."""
        if any(spec.replicas > 1 for spec in self.specs):
            import datetime

            import torch.distributed as dist

            self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=self.timeout_s))
        port = self.store.port if self.store is not None else 0
        return [replica_places(spec, host, port, self.timeout_s) for spec in self.specs]
