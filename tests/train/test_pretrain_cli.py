"""`hybridtron pretrain` as a new user meets it: running the quickstart twice, `--print-config` and `--config`
(TOML or a run's run_config.json), the example config in configs/, and the TensorBoard files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hybridtron.cli import main
from hybridtron.train.config import RunConfig, tomllib

ROOT = Path(__file__).resolve().parents[2]
# A quick run: a few stdlib families, short rows, tiny batches, 2 steps.
FAST = ["--steps", "2", "--set", "data.families=json,text,functional", "--set", "data.seq_len=64",
        "--set", "data.batch_size=4", "--set", "data.vocab_size=512", "--set", "model.vocab_size=512",
        "--set", "data.val_batches=2", "--set", "train.warmup_steps=1", "--set", "train.threads=1", "--quiet"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-step run that trained to its end and wrote its HF export; tests copy it before changing it."""
    root = tmp_path_factory.mktemp("pretrain_cli")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HYBRIDTRON_CACHE", str(root / "cache"))
        assert main(["pretrain", "--out", str(root / "run"), *FAST]) == 0
    return root / "run"


@pytest.fixture
def cache(finished_run, monkeypatch):
    """The same tokenizer and token cache as the finished run (so nothing is trained twice)."""
    monkeypatch.setenv("HYBRIDTRON_CACHE", str(finished_run.parent / "cache"))


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_running_a_finished_run_again_says_it_is_complete(finished_run, cache, capsys):
    before = snapshot(finished_run)
    assert main(["pretrain", "--out", str(finished_run), *FAST]) == 0
    out = capsys.readouterr().out
    assert f"{finished_run}: this run is complete (2 steps); nothing to do." in out
    assert f"To train it further: hybridtron pretrain --out {finished_run} --resume --steps N (N > 2)" in out
    assert f"HF export:   {finished_run / 'hf'}" in out and "metrics:" in out and "checkpoints:" in out
    assert snapshot(finished_run) == before, "nothing in the run directory changed"


def test_an_unfinished_run_is_continued_only_with_resume(finished_run, cache, tmp_path, capsys):
    """A run that stopped after its last checkpoint but before its HF export (a crash, a kill): the same command
    refuses it and names --resume; --resume finishes it."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    shutil.rmtree(run_dir / "hf")
    assert main(["pretrain", "--out", str(run_dir), *FAST]) == 2
    err = capsys.readouterr().err
    assert f"hybridtron pretrain: error: {run_dir}: holds an unfinished run (checkpoint step_000002)" in err
    assert "pass --resume to continue it, or choose another --out" in err
    assert "Traceback" not in err
    assert main(["pretrain", "--out", str(run_dir), *FAST, "--resume"]) == 0
    assert (run_dir / "hf" / "config.json").is_file()
    capsys.readouterr()
    assert main(["pretrain", "--out", str(run_dir), *FAST]) == 0
    assert "this run is complete" in capsys.readouterr().out


def test_a_run_saved_before_tokenizer_digits_existed_resumes_with_merged_digits(cache, tmp_path, capsys):
    """A run_config.json written before `data.tokenizer_digits` existed ran with GPT-2's merged digits: a resume
    keeps them (with today's default its data would not match its loader state), and a new run from it too."""
    run_dir = tmp_path / "old"
    assert main(["pretrain", "--out", str(run_dir), *FAST, "--set", "data.tokenizer_digits=merged"]) == 0
    saved = json.loads((run_dir / "run_config.json").read_text())
    del saved["data"]["tokenizer_digits"]
    (run_dir / "run_config.json").write_text(json.dumps(saved))
    assert RunConfig.load(run_dir / "run_config.json").data.tokenizer_digits == "merged"
    assert RunConfig().data.tokenizer_digits == "individual"
    steps = [arg if arg != "2" else "3" for arg in FAST]
    assert main(["pretrain", "--out", str(run_dir), *steps, "--resume"]) == 0, capsys.readouterr().err
    assert json.loads((run_dir / "run_config.json").read_text())["data"]["tokenizer_digits"] == "merged"


def test_tensorboard_event_files_are_written(finished_run):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    files = list((finished_run / "tensorboard").glob("events.out.tfevents.*"))
    assert files, f"no event file in {finished_run / 'tensorboard'}"
    events = event_accumulator.EventAccumulator(str(finished_run / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"loss", "lm_loss", "grad_norm", "val_loss"} <= set(scalars), scalars
    assert [event.step for event in events.Scalars("loss")] == [1, 2]
    metrics = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert events.Scalars("loss")[-1].value == pytest.approx(metrics[-1]["loss"], rel=1e-6)


def print_config(capsys, *args: str) -> str:
    capsys.readouterr()
    assert main(["pretrain", *args, "--print-config"]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("preset", ["tiny", "nano3"])
def test_print_config_is_a_toml_file_that_config_reads_back(preset, tmp_path, capsys, pretrain_config):
    text = print_config(capsys, "--preset", preset, "--set", "train.lr=1e-3", "--set", "data.families=json")
    path = tmp_path / "run.toml"
    path.write_text(text)
    expected = pretrain_config("train.lr=1e-3", "data.families=json", preset=preset)
    assert pretrain_config(config=path) == expected, "the file carries the whole model, whatever --preset"
    assert print_config(capsys, "--config", str(path)) == text
    assert "# peak learning rate" in text and "[monitor]" in text, "fields come with their comments"


def test_a_runs_run_config_json_is_accepted_by_config(finished_run, capsys, pretrain_config):
    saved = finished_run / "run_config.json"
    text = print_config(capsys, "--config", str(saved))
    assert text == RunConfig.load(saved).to_toml()
    assert pretrain_config(config=saved) == RunConfig.load(saved)
    assert RunConfig.load(saved).train.steps == 2 and RunConfig.load(saved).model.vocab_size == 512


def test_the_example_config_is_the_quickstarts(capsys, pretrain_config):
    """configs/tiny.toml: what `--print-config` prints for the quickstart, every field of every section in it."""
    path = ROOT / "configs" / "tiny.toml"
    assert pretrain_config(config=path) == pretrain_config()
    written = tomllib.loads(path.read_text())
    expected = tomllib.loads(print_config(capsys, "--preset", "tiny"))
    assert {section: sorted(values) for section, values in written.items()} == \
        {section: sorted(values) for section, values in expected.items()}, \
        "regenerate it: hybridtron pretrain --preset tiny --print-config > configs/tiny.toml"
