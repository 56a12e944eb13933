"""Token storage and packing of documents into fixed-length training rows.

The packed stream is `bos d1 eos bos d2 eos ...` (a proxy's cut document keeps its bos and has no eos). Rows of
length T are consecutive windows with stride T over that stream, so the next-token label of a row's last
position is the next row's first token and every token is a target exactly once. Labels follow the model
contract (docs/MODEL_API.md): `labels[t]` = the token at t+1, already shifted, and -100 where the token at t+1
belongs to another document (it is a document's bos, or padding), so the loss never predicts across a document
boundary; the MTP heads then also skip every target past it. With a document mask (`DataConfig.document_mask`)
the rows carry `seq_idx` as well: each position's document within its row, which stops attention and the Mamba
scan from reading across a boundary as the labels stop the loss.

Legend: N = tokens in a stream piece, R = rows, T = sequence length.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from hybridtron.data.batch import TokenBatch
from hybridtron.data.corpus import Document
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.ops.cross_entropy import IGNORE_INDEX

TOKENS_CACHE_VERSION = 1
_ENCODE_CHUNK = 64  # documents per encode_batch call: bounds the Python lists alive at once


@dataclass(frozen=True)
class TokenStore:
    """All documents' tokens, flat: document i is `tokens[offsets[i]:offsets[i + 1]]` (no bos/eos)."""

    tokens: np.ndarray  # [total] uint16 (vocabularies up to 65536) or uint32
    offsets: np.ndarray  # [documents + 1] int64

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def document(self, index: int) -> np.ndarray:
        return self.tokens[self.offsets[index]:self.offsets[index + 1]]


def tokenize_documents(documents: Sequence[Document], tokenizer: Tokenizer) -> TokenStore:
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    arrays = []
    for start in range(0, len(documents), _ENCODE_CHUNK):
        chunk = [document.text for document in documents[start:start + _ENCODE_CHUNK]]
        arrays += [np.asarray(ids, dtype=dtype) for ids in tokenizer.encode_batch(chunk)]
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
    return TokenStore(tokens, offsets)


def cached_tokens(
    documents: Sequence[Document], tokenizer: Tokenizer, corpus_fingerprint: str, cache_dir: str | os.PathLike
) -> TokenStore:
    """Tokenize once; later runs memory-map `<cache_dir>/tokens/<key>/{tokens,offsets}.npy`
    (key = corpus fingerprint + tokenizer fingerprint)."""
    key_text = json.dumps([corpus_fingerprint, tokenizer.fingerprint, TOKENS_CACHE_VERSION])
    directory = Path(cache_dir) / "tokens" / hashlib.sha256(key_text.encode()).hexdigest()[:16]
    tokens_path, offsets_path = directory / "tokens.npy", directory / "offsets.npy"
    if tokens_path.is_file() and offsets_path.is_file():
        store = TokenStore(np.load(tokens_path, mmap_mode="r"), np.load(offsets_path))
        if len(store) == len(documents):
            return store
    store = tokenize_documents(documents, tokenizer)
    directory.mkdir(parents=True, exist_ok=True)
    for path, array in ((offsets_path, store.offsets), (tokens_path, store.tokens)):  # tokens last: the marker
        temporary = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(temporary, array)
        os.replace(temporary, path)
    return store


def pack_rows(ids_N: np.ndarray, starts_N: np.ndarray, seq_len: int, *, document_mask: bool = False,
              padding_N: np.ndarray | None = None) -> TokenBatch:
    """Rows from a stream piece of N = R*T + 1 tokens: a `TokenBatch` of input_ids [R, T] and labels [R, T], int64.

    `starts_N[i]` is True where token i begins a document (its bos) or is padding; the label that would
    predict such a token is -100. `document_mask`: the batch's seq_idx [R, T] too, the index of each position's
    document within its row (0 at the row's first position, whatever document it is in; one more at each document
    start), where a run of padding (`padding_N[i]` True: token i is padding) is one document."""
    rows = (len(ids_N) - 1) // seq_len
    assert len(ids_N) == rows * seq_len + 1 and len(starts_N) == len(ids_N)
    starts_N = np.asarray(starts_N, dtype=bool)
    ids_N = torch.from_numpy(ids_N.astype(np.int64))
    labels = torch.where(torch.from_numpy(starts_N[1:]), IGNORE_INDEX, ids_N[1:])
    batch = TokenBatch(ids_N[:-1].reshape(rows, seq_len), labels.reshape(rows, seq_len))
    if document_mask:
        new_document = starts_N[:-1].copy()
        if padding_N is not None:  # padding after padding continues its document
            padding = np.asarray(padding_N[:-1], dtype=bool)
            new_document[1:] &= ~(padding[1:] & padding[:-1])
        new_document_RT = torch.from_numpy(new_document).reshape(rows, seq_len).to(torch.int64)
        new_document_RT[:, 0] = 0  # a row opens at index 0, in the middle of a document or at its start
        batch.seq_idx = new_document_RT.cumsum(1)
    return batch


def pack_rows_ref(ids_N: np.ndarray, starts_N: np.ndarray, seq_len: int, *, document_mask: bool = False,
                  padding_N: np.ndarray | None = None) -> TokenBatch:
    """`pack_rows` spelled out one position at a time, by document index: the test oracle."""
    document = np.cumsum(starts_N)  # the document each token belongs to (each pad token its own)
    padding = np.zeros(len(ids_N), dtype=bool) if padding_N is None else np.asarray(padding_N, dtype=bool)
    rows = (len(ids_N) - 1) // seq_len
    input_ids = torch.zeros(rows, seq_len, dtype=torch.int64)
    labels = torch.zeros(rows, seq_len, dtype=torch.int64)
    seq_idx = torch.zeros(rows, seq_len, dtype=torch.int64)
    for r in range(rows):
        for t in range(seq_len):
            i = r * seq_len + t
            input_ids[r, t] = int(ids_N[i])
            labels[r, t] = int(ids_N[i + 1]) if document[i + 1] == document[i] else IGNORE_INDEX
            if t > 0:  # a new document index where the document changes, except within a run of padding
                same = document[i] == document[i - 1] or (padding[i] and padding[i - 1])
                seq_idx[r, t] = seq_idx[r, t - 1] + (0 if same else 1)
    return TokenBatch(input_ids, labels, seq_idx if document_mask else None)
