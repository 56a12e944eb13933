"""The role machinery of asynchronous RL (hybridtron.post.roles): order, weights and state travel with the items, the
backends agree, failures surface with the role's name."""

from __future__ import annotations

import os

import pytest
import torch

from hybridtron.post.roles import Role, RoleError, RolePipeline, RoleSpec


class Stamp(Role):
    """Stamps each item with the version of the weights it holds and a running count (its state)."""

    name = "stamp"

    def __init__(self, offset: int = 0):
        self.offset, self.version, self.weight, self.count = offset, None, None, 0

    def load_weights(self, version, state_dict):
        self.version, self.weight = version, float(state_dict["w"].sum())

    def step(self, item):
        self.count += 1
        return {"item": item, "version": self.version, "weight": self.weight, "count": self.count + self.offset}

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


class Scale(Role):
    """A second stage (what a teacher-scoring role is to MOPD): adds a field to the first stage's output."""

    name = "scale"

    def step(self, item):
        return {**item, "scaled": item["item"] * 10}


class Fail(Role):
    name = "fail"

    def step(self, item):
        raise ArithmeticError(f"cannot handle {item}")


class Die(Role):
    name = "die"

    def step(self, item):
        os._exit(3)


def exchange(pipeline: RolePipeline) -> list[dict]:
    """Weights v0, items 1 and 2, weights v1, item 3, a state load, item 4: the outputs, states attached."""
    outputs = []
    with pipeline:
        pipeline.send_weights("stamp", 0, {"w": torch.ones(3)})
        pipeline.submit(1)
        pipeline.submit(2)
        weights = {"w": torch.full((3,), 2.0)}
        pipeline.send_weights("stamp", 1, weights)
        weights["w"].fill_(100.0)  # the learner moves on: the role must see the weights as they were sent
        pipeline.submit(3)
        outputs += [pipeline.receive() for _ in range(3)]
        pipeline.send_state("stamp", {"count": 10})
        pipeline.submit(4)
        outputs.append(pipeline.receive())
        assert pipeline.in_flight == 0
    return [{**d.item, "states": d.states} for d in outputs]


EXPECTED = [
    {"item": 1, "version": 0, "weight": 3.0, "count": 1, "scaled": 10, "states": {"stamp": {"count": 1}, "scale": {}}},
    {"item": 2, "version": 0, "weight": 3.0, "count": 2, "scaled": 20, "states": {"stamp": {"count": 2}, "scale": {}}},
    {"item": 3, "version": 1, "weight": 6.0, "count": 3, "scaled": 30, "states": {"stamp": {"count": 3}, "scale": {}}},
    {"item": 4, "version": 1, "weight": 6.0, "count": 11, "scaled": 40,
     "states": {"stamp": {"count": 11}, "scale": {}}},
]


def test_inline_pipeline_keeps_the_order_of_items_weights_and_state():
    assert exchange(RolePipeline([RoleSpec(Stamp), RoleSpec(Scale)], "inline")) == EXPECTED


@pytest.mark.timeout(120)
def test_process_pipeline_gives_what_the_inline_one_gives():
    """Two role processes (spawn) connected by bounded queues: the same outputs, weights and states."""
    assert exchange(RolePipeline([RoleSpec(Stamp), RoleSpec(Scale)], "process", capacity=2)) == EXPECTED


@pytest.mark.parametrize("backend", ["inline", "process"])
@pytest.mark.timeout(120)
def test_a_failing_role_is_named_with_its_traceback(backend):
    with RolePipeline([RoleSpec(Fail)], backend) as pipeline:
        pipeline.submit(7)
        with pytest.raises(RoleError, match=r"(?s)role 'fail' failed.*ArithmeticError: cannot handle"):
            pipeline.receive()


@pytest.mark.timeout(120)
def test_a_dead_role_process_is_reported():
    with RolePipeline([RoleSpec(Die)], "process") as pipeline:
        pipeline.submit(1)
        with pytest.raises(RoleError, match="role 'die' died"):
            pipeline.receive()


def test_role_weights_go_only_to_roles_that_hold_a_policy():
    with RolePipeline([RoleSpec(Scale)], "inline") as pipeline:
        pipeline.send_weights("scale", 0, {"w": torch.ones(1)})
        pipeline.submit(1)
        with pytest.raises(RoleError, match="holds no policy"):
            pipeline.receive()


def test_bad_pipelines_are_refused():
    with pytest.raises(ValueError, match="backend must be one of inline, process, ray"):
        RolePipeline([RoleSpec(Stamp)], "threads")
    with pytest.raises(ValueError, match="unique"):
        RolePipeline([RoleSpec(Stamp), RoleSpec(Stamp)])
    with pytest.raises(ValueError, match="no role named 'teacher'"):
        with RolePipeline([RoleSpec(Stamp)]) as pipeline:
            pipeline.send_state("teacher", {})
    with RolePipeline([RoleSpec(Stamp)]) as pipeline:
        with pytest.raises(RuntimeError, match="no item in flight"):
            pipeline.receive()
