"""The resumable training loader and the fixed validation batches.

Sampling: each document draw picks a bucket with probability p_b proportional to weight_b / mean packed
length_b, so that buckets supply tokens in proportion to their weights; then takes the bucket's next document.
Draw i's bucket comes from a counter-based stream (block i // BLOCK of `default_rng([seed, block])`), and a
bucket's documents are visited in a fresh permutation per epoch (`default_rng([seed, bucket_key, epoch])`), so
the whole stream is a pure function of (seed, draw index) and the loader's position is three numbers and a
per-bucket count: `state_dict()` after N batches, `load_state_dict()` into a fresh loader, and the next batches
are identical to an uninterrupted run's (none repeated, none skipped). The position is in tokens of the stream,
not in batches, so a resume may change batch size or sequence length.

Batches are `TokenBatch`es (hybridtron.data.batch); with `document_mask` they carry `seq_idx`, each position's
document within its row (`packing.pack_rows`), which changes what the model computes but not the stream.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hybridtron.data.batch import TokenBatch
from hybridtron.data.packing import TokenStore, pack_rows

BLOCK = 4096  # bucket draws generated per RNG block
STATE_VERSION = 1


@dataclass(frozen=True)
class BucketDocs:
    """The training documents of one bucket: slices of the token store."""

    name: str
    starts: np.ndarray  # [n] int64: offset of each document's first token in the store
    lengths: np.ndarray  # [n] int64: text tokens used (a proxy's cut document uses fewer than it has)
    complete: np.ndarray  # [n] bool: the document ends here and gets an eos

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def packed_tokens(self) -> int:
        return int(self.lengths.sum() + len(self.lengths) + self.complete.sum())

    @property
    def key(self) -> int:
        """A stable per-bucket RNG key (independent of which other buckets exist)."""
        return int.from_bytes(hashlib.sha1(self.name.encode()).digest()[:4], "little")


def packed_document(store: TokenStore, start: int, length: int, complete: bool, bos: int, eos: int) -> np.ndarray:
    pieces = [np.array([bos], dtype=np.int64), np.asarray(store.tokens[start:start + length], dtype=np.int64)]
    if complete:
        pieces.append(np.array([eos], dtype=np.int64))
    return np.concatenate(pieces)


class PackedLoader:
    """Infinite iterator of `TokenBatch`es (input_ids [B,T], labels [B,T], int64; with `document_mask` seq_idx
    [B,T]) drawn from weighted buckets. The mask is not in `fingerprint`: it leaves the stream as it is."""

    def __init__(self, store: TokenStore, buckets: Sequence[BucketDocs], weights: Sequence[float], *,
                 seq_len: int, batch_size: int, seed: int, bos_id: int, eos_id: int, fingerprint: str,
                 document_mask: bool = False):
        if len(buckets) != len(weights) or not buckets:
            raise ValueError("PackedLoader: expected one weight per bucket and at least one bucket")
        if any(len(b) == 0 for b in buckets):
            raise ValueError(f"PackedLoader: bucket {next(b.name for b in buckets if len(b) == 0)!r} is empty")
        self.store, self.buckets = store, list(buckets)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.bos_id, self.eos_id, self.fingerprint = bos_id, eos_id, fingerprint
        self.document_mask = document_mask
        mean_lengths = np.array([b.packed_tokens / len(b) for b in self.buckets])
        probabilities = np.asarray(weights, dtype=np.float64) / mean_lengths
        self.probabilities = probabilities / probabilities.sum()
        self._block_index, self._block = -1, np.zeros(0, dtype=np.int64)
        self._permutations: dict[int, tuple[int, np.ndarray]] = {}
        self._reset()

    # ------------------------------------------------------------------------------------------ stream
    def _reset(self) -> None:
        self.draw = -1  # index of the document being read
        self.offset = 0  # tokens of it already consumed
        self.bucket_draws = [0] * len(self.buckets)
        self.batches = 0
        self._next_document()

    def bucket_of_draw(self, draw: int) -> int:
        block = draw // BLOCK
        if block != self._block_index:
            rng = np.random.default_rng([self.seed, block])
            self._block = rng.choice(len(self.buckets), size=BLOCK, p=self.probabilities)
            self._block_index = block
        return int(self._block[draw % BLOCK])

    def _document_index(self, bucket: int, count: int) -> int:
        n = len(self.buckets[bucket])
        epoch = count // n
        cached = self._permutations.get(bucket)
        if cached is None or cached[0] != epoch:
            permutation = np.random.default_rng([self.seed, self.buckets[bucket].key, epoch]).permutation(n)
            self._permutations[bucket] = cached = (epoch, permutation)
        return int(cached[1][count % n])

    def _next_document(self) -> None:
        self.draw += 1
        bucket = self.bucket_of_draw(self.draw)
        index = self._document_index(bucket, self.bucket_draws[bucket])
        self.bucket_draws[bucket] += 1
        docs = self.buckets[bucket]
        self._document = packed_document(self.store, int(docs.starts[index]), int(docs.lengths[index]),
                                         bool(docs.complete[index]), self.bos_id, self.eos_id)
        self.offset = 0

    def _take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The next n stream tokens and their document-start flags, plus one token peeked (not consumed)."""
        ids = np.empty(n + 1, dtype=np.int64)
        starts = np.zeros(n + 1, dtype=bool)
        filled = 0
        while True:
            if self.offset == 0:
                starts[filled] = True
            if filled == n:  # the peeked token: the first of the next row
                ids[n] = self._document[self.offset]
                return ids, starts
            take = min(n - filled, len(self._document) - self.offset)
            ids[filled:filled + take] = self._document[self.offset:self.offset + take]
            filled += take
            self.offset += take
            if self.offset == len(self._document):
                self._next_document()

    def __iter__(self) -> "PackedLoader":
        return self

    def __next__(self) -> TokenBatch:
        ids, starts = self._take(self.batch_size * self.seq_len)
        self.batches += 1
        return pack_rows(ids, starts, self.seq_len, document_mask=self.document_mask)

    # ------------------------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION, "fingerprint": self.fingerprint, "draw": self.draw, "offset": self.offset,
            "bucket_draws": {b.name: count for b, count in zip(self.buckets, self.bucket_draws)},
            "batches": self.batches,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state: version {state.get('version')!r}; expected {STATE_VERSION}")
        if state["fingerprint"] != self.fingerprint:
            raise ValueError(
                "loader state: it belongs to different data (corpus, tokenizer, mixture, proxy or seed changed: "
                f"fingerprint {state['fingerprint']} != {self.fingerprint}); resume with the run's data config"
            )
        counts = state["bucket_draws"]
        # Replay the current document's draw: counts before it, then draw it again.
        self.bucket_draws = [counts[b.name] for b in self.buckets]
        self.draw = state["draw"] - 1
        self.bucket_draws[self.bucket_of_draw(state["draw"])] -= 1
        self._next_document()
        self.offset = state["offset"]
        self.batches = state["batches"]


def validation_batches(store: TokenStore, documents: Sequence[int], *, seq_len: int, batch_size: int,
                       max_batches: int | None, bos_id: int, eos_id: int, pad_id: int,
                       document_mask: bool = False) -> list[TokenBatch]:
    """Pack the validation documents (store indices, in the given order) into at most `max_batches` batches;
    the last row is padded with pad (labels -100), the last batch may have fewer rows. `document_mask`: with
    seq_idx, the padding one document of its own."""
    limit = None if max_batches is None else max_batches * batch_size * seq_len + 1
    ids_parts, start_parts, total = [], [], 0
    for index in documents:
        if limit is not None and total >= limit:
            break
        doc = packed_document(store, int(store.offsets[index]), len(store.document(index)), True, bos_id, eos_id)
        starts = np.zeros(len(doc), dtype=bool)
        starts[0] = True
        ids_parts.append(doc)
        start_parts.append(starts)
        total += len(doc)
    if not ids_parts:
        return []
    ids, starts = np.concatenate(ids_parts), np.concatenate(start_parts)
    rows = -(-(len(ids) - 1) // seq_len)
    if max_batches is not None:
        rows = min(rows, max_batches * batch_size)
    length = rows * seq_len + 1
    padding = np.zeros(max(length, len(ids)), dtype=bool)
    if len(ids) < length:  # pad the tail; every pad token counts as its own document for the labels
        padding[len(ids):] = True
        ids = np.concatenate([ids, np.full(length - len(ids), pad_id, dtype=np.int64)])
        starts = np.concatenate([starts, np.ones(length - len(starts), dtype=bool)])
    batch = pack_rows(ids[:length], starts[:length], seq_len, document_mask=document_mask,
                      padding_N=padding[:length])
    return [batch.rows(i, i + batch_size) for i in range(0, rows, batch_size)]
