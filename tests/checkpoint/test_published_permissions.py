"""What the package publishes for others to read gets the umask's permissions, not a temporary file's private ones:
the HF export (safetensors writes 0o600 files, tempfile.mkdtemp a 0o700 directory), the boosted checkpoint of
`hybridtron mtp-boost` and the tokenizer cache. Directories 0o777 & ~umask, files 0o666 & ~umask."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hybridtron.checkpoint import save_pretrained
from hybridtron.cli import main
from hybridtron.data.tokenizer import Tokenizer, cached_tokenizer
from hybridtron.model.lm import HybridLM

UMASK = 0o022


@pytest.fixture
def umask():
    previous = os.umask(UMASK)
    try:
        yield UMASK
    finally:
        os.umask(previous)


def assert_published(root: Path, umask: int) -> None:
    paths = [root, *sorted(root.rglob("*"))]
    assert len(paths) > 1, f"{root} is empty"
    for path in paths:
        mode = stat.S_IMODE(path.stat().st_mode)
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert mode == expected, f"{path}: {oct(mode)}, expected {oct(expected)}"
        assert mode & 0o044 == 0o044, f"{path}: not readable by group and others"


@pytest.mark.parametrize("max_shard_bytes", [None, 64 * 1024])
def test_hf_export_is_readable_by_others(small_config, tmp_path, umask, max_shard_bytes):
    model = HybridLM(small_config())
    options = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    save_pretrained(model, tmp_path / "hf", **options)
    if max_shard_bytes is not None:
        assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1, "the sharded layout is tested"
    assert_published(tmp_path / "hf", umask)
    save_pretrained(model, tmp_path / "hf", overwrite=True, **options)  # replacing an export keeps it readable
    assert_published(tmp_path / "hf", umask)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"], "no staging directory is left behind"


def test_boosted_checkpoint_is_readable_by_others(small_config, tmp_path, umask, capsys):
    model_dir, out = tmp_path / "ckpt", tmp_path / "boosted"
    save_pretrained(HybridLM(small_config(vocab_size=640)), model_dir)
    Tokenizer.train(["def f(x):\n    return x + 1\n" * 50], 600).save(model_dir)
    settings = ["boost.num_samples=2", "boost.sample_length=4", "boost.batch_size=2", "boost.depths=2",
                "boost.draft_length=2"]
    assert main(["mtp-boost", "--model", str(model_dir), "--out", str(out), "--steps", "1", "--quiet",
                 *[arg for setting in settings for arg in ("--set", setting)]]) == 0
    # --out is a run directory: the boosted model is its HF export, hf/, with the tokenizer files; all of it
    # (checkpoints, metrics, the export) is readable by others
    assert (out / "mtp_boost.json").is_file() and (out / "hf" / "tokenizer.json").is_file()
    assert_published(out, umask)


def test_tokenizer_cache_is_readable_by_others(tmp_path, umask):
    texts = [(f"doc{i}", f"def f{i}(x):\n    return x * {i}\n") for i in range(50)]
    cached_tokenizer(texts, "fingerprint", 600, tmp_path / "cache", max_train_chars=10_000)
    assert list((tmp_path / "cache").rglob("tokenizer.json")), "the cache was written"
    assert_published(tmp_path / "cache", umask)
