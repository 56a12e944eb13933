"""`dist.offload_optimizer`: FSDP2's CPUOffloadPolicy on every FSDP group. On gloo the offloaded run trains bit for
bit as the same layout without it, and as one process to 1e-5, under DP, TP x EP and PP; every FSDP parameter is
offloaded (`FSDPParam.offload_to_cpu`) and its shard, gradient and AdamW state are host tensors. The planner's
per-GPU bytes of master weights, gradients and Adam moments are the measured bytes of each rank's state, and with
the offload it moves exactly those bytes from the device's total to the host. On a CPU the offload moves nothing
(the device is the host); what only a GPU shows (pinned memory, the host-device copies, the memory they free) is
scripts/gpu_check.sh's. A process without FSDP, and NCCL alone for host tensors, are refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import layout_worker
from hybridtron.distributed.config import DistConfig
from hybridtron.distributed.costs import GiB, cluster_for
from hybridtron.distributed.layout import Layout, Workload
from hybridtron.distributed.mesh import check_run_layout
from hybridtron.distributed.plan import estimate, format_estimate
from hybridtron.train.preflight import training_memory
from test_parallel_layouts import assert_same_run

WORKER = Path(__file__).with_name("offload_worker.py")
STEPS = 3
PLAIN = f"dp_shard=2,steps={STEPS}"
OFFLOADED = {f"{layout},offload_optimizer=1,steps={STEPS}": layout for layout in ("dp_shard=2", "tp=2,ep=2", "pp=2")}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("offload") / "results.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
               str(out), PLAIN, *OFFLOADED]
    done = subprocess.run(command, capture_output=True, text=True, timeout=150,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(180)
def test_offloaded_layouts_train_as_without_offload(results):
    plain, offloaded = results[PLAIN], results[f"dp_shard=2,offload_optimizer=1,steps={STEPS}"]
    assert [(s["losses"], s["grad_norm"]) for s in offloaded["steps"]] == \
        [(s["losses"], s["grad_norm"]) for s in plain["steps"]]  # the same arithmetic, bit for bit
    reference = layout_worker.train(None, STEPS)
    for layout in OFFLOADED:
        assert_same_run(results[layout]["steps"], reference, layout)
    assert "optimizer offload: FSDP2's CPU offload path, no memory moved" in offloaded["describe"]
    assert "offload" not in plain["describe"]


@pytest.mark.timeout(180)
def test_the_offloaded_state_is_on_the_host_and_is_what_the_planner_counts(results):
    config = layout_worker.model_config()
    cluster = cluster_for("h100", 2, gpus_per_node=2, nvlink_domain=2)
    sizes = dict(seq_len=layout_worker.SEQ, micro_batch=layout_worker.BATCH // 2,
                 tokens_per_iter=layout_worker.SEQ * layout_worker.BATCH * layout_worker.GRAD_ACCUM)
    assert {flag for rank in results[PLAIN]["ranks"] for flag in rank["offload_to_cpu"]} == {False}
    for text, layout_text in OFFLOADED.items():
        ranks = results[text]["ranks"]
        assert {flag for rank in ranks for flag in rank["offload_to_cpu"]} == {True}, text
        assert {where for rank in ranks for kind in rank["bytes"].values() for where in kind} == {"cpu"}, text
        # the fullest rank's state (the first pipeline stage's under PP) in bytes, per kind
        measured = {kind: max(sum(rank["bytes"][kind].values()) for rank in ranks)
                    for kind in ("master", "grads", "moments")}
        layout = Layout.parse(layout_text, 2)
        kept = estimate(config, cluster, Workload(**sizes), layout).memory
        moved = estimate(config, cluster, Workload(**sizes, offload_optimizer=True), layout).memory
        assert (kept.master_weights * GiB, kept.gradients * GiB, kept.optimizer * GiB) == \
            pytest.approx((measured["master"], measured["grads"], measured["moments"]), rel=1e-12), text
        assert moved.master_weights == moved.gradients == moved.optimizer == 0
        assert moved.host * GiB == pytest.approx(sum(measured.values()), rel=1e-12), text
        assert (kept.total - moved.total) * GiB == pytest.approx(sum(measured.values()), rel=1e-9), text
    # the same state as without the offload, byte for byte
    assert results[f"dp_shard=2,offload_optimizer=1,steps={STEPS}"]["ranks"] == \
        [{**rank, "offload_to_cpu": [True]} for rank in results[PLAIN]["ranks"]]


def test_the_planner_prints_the_host_memory():
    config, cluster = layout_worker.model_config(), cluster_for("h100", 2, gpus_per_node=2, nvlink_domain=2)
    workload = Workload(seq_len=32, tokens_per_iter=256, micro_batch=2, offload_optimizer=True)
    text = format_estimate(estimate(config, cluster, workload, Layout(dp_shard=2)), config, cluster, workload, "t")
    assert "host memory per GPU" in text and "(offloaded to the host)" in text


def test_the_preflight_memory_check_leaves_the_offloaded_state_off_a_gpu():
    config, offload = layout_worker.model_config(), DistConfig(offload_optimizer=True)
    on_gpu = training_memory(config, 256, dist_config=offload, world=2, device=torch.device("cuda", 0))
    on_cpu = training_memory(config, 256, dist_config=offload, world=2)
    assert on_gpu.state_bytes == 0
    assert on_cpu.state_bytes == training_memory(config, 256, world=2).state_bytes > 0  # the CPU is the host


def test_a_process_without_fsdp_and_nccl_alone_are_refused(monkeypatch):
    for name in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"^dist.offload_optimizer=true: the offload is FSDP2's, and this process "
                                         r"trains without FSDP .* launch it with torchrun"):
        check_run_layout(DistConfig(offload_optimizer=True), layout_worker.model_config(), 1, batch_size=4,
                         grad_accum=1, seq_len=32)
    with pytest.raises(ValueError, match=r"^dist.offload_optimizer=true with dist.backend=nccl: .* use "
                                         r"dist.backend=auto"):
        DistConfig(offload_optimizer=True, backend="nccl").validate()


@pytest.mark.timeout(60)
def test_the_command_refuses_before_writing(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "hybridtron", "pretrain", "--preset", "tiny", "--out", str(out),
                           "--set", "dist.offload_optimizer=true"], capture_output=True, text=True, timeout=50,
                          env={k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "TORCHELASTIC_RUN_ID")})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "hybridtron pretrain: error: dist.offload_optimizer=true: the offload is FSDP2's, and this process trains "
        "without FSDP (a plain process, or one torchrun process on CPU with dist.backend=auto); launch it with "
        "torchrun (one process per GPU; on a CPU with dist.backend=gloo)"]
    assert not out.exists()
