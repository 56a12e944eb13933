"""The shared compile cache (hybridtron.ops.compile_cache): processes that compile the same graph with the same
cache directory load what the first compiled (torch's own hit counters say so), several writing at once leave a
usable cache, and a directory that cannot be written is one warning line, after which the run goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridtron.cli import main
from hybridtron.config import preset
from hybridtron.ops.compile_cache import CACHE_DIR_VARIABLE, use_compile_cache
from hybridtron.train.config import TrainConfig
from hybridtron.train.run import prepare_process

WORKER = Path(__file__).with_name("compile_cache_worker.py")


def start_worker(cache_dir: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")  # no compile worker pool
    env.pop(CACHE_DIR_VARIABLE, None)
    return subprocess.Popen([sys.executable, str(WORKER), str(cache_dir)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def result(worker: subprocess.Popen) -> dict:
    out, err = worker.communicate(timeout=300)
    assert worker.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_processes_writing_at_once_fill_a_cache_that_the_next_process_loads(tmp_path):
    cache = tmp_path / "compile-cache"
    first, second = start_worker(cache), start_worker(cache)  # cold, into the same directory at once
    for cold in (result(first), result(second)):
        assert cold["warning"] is None and cold["loss_matches"]
        # the forward and backward graphs: each compiled here or, had the other process finished first, loaded
        assert cold["inductor"].get("fxgraph_cache_miss", 0) + cold["inductor"].get("fxgraph_cache_hit", 0) == 2
    assert list((cache / "fxgraph").rglob("*")) and not list(cache.rglob(".*.tmp"))  # entries, no torn writes

    warm = result(start_worker(cache))
    assert warm["warning"] is None and warm["loss_matches"]
    assert warm["inductor"].get("fxgraph_cache_hit") == 2 and "fxgraph_cache_miss" not in warm["inductor"]
    assert warm["aot_autograd"].get("autograd_cache_hit") == 1 and "autograd_cache_miss" not in warm["aot_autograd"]


def test_a_directory_that_cannot_be_written_is_one_warning_and_the_cache_stays_torchs(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_DIR_VARIABLE, raising=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    warning = use_compile_cache(blocker / "cache")  # a path below a file fails for root too
    assert warning == (f"warning: compile cache {blocker / 'cache'} cannot be written (Not a directory); going on "
                       f"without it (torch's default cache)")
    assert CACHE_DIR_VARIABLE not in os.environ


def test_a_writable_directory_is_created_and_used(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_DIR_VARIABLE, raising=False)
    assert use_compile_cache(tmp_path / "new" / "cache") is None
    assert os.environ[CACHE_DIR_VARIABLE] == str(tmp_path / "new" / "cache")
    assert (tmp_path / "new" / "cache").is_dir() and list((tmp_path / "new" / "cache").iterdir()) == []  # no probe


def test_training_goes_on_with_one_line_when_train_compile_cache_cannot_be_written(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(CACHE_DIR_VARIABLE, raising=False)
    (tmp_path / "a-file").write_text("")
    train = TrainConfig(steps=2, warmup_steps=0, compile_cache=str(tmp_path / "a-file" / "cache"))
    prepare_process(train, preset("tiny"), 64, sys.stderr)
    lines = capsys.readouterr().err.splitlines()
    assert [line for line in lines if "compile cache" in line] == [
        f"warning: compile cache {tmp_path / 'a-file' / 'cache'} cannot be written (Not a directory); going on "
        f"without it (torch's default cache)"]
    assert CACHE_DIR_VARIABLE not in os.environ


def test_compile_cache_without_compile_is_an_error(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--compile-cache", str(tmp_path / "c")]) == 2
    assert capsys.readouterr().err.strip() == ("hybridtron generate: error: --compile-cache applies to --compile "
                                               "(nothing is compiled without it)")
    # serve in a process of its own: importing its command module here would defeat test_server.py's fake engine
    done = subprocess.run([sys.executable, "-m", "hybridtron", "serve", "--model", str(tmp_path), "--compile-cache",
                           str(tmp_path / "c")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == (
        "hybridtron serve: error: --compile-cache applies to --compile (nothing is compiled without it)")
    assert not (tmp_path / "c").exists()
