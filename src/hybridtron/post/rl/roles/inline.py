"""The "inline" role backend: the roles live in the learner's process and run when the learner asks for the next
output (the synchronous mode; tests)."""

from __future__ import annotations

import collections

from hybridtron.post.rl.roles.base import ERROR, Message, RoleBackend, Stage


class InlineBackend(RoleBackend):
    def start(self) -> None:
        self.stages = [Stage(spec) for spec in self.specs]
        self.waiting: collections.deque[Message] = collections.deque()  # sent, not yet handled
        self.outputs: collections.deque[Message] = collections.deque()

    def send(self, message: Message) -> None:
        self.waiting.append(message)

    def receive(self) -> Message:
        while not self.outputs:  # handle what was sent, in order, until an output comes out of the last role
            message = self.waiting.popleft()
            for stage in self.stages:
                message = stage.handle(message)
                if message is None or message.kind == ERROR:
                    break
            if message is not None:
                self.outputs.append(message)
        return self.outputs.popleft()

    def close(self) -> None:
        for stage in self.stages:
            stage.close()
