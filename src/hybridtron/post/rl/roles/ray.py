"""The "ray" role backend: one Ray actor per role replica (the optional `rl` extra, `pip install hybridtron[rl]`;
`ray` is imported only here, when this backend starts). Ray places actors on any machine of a cluster (`ray start
--head` on one, `ray start --address=HEAD:6379` on the others, then `RAY_ADDRESS=HEAD:6379` for the run):
`RoleSpec.resources` are the actor's `ray.remote` options (e.g. `{"num_gpus": 1}` or a custom resource naming a
node), which is how verl, miles, OpenRLHF and NeMo-RL place their rollout, reference/teacher and learner workers."""

from __future__ import annotations

import collections
import os
import sys
import time

from hybridtron.post.rl.roles.base import Message, ReplicaPlace, RoleBackend, RoleDied, RoleError, RoleSpec, Stage


class RayStage:
    """The Ray actor around a Stage (wrapped by `ray.remote` when the backend starts)."""

    def __init__(self, spec: RoleSpec, replica: ReplicaPlace | None):
        self.stage = Stage(spec, replica)

    def handle(self, message: Message) -> Message | None:
        if message is None:  # an earlier stage consumed the message
            return None
        return self.stage.handle(message)

    def close(self) -> None:
        self.stage.close()


class RayBackend(RoleBackend):
    def start(self) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("the ray role backend needs Ray: pip install 'hybridtron[rl]' (or ray>=2.9), or use "
                             "the process backend") from None
        self.ray = ray
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:  # a local cluster, or the one RAY_ADDRESS names
            # the workers import roles (and environments) by module path as spawned processes do: from the
            # learner's sys.path (on other machines, what is not there is skipped by Python)
            path = os.pathsep.join(entry for entry in sys.path if entry)
            ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False,
                     runtime_env={"env_vars": {"PYTHONPATH": path}})
            if not os.environ.get("RAY_ADDRESS"):  # a local cluster cannot grow: actors it cannot place never start
                self.check_local_resources(ray.cluster_resources())
        actor_class = ray.remote(RayStage)
        # the replicas meet at a store on this machine, which every node of the cluster reaches
        places = self.places(ray.util.get_node_ip_address())
        self.actors = [[actor_class.options(**{"num_cpus": 1, **spec.resources}).remote(spec, replica)
                        for replica in replicas] for spec, replicas in zip(self.specs, places)]
        self.outputs: collections.deque = collections.deque()  # the last actor's ObjectRefs, in order
        self.others: list = []  # the other replicas' ObjectRefs, watched for their errors

    def check_local_resources(self, available: dict) -> None:
        """ValueError (after shutting the local cluster down) if the roles' actors ask for more CPUs or GPUs than this
        machine's Ray cluster has: Ray would wait for them forever."""
        for resource, key in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
            asks = [(spec.role_name, spec.replicas, spec.resources.get(key, 1 if key == "num_cpus" else 0))
                    for spec in self.specs]
            wanted = sum(replicas * each for _, replicas, each in asks)
            if wanted > available.get(resource, 0):
                self.ray.shutdown()
                parts = ", ".join(f"{name}: {replicas} x {each:g}" for name, replicas, each in asks if each)
                raise ValueError(f"the roles' Ray actors ask for {wanted:g} {resource}s ({parts}), but this machine's "
                                 f"Ray cluster has {available.get(resource, 0):g}; ask for fewer (RoleSpec.resources "
                                 f"{key}, fewer replicas) or start a cluster with more (ray start, RAY_ADDRESS)")

    def send(self, message: Message) -> None:
        # Ray runs the calls one caller makes on one actor in the order it made them, so chaining each message
        # through every actor keeps the pipeline's order, as the queues of the process backend do. Every replica
        # of a role takes the first replica's output of the role before (stored once); control messages come back
        # as None (or an ERROR), read in order before the next item's output.
        ref = self.ray.put(message) if len(self.actors[0]) > 1 else message
        for replicas in self.actors:
            refs = [actor.handle.remote(ref) for actor in replicas]
            ref = refs[0]
            self.others += refs[1:]
        self.outputs.append(ref)

    def receive(self) -> Message:
        while True:
            message = self.wait(self.outputs.popleft())
            if message is not None:  # an item's output, or an error; None: a control message was applied
                return message

    def wait(self, ref) -> Message | None:
        """The message of `ref`, or the error of another replica that failed first (which `ref` would wait for)."""
        ray = self.ray
        deadline = time.monotonic() + self.timeout_s
        while True:
            ready, _ = ray.wait([ref, *self.others], num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise RoleError(f"no output from the roles for {self.timeout_s:.0f}s")
            try:
                message = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                raise RoleDied(f"a role actor died before answering: {exc}") from None
            if ready[0] == ref:
                return message
            self.others.remove(ready[0])
            if message is not None:  # another replica's error
                return message

    def close(self) -> None:
        ray = self.ray
        for actor in (actor for replicas in self.actors for actor in replicas):
            try:
                ray.get(actor.close.remote(), timeout=10)
            except Exception:  # closing is best effort: the actor is killed next
                pass
            ray.kill(actor)
        if self.owns_ray:
            ray.shutdown()
        self.store = None
