"""Parity with transformers on a trained checkpoint and real text, not only at initialization on random ids.

Training moves some Mamba heads' dt below `time_step_min` (0.001), where transformers' prefill up to 5.24 clamps it
and every other reader (vLLM, Megatron, transformers' own decode step, transformers from 5.25, which clamps at
`time_step_limit`, hybridtron) does not. The HF export writes a `time_step_min` at which that clamp changes nothing
(see `ModelConfig.to_hf`), so the logits agree to fp32 rounding with either transformers.
"""

from __future__ import annotations

import json
import json.decoder
import shutil
from pathlib import Path

import pytest
import torch

from hybridtron.checkpoint import load_pretrained
from hybridtron.config import INIT_TIME_STEP_MIN_KEY
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.model.mamba2 import Mamba2Mixer

transformers = pytest.importorskip("transformers")


def real_text_ids(hf_dir: Path, tokens: int = 256) -> torch.Tensor:
    """The first `tokens` tokens of the standard library's json/decoder.py."""
    tokenizer = Tokenizer.load(hf_dir / "tokenizer.json")
    ids = tokenizer.encode(Path(json.decoder.__file__).read_text())[:tokens]
    assert len(ids) == tokens
    return torch.tensor([ids])


def smallest_dt(model, ids) -> float:
    """The smallest dt any Mamba head computes on `ids`."""
    seen = []
    original = Mamba2Mixer.discretize

    def recording(self, dt_raw):
        dt, A = original(self, dt_raw)
        seen.append(float(dt.min()))
        return dt, A

    Mamba2Mixer.discretize = recording
    try:
        with torch.no_grad():
            model(ids, mtp=False)
    finally:
        Mamba2Mixer.discretize = original
    return min(seen)


def max_logit_difference(hf_dir: Path, ids: torch.Tensor) -> float:
    return logit_difference_and_clamp(hf_dir, ids)[0]


def logit_difference_and_clamp(hf_dir: Path, ids: torch.Tensor) -> tuple[float, float]:
    """(the largest |logit difference| between our model and transformers', the dt floor transformers' prefill
    applies: its mixers' `time_step_limit[0]`, which transformers up to 5.24 set from `time_step_min`)."""
    ours = load_pretrained(hf_dir).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    floors = {float(m.time_step_limit[0]) for m in theirs.modules() if hasattr(m, "time_step_limit")}
    assert len(floors) == 1, floors
    with torch.no_grad():
        return float((ours(ids, mtp=False).logits - theirs(ids).logits).abs().max()), floors.pop()


def test_trained_checkpoint_matches_transformers_on_real_text(trained_run, tmp_path):
    hf_dir = trained_run / "hf"
    ids = real_text_ids(hf_dir)
    model = load_pretrained(hf_dir).eval()
    assert smallest_dt(model, ids) < model.config.time_step_min, "training has not reached the regime under test"
    config = json.loads((hf_dir / "config.json").read_text())
    assert config[INIT_TIME_STEP_MIN_KEY] == model.config.time_step_min == 0.001
    assert max_logit_difference(hf_dir, ids) <= 1e-4

    # the same weights exported with the init value where transformers up to 5.24 reads its clamp: the logits part
    # there; transformers from 5.25 clamps at time_step_limit (0) like every other reader, and agrees either way
    naive = tmp_path / "naive"
    shutil.copytree(hf_dir, naive)
    config["time_step_min"] = config.pop(INIT_TIME_STEP_MIN_KEY)
    (naive / "config.json").write_text(json.dumps(config))
    difference, floor = logit_difference_and_clamp(naive, ids)
    assert floor in (model.config.time_step_min, 0.0)
    assert difference > 1e-3 if floor == model.config.time_step_min else difference <= 1e-4
