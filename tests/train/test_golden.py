"""Golden loss curve: the quickstart's first steps (`hybridtron pretrain --preset tiny`, the default data and
config) give exactly the recorded per-step losses. A refactor that does not change the math keeps them bit for
bit; a change of the math must re-record them (`python tests/train/test_golden.py`) and say why in docs/LOG.md.

Bit-identity holds on the CPU the curve was recorded on, with one intra-op thread (as the whole suite runs, see
tests/conftest.py; the thread count changes how MKL splits its sums): other instruction sets (AVX2 against AVX-512
or AMX) take other MKL kernels, whose fp32 sums round differently, so there the curve must agree to
GOLDEN_REL_TOLERANCE.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).with_name("golden_quickstart.json")
STEPS = 12
KEYS = ("loss", "lm_loss", "mtp_loss_1", "mtp_loss_2", "grad_norm")
GOLDEN_REL_TOLERANCE = 1e-4


def cpu_signature() -> str:
    """The CPU features that choose MKL's fp32 kernels."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    present = set(flags.split(":", 1)[1].split())
    return ",".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in present)


def quickstart_losses(out: Path) -> dict[int, dict[str, float]]:
    from hybridtron.train import pretrain
    from hybridtron.train.loop import Trainer

    train = Trainer.train
    try:  # the quickstart's own schedule (400 steps), stopped after STEPS
        Trainer.train = lambda self, until=None: train(self, until=STEPS)
        pretrain.run(argparse.Namespace(preset="tiny", out=str(out), steps=None, config=None, overrides=[],
                                        resume=False, quiet=True, print_config=False))
    finally:
        Trainer.train = train
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: r[k] for k in KEYS} for r in records if "loss" in r}


@pytest.mark.slow
def test_quickstart_losses_match_the_golden_curve(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    losses = quickstart_losses(tmp_path / "run")
    assert sorted(losses) == list(range(1, STEPS + 1))
    exact = golden["cpu"] == cpu_signature()
    for step, values in losses.items():
        for key, value in values.items():
            expected = golden["steps"][str(step)][key]
            if exact:
                assert value == expected, f"step {step} {key}: {value!r} != golden {expected!r}"
            else:
                assert value == pytest.approx(expected, rel=GOLDEN_REL_TOLERANCE), f"step {step} {key}"


if __name__ == "__main__":  # re-record
    import tempfile

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        steps = quickstart_losses(Path(directory) / "run")
    GOLDEN.write_text(json.dumps({"cpu": cpu_signature(), "steps": {str(k): v for k, v in steps.items()}},
                                 indent=1) + "\n")
    print(f"recorded {len(steps)} steps on a CPU with {cpu_signature()} into {GOLDEN}", file=sys.stderr)
