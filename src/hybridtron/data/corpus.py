"""Documents and the readers of user data: JSONL, Parquet, directories of text files, synthetic rollouts.

Every reader returns `Document`s in a deterministic order (file order, then line/row order; directories
walked in sorted order) and names the file and line/row of anything it cannot use. Bucket of a user document:

- JSONL / Parquet: the record's optional `bucket` field/column, else the file's stem (`web.jsonl` -> `web`).
- Directory: the first sub-directory under the root (`root/math/a.md` -> `math`), else the root's name.
- Rollouts (JSONL with `text` and a boolean `success`): `"{bucket or 'rollouts'}/success"` or `".../failure"`,
  and the text is prefixed with the `<|success|>` / `<|failure|>` special token, so the model learns from both
  outcomes and knows which is which (the Nemotron 3 recipe for synthetic pretraining data).

Empty texts are skipped; a source that yields no document at all is an error.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from hybridtron.data.tokenizer import FAILURE, SUCCESS

# What a directory source reads.
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".pyi", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java",
                 ".js", ".ts", ".sh", ".toml", ".yaml", ".yml", ".tex", ".html", ".css")


@dataclass(frozen=True, slots=True)
class Document:
    doc_id: str  # unique and stable: "stdlib:json/decoder.py", "web.jsonl:17", "notes/math/a.md#2"
    text: str
    bucket: str  # mixture bucket, e.g. "json/q4"
    origin: str  # the file or record the text came from; the validation split never separates an origin


def split_text(text: str, max_chars: int) -> list[str]:
    """Cut `text` into parts of at most `max_chars` characters, at line ends where a line end exists."""
    if max_chars < 1:
        raise ValueError(f"max_document_chars: expected a positive number of characters, got {max_chars}")
    parts, start = [], 0
    while len(text) - start > max_chars:
        cut = text.rfind("\n", start, start + max_chars)
        cut = start + max_chars if cut < start else cut + 1
        parts.append(text[start:cut])
        start = cut
    parts.append(text[start:])
    return parts


def corpus_fingerprint(documents: list[Document]) -> str:
    """Hash of every document's id, bucket and text: the key of the tokenizer and token caches."""
    digest = hashlib.sha256()
    for document in documents:
        digest.update(f"{document.doc_id}\0{document.bucket}\0".encode())
        digest.update(document.text.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def read_source(path: str | os.PathLike, max_document_chars: int) -> list[Document]:
    """Read one user source: a `.jsonl` or `.parquet` file, a text file, or a directory of text files."""
    path = Path(path)
    if path.is_dir():
        documents = read_text_dir(path, max_document_chars)
    elif not path.exists():
        raise ValueError(
            f"source {str(path)!r}: no such file or directory; expected 'stdlib', 'stdlib-repos', "
            f"a .jsonl or .parquet file, or a directory of text files"
        )
    elif path.suffix == ".jsonl":
        documents = read_jsonl(path, max_document_chars)
    elif path.suffix == ".parquet":
        documents = read_parquet(path, max_document_chars)
    elif path.suffix in TEXT_SUFFIXES:
        documents = _text_file_documents(path, path.name, path.stem, max_document_chars)
    else:
        raise ValueError(
            f"source {str(path)!r}: unknown file type {path.suffix!r}; expected .jsonl, .parquet, "
            f"a text file ({', '.join(TEXT_SUFFIXES)}) or a directory"
        )
    if not documents:
        raise ValueError(f"source {str(path)!r}: no documents (empty, or every text is empty)")
    return documents


def jsonl_records(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        with path.open("rb") as f:
            for line_number, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise ValueError(f"{path} line {line_number}: not valid JSON ({exc})") from exc
                if not isinstance(record, dict):
                    raise ValueError(f"{path} line {line_number}: expected a JSON object, got {type(record).__name__}")
                yield line_number, record
    except OSError as exc:
        raise ValueError(f"source {str(path)!r}: cannot read ({exc.strerror or exc})") from exc


def _field(record: dict, name: str, kind: type, path: Path, where: str, default=None):
    if name not in record:
        if default is not None:
            return default
        raise ValueError(f"{path} {where}: missing the {name!r} field (found {sorted(record)})")
    value = record[name]
    if not isinstance(value, kind):
        raise ValueError(f"{path} {where}: {name!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def read_jsonl(path: str | os.PathLike, max_document_chars: int) -> list[Document]:
    """One document (or several parts) per line: `{"text": str, "bucket": str (optional)}`."""
    path = Path(path)
    documents = []
    for line_number, record in jsonl_records(path):
        where = f"line {line_number}"
        text = _field(record, "text", str, path, where)
        bucket = _field(record, "bucket", str, path, where, default=path.stem)
        documents += _parts(text, f"{path.name}:{line_number}", bucket, max_document_chars)
    return documents


def read_rollouts(path: str | os.PathLike, max_document_chars: int) -> list[Document]:
    """Synthetic rollouts, `{"text": str, "success": bool, "bucket": str (optional)}` per line; each text is
    prefixed with its outcome's special token."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"rollouts: {str(path)!r} does not exist; expected a .jsonl file")
    documents = []
    for line_number, record in jsonl_records(path):
        where = f"line {line_number}"
        text = _field(record, "text", str, path, where)
        success = _field(record, "success", bool, path, where)
        base = _field(record, "bucket", str, path, where, default="rollouts")
        if text:
            tagged = (SUCCESS if success else FAILURE) + text
            outcome = "success" if success else "failure"
            documents += _parts(tagged, f"{path.name}:{line_number}", f"{base}/{outcome}", max_document_chars)
    if not documents:
        raise ValueError(f"rollouts: {str(path)!r} holds no rollout (empty, or every text is empty)")
    return documents


def read_parquet(path: str | os.PathLike, max_document_chars: int) -> list[Document]:
    """One document per row of the `text` column (string); an optional `bucket` column names buckets."""
    path = Path(path)
    try:
        import pyarrow as pa  # optional dependency: only Parquet sources need it
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ValueError(
            f"source {str(path)!r}: reading Parquet needs pyarrow; install it with pip install 'hybridtron[data]'"
        ) from exc
    try:
        schema = pq.read_schema(path)
        columns = [name for name in ("text", "bucket") if name in schema.names]
        if "text" not in columns:
            raise ValueError(f"{path}: no 'text' column (columns: {schema.names})")
        table = pq.read_table(path, columns=columns)
    except (OSError, pa.ArrowException) as exc:
        raise ValueError(f"source {str(path)!r}: cannot read as Parquet ({exc})") from exc
    texts = table.column("text").to_pylist()
    buckets = table.column("bucket").to_pylist() if "bucket" in columns else [path.stem] * len(texts)
    documents = []
    for row, (text, bucket) in enumerate(zip(texts, buckets)):
        if not isinstance(text, str):
            raise ValueError(f"{path} row {row}: 'text' must be a string, got {type(text).__name__}")
        if not isinstance(bucket, str):
            raise ValueError(f"{path} row {row}: 'bucket' must be a string, got {type(bucket).__name__}")
        documents += _parts(text, f"{path.name}:{row}", bucket, max_document_chars)
    return documents


def read_text_dir(root: str | os.PathLike, max_document_chars: int) -> list[Document]:
    """Every file under `root` whose suffix is in `TEXT_SUFFIXES` (hidden directories skipped), sorted by path."""
    root = Path(root)
    paths = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        paths += [Path(directory, name) for name in names if Path(name).suffix in TEXT_SUFFIXES]
    if not paths:
        raise ValueError(f"source {str(root)!r}: no text files ({', '.join(TEXT_SUFFIXES)}) in this directory")
    documents = []
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        relative = path.relative_to(root)
        bucket = relative.parts[0] if len(relative.parts) > 1 else root.resolve().name
        documents += _text_file_documents(path, f"{root.name}/{relative.as_posix()}", bucket, max_document_chars)
    return documents


def _text_file_documents(path: Path, doc_id: str, bucket: str, max_document_chars: int) -> list[Document]:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}); convert it or remove it") from exc
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    return _parts(text, doc_id, bucket, max_document_chars)


def _parts(text: str, doc_id: str, bucket: str, max_document_chars: int) -> list[Document]:
    if not text:
        return []
    parts = split_text(text, max_document_chars)
    if len(parts) == 1:
        return [Document(doc_id, text, bucket, doc_id)]
    return [Document(f"{doc_id}#{i + 1}", part, bucket, doc_id) for i, part in enumerate(parts)]
