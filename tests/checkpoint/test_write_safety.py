"""Writing a checkpoint never deletes what hybridtron did not write, for every writer: `hybridtron quantize`,
`convert` (both ways), `slice`, a run's export and `save_pretrained`. A directory holding anything else is refused
and left as it was; an existing checkpoint is replaced only when asked (`--overwrite`, `overwrite=True`), and then
only its own files (a user's file beside it survives); an output that is, lies inside or holds the checkpoint being
read is refused before anything is written; a failure mid-save leaves the old checkpoint whole."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hybridtron.checkpoint import hf
from hybridtron.checkpoint.hf import load_pretrained, save_pretrained
from hybridtron.cli import main
from hybridtron.data.chat import save_tokenizer_files
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.distributed.convert import load_dcp_model
from hybridtron.distributed.mesh import Parallel
from hybridtron.files import METRICS_FILE, RUN_CONFIG
from hybridtron.model.lm import HybridLM
from hybridtron.train.run import export_model

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 20 for i in range(40)]
STEP = "checkpoints/step_000010"


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(TEXTS, 512)


@pytest.fixture
def run(tmp_path, small_config, tokenizer):
    """A run directory as `hybridtron pretrain` leaves it, in small: hf/ (with the tokenizer), a DCP step, its
    run_config.json (whose [data], a small JSONL, calibrates `quantize`) and metrics."""
    run = tmp_path / "run"
    config = small_config(vocab_size=512)
    model = HybridLM(config)
    save_pretrained(model, run / "hf")
    save_tokenizer_files(tokenizer, run / "hf")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(run / STEP))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    data = {"source": [str(tmp_path / "docs.jsonl")], "seq_len": 32, "val_fraction": 0.5,
            "cache_dir": str(tmp_path / "cache")}
    (run / RUN_CONFIG).write_text(json.dumps({"model": config.to_hf(), "train": {}, "data": data}))
    (run / METRICS_FILE).write_text('{"step": 1, "loss": 6.2}\n')
    return run


# each command that writes a checkpoint: (its argv without the output, the output's option, the input's option,
# the checkpoint it reads, relative to the run directory; `--model RUN` reads RUN/hf)
COMMANDS = {
    "quantize": (lambda run: ["quantize", "--model", str(run), "--format", "fp8", "--calib", "2"], "--out",
                 "--model", "hf"),
    "slice": (lambda run: ["slice", "--model", str(run), "--layers", "4"], "--out", "--model", "hf"),
    "convert-dcp-to-hf": (lambda run: ["convert", "--from", str(run / STEP)], "--to", "--from", STEP),
    "convert-hf-to-dcp": (lambda run: ["convert", "--from", str(run / "hf")], "--to", "--from", "hf"),
}


def write(command: str, run: Path, out: Path, *extra: str) -> int:
    argv, option, _, _ = COMMANDS[command]
    return main([*argv(run), option, str(out), *extra])


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every entry under `root`: a file's bytes, a directory as None."""
    return {str(path.relative_to(root)): None if path.is_dir() else path.read_bytes() for path in root.rglob("*")}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def assert_loads(command: str, out: Path) -> None:
    if command == "convert-hf-to-dcp":
        load_dcp_model(out)
    else:
        load_pretrained(out)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_directory_holding_something_else_is_refused_and_left_as_it_was(command, run, tmp_path, capsys):
    option = COMMANDS[command][1]
    mine = tmp_path / "mine"
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "notes.txt").write_text("kept")
    copy = shutil.copytree(run, tmp_path / "copy_of_run")  # the case: a run directory lost its all
    for out, listed in ((mine, "checkpoints/, notes.txt"),
                        (copy, f"checkpoints/, hf/, {METRICS_FILE}, {RUN_CONFIG}")):
        before = snapshot(out)
        for extra in ([], ["--overwrite"]):  # --overwrite replaces a checkpoint, never anything else
            assert write(command, run, out, *extra) == 2
            assert one_error_line(capsys).endswith(f"error: {option} {out} is not empty and holds no checkpoint "
                                                   f"({listed}): choose an empty or new directory")
            assert snapshot(out) == before
    (tmp_path / "file").write_text("a file")
    assert write(command, run, tmp_path / "file") == 2
    assert f"{option} {tmp_path / 'file'} is a file, not a directory" in one_error_line(capsys)


@pytest.mark.parametrize("command", COMMANDS)
def test_an_existing_checkpoint_is_replaced_only_with_overwrite_and_a_users_file_survives(command, run, tmp_path,
                                                                                         capsys):
    option, out = COMMANDS[command][1], tmp_path / "out"
    out.mkdir()  # an empty directory is a new one
    assert write(command, run, out) == 0
    (out / "notes.txt").write_text("mine")
    (out / "extra").mkdir()
    (out / "extra" / "eval.json").write_text("{}")
    stale = out / "model-00009-of-00009.safetensors"  # a shard of an older, sharded checkpoint
    stale.write_bytes(b"stale")
    before = snapshot(out)

    assert write(command, run, out) == 2
    line = one_error_line(capsys)
    assert f"{option} {out} already holds a checkpoint (" in line
    assert "pass --overwrite to replace its checkpoint files (the other files there are kept)" in line
    assert snapshot(out) == before

    capsys.readouterr()
    assert write(command, run, out, "--overwrite") == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "extra" / "eval.json").read_text() == "{}"
    assert not stale.exists(), "the old checkpoint's files are all replaced"
    assert_loads(command, out)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging or old directory left"


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_that_is_inside_or_holds_the_input_is_refused_before_anything_is_written(command, run, capsys):
    _, option, reading, read = COMMANDS[command]
    source = run / read
    before = snapshot(run)
    for out, relation in ((source, "is"), (source / "sub", "is inside"), (source.parent, "holds"), (run, "holds")):
        for extra in ([], ["--overwrite"]):
            assert write(command, run, out, *extra) == 2
            assert f"{option} {out} {relation} {reading} {source}, the checkpoint being read" in \
                one_error_line(capsys)
            assert snapshot(run) == before


def test_quantize_over_its_own_run_directory_says_so_and_deletes_nothing(run, capsys):
    """The issue's case: `--out` equal to `--model` wiped the source, then failed with ZeroDivisionError."""
    before = snapshot(run)
    assert main(["quantize", "--model", str(run), "--format", "fp8", "--out", str(run), "--overwrite"]) == 2
    assert f"--out {run} holds --model {run / 'hf'}" in one_error_line(capsys)
    assert snapshot(run) == before


def test_slice_reads_a_run_directory_and_points_a_training_checkpoint_at_convert(run, tmp_path, capsys):
    assert main(["slice", "--model", str(run), "--layers", "4", "--out", str(tmp_path / "slice")]) == 0
    assert load_pretrained(tmp_path / "slice").config.num_hidden_layers == 4
    assert (tmp_path / "slice" / "tokenizer.json").read_bytes() == (run / "hf" / "tokenizer.json").read_bytes()
    assert main(["slice", "--model", str(run / STEP), "--layers", "4", "--out", str(tmp_path / "x")]) == 2
    line = one_error_line(capsys)
    assert "is a training checkpoint (DCP)" in line and f"hybridtron convert --from {run / STEP}" in line
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------------- a run's export
def test_a_runs_export_replaces_its_own_and_keeps_a_users_file(run, small_config, tokenizer):
    """The run owns hf/: a resumed run re-exports over it; a file the user put there stays."""
    hf_dir = run / "hf"
    (hf_dir / "notes.txt").write_text("mine")
    model = HybridLM(small_config(vocab_size=512))
    assert export_model(SimpleNamespace(model=model, parallel=Parallel.single_process()), hf_dir, tokenizer)
    exported = load_pretrained(hf_dir).state_dict()
    assert all(torch.equal(exported[name], tensor) for name, tensor in model.state_dict().items())
    assert (hf_dir / "notes.txt").read_text() == "mine"
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {p.name for p in hf_dir.iterdir()}
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "hf", METRICS_FILE, RUN_CONFIG]


def test_a_runs_export_refuses_an_hf_directory_holding_something_else(tmp_path, small_config, tokenizer):
    hf_dir = tmp_path / "run" / "hf"
    hf_dir.mkdir(parents=True)
    (hf_dir / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"hf is not empty and holds no checkpoint \(notes.txt\)"):
        export_model(SimpleNamespace(model=HybridLM(small_config()), parallel=Parallel.single_process()), hf_dir,
                     tokenizer)
    assert [p.name for p in hf_dir.iterdir()] == ["notes.txt"]


def test_a_training_run_refuses_such_an_hf_directory_before_it_trains(tmp_path, capsys):
    """The same refusal at the start of the run, not after its training: nothing is written into the run directory."""
    from hybridtron.cli import main

    out = tmp_path / "run"
    (out / "hf").mkdir(parents=True)
    (out / "hf" / "notes.txt").write_text("mine")
    assert main(["pretrain", "--preset", "tiny", "--out", str(out), "--steps", "1", "--quiet"]) == 2
    assert f"the run's HF export {out / 'hf'} is not empty and holds no checkpoint (notes.txt)" in \
        capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["hf"]


# ------------------------------------------------------------------------------------------------- the API
def test_save_pretrained_replaces_a_checkpoint_only_with_overwrite(small_config, tmp_path):
    first, second = HybridLM(small_config()), HybridLM(small_config())
    target = tmp_path / "ckpt"
    save_pretrained(first, target)
    (target / "README.md").write_text("mine")
    with pytest.raises(ValueError, match=r"already holds a checkpoint \(README.md, config.json, model.safetensors\): "
                                         r"pass overwrite=True"):
        save_pretrained(second, target)
    assert torch.equal(load_pretrained(target).lm_head.weight, first.lm_head.weight)
    save_pretrained(second, target, overwrite=True)
    assert torch.equal(load_pretrained(target).lm_head.weight, second.lm_head.weight)
    assert (target / "README.md").read_text() == "mine"

    other = tmp_path / "other"
    other.mkdir()
    (other / "data.csv").write_text("1,2")
    with pytest.raises(ValueError, match=r"holds no checkpoint \(data.csv\): choose an empty or new directory"):
        save_pretrained(first, other, overwrite=True)
    assert [p.name for p in other.iterdir()] == ["data.csv"]


def test_a_failure_mid_save_leaves_the_old_checkpoint_and_the_users_files(small_config, tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    save_pretrained(HybridLM(small_config()), target)
    (target / "notes.txt").write_text("mine")
    before = snapshot(target)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf, "save_file", crash)  # while the new files are written
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(HybridLM(small_config()), target, overwrite=True)
    monkeypatch.undo()
    assert snapshot(target) == before

    rename = hf.os.rename

    def failing_swap(source, destination):  # the directories' swap fails, after the user's files moved out
        if Path(source) == target.resolve():
            raise OSError("swap failed")
        rename(source, destination)

    monkeypatch.setattr(hf.os, "rename", failing_swap)
    with pytest.raises(OSError, match="swap failed"):
        save_pretrained(HybridLM(small_config()), target, overwrite=True)
    monkeypatch.undo()
    assert snapshot(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "no staging directory left behind"
