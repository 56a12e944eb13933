"""The role machinery of asynchronous RL (hybridtron.post.rl.roles): order, weights and state travel with the items, the
backends agree, failures surface with the role's name."""

from __future__ import annotations

import os

import pytest
import torch

from hybridtron.post.rl.roles import Role, RoleError, RolePipeline, RoleSpec, check_replicas


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


class Square(Role):
    """Squares its share of a list (all of it without replicas) and gathers everyone's: each square tagged with the
    replica that made it and the weights version that replica held."""

    name = "square"

    def __init__(self, share=None):
        self.share, self.version = share, None

    def load_weights(self, version, state_dict):
        self.version = version

    def step(self, numbers):
        start, stop = self.share.span(len(numbers)) if self.share is not None else (0, len(numbers))
        rank = self.share.rank if self.share is not None else 0
        mine = [(x * x, rank, self.version) for x in numbers[start:stop]]
        return [y for part in (self.share.gather(mine) if self.share is not None else [mine]) for y in part]


class Count(Role):
    """A second replicated role: tags each square with the replica that counted it."""

    name = "count"

    def __init__(self, share=None):
        self.share = share

    def step(self, squares):
        start, stop = self.share.span(len(squares)) if self.share is not None else (0, len(squares))
        mine = [(*y, self.share.rank if self.share is not None else 0) for y in squares[start:stop]]
        return [y for part in (self.share.gather(mine) if self.share is not None else [mine]) for y in part]


class FailOnSecondReplica(Role):
    name = "picky"

    def __init__(self, share=None, exit_instead: bool = False):
        self.share, self.exit_instead = share, exit_instead

    def step(self, item):
        if self.share.rank == 1:
            if self.exit_instead:
                os._exit(3)
            raise ArithmeticError(f"replica 1 cannot handle {item}")
        return self.share.gather(item)


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


def replicated_exchange(backend: str) -> list:
    """Weights v0, a list of 5, weights v1, a list of 3, through squaring (2 replicas) then counting (2 replicas).
    (Ray: half a CPU each, so that the four actors fit on a two-core machine.)"""
    cpus = {"num_cpus": 0.5}
    with RolePipeline([RoleSpec(Square, replicas=2, resources=cpus), RoleSpec(Count, replicas=2, resources=cpus)],
                      backend, capacity=2) as pipeline:
        pipeline.send_weights("square", 0, {"w": torch.ones(1)})
        pipeline.submit([1, 2, 3, 4, 5])
        pipeline.send_weights("square", 1, {"w": torch.ones(1)})
        pipeline.submit([6, 7, 8])
        return [pipeline.receive().item for _ in range(2)]


REPLICATED = [  # (square, squaring replica, its weights version, counting replica): each replica did its share
    [(1, 0, 0, 0), (4, 0, 0, 0), (9, 1, 0, 1), (16, 1, 0, 1), (25, 1, 0, 1)],
    [(36, 0, 1, 0), (49, 1, 1, 1), (64, 1, 1, 1)],
]


@pytest.mark.timeout(120)
def test_replicas_share_each_item_and_all_get_the_weights():
    """Two roles of two processes each: every replica gets every message, does its share, and the whole output
    comes out once, in order."""
    assert replicated_exchange("process") == REPLICATED


@pytest.mark.timeout(180)
def test_ray_replicas_share_each_item_as_processes_do():
    pytest.importorskip("ray")
    assert replicated_exchange("ray") == REPLICATED


@pytest.mark.timeout(120)
def test_ray_actors_a_local_cluster_cannot_place_are_refused(monkeypatch):
    """More one-CPU actors than the machine has CPUs would wait forever: refused before any starts, naming what each
    role asks (no actor is built: the check comes first)."""
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    pipeline = RolePipeline([RoleSpec(Square, replicas=1000), RoleSpec(Count, replicas=2)], "ray")
    with pytest.raises(ValueError, match=r"ask for 1002 CPUs \(square: 1000 x 1, count: 2 x 1\), but this "
                                         r"machine's Ray cluster has \d+; ask for fewer"):
        pipeline.start()


@pytest.mark.parametrize("exit_instead, message", [(False, r"(?s)role 'picky \(replica 1 of 2\)' failed.*"
                                                           r"ArithmeticError: replica 1 cannot handle"),
                                                   (True, r"role 'picky \(replica 1 of 2\)' died")])
@pytest.mark.timeout(120)
def test_a_failing_or_dead_replica_is_named_while_the_first_waits_for_it(exit_instead, message):
    spec = RoleSpec(FailOnSecondReplica, dict(exit_instead=exit_instead), replicas=2)
    with RolePipeline([spec], "process", timeout_s=60) as pipeline:
        pipeline.submit(1)
        with pytest.raises(RoleError, match=message):
            pipeline.receive()


def test_bad_replicas_are_refused():
    with pytest.raises(ValueError, match="role 'square': replicas must be an integer >= 1, got 0"):
        RoleSpec(Square, replicas=0)
    with pytest.raises(ValueError, match=r"role replicas \(square \(2\)\) need processes"):
        RolePipeline([RoleSpec(Square, replicas=2)], "inline")
    with pytest.raises(ValueError, match="grpo.rollout_replicas=2: replicas are processes .* set "
                                         "grpo.async_rollouts=true with grpo.rollout_backend=process or ray"):
        check_replicas("grpo", {"rollout_replicas": 2}, async_rollouts=False, backend="process")
    with pytest.raises(ValueError, match="mopd.teacher_replicas=3"):
        check_replicas("mopd", {"teacher_replicas": 3}, async_rollouts=True, backend="inline")
    with pytest.raises(ValueError, match="mopd.rollout_replicas must be an integer >= 1, got 0"):
        check_replicas("mopd", {"rollout_replicas": 0}, async_rollouts=True, backend="process")
