"""Checks before training: a run that cannot fit fails before it allocates, with its numbers; bf16 on a CPU whose
bf16 matmuls are slow is announced, with both measured rates, before the first step."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from hybridtron.cli import main
from hybridtron.distributed.config import DistConfig
from hybridtron.train import preflight
from hybridtron.train.config import TrainConfig

SLOW_BF16 = (170.0, 8.0)  # (fp32, bf16) GFLOP/s: an AVX2-only EPYC (issue 10, item 20)
FAST_BF16 = (170.0, 160.0)  # AMX or AVX512-BF16


def test_slow_bf16_is_announced_with_both_rates_and_the_alternatives(monkeypatch):
    monkeypatch.setattr(preflight, "bf16_slowdown", lambda: SLOW_BF16)
    message = preflight.bf16_warning("bf16", torch.device("cpu"))
    assert message is not None
    assert "8.0 GFLOP/s against 170.0 in fp32" in message and "21x slower" in message
    assert "train.precision=fp32" in message and "nvfp4" in message and "mxfp8" in message


def test_fast_bf16_and_other_precisions_are_quiet(monkeypatch):
    monkeypatch.setattr(preflight, "bf16_slowdown", lambda: FAST_BF16)
    assert preflight.bf16_warning("bf16", torch.device("cpu")) is None

    def no_probe():
        raise AssertionError("probed although the run is not bf16 on a CPU")

    monkeypatch.setattr(preflight, "bf16_slowdown", no_probe)
    for precision in ("fp32", "nvfp4", "mxfp8"):
        assert preflight.bf16_warning(precision, torch.device("cpu")) is None
    assert preflight.bf16_warning("bf16", torch.device("cuda")) is None, "a GPU is not probed"


def test_the_probe_measures_real_rates():
    fp32, bf16 = preflight.bf16_slowdown()
    assert fp32 > 0 and bf16 > 0


def test_pretrain_prints_the_bf16_warning_before_training(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(preflight, "bf16_slowdown", lambda: SLOW_BF16)
    monkeypatch.setenv("HYBRIDTRON_CACHE", str(tmp_path / "cache"))
    code = main(["pretrain", "--out", str(tmp_path / "run"), "--steps", "1", "--set", "train.precision=bf16",
                 "--set", "data.families=json,text,functional", "--set", "data.seq_len=32", "--set", "data.batch_size=2",
                 "--set", "data.vocab_size=512", "--set", "model.vocab_size=512", "--set", "data.val_batches=1",
                 "--set", "train.warmup_steps=1", "--set", "train.threads=1"])
    assert code == 0
    err = capsys.readouterr().err
    warning = err.index("warning: train.precision=bf16 on a CPU without native bf16 matmuls")
    assert warning < err.index("step 1/1"), "the warning comes before the first step"
    assert warning < err.index("bucket"), "and before the data is built (the mixture table)"


PROBE = """
import re, sys
from hybridtron.train import preflight

measured = preflight.available_memory
preflight.available_memory = lambda device: min(measured(device) or {limit}, {limit})  # a {gib} GiB machine
from hybridtron.cli import main

code = main(sys.argv[1:])
# VmHWM, not getrusage's ru_maxrss: the latter survives exec, so it would report the forking pytest's size
print("peak_rss_kib", re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1), file=sys.stderr)
sys.exit(code)
"""


def test_a_preset_that_cannot_fit_fails_before_allocating(tmp_path):
    """nano3 (32B parameters, about 500 GiB to train) on a 24 GiB machine: exit code 2 and the estimate against
    what is available, before a byte of the model is allocated (the process stays at the size of torch itself)."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PROBE.format(limit=24 << 30, gib=24), "pretrain", "--preset",
                             "nano3", "--out", str(tmp_path / "run"), "--quiet"], capture_output=True, text=True,
                            timeout=120, env={"HYBRIDTRON_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin",
                                                 "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    elapsed = time.perf_counter() - started
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    match = re.search(r"this run needs about ([\d.]+) GiB to train \(([\d.]+)B parameters.*but cpu has ([\d.]+) GiB "
                      r"available; use a smaller preset", result.stderr)
    assert match, result.stderr
    needed, parameters, available = map(float, match.groups())
    assert needed > 400 and 30 < parameters < 35 and available <= 24
    peak_gib = int(re.search(r"peak_rss_kib (\d+)", result.stderr).group(1)) / 2**20
    assert peak_gib < 1.0, f"the process grew to {peak_gib:.2f} GiB: it allocated before refusing"
    assert elapsed < 60
    assert not list((tmp_path / "run").rglob("*.distcp")), "no checkpoint was written"


def test_a_preset_that_cannot_fit_stops_every_torchrun_rank_before_allocating(tmp_path):
    """Under torchrun each rank checks its share of the layout (here FSDP over 2 processes, which share this
    machine's memory): the ranks stop, exit code 2, before the model is built (a rank still checking when another
    has stopped is stopped by torchrun); rank 0 prints the one-line estimate."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "hybridtron", "pretrain", "--preset", "nano3", "--out", str(tmp_path / "run"),
                             "--quiet"], capture_output=True, text=True, timeout=180,
                            env={**os.environ, "HYBRIDTRON_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"})
    assert result.returncode != 0
    errors = re.findall(r"hybridtron pretrain: error: this run needs about ([\d.]+) GiB to train per process in "
                        r"layout dp_replicate=1,dp_shard=2,cp=1,tp=1,pp=1,ep=1,etp=1 \(31.58B parameters.*; "
                        r"([\d.]+) GiB for the 2 processes on this machine\), but cpu has [\d.]+ GiB available",
                        result.stderr)
    assert len(errors) == 1, result.stderr
    codes = re.findall(r"exitcode\s*: (-?\d+)", result.stderr)
    assert "2" in codes and set(codes) <= {"2", "-15"}, result.stderr  # refused, or stopped by torchrun (SIGTERM)
    per_process, both = map(float, errors[0])
    assert per_process > 235 and abs(both - 2 * per_process) < 0.2  # half of nano3's 470 GiB of fp32 state each
    assert "[rank" not in result.stderr, "no rank printed a traceback"
    assert time.perf_counter() - started < 90
    assert not list((tmp_path / "run").rglob("*.distcp"))


def test_a_ranks_share_divides_what_the_layout_divides(small_config):
    config, tokens = small_config(), 4 * 64
    one = preflight.training_memory(config, tokens)
    for layout in ({}, {"tp": 2}, {"ep": 2}):
        share = preflight.training_memory(config, tokens, dist_config=DistConfig(**layout), world=2)
        assert share.state_bytes == pytest.approx(one.state_bytes / 2, rel=1e-6), layout  # FSDP, TP or EP x FSDP
        assert share.activation_bytes < one.activation_bytes * 0.6, layout  # half the rows, or TP's sequence shards
    stage = preflight.training_memory(config, tokens, dist_config=DistConfig(pp=2),
                                      train=TrainConfig(grad_accum=2), world=2)
    assert one.state_bytes / 2 <= stage.state_bytes < one.state_bytes  # the fullest stage holds most
    assert stage.activation_bytes > one.activation_bytes / 2  # 1F1B: stage 0 keeps 2 micro-batches in flight
    recomputed = preflight.training_memory(config, tokens, train=TrainConfig(recompute="full"))
    assert recomputed.activation_bytes < one.activation_bytes and recomputed.state_bytes == one.state_bytes
    bf16 = preflight.training_memory(config, tokens, train=TrainConfig(precision="bf16"))
    assert bf16.activation_bytes == pytest.approx(one.activation_bytes / 2, abs=2)  # fp32 keeps twice the bytes


def test_processes_on_one_machine_share_its_memory_and_a_gpu_keeps_a_reserve(small_config, monkeypatch):
    config = small_config()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(preflight, "available_memory", lambda device: 1 << 20)  # 1 MiB
    with pytest.raises(ValueError, match=r"for the 2 processes on this machine\), but cpu has 0.0 GiB available"):
        preflight.check_memory(config, 256, torch.device("cpu"))
    gpu = preflight.training_memory(config, 256, world=2, device=torch.device("cuda", 0))
    assert gpu.processes == 1 and gpu.reserve_bytes == 4 << 30


def test_the_quickstart_fits():
    """The estimate is an order of magnitude, not a bound; it must not refuse the quickstart on a laptop."""
    from hybridtron.config import preset

    estimate = preflight.training_memory(preset("tiny"), 256 * 8)
    assert estimate.total_bytes < 2 << 30
    assert preflight.check_memory(preset("tiny"), 256 * 8, torch.device("cpu"), "the quickstart") == estimate
