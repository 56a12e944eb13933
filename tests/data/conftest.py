"""Fixtures for the data tests: a small slice of the stdlib corpus (three families, about 0.5 MB of source) with
its own cache directory, and a synthetic token store whose documents are easy to recognise in a batch."""

from __future__ import annotations

import numpy as np
import pytest

from hybridtron.data import DataConfig, build_data
from hybridtron.data.loader import BucketDocs, PackedLoader
from hybridtron.data.packing import TokenStore

SMALL_FAMILIES = ("json", "config", "re")
BOS, EOS = 1, 2


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data_cache"))


@pytest.fixture(scope="session")
def small_data_config(data_cache):
    """`small_data_config(**overrides)`: a DataConfig over three stdlib families, vocabulary 512, cached."""

    def make(**overrides) -> DataConfig:
        base = dict(families=SMALL_FAMILIES, vocab_size=512, seq_len=64, batch_size=4, cache_dir=data_cache,
                    val_fraction=0.1)
        return DataConfig(**{**base, **overrides})

    return make


@pytest.fixture(scope="session")
def small_bundle(small_data_config):
    return build_data(small_data_config())


def synthetic_store(lengths_per_bucket: dict[str, list[int]]):
    """A token store where every token of document d is `10 + d`, so a token names its document."""
    arrays, buckets, start = [], [], 0
    for name, lengths in lengths_per_bucket.items():
        starts = []
        for length in lengths:
            arrays.append(np.full(length, 10 + len(arrays), dtype=np.uint16))
            starts.append(start)
            start += length
        buckets.append(BucketDocs(name, np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64),
                                  np.ones(len(lengths), dtype=bool)))
    offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)
    return TokenStore(np.concatenate(arrays), offsets), buckets


@pytest.fixture
def synthetic_loader():
    """`synthetic_loader(lengths_per_bucket, weights, seq_len=32, batch_size=4, seed=0, document_mask=False)`
    -> (loader, store)."""

    def make(lengths_per_bucket, weights, seq_len=32, batch_size=4, seed=0, document_mask=False):
        store, buckets = synthetic_store(lengths_per_bucket)
        loader = PackedLoader(store, buckets, weights, seq_len=seq_len, batch_size=batch_size, seed=seed,
                              bos_id=BOS, eos_id=EOS, fingerprint="synthetic", document_mask=document_mask)
        return loader, store

    return make
