"""`build_data(DataConfig) -> DataBundle`: corpus -> tokenizer -> tokens -> split -> mixture plan -> loader.

Steps (each cached or fast, so a second call on the stdlib takes a couple of seconds):
1. Documents from every source, in order (`load_documents`); `families` / `max_documents` trim them.
2. The tokenizer: `tokenizer` (a tokenizer.json) or byte-level BPE trained on the corpus and cached.
3. Token arrays, cached as .npy under `cache_dir`.
4. Validation split: an origin (file, record) is held out, with every part of it, when a hash of its name
   falls below `val_fraction`; a bucket never loses its last origin. Deterministic, disjoint from training,
   independent of the seed and of which other documents are loaded.
5. Mixture plan: weights over the training buckets, proxy sub-sampling, the repetition guard, the report.
6. The resumable `PackedLoader` and the fixed validation batches (`TokenBatch`es; with `document_mask`, their
   seq_idx too).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import numpy as np

from hybridtron.data.batch import TokenBatch
from hybridtron.data.corpus import Document, corpus_fingerprint, read_rollouts, read_source
from hybridtron.data.loader import BucketDocs, PackedLoader, validation_batches
from hybridtron.data.mixture import BucketPlan, MixtureReport, mixture_weights, proxy_keep
from hybridtron.data.packing import TokenStore, cached_tokens
from hybridtron.data.stdlib import stdlib_documents, stdlib_files, stdlib_repo_documents
from hybridtron.data.tokenizer import DIGITS, Tokenizer, cached_tokenizer

BUILTIN_SOURCES = ("stdlib", "stdlib-repos")


def default_cache_dir() -> str:
    """`$HYBRIDTRON_CACHE`, else `$XDG_CACHE_HOME/hybridtron`, else `~/.cache/hybridtron`."""
    if os.environ.get("HYBRIDTRON_CACHE"):
        return os.environ["HYBRIDTRON_CACHE"]
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridtron")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the pretraining tokens come from and how they are mixed, packed and split."""

    # corpus
    source: tuple[str, ...] = ("stdlib",)  # "stdlib" (a document per file), "stdlib-repos" (packages stitched
    #   into long documents), .jsonl / .parquet files (a `text` field) or directories of text files; a plain
    #   string is one source
    families: tuple[str, ...] | None = None  # keep only these stdlib families (stdlib.FAMILIES); None = all
    max_documents: int | None = None  # keep the first N documents (sources in order); for tests and quick runs
    max_document_chars: int = 32768  # longer texts are split at line ends into parts of at most this
    max_repo_chars: int = 1 << 20  # "stdlib-repos": a package longer than this becomes several documents
    rollouts: tuple[str, ...] = ()  # JSONL files of synthetic rollouts (`text`, bool `success`), outcome-tagged
    # tokenizer
    tokenizer: str | None = None  # a tokenizer.json (or its directory) to use; None = train BPE on the corpus
    vocab_size: int = 4096  # size of the trained BPE vocabulary (special tokens included)
    tokenizer_train_chars: int = 16_000_000  # characters of the deterministic corpus sample BPE learns from
    tokenizer_digits: str = "individual"  # "individual": every digit a token (LLaMA, Qwen2), so a number is spelt
    #   alike wherever it stands and a model can copy it from a prompt or a tool's output; "merged": BPE merges digit
    #   runs as GPT-2's does (the same number then splits differently after a space, a "(" or a "{")
    # packing and batches (a training run passes its own to build_data, which override these)
    seq_len: int = 512  # tokens per row
    batch_size: int = 8  # rows per batch
    total_tokens: int | None = None  # the run's token budget; None = one pass over the training split
    val_fraction: float = 0.02  # share of each bucket's origins (files, records) held out for validation
    val_batches: int | None = 8  # validation batches kept (fixed for the whole run); None = all
    document_mask: bool = False  # batches carry seq_idx, each position's document in its row: attention, the
    #   Mamba scan and conv restart at every bos (attention runs a call per document). Off by default: at base
    #   length the bos already resets the model's context and the report's pretraining packs without a mask;
    #   Llama 3 found masking mattered little in standard pretraining and a lot in long-context continued
    #   pretraining: a long-context phase turns it on
    # mixture
    mixture: str = "natural"  # preset (natural, uniform, quality) or a path to a mixture .toml
    proxy_of: int | None = None  # the full run's token budget when this run is its proxy (needs a budget)
    max_epochs: float = 1.0  # most passes the plan may make over any bucket
    allow_repeat: bool = False  # accept plans that repeat a bucket more than max_epochs
    seed: int = 0  # bucket draws and per-epoch document order (not the validation split or proxy slices)
    cache_dir: str | None = None  # tokenizer and token caches; None = default_cache_dir()

    # the data a run reads is fixed at its start (its loader position counts into this stream); only where the
    # caches live may change on resume (hybridtron.train.config). document_mask leaves the stream as it is but
    # changes what the model computes on it, so a resume keeps it too
    RESUMABLE: ClassVar = ("cache_dir",)
    # fields added after runs were saved, with the value a run_config.json without them ran with (it is resumed, and
    # a new run from it made, with that value)
    SAVED_WITHOUT: ClassVar = {"tokenizer_digits": "merged"}

    def __post_init__(self):
        for name in ("source", "rollouts", "families"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif value is not None:
                object.__setattr__(self, name, tuple(value))
        if not self.source:
            raise ValueError("data.source: expected at least one source ('stdlib', a file or a directory)")
        for name in ("max_document_chars", "max_repo_chars", "vocab_size", "tokenizer_train_chars", "seq_len",
                     "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name}: expected a positive integer, got {getattr(self, name)}")
        for name in ("max_documents", "total_tokens", "proxy_of", "val_batches"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"data.{name}: expected a positive integer or None, got {getattr(self, name)}")
        if self.tokenizer_digits not in DIGITS:
            raise ValueError(f"data.tokenizer_digits: expected one of {', '.join(DIGITS)}, "
                             f"got {self.tokenizer_digits!r}")
        if not isinstance(self.document_mask, bool):
            raise ValueError(f"data.document_mask: expected true or false, got {self.document_mask!r}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"data.val_fraction: expected a number in [0, 1), got {self.val_fraction}")
        if not self.max_epochs > 0:
            raise ValueError(f"data.max_epochs: expected a positive number, got {self.max_epochs}")
        if self.proxy_of is not None and self.total_tokens is not None and self.proxy_of < self.total_tokens:
            raise ValueError(f"data.proxy_of: {self.proxy_of:,} is smaller than total_tokens "
                             f"{self.total_tokens:,}; expected the full run's (larger) budget")


@dataclass
class DataBundle:
    tokenizer: Tokenizer
    train_loader: PackedLoader
    val_batches: list[TokenBatch]
    mixture_report: MixtureReport
    stats: dict = field(default_factory=dict)  # corpus size, split sizes and the seconds each step took


def load_documents(config: DataConfig) -> list[Document]:
    """Every source's documents in order, then the rollouts; `max_documents` keeps the first N."""
    documents: list[Document] = []
    files = None
    for source in config.source:
        if source in BUILTIN_SOURCES:
            files = stdlib_files(config.families) if files is None else files
            if source == "stdlib":
                documents += stdlib_documents(files, config.max_document_chars)
            else:
                documents += stdlib_repo_documents(files, config.max_document_chars, config.max_repo_chars)
        else:
            documents += read_source(source, config.max_document_chars)
    for path in config.rollouts:
        documents += read_rollouts(path, config.max_document_chars)
    if config.max_documents is not None:
        documents = documents[:config.max_documents]
    if not documents:
        raise ValueError(f"data.source {list(config.source)}: no documents (families={config.families})")
    doc_ids = [document.doc_id for document in documents]
    if len(set(doc_ids)) != len(doc_ids):
        duplicate = next(d for d in doc_ids if doc_ids.count(d) > 1)
        raise ValueError(f"data.source: document {duplicate!r} appears twice; is a source listed twice?")
    return documents


def _hash_order(names: list[str]) -> list[int]:
    return sorted(range(len(names)), key=lambda i: hashlib.sha1(names[i].encode()).digest())


def _unit_hash(name: str) -> float:
    """A stable pseudo-random number in [0, 1) from a name."""
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "little") / 2**64


def split_validation(documents: list[Document], val_fraction: float) -> tuple[dict[str, list[int]], list[int]]:
    """`({bucket: training document indices in the fixed (hashed id) order}, validation indices in hashed order)`.

    An origin is held out when the hash of its name falls below `val_fraction`, except that a bucket always keeps
    its origin with the largest hash for training."""
    by_bucket: dict[str, list[int]] = {}
    for index, document in enumerate(documents):
        by_bucket.setdefault(document.bucket, []).append(index)
    train, val = {}, []
    for bucket, indices in sorted(by_bucket.items()):
        origins = {documents[i].origin for i in indices}
        keeper = max(origins, key=_unit_hash)
        held = {origin for origin in origins if _unit_hash(origin) < val_fraction and origin != keeper}
        val += [i for i in indices if documents[i].origin in held]
        kept = [i for i in indices if documents[i].origin not in held]
        train[bucket] = [kept[i] for i in _hash_order([documents[j].doc_id for j in kept])]
    val = [val[i] for i in _hash_order([documents[j].doc_id for j in val])]
    return train, val


def _bucket_docs(name: str, indices: list[int], store: TokenStore, ratio: float) -> BucketDocs:
    lengths = store.lengths()[indices]
    starts = store.offsets[:-1][indices]
    complete = np.ones(len(indices), dtype=bool)
    if ratio < 1.0:
        whole, cut = proxy_keep((lengths + 2).tolist(), ratio)
        keep = whole + (cut > 0)
        starts, lengths, complete = starts[:keep], lengths[:keep].copy(), complete[:keep].copy()
        if cut:
            lengths[-1], complete[-1] = cut - 1, False  # the bos plus cut - 1 text tokens
    return BucketDocs(name, np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64), complete)


def build_data(config: DataConfig, *, seq_len: int | None = None, batch_size: int | None = None,
               total_sequences: int | None = None, val_batches: int | None = None) -> DataBundle:
    """Build the tokenizer, training loader, validation batches and mixture report of `config`.

    A training run passes its own `seq_len`, `batch_size`, budget in sequences (`total_sequences` x seq_len
    tokens) and `val_batches`; they replace the config's fields."""
    overrides = {k: v for k, v in dict(seq_len=seq_len, batch_size=batch_size, val_batches=val_batches).items()
                 if v is not None}
    config = replace(config, **overrides)
    if total_sequences is not None:
        config = replace(config, total_tokens=total_sequences * config.seq_len)
    if config.proxy_of is not None and config.total_tokens is None:
        raise ValueError("data.proxy_of: a proxy run needs its own budget; set data.total_tokens "
                         "(or pass total_sequences)")
    cache_dir = config.cache_dir or default_cache_dir()
    seconds = {}
    clock = time.perf_counter()

    documents = load_documents(config)
    fingerprint = corpus_fingerprint(documents)
    seconds["corpus"] = time.perf_counter() - clock

    clock = time.perf_counter()
    if config.tokenizer is not None:
        tokenizer = Tokenizer.load(config.tokenizer)
    else:
        tokenizer = cached_tokenizer([(d.doc_id, d.text) for d in documents], fingerprint, config.vocab_size,
                                     cache_dir, config.tokenizer_train_chars, config.tokenizer_digits)
    seconds["tokenizer"] = time.perf_counter() - clock

    clock = time.perf_counter()
    store = cached_tokens(documents, tokenizer, fingerprint, cache_dir)
    seconds["tokenize"] = time.perf_counter() - clock

    clock = time.perf_counter()
    train, val = split_validation(documents, config.val_fraction)
    if config.val_fraction > 0 and not val:
        raise ValueError(f"data.val_fraction: {config.val_fraction} holds out no document of these "
                         f"{len(documents)} (each bucket keeps at least one); raise it, or set 0 for no validation")
    packed = store.lengths() + 2
    full_tokens = {bucket: int(packed[indices].sum()) for bucket, indices in train.items() if indices}
    weights = mixture_weights(config.mixture, full_tokens)
    total_tokens = config.total_tokens or sum(full_tokens.values())
    ratio = total_tokens / config.proxy_of if config.proxy_of else 1.0
    active = [name for name in sorted(full_tokens) if weights[name] > 0]
    bucket_docs = [_bucket_docs(name, train[name], store, ratio) for name in active]
    report = MixtureReport(
        mixture=config.mixture, total_tokens=total_tokens, proxy_of=config.proxy_of, max_epochs=config.max_epochs,
        buckets=tuple(BucketPlan(b.name, len(b), b.packed_tokens, full_tokens[b.name], weights[b.name],
                                 weights[b.name] * total_tokens) for b in bucket_docs),
        val_documents=len(val), val_tokens=int(packed[val].sum()) if val else 0,
    )
    report.check_epochs(config.allow_repeat)
    plan_fingerprint = hashlib.sha256(json.dumps(
        [fingerprint, tokenizer.fingerprint, [(b.name, round(weights[b.name], 12), b.packed_tokens)
                                              for b in bucket_docs], config.seed]).encode()).hexdigest()[:16]
    loader = PackedLoader(store, bucket_docs, [weights[b.name] for b in bucket_docs], seq_len=config.seq_len,
                          batch_size=config.batch_size, seed=config.seed, bos_id=tokenizer.bos_id,
                          eos_id=tokenizer.eos_id, fingerprint=plan_fingerprint,
                          document_mask=config.document_mask)
    held_out = validation_batches(store, val, seq_len=config.seq_len, batch_size=config.batch_size,
                                  max_batches=config.val_batches, bos_id=tokenizer.bos_id,
                                  eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                                  document_mask=config.document_mask)
    seconds["plan"] = time.perf_counter() - clock

    stats = {
        "documents": len(documents), "tokens": len(store.tokens), "packed_tokens": int(packed.sum()),
        "buckets": len(full_tokens),
        "train_documents": sum(len(train[name]) for name in full_tokens), "val_documents": len(val),
        "vocab_size": tokenizer.vocab_size, "corpus_fingerprint": fingerprint, "seconds": seconds,
    }
    return DataBundle(tokenizer, loader, held_out, report, stats)
