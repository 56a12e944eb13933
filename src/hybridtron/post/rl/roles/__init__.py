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

Backends (same semantics, same results for a fixed seed), one module each behind one interface
(hybridtron.post.rl.roles.base.RoleBackend: start, send, receive, close):
- "inline" (.inline): the roles live in the learner's process and run when the learner asks for the next output
  (the synchronous mode; tests).
- "process" (.process): one process per role replica (torch.multiprocessing, spawn), roles connected by bounded
  queues.
- "ray" (.ray): one Ray actor per role replica, on any machine of a Ray cluster, placed by `RoleSpec.resources`
  (the optional `rl` extra, `pip install hybridtron[rl]`; the module says how to start a cluster).

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

from typing import Any

# the names the rest of the package uses, re-exported
from hybridtron.post.rl.roles.base import (ERROR, ITEM, STATE, WEIGHTS, Delivery, Message, Role,  # noqa: F401
                                           RoleBackend, RoleDied, RoleError, RoleSpec, RoleStopped, WorkShare,
                                           check_replicas)
from hybridtron.post.rl.roles.inline import InlineBackend
from hybridtron.post.rl.roles.process import ProcessBackend
from hybridtron.post.rl.roles.ray import RayBackend

BACKEND_CLASSES: dict[str, type[RoleBackend]] = {"inline": InlineBackend, "process": ProcessBackend,
                                                 "ray": RayBackend}
BACKENDS = tuple(BACKEND_CLASSES)


# ---------------------------------------------------------------------------------------------- the chain
class RolePipeline:
    """Roles chained in the order of `specs` (see the module docstring), run by the `backend` named. `capacity`
    bounds each queue between roles (messages, items and control alike); the learner's own protocol bounds the items
    in flight. `timeout_s`: the longest `receive` waits for an output before it gives up with a RoleError."""

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
        self.specs, self.names = list(specs), names
        self.backend = BACKEND_CLASSES[backend](self.specs, capacity=capacity, timeout_s=timeout_s)
        self.submitted = self.received = 0
        self._started = False

    @property
    def in_flight(self) -> int:
        """Items submitted and not yet received."""
        return self.submitted - self.received

    def start(self) -> "RolePipeline":
        assert not self._started, "the pipeline is running already"
        self.backend.start()
        self._started = True
        return self

    def close(self) -> None:
        """Stop every role (an in-flight item is abandoned)."""
        if not self._started:
            return
        self._started = False
        self.backend.close()

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
        try:
            message = self.backend.receive()
        except RoleDied:
            self.close()
            raise
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
        try:
            self.backend.send(message)
        except RoleDied:
            self.close()
            raise
