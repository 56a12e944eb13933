"""Roles of asynchronous RL, connected by bounded queues: the machinery GRPO's asynchronous mode runs on, and that
MOPD reuses with a teacher-scoring role between rollout and learning.

A role is an object with a `step(item) -> item` method (and, if it holds a policy, `load_weights(version,
state_dict)`; if it has state a resumed run must restore, `state_dict` / `load_state_dict`). A `RolePipeline` chains
roles: what the learner submits goes to the first role, each role's output is the next one's input, and the last
role's output comes back to the learner, first in, first out:

    learner --submit--> [rollout] --queue--> [teacher scoring] --queue--> receive() --> learner
       \\--send_weights(rollout, version, weights)--^

Every message (an item, new weights, a role's state) enters at the first role and travels down the chain in the
order the learner sent it, so "weights of version v, then request r" reaches the rollout role in that order, and
what each request was computed with is fixed by the learner's order of calls, never by timing. That is what makes
the asynchronous runs reproducible: the staleness bound is a property of the protocol (hybridtron.post.rl.batches'
`RolloutBatches` keeps at most `staleness + 1` requests in flight and publishes the weights before each new one),
not of how fast a process happens to be.

Each output comes back with the `state_dict()` of every role right after it produced it (`Delivery.states`), so a
checkpoint can restore the roles to exactly the point of the last item the learner holds.

Backends (same semantics, same results for a fixed seed):
- "inline": the roles live in the learner's process and run when the learner asks for the next output (the
  synchronous mode; tests).
- "process": one process per role replica (torch.multiprocessing, spawn), roles connected by bounded queues.
- "ray": one Ray actor per role replica (the optional `rl` extra, `pip install hybridtron[rl]`; `ray` is imported only
  here, when this backend starts). Ray places actors on any machine of a cluster (`ray start --head` on one,
  `ray start --address=HEAD:6379` on the others, then `RAY_ADDRESS=HEAD:6379` for the run): `RoleSpec.resources`
  are the actor's `ray.remote` options (e.g. `{"num_gpus": 1}` or a custom resource naming a node), which is how
  verl, miles, OpenRLHF and NeMo-RL place their rollout, reference/teacher and learner workers.

Replicas (`RoleSpec(replicas=N)`, the process and ray backends): N processes (or actors) run one role, each
receiving every message, so they hold the same weights and state, and each doing its share of every item's work
(`WorkShare.span`: the rollout role's prompts, a scoring role's rollouts), then exchanging the shares
(`WorkShare.gather`, over a gloo group of the replicas that meets at a TCP store the learner hosts) so every replica
ends with the whole output. Replica 0 passes it on; the others pass on only their errors. That is how rollout
generation scales with processes while the batch stays the one a single process makes (an engine's samples depend
on their seed and their index in the round alone), and the same sharing the synchronous mode does over the torchrun
ranks.

A role that raises ends the pipeline: the learner's next `receive()` raises `RoleError` with the role's name and
traceback (a `RoleStopped`, whose one line says the cause and the fix, is raised as itself); a role process
that dies is reported the same way. `close()` stops every role.

Writing a role: a class importable by its module path (the "process" and "ray" backends build it in another
process from a `RoleSpec(factory, kwargs)`; the kwargs must pickle), constructed with everything it needs (a model
directory, a config), whose `step` takes and returns picklable items (CPU tensors, lists, dataclasses).
"""

from __future__ import annotations

import collections
import os
import queue as queue_module
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

BACKENDS = ("inline", "process", "ray")
ITEM, WEIGHTS, STATE, STOP, ERROR = "item", "weights", "state", "stop", "error"
POLL_S = 0.5  # how often a waiting learner checks that the role processes are alive


class RoleError(RuntimeError):
    """A role raised (or its process died); the message names the role and carries its traceback."""


class RoleStopped(ValueError):
    """A role's failure that its message explains in one line, cause and fix (a rollout engine missing, failing to
    start or dying: hybridtron.post.rl.engines): the learner raises it again as itself, naming the role, without
    the traceback (a ValueError: `hybridtron.cli` prints one line)."""


def _error(name: str) -> "Message":
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
        return _error(self.replica.label if self.replica is not None else self.name)

    def close(self) -> None:
        self.role.close()
        if self.replica is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


def _serve_stage(spec: RoleSpec, replica: ReplicaPlace | None, inbox, outboxes: list) -> None:
    """The loop of a role process: handle messages in order until STOP (passed on) or an error (passed on, then
    exit). What the stage passes on goes to every replica of the next role (`outboxes`; the learner's queue after
    the last role); a non-leading replica's errors go to the first."""
    try:
        stage = Stage(spec, replica)
    except Exception:
        name = replica.label if replica is not None else spec.role_name
        outboxes[0].put(_error(name))
        return
    try:
        while True:
            message = inbox.get()
            out = stage.handle(message)
            if out is not None:
                for outbox in outboxes if stage.leads else outboxes[:1]:
                    outbox.put(out)
            if message.kind in (STOP, ERROR) or (out is not None and out.kind == ERROR):
                return
    finally:
        stage.close()


class _RayStage:
    """The Ray actor around a Stage (wrapped by `ray.remote` when the ray backend starts)."""

    def __init__(self, spec: RoleSpec, replica: ReplicaPlace | None):
        self.stage = Stage(spec, replica)

    def handle(self, message: Message) -> Message | None:
        if message is None:  # an earlier stage consumed the message
            return None
        return self.stage.handle(message)

    def close(self) -> None:
        self.stage.close()


# ---------------------------------------------------------------------------------------------- the chain
class RolePipeline:
    """Roles chained in the order of `specs` (see the module docstring). `capacity` bounds each queue between
    roles (messages, items and control alike); the learner's own protocol bounds the items in flight.
    `timeout_s`: the longest `receive` waits for an output before it gives up with a RoleError."""

    def __init__(self, specs: list[RoleSpec], backend: str = "inline", *, capacity: int = 4,
                 timeout_s: float = 3600.0):
        if backend not in BACKENDS:
            raise ValueError(f"role backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
        if not specs:
            raise ValueError("a role pipeline needs at least one role")
        names = [spec.role_name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"role names must be unique, got {names}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        replicated = [f"{spec.role_name} ({spec.replicas})" for spec in specs if spec.replicas > 1]
        if replicated and backend == "inline":
            raise ValueError(f"role replicas ({', '.join(replicated)}) need processes: the process or ray backend, "
                             f"not inline (one process runs every role)")
        self.specs, self.backend, self.names = list(specs), backend, names
        self.capacity, self.timeout_s = capacity, timeout_s
        self.submitted = self.received = 0
        self._started = False

    @property
    def in_flight(self) -> int:
        """Items submitted and not yet received."""
        return self.submitted - self.received

    # ------------------------------------------------------------------------------------------- start, stop
    def start(self) -> "RolePipeline":
        assert not self._started, "the pipeline is running already"
        getattr(self, f"_start_{self.backend}")()
        self._started = True
        return self

    def _start_inline(self) -> None:
        self._stages = [Stage(spec) for spec in self.specs]
        self._waiting: collections.deque[Message] = collections.deque()  # sent, not yet handled
        self._outputs: collections.deque[Message] = collections.deque()

    def _places(self, host: str) -> list[list[ReplicaPlace | None]]:
        """Each role's replica places; for replicated roles this starts the TCP store where they meet (held by the
        pipeline until it closes)."""
        self._store = None
        if any(spec.replicas > 1 for spec in self.specs):
            import datetime

            import torch.distributed as dist

            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=self.timeout_s))
        port = self._store.port if self._store is not None else 0
        return [replica_places(spec, host, port, self.timeout_s) for spec in self.specs]

    def _start_process(self) -> None:
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        places = self._places("127.0.0.1")
        # one inbox per replica of each role, then the learner's
        self._inboxes = [[context.Queue(maxsize=self.capacity) for _ in replicas] for replicas in places]
        self._inboxes.append([context.Queue(maxsize=self.capacity)])
        self._processes = []  # (label, process)
        for index, (spec, replicas) in enumerate(zip(self.specs, places)):
            for replica, inbox in zip(replicas, self._inboxes[index]):
                label = replica.label if replica is not None else spec.role_name
                process = context.Process(target=_serve_stage, args=(spec, replica, inbox, self._inboxes[index + 1]),
                                          name=f"hybridtron-role-{spec.role_name}", daemon=True)
                process.start()
                self._processes.append((label, process))

    def _start_ray(self) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("the ray role backend needs Ray: pip install 'hybridtron[rl]' (or ray>=2.9), or use "
                             "the process backend") from None
        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:  # a local cluster, or the one RAY_ADDRESS names
            # the workers import roles (and environments) by module path as spawned processes do: from the
            # learner's sys.path (on other machines, what is not there is skipped by Python)
            path = os.pathsep.join(entry for entry in sys.path if entry)
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False,
                     runtime_env={"env_vars": {"PYTHONPATH": path}})
            if not os.environ.get("RAY_ADDRESS"):  # a local cluster cannot grow: actors it cannot place never start
                self._check_local_resources(ray.cluster_resources())
        actor_class = ray.remote(_RayStage)
        # the replicas meet at a store on this machine, which every node of the cluster reaches
        places = self._places(ray.util.get_node_ip_address())
        self._actors = [[actor_class.options(**{"num_cpus": 1, **spec.resources}).remote(spec, replica)
                         for replica in replicas] for spec, replicas in zip(self.specs, places)]
        self._ray_outputs: collections.deque = collections.deque()  # the last actor's ObjectRefs, in order
        self._ray_others: list = []  # the other replicas' ObjectRefs, watched for their errors

    def _check_local_resources(self, available: dict) -> None:
        """ValueError (after shutting the local cluster down) if the roles' actors ask for more CPUs or GPUs than this
        machine's Ray cluster has: Ray would wait for them forever."""
        for resource, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
            asks = [(spec.role_name, spec.replicas, spec.resources.get(key, 1 if key == "num_cpus" else 0))
                    for spec in self.specs]
            wanted = sum(replicas * each for _, replicas, each in asks)
            if wanted > available.get(resource, 0):
                self._ray.shutdown()
                parts = ", ".join(f"{name}: {replicas} x {each:g}" for name, replicas, each in asks if each)
                raise ValueError(f"the roles' Ray actors ask for {wanted:g} {resource}s ({parts}), but this machine's "
                                 f"Ray cluster has {available.get(resource, 0):g}; ask for fewer (RoleSpec.resources "
                                 f"{key}, fewer replicas) or start a cluster with more (ray start, RAY_ADDRESS)")

    def close(self) -> None:
        """Stop every role (an in-flight item is abandoned)."""
        if not self._started:
            return
        self._started = False
        getattr(self, f"_close_{self.backend}")()

    def _close_inline(self) -> None:
        for stage in self._stages:
            stage.close()

    def _close_process(self) -> None:
        for inbox in self._inboxes[0]:
            try:
                inbox.put(Message(STOP), timeout=1.0)
            except queue_module.Full:
                pass
        deadline = time.monotonic() + 5.0
        for _, process in self._processes:
            process.join(timeout=max(deadline - time.monotonic(), 0.1))
            if process.is_alive():  # busy with an item nobody will read, or waiting for a dead replica
                process.terminate()
                process.join(timeout=5.0)
        for inboxes in self._inboxes:
            for q in inboxes:
                q.cancel_join_thread()
                q.close()
        self._store = None

    def _close_ray(self) -> None:
        ray = self._ray
        for actor in (actor for replicas in self._actors for actor in replicas):
            try:
                ray.get(actor.close.remote(), timeout=10)
            except Exception:  # closing is best effort: the actor is killed next
                pass
            ray.kill(actor)
        if self._owns_ray:
            ray.shutdown()
        self._store = None

    def __enter__(self) -> "RolePipeline":
        return self.start() if not self._started else self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- messages
    def submit(self, item: Any) -> None:
        """Send an item to the first role; its output (after the last role) comes back from `receive`."""
        self._send(Message(ITEM, item))
        self.submitted += 1

    def send_weights(self, role: str, version: int, state_dict: dict) -> None:
        """Hand a policy's weights to `role` (its `load_weights(version, state_dict)`), ordered with the items: the
        items submitted after this call are computed with these weights. The tensors are copied at once, so the
        learner may go on updating its own while the message waits its turn."""
        self._check_role(role)
        state_dict = {name: value.detach().clone() for name, value in state_dict.items()}
        self._send(Message(WEIGHTS, (version, state_dict), target=role))

    def send_state(self, role: str, state: dict) -> None:
        """Restore `role` to a `state_dict()` it returned (resuming a run), before the items submitted next."""
        self._check_role(role)
        self._send(Message(STATE, state, target=role))

    def receive(self) -> Delivery:
        """The output of the oldest item in flight, waiting for it; RoleError if a role failed."""
        assert self._started, "start() the pipeline first"
        if self.in_flight < 1:
            raise RuntimeError("receive(): no item in flight (submit one first)")
        message = getattr(self, f"_receive_{self.backend}")()
        if message.kind == ERROR:
            role, text, line = message.payload
            self.close()
            if line is not None:
                raise RoleStopped(f"role {role!r}: {line}")
            raise RoleError(f"role {role!r} failed:\n{text}")
        assert message.kind == ITEM, f"unexpected {message.kind} message from the last role"
        self.received += 1
        return Delivery(message.payload, message.states)

    def _check_role(self, role: str) -> None:
        if role not in self.names:
            raise ValueError(f"no role named {role!r} in this pipeline (roles: {', '.join(self.names)})")

    def _send(self, message: Message) -> None:
        assert self._started, "start() the pipeline first"
        getattr(self, f"_send_{self.backend}")(message)

    def _send_inline(self, message: Message) -> None:
        self._waiting.append(message)

    def _receive_inline(self) -> Message:
        while not self._outputs:  # handle what was sent, in order, until an output comes out of the last role
            message = self._waiting.popleft()
            for stage in self._stages:
                message = stage.handle(message)
                if message is None or message.kind == ERROR:
                    break
            if message is not None:
                self._outputs.append(message)
        return self._outputs.popleft()

    def _send_process(self, message: Message) -> None:
        deadline = time.monotonic() + self.timeout_s
        for inbox in self._inboxes[0]:  # every replica of the first role
            while True:
                try:
                    inbox.put(message, timeout=POLL_S)
                    break
                except queue_module.Full:
                    self._check_processes()
                    if time.monotonic() > deadline:
                        raise RoleError(f"role {self.names[0]!r} took no message for {self.timeout_s:.0f}s") from None

    def _receive_process(self) -> Message:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = self._inboxes[-1][0].get(timeout=POLL_S)
            except queue_module.Empty:
                self._check_processes()
                if time.monotonic() > deadline:
                    raise RoleError(f"no output from the roles for {self.timeout_s:.0f}s "
                                    f"(roles: {', '.join(self.names)})") from None
                continue
            if message.kind == ERROR:  # a replica whose peer died fails in their exchange: name the dead one
                self._check_processes(crashed_only=True)
            return message

    def _check_processes(self, crashed_only: bool = False) -> None:
        """RoleError if a role process has ended (`crashed_only`: with a failure code; a role that reported its
        error exits normally)."""
        for name, process in self._processes:
            if not process.is_alive() and not (crashed_only and process.exitcode == 0):
                code = process.exitcode
                self.close()
                raise RoleError(f"role {name!r} died (its process exited with code {code}) before answering")

    def _send_ray(self, message: Message) -> None:
        # Ray runs the calls one caller makes on one actor in the order it made them, so chaining each message
        # through every actor keeps the pipeline's order, as the queues of the process backend do. Every replica
        # of a role takes the first replica's output of the role before (stored once); control messages come back
        # as None (or an ERROR), read in order before the next item's output.
        ref = self._ray.put(message) if len(self._actors[0]) > 1 else message
        for replicas in self._actors:
            refs = [actor.handle.remote(ref) for actor in replicas]
            ref = refs[0]
            self._ray_others += refs[1:]
        self._ray_outputs.append(ref)

    def _receive_ray(self) -> Message:
        while True:
            message = self._ray_wait(self._ray_outputs.popleft())
            if message is not None:  # an item's output, or an error; None: a control message was applied
                return message

    def _ray_wait(self, ref) -> Message | None:
        """The message of `ref`, or the error of another replica that failed first (which `ref` would wait for)."""
        ray = self._ray
        deadline = time.monotonic() + self.timeout_s
        while True:
            ready, _ = ray.wait([ref, *self._ray_others], num_returns=1,
                                timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise RoleError(f"no output from the roles for {self.timeout_s:.0f}s")
            try:
                message = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                self.close()
                raise RoleError(f"a role actor died before answering: {exc}") from None
            if ready[0] == ref:
                return message
            self._ray_others.remove(ready[0])
            if message is not None:  # another replica's error
                return message
