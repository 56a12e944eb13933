"""The "process" role backend: one process per role replica (torch.multiprocessing, spawn), roles connected by
bounded queues."""

from __future__ import annotations

import queue as queue_module
import time

from hybridtron.post.rl.roles.base import (ERROR, STOP, Message, ReplicaPlace, RoleBackend, RoleDied, RoleError,
                                           RoleSpec, Stage, error_message)

POLL_S = 0.5  # how often a waiting learner checks that the role processes are alive
DEATH_GRACE_S = 1.0  # how long a replica's error waits for a peer's death to show (the death is the cause to name)


def serve_stage(spec: RoleSpec, replica: ReplicaPlace | None, inbox, outboxes: list) -> None:
    """The loop of a role process: handle messages in order until STOP (passed on) or an error (passed on, then
    exit). What the stage passes on goes to every replica of the next role (`outboxes`; the learner's queue after
    the last role); a non-leading replica's errors go to the first."""
    try:
        stage = Stage(spec, replica)
    except Exception:
        name = replica.label if replica is not None else spec.role_name
        outboxes[0].put(error_message(name))
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


class ProcessBackend(RoleBackend):
    def start(self) -> None:
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        places = self.places("127.0.0.1")
        # one inbox per replica of each role, then the learner's
        self.inboxes = [[context.Queue(maxsize=self.capacity) for _ in replicas] for replicas in places]
        self.inboxes.append([context.Queue(maxsize=self.capacity)])
        self.processes = []  # (label, process)
        for index, (spec, replicas) in enumerate(zip(self.specs, places)):
            for replica, inbox in zip(replicas, self.inboxes[index]):
                label = replica.label if replica is not None else spec.role_name
                process = context.Process(target=serve_stage, args=(spec, replica, inbox, self.inboxes[index + 1]),
                                          name=f"hybridtron-role-{spec.role_name}", daemon=True)
                process.start()
                self.processes.append((label, process))

    def send(self, message: Message) -> None:
        deadline = time.monotonic() + self.timeout_s
        for inbox in self.inboxes[0]:  # every replica of the first role
            while True:
                try:
                    inbox.put(message, timeout=POLL_S)
                    break
                except queue_module.Full:
                    self.check_processes()
                    if time.monotonic() > deadline:
                        raise RoleError(f"role {self.names[0]!r} took no message for {self.timeout_s:.0f}s") from None

    def receive(self) -> Message:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = self.inboxes[-1][0].get(timeout=POLL_S)
            except queue_module.Empty:
                self.check_processes()
                if time.monotonic() > deadline:
                    raise RoleError(f"no output from the roles for {self.timeout_s:.0f}s "
                                    f"(roles: {', '.join(self.names)})") from None
                continue
            if message.kind == ERROR and len(self.processes) > 1:
                # a replica whose peer died fails in their exchange: name the dead one. The peer's error can arrive
                # while the dead process is still exiting (its sockets closed, not yet reaped), so look a moment longer
                grace = time.monotonic() + DEATH_GRACE_S
                while True:
                    self.check_processes(crashed_only=True)
                    if time.monotonic() > grace:
                        break
                    time.sleep(0.05)
            return message

    def check_processes(self, crashed_only: bool = False) -> None:
        """RoleDied if a role process has ended (`crashed_only`: with a failure code; a role that reported its
        error exits normally)."""
        for name, process in self.processes:
            if not process.is_alive() and not (crashed_only and process.exitcode == 0):
                raise RoleDied(f"role {name!r} died (its process exited with code {process.exitcode}) before "
                               f"answering")

    def close(self) -> None:
        for inbox in self.inboxes[0]:
            try:
                inbox.put(Message(STOP), timeout=1.0)
            except queue_module.Full:
                pass
        deadline = time.monotonic() + 5.0
        for _, process in self.processes:
            process.join(timeout=max(deadline - time.monotonic(), 0.1))
            if process.is_alive():  # busy with an item nobody will read, or waiting for a dead replica
                process.terminate()
                process.join(timeout=5.0)
        for inboxes in self.inboxes:
            for q in inboxes:
                q.cancel_join_thread()
                q.close()
        self.store = None
