"""Checks before training: a run that cannot fit fails before it allocates, with its numbers; bf16 on a CPU whose
bf16 matmuls are slow is announced, with both measured rates, before the first step."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import torch

from hybridtron.cli import main
from hybridtron.train import preflight

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
                            timeout=120, env={"HYBRIDTRON_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"})
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


def test_the_quickstart_fits():
    """The estimate is an order of magnitude, not a bound; it must not refuse the quickstart on a laptop."""
    from hybridtron.config import preset

    estimate = preflight.training_memory(preset("tiny"), 256 * 8)
    assert estimate.total_bytes < 2 << 30
    assert preflight.check_memory(preset("tiny"), 256 * 8, torch.device("cpu"), "the quickstart") == estimate
