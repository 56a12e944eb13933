"""The pretraining job end to end: resumable after kill -9, crash-safe saves, HF export, clear config errors."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybridtron.checkpoint.dcp import CheckpointManager
from hybridtron.checkpoint.hf import load_pretrained
from hybridtron.cli import main as cli_main
from hybridtron.config import HYBRIDTRON_H
from hybridtron.files import METRICS_FILE
from hybridtron.train import pretrain
from hybridtron.train.run import complete_steps

# A small, quick run: a few stdlib families, short rows, tiny batches.
FAST = ["--set", "data.families=json,text,functional", "--set", "data.seq_len=64", "--set", "data.batch_size=4",
        "--set", "data.vocab_size=512", "--set", "model.vocab_size=512", "--set", "train.val_every=6",
        "--set", "data.val_batches=2", "--set", "train.checkpoint_every=3", "--set", "train.warmup_steps=2",
        "--set", "train.threads=1", "--quiet"]


def pretrain_args(out: Path, steps: int, *extra: str) -> list[str]:
    return ["pretrain", "--preset", "tiny", "--out", str(out), "--steps", str(steps), *FAST, *extra]


def pretrain_cmd(out: Path, steps: int, *extra: str) -> list[str]:
    """The same run in a process of its own."""
    return [sys.executable, "-m", "hybridtron.cli", *pretrain_args(out, steps, *extra)]


def run_env(cache: Path) -> dict:
    return {**os.environ, "HYBRIDTRON_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}


def step_records(run_dir: Path) -> dict[int, dict]:
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            records[record["step"]] = record
    return records


DETERMINISTIC = ("loss", "lm_loss", "mtp_loss_1", "mtp_loss_2", "grad_norm", "lr")
KILL_9_STEPS = 12  # long enough that the killed run is past its second checkpoint (every 3 steps) mid-run


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The tokenizer and token caches ($HYBRIDTRON_CACHE) of every run in this module: the runs share their data,
    so the tokenizer is trained once, not once a test."""
    return tmp_path_factory.mktemp("pretrain_cache")


@pytest.fixture(scope="module")
def uninterrupted(cache, tmp_path_factory) -> Path:
    """A 12-step FAST run trained to its end (HF export included) in this process: the kill -9 test's reference and
    the export the transformers test loads."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYBRIDTRON_CACHE", str(cache))
        assert cli_main(pretrain_args(out, KILL_9_STEPS)) == 0
    return out


@pytest.mark.slow
def test_kill_9_then_resume_matches_uninterrupted_run_bit_for_bit(tmp_path, cache, uninterrupted, monkeypatch):
    """The kill needs a real process; the uninterrupted reference and the resume run in this one (same code)."""
    steps, crashed = KILL_9_STEPS, tmp_path / "crashed"
    process = subprocess.Popen(pretrain_cmd(crashed, steps), env=run_env(cache))
    deadline = time.time() + 600
    while time.time() < deadline:  # kill once it is past its second checkpoint, mid-run
        metrics = crashed / "metrics.jsonl"
        if metrics.exists() and any(json.loads(l).get("step", 0) >= 7 for l in metrics.read_text().splitlines()):
            break
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not (crashed / "hf").exists(), "the run finished before it was killed; the test proves nothing"
    assert CheckpointManager(crashed / "checkpoints").latest() is not None

    monkeypatch.setenv("HYBRIDTRON_CACHE", str(cache))
    assert cli_main(pretrain_args(crashed, steps, "--resume")) == 0
    expected, resumed = step_records(uninterrupted), step_records(crashed)
    assert sorted(expected) == list(range(1, steps + 1))
    assert sorted(resumed) == list(range(1, steps + 1)), "every step has exactly one metrics line"
    for step in expected:
        for key in DETERMINISTIC:
            assert resumed[step][key] == expected[step][key], f"step {step} {key}"


@pytest.mark.slow
def test_hf_export_loads_in_transformers_with_equal_logits(uninterrupted):
    transformers = pytest.importorskip("transformers")
    from hybridtron.checkpoint import load_pretrained

    hf = uninterrupted / "hf"
    ours = load_pretrained(hf).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert (hf / "tokenizer.json").is_file()
    ids = torch.randint(3, 512, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids).logits - theirs(ids).logits).abs().max() <= 1e-4


def test_crash_during_save_leaves_last_good_checkpoint_loadable(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path / "ckpt", keep=2)
    model = torch.nn.Linear(4, 4)
    manager.save(1, {"model": model.state_dict()}, {"step": 1}, blocking=True)
    saved_weight = model.weight.detach().clone()

    import torch.distributed.checkpoint as dcp
    real_save = dcp.save

    def crash_midway(state, checkpoint_id):
        real_save(state, checkpoint_id=checkpoint_id)  # files written, but the save dies before it completes
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", crash_midway)
    with torch.no_grad():
        model.weight.add_(1.0)
    manager.save(2, {"model": model.state_dict()}, {"step": 2})
    with pytest.raises(OSError, match="disk full"):
        manager.wait()
    monkeypatch.setattr(dcp, "save", real_save)

    latest = manager.latest()
    assert latest is not None and latest.name == "step_000001"
    assert any(p.name.startswith("step_000002.tmp") for p in manager.directory.iterdir())
    restored = {"model": torch.nn.Linear(4, 4).state_dict()}
    state = manager.load(latest, restored)
    assert state["step"] == 1
    assert torch.equal(restored["model"]["weight"], saved_weight)
    manager.remove_incomplete()
    assert [p.name for p in manager.directory.iterdir()] == ["step_000001"]


def test_keep_last_k_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in range(1, 5):
        manager.save(step, {"x": torch.tensor([float(step)])}, {"step": step})
    manager.close()
    assert [p.name for p in manager.list()] == ["step_000003", "step_000004"]


def test_run_config_overrides_and_toml(tmp_path, pretrain_config):
    toml = tmp_path / "run.toml"
    toml.write_text('[train]\nlr = 1e-3\nsteps = 7\n[data]\nseq_len = 32\n[model]\nhidden_size = 128\n')
    config = pretrain_config("train.lr=3e-4", "data.families=json,csv", "train.grad_accum=2", config=toml)
    assert config.train.lr == 3e-4 and config.train.steps == 7 and config.train.grad_accum == 2
    assert config.data.seq_len == 32 and config.data.families == ("json", "csv")
    assert config.model.hidden_size == 128


@pytest.mark.parametrize("args, message", [
    (["--set", "train.nope=1"], "unknown train fields ['nope']"),
    (["--set", "optim.lr=1"], "unknown section 'optim'"),
    (["--set", "train.lr"], "expected SECTION.FIELD=VALUE"),
    (["--set", "train.grad_accum=many"], "train.grad_accum: expected int"),
    (["--set", "model.mamba_num_heads=5"], "mamba_num_heads (5) must be divisible by n_groups"),
    (["--set", "train.precision=fp8"], "train.precision must be one of"),
    (["--set", "data.source=/no/such/path"], "no such file or directory"),
])
def test_bad_overrides_and_data_paths_give_clear_errors(tmp_path, capsys, args, message):
    code = cli_main(["pretrain", "--out", str(tmp_path / "run"), "--steps", "1", *args, "--quiet"])
    assert code == 2
    assert message in capsys.readouterr().err


def test_bad_toml_gives_clear_error(tmp_path, capsys):
    toml = tmp_path / "bad.toml"
    toml.write_text("[train\nlr = 3")
    assert cli_main(["pretrain", "--out", str(tmp_path / "run"), "--config", str(toml)]) == 2
    assert "bad.toml: invalid TOML" in capsys.readouterr().err
    assert cli_main(["pretrain", "--out", str(tmp_path / "run"), "--config", str(tmp_path / "none.toml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_resume_without_a_run_is_an_error(tmp_path, capsys):
    assert cli_main(["pretrain", "--out", str(tmp_path / "empty"), "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        cli_main(["pretrain", "--help"])
    text = capsys.readouterr().out
    for option in ("--preset", "--out", "--steps", "--config", "--set", "--resume"):
        assert option in text


@pytest.mark.parametrize("precision", ["fp32", "nvfp4"])
def test_resume_continues_bit_for_bit_including_stochastic_rounding(tmp_path, cache, monkeypatch, precision):
    """A run stopped after 3 steps and resumed to 6 equals a 6-step run (constant LR after warmup, so the
    schedule does not depend on the total); under NVFP4 this needs the SR generators' state in the checkpoint."""
    monkeypatch.setenv("HYBRIDTRON_CACHE", str(cache))
    common = [*FAST, "--set", "train.decay_fraction=0", "--set", f"train.precision={precision}",
              "--set", "data.seq_len=32", "--set", "data.batch_size=2"]
    assert cli_main(["pretrain", "--out", str(tmp_path / "whole"), "--steps", "6", *common]) == 0
    assert cli_main(["pretrain", "--out", str(tmp_path / "split"), "--steps", "3", *common]) == 0
    assert cli_main(["pretrain", "--out", str(tmp_path / "split"), "--steps", "6", "--resume", *common]) == 0
    whole, split = step_records(tmp_path / "whole"), step_records(tmp_path / "split")
    assert sorted(split) == list(range(1, 7))
    for step in range(1, 7):
        for key in DETERMINISTIC:
            assert split[step][key] == whole[step][key], f"step {step} {key}"


def test_a_run_the_monitor_gives_up_on_stops_with_a_message_not_a_traceback(tmp_path, cache, monkeypatch, capsys):
    monkeypatch.setenv("HYBRIDTRON_CACHE", str(cache))
    faults = ["--set", "monitor.on_nonfinite=rollback", "--set", "monitor.max_rollbacks=1",
              "--set", "monitor.inject_fault=nan_grad@2,nan_grad@3"]
    code = cli_main(["pretrain", "--out", str(tmp_path / "run"), "--steps", "4", *FAST, *faults])
    err = capsys.readouterr().err
    assert code == 3
    assert "hybridtron pretrain: stopped: step 3: still unstable after 1 rollbacks" in err
    assert "Traceback" not in err
    assert (tmp_path / "run" / "checkpoints" / "step_000000").is_dir(), "the GOOD initialization is kept"


def test_the_hf_export_is_whole_before_any_rank_returns(tmp_path, monkeypatch, small_config):
    """Under torchrun global rank 0 writes the export and the others wait at a barrier, then read it (the MOPD
    warmup's student): weights and tokenizer files are all there when the barrier opens (the tokenizer files were
    once written after it, and a pipeline stage failed to find them)."""
    from types import SimpleNamespace

    from hybridtron.data.tokenizer import Tokenizer
    from hybridtron.model.lm import HybridLM
    from hybridtron.train import run
    from hybridtron.train.run import export_model

    hf_dir = tmp_path / "hf"
    at_barrier = []

    class MainRank:
        is_main = True

        def barrier(self):
            at_barrier.append(sorted(path.name for path in hf_dir.iterdir()))

    # the gathered shards (patched where the scaffold looks the gather up)
    monkeypatch.setattr(run, "full_state_dict", lambda model, parallel: model.state_dict())
    trainer = SimpleNamespace(model=HybridLM(small_config(vocab_size=640)), parallel=MainRank())
    tokenizer = Tokenizer.train(["What is 2 + 3? The answer is 5.\n" * 50], 600)
    assert export_model(trainer, hf_dir, tokenizer, model_max_length=256)
    assert len(at_barrier) == 1
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= set(at_barrier[0])
    assert any(name.endswith(".safetensors") for name in at_barrier[0])


def test_pretraining_without_held_out_documents_trains_without_validation(cache, tmp_path, capsys):
    """data.val_fraction = 0 ("no validation", as its error message offers) trains and says nothing of a val loss."""
    overrides = ["data.families=json", "data.vocab_size=512", "model.vocab_size=512", "data.seq_len=32",
                 "data.batch_size=2", "data.val_fraction=0", f"data.cache_dir={cache}"]
    args = argparse.Namespace(preset="tiny", out=str(tmp_path / "run"), steps=2, config=None, overrides=overrides,
                              resume=False, quiet=True, print_config=False)
    assert pretrain.run(args) == 0
    assert "validation loss" not in capsys.readouterr().out
    assert not any("val_loss" in line for line in (tmp_path / "run" / METRICS_FILE).read_text().splitlines())


def test_a_run_with_an_option_nemotron_h_cannot_express_exports_in_hybridtrons_format(cache, tmp_path, capsys):
    """moe_output_norm (a Marin option): the run finishes, its hf/ is model_type hybridtron_h (said in one line) and
    loads here with the trained weights; the run counts as complete."""
    overrides = ["data.families=json", "data.vocab_size=512", "model.vocab_size=512", "data.seq_len=32",
                 "data.batch_size=2", "data.val_fraction=0", "model.moe_output_norm=true",
                 f"data.cache_dir={cache}"]
    args = argparse.Namespace(preset="tiny", out=str(tmp_path / "run"), steps=2, config=None, overrides=overrides,
                              resume=False, quiet=True, print_config=False)
    assert pretrain.run(args) == 0
    assert "hybridtron's own format" in capsys.readouterr().err
    hf = tmp_path / "run" / "hf"
    assert json.loads((hf / "config.json").read_text())["model_type"] == HYBRIDTRON_H
    assert load_pretrained(hf).config.moe_output_norm
    assert complete_steps(tmp_path / "run") == 2
