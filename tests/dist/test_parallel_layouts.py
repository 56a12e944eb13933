"""Every parallel layout trains exactly as one process does on the same global batches: FSDP2, TP (with sequence
parallelism), EP (dropless and capacity-limited), PP (1F1B and interleaved) and PP x TP, with activation
checkpointing and compile composed in, 10 steps each on gloo,
losses and gradient norms equal to 1e-5 (fp32) and expert counts equal (DP x TP x EP: test_dist_checkpoints.py). One torchrun job per world size runs all of
its layouts (tests/dist/layout_worker.py); the reference is computed here, in this process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import layout_worker

WORKER = Path(__file__).with_name("layout_worker.py")
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reference():
    return layout_worker.train(None)


def run_layouts(tmp_path: Path, world: int, layouts: list[str], timeout: int) -> dict:
    out = tmp_path / f"world{world}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               str(WORKER), str(out), *layouts]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def assert_same_run(steps: list[dict], reference: list[dict], layout: str) -> None:
    assert len(steps) == len(reference) == layout_worker.STEPS
    for step, (got, want) in enumerate(zip(steps, reference), start=1):
        assert got["losses"].keys() == want["losses"].keys()
        for key in want["losses"]:
            assert abs(got["losses"][key] - want["losses"][key]) <= TOLERANCE, (layout, step, key)
        assert abs(got["grad_norm"] - want["grad_norm"]) <= TOLERANCE, (layout, step)
        assert got["tokens"] == want["tokens"]
        assert got["expert_counts"] == want["expert_counts"], (layout, step)


# recompute and compile compose with the layouts (compiled with aot_eager: the tracing, not the code generation)
WORLD_2 = ["dp_shard=2", "tp=2", "ep=2", "pp=2", "pp=2,pp_schedule=interleaved-1f1b",
           "tp=2,recompute=full,compile=aot_eager", "ep=2,recompute=selective", "ep=2,ep_capacity_factor=8.0",
           "ep=2,ep_capacity_factor=0.5"]


@pytest.mark.timeout(300)
def test_layouts_on_two_processes_match_one_process(tmp_path, reference):
    results = run_layouts(tmp_path, 2, WORLD_2, timeout=280)
    for layout in WORLD_2[:-1]:  # a capacity of 8x the mean load drops nothing: the dropless run exactly
        assert_same_run(results[layout], reference, layout)
    assert all(value == 0.0 for step in results["ep=2,ep_capacity_factor=8.0"] for value in step["signals"].values())
    capped = results["ep=2,ep_capacity_factor=0.5"]  # half the mean load per expert: rows are dropped and counted
    dropped = [value for step in capped for value in step["signals"].values()]
    assert dropped and all(0.0 < value < 1.0 for value in dropped)
    assert all(math.isfinite(step["losses"]["loss"]) for step in capped)
    assert capped[-1]["losses"]["loss"] != reference[-1]["losses"]["loss"]


# DP 2 x TP 2 x EP 2 on 4 processes runs end to end, against one process, in test_dist_checkpoints.py
WORLD_4 = ["pp=2,tp=2"]


@pytest.mark.timeout(300)
def test_pipeline_with_tensor_parallel_stages_on_four_processes_matches_one_process(tmp_path, reference):
    results = run_layouts(tmp_path, 4, WORLD_4, timeout=280)
    for layout in WORLD_4:
        assert_same_run(results[layout], reference, layout)
