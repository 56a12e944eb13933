"""The embedded stdlib corpus (families, quality, buckets, repo view) and the user-data readers."""

from __future__ import annotations

import json
import sys

import pytest

from hybridtron.data import DataConfig, load_documents
from hybridtron.data.corpus import read_rollouts, read_source, split_text
from hybridtron.data.stdlib import (FAMILIES, QUALITY_LEVELS, family_of, quality_signals, stdlib_documents,
                                    stdlib_files, stdlib_repo_documents)
from hybridtron.data.tokenizer import FAILURE, FILE_TOKEN, SUCCESS


def test_family_of_maps_modules_and_their_tests():
    assert family_of("asyncio/tasks.py") == "asyncio"
    assert family_of("os.py") == "files"
    assert family_of("test/test_asyncio/test_tasks.py") == "asyncio"
    assert family_of("test/test_xml_etree_c.py") == "xml"  # trailing parts dropped until a module matches
    assert family_of("test/test_urllib2net.py") == "web"
    assert family_of("test/test_dict.py") == "test"  # an interpreter test: no module of its own
    assert family_of("test/support/__init__.py") == "testing"
    assert family_of("_sysconfigdata__linux_x86_64-linux-gnu.py") == "packaging"
    assert family_of("no_such_module.py") == "other"
    assert len(FAMILIES) == 40


def test_quality_rule_orders_documented_code_above_tables_and_stubs():
    documented = '"""Parse things.\n\nA longer explanation of the parser.\n"""\n\n' + "".join(
        f"def f{i}(x):\n    # add one, because the format counts from one\n    return x + {i}\n\n" for i in range(12))
    table = "TABLE = (\n" + "".join(f"    '\\u{i:04x}'  # {i:#x} -> CHAR {i}\n" for i in range(200)) + ")\n"
    stub = "from _json import *\n"
    levels = [quality_signals(text, is_test=False).level for text in (documented, table, stub)]
    assert levels[0] == QUALITY_LEVELS
    assert levels[1] == 1 and levels[2] == 1
    assert quality_signals(table, False).literal_share > 0.9
    # being a test costs exactly one point of score
    assert quality_signals(documented, True).score == pytest.approx(quality_signals(documented, False).score - 1)


def test_full_stdlib_has_about_200_buckets_in_5_levels():
    files = stdlib_files()
    assert len(files) > 1000
    buckets = {f.bucket for f in files}
    assert 150 <= len(buckets) <= 200
    assert {f.quality for f in files} == set(range(1, QUALITY_LEVELS + 1))
    assert {f.family for f in files} == set(FAMILIES)
    assert not any("site-packages" in f.path or "dist-packages" in f.path for f in files)
    # the levels are calibrated to hold roughly equal shares of the text
    chars = sum(len(f.text) for f in files)
    for level in range(1, QUALITY_LEVELS + 1):
        share = sum(len(f.text) for f in files if f.quality == level) / chars
        assert 0.12 < share < 0.28, (level, share)


def test_stdlib_documents_are_deterministic_and_split_at_line_ends():
    files = stdlib_files(("json", "re"))
    assert [f.path for f in files] == sorted(f.path for f in files)
    docs = stdlib_documents(files, max_document_chars=4000)
    again = stdlib_documents(stdlib_files(("json", "re")), max_document_chars=4000)
    assert docs == again
    for file in files:
        parts = [d for d in docs if d.origin == f"stdlib:{file.path}"]
        assert "".join(d.text for d in parts) == file.text
        assert all(d.bucket == file.bucket for d in parts)
        assert all(len(d.text) <= 4000 for d in parts)
        assert all(d.text.endswith("\n") for d in parts[:-1])


def test_repo_view_stitches_packages_with_file_headers():
    files = stdlib_files(("json",))
    repos = stdlib_repo_documents(files, max_document_chars=1 << 20, max_repo_chars=1 << 22)
    package = next(d for d in repos if d.doc_id == "stdlib-repo:json")
    assert package.bucket == "repos/json"
    headers = [line[len(FILE_TOKEN):] for line in package.text.splitlines() if line.startswith(FILE_TOKEN)]
    assert headers == sorted(f.path for f in files if f.path.startswith("json/"))
    for file in files:
        if file.path.startswith("json/"):
            assert f"{FILE_TOKEN}{file.path}\n{file.text}" in package.text
    small = stdlib_repo_documents(files, max_document_chars=1 << 20, max_repo_chars=20_000)
    assert len([d for d in small if d.origin == "stdlib-repo:json"]) > 1


def test_split_text_rejoins_and_respects_the_cap():
    text = "a" * 50 + "\n" + "b" * 10 + "\n" + "c" * 7
    parts = split_text(text, 20)
    assert "".join(parts) == text and all(len(p) <= 20 for p in parts)
    assert split_text("short", 100) == ["short"]


def test_families_and_max_documents_filters():
    config = DataConfig(families=("json",), max_documents=3)
    docs = load_documents(config)
    assert len(docs) == 3 and all(d.bucket.startswith("json/") for d in docs)
    with pytest.raises(ValueError, match="unknown stdlib families.*'jsn'"):
        load_documents(DataConfig(families=("jsn",)))


# --------------------------------------------------------------------------------------------- user data
def test_jsonl_reader(tmp_path):
    path = tmp_path / "web.jsonl"
    path.write_text(json.dumps({"text": "hello"}) + "\n\n" + json.dumps({"text": "x" * 25, "bucket": "code"}) + "\n"
                    + json.dumps({"text": ""}) + "\n")
    docs = read_source(path, max_document_chars=10)
    assert [d.bucket for d in docs] == ["web", "code", "code", "code"]
    assert docs[0].doc_id == "web.jsonl:1" and docs[1].doc_id == "web.jsonl:3#1"
    assert {d.origin for d in docs[1:]} == {"web.jsonl:3"}


@pytest.mark.parametrize("line, message", [
    ('{"txt": "a"}', r"bad\.jsonl line 2: missing the 'text' field \(found \['txt'\]\)"),
    ('{"text": 3}', r"bad\.jsonl line 2: 'text' must be a str, got int"),
    ('{"text": "a", "bucket": 1}', r"line 2: 'bucket' must be a str"),
    ('{"text": "a"', r"bad\.jsonl line 2: not valid JSON"),
    ('["a"]', r"line 2: expected a JSON object, got list"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        read_source(path, 100)


def test_directory_reader(tmp_path):
    (tmp_path / "notes" / "math").mkdir(parents=True)
    (tmp_path / "notes" / "math" / "b.md").write_text("# algebra")
    (tmp_path / "notes" / "a.txt").write_text("top level")
    (tmp_path / "notes" / "image.png").write_bytes(b"\x89PNG")
    docs = read_source(tmp_path / "notes", 1000)
    assert [(d.doc_id, d.bucket, d.text) for d in docs] == [
        ("notes/a.txt", "notes", "top level"), ("notes/math/b.md", "math", "# algebra")]


def test_directory_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        read_source(tmp_path / "empty", 100)
    (tmp_path / "latin").mkdir()
    (tmp_path / "latin" / "a.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"a\.txt: not UTF-8"):
        read_source(tmp_path / "latin", 100)


def test_parquet_reader(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["one", "two"], "bucket": ["a", "b"]}), tmp_path / "d.parquet")
    docs = read_source(tmp_path / "d.parquet", 100)
    assert [(d.doc_id, d.bucket, d.text) for d in docs] == [("d.parquet:0", "a", "one"), ("d.parquet:1", "b", "two")]
    pq.write_table(pa.table({"body": ["one"]}), tmp_path / "nocol.parquet")
    with pytest.raises(ValueError, match=r"no 'text' column \(columns: \['body'\]\)"):
        read_source(tmp_path / "nocol.parquet", 100)
    pq.write_table(pa.table({"text": ["one", None]}), tmp_path / "null.parquet")
    with pytest.raises(ValueError, match="row 1: 'text' must be a string, got NoneType"):
        read_source(tmp_path / "null.parquet", 100)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="cannot read as Parquet"):
        read_source(tmp_path / "junk.parquet", 100)


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "d.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"needs pyarrow.*hybridtron\[data\]"):
        read_source(tmp_path / "d.parquet", 100)


def test_bad_and_empty_sources(tmp_path):
    with pytest.raises(ValueError, match="no such file or directory"):
        read_source(tmp_path / "missing.jsonl", 100)
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(ValueError, match="unknown file type '.csv'"):
        read_source(tmp_path / "data.csv", 100)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no documents"):
        read_source(tmp_path / "empty.jsonl", 100)
    with pytest.raises(ValueError, match="data.source: expected at least one source"):
        DataConfig(source=())


def test_rollouts_carry_outcome_tags(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps({"text": "solved", "success": True}) + "\n"
                    + json.dumps({"text": "wrong", "success": False, "bucket": "math"}) + "\n")
    docs = read_rollouts(path, 1000)
    assert [(d.text, d.bucket) for d in docs] == [(SUCCESS + "solved", "rollouts/success"),
                                                 (FAILURE + "wrong", "math/failure")]
    path.write_text(json.dumps({"text": "x", "success": "yes"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: 'success' must be a bool, got str"):
        read_rollouts(path, 1000)
    with pytest.raises(ValueError, match="rollouts: .* does not exist"):
        read_rollouts(tmp_path / "nope.jsonl", 1000)
