"""Packing (labels never cross a document), weighted sampling, exact resume, the validation split, build_data."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridtron.data import DataConfig, build_data
from hybridtron.data.loader import BLOCK
from hybridtron.data.packing import pack_rows, pack_rows_ref
from hybridtron.ops.cross_entropy import IGNORE_INDEX

LENGTHS = {"a": [3, 7, 1, 12, 5], "b": [40, 2, 9], "c": [4] * 20, "d": [25, 31]}


def _document_of(token: int) -> int | None:
    return token - 10 if token >= 10 else None  # synthetic store: token 10 + d belongs to document d


def test_labels_are_next_tokens_and_never_cross_a_document(synthetic_loader):
    loader, _ = synthetic_loader(LENGTHS, [0.25] * 4, seq_len=16, batch_size=3)
    BOS, EOS = loader.bos_id, loader.eos_id
    rows, labels = zip(*(next(loader) for _ in range(30)))
    ids = torch.cat(rows).flatten()
    labels = torch.cat(labels).flatten()
    # the stream is contiguous across rows and batches: each label is the next input token, or -100
    for t in range(len(ids) - 1):
        current, following = int(ids[t]), int(ids[t + 1])
        if following == BOS:
            assert labels[t] == IGNORE_INDEX, t  # the next document's bos is never a target
            assert current == EOS  # every complete document ended with its eos before it
        else:
            assert labels[t] == following, t
            doc_now, doc_next = _document_of(current), _document_of(following)
            # within one document: bos -> text -> eos, the same document id throughout
            assert current != EOS
            assert doc_now is None or doc_next is None or doc_now == doc_next
    masked = labels == IGNORE_INDEX
    assert masked.any() and (ids[1:][masked[:-1]] == BOS).all()
    assert 10 not in (BOS, EOS)  # special ids below the synthetic text tokens


def test_pack_rows_matches_reference():
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 100, size=4 * 8 + 1)
    starts = rng.random(4 * 8 + 1) < 0.2
    for fast, ref in zip(pack_rows(ids, starts, 8), pack_rows_ref(ids, starts, 8)):
        assert fast.dtype == torch.int64 and fast.shape == (4, 8)
        assert torch.equal(fast, ref)


def test_bucket_draws_within_binomial_confidence(synthetic_loader):
    weights = [0.1, 0.2, 0.3, 0.4]
    loader, _ = synthetic_loader(LENGTHS, weights)
    n = 3 * BLOCK  # spans several RNG blocks
    counts = np.bincount([loader.bucket_of_draw(i) for i in range(n)], minlength=4)
    p = loader.probabilities
    z = (counts - n * p) / np.sqrt(n * p * (1 - p))
    assert np.all(np.abs(z) < 4.0), z  # 4 sigma per bucket
    # draw probabilities are weight / mean packed length, so the expected token shares are the weights
    mean_packed = np.array([np.mean(v) + 2 for v in LENGTHS.values()])
    token_share = p * mean_packed / (p * mean_packed).sum()
    assert token_share == pytest.approx(weights, rel=1e-9)


def test_realized_token_shares_follow_weights(synthetic_loader):
    weights = [0.1, 0.2, 0.3, 0.4]
    loader, _ = synthetic_loader(LENGTHS, weights, seq_len=64, batch_size=8)
    ids = torch.cat([next(loader)[0].flatten() for _ in range(400)]).numpy()
    documents = ids[ids >= 10] - 10
    first_document_of_next_bucket = np.cumsum([len(v) for v in LENGTHS.values()])
    tokens = np.bincount(np.searchsorted(first_document_of_next_bucket, documents, side="right"), minlength=4)
    shares = tokens / tokens.sum()
    # text-token shares differ from packed-token weights by the bos/eos overhead of each bucket's documents
    text_fraction = np.array([np.mean(v) / (np.mean(v) + 2) for v in LENGTHS.values()])
    expected = np.array(weights) * text_fraction / (np.array(weights) * text_fraction).sum()
    assert shares == pytest.approx(expected, abs=0.02), shares


def test_resume_repeats_and_skips_nothing(synthetic_loader):
    def fresh():
        return synthetic_loader(LENGTHS, [0.1, 0.2, 0.3, 0.4], seq_len=16, batch_size=3, seed=5)[0]

    # N batches, save, M more; a fresh loader restored from the state must produce the same M
    for n, m in [(0, 3), (7, 5), (1100, 20)]:  # 1100 batches: past the first 4096-draw RNG block
        loader = fresh()
        for _ in range(n):
            next(loader)
        state = json.loads(json.dumps(loader.state_dict()))  # the state survives a JSON checkpoint
        expected = [next(loader) for _ in range(m)]
        restored = fresh()
        restored.load_state_dict(state)
        for (x, y), (rx, ry) in zip(expected, (next(restored) for _ in range(m))):
            assert torch.equal(x, rx) and torch.equal(y, ry)
    assert state["draw"] > BLOCK


def test_resume_of_a_different_run_is_refused(synthetic_loader):
    loader, _ = synthetic_loader(LENGTHS, [0.25] * 4)
    state = loader.state_dict()
    state["fingerprint"] = "other"
    with pytest.raises(ValueError, match="loader state: it belongs to different data"):
        loader.load_state_dict(state)


def test_every_document_of_a_bucket_once_per_epoch(synthetic_loader):
    loader, store = synthetic_loader({"only": [2] * 10}, [1.0], seq_len=4, batch_size=1)
    seen = []
    for _ in range(3 * 10 * 4 // 4):  # three epochs of 10 documents x 4 packed tokens
        ids, _ = next(loader)
        seen += [t - 10 for t in ids.flatten().tolist() if t >= 10]
    documents = [seen[i] for i in range(0, len(seen), 2)]
    for epoch in range(3):
        assert sorted(documents[10 * epoch:10 * (epoch + 1)]) == list(range(10))
    assert documents[:10] != documents[10:20]  # a fresh order each epoch


# ------------------------------------------------------------------------------------------- build_data
def test_build_data_end_to_end(small_bundle, small_data_config):
    bundle = small_bundle
    x, y = next(bundle.train_loader)
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.int64
    assert int(x.max()) < bundle.tokenizer.vocab_size and bundle.tokenizer.vocab_size <= 512
    assert bundle.stats["buckets"] == len(bundle.mixture_report.buckets)
    assert {b.name.split("/")[0] for b in bundle.mixture_report.buckets} == {"json", "config", "re"}
    assert sum(b.weight for b in bundle.mixture_report.buckets) == pytest.approx(1.0)
    assert bundle.stats["train_documents"] + bundle.stats["val_documents"] == bundle.stats["documents"]
    # a second build reuses the caches and yields the same batches
    again = build_data(small_data_config())
    assert again.stats["seconds"]["tokenizer"] < 0.5 and again.stats["seconds"]["tokenize"] < 0.5
    again_x, again_y = next(again.train_loader)
    assert torch.equal(again_x, x) and torch.equal(again_y, y)


def test_validation_split_is_fixed_and_disjoint(small_bundle, small_data_config):
    val = small_bundle.val_batches
    assert 0 < len(val) <= 8
    assert all(v[0].shape[1] == 64 for v in val)
    train_starts = {int(s) for b in small_bundle.train_loader.buckets for s in b.starts}
    store = small_bundle.train_loader.store
    other_seed = build_data(small_data_config(seed=3))
    for (x, y), (ox, oy) in zip(val, other_seed.val_batches):  # the split does not depend on the seed
        assert torch.equal(x, ox) and torch.equal(y, oy)
    # the held-out documents are exactly those not drawn for training
    n_val = small_bundle.stats["val_documents"]
    assert len(train_starts) + n_val == len(store)
    assert n_val > 0


def test_validation_batches_pad_the_tail(small_data_config):
    bundle = build_data(small_data_config(val_batches=None, val_fraction=0.05))
    report, tokenizer = bundle.mixture_report, bundle.tokenizer
    inputs = torch.cat([x for x, _ in bundle.val_batches])
    labels = torch.cat([y for _, y in bundle.val_batches])
    # rows of 64 cover the whole held-out stream; the tail of the last row is padding that is never a target
    assert inputs.shape[0] == -(-(report.val_tokens - 1) // 64)
    pads = inputs == tokenizer.pad_id
    assert int(pads.sum()) == inputs.numel() - report.val_tokens  # stream of rows*T + 1 tokens, last one peeked
    assert (labels[pads] == IGNORE_INDEX).all()
    # every held-out token except each document's bos is a target exactly once
    assert int((labels != IGNORE_INDEX).sum()) == report.val_tokens - report.val_documents


def test_budget_overrides_from_the_training_loop(small_data_config):
    bundle = build_data(small_data_config(), seq_len=32, batch_size=2, total_sequences=100, val_batches=1)
    assert next(bundle.train_loader)[0].shape == (2, 32)
    assert bundle.mixture_report.total_tokens == 3200
    assert len(bundle.val_batches) == 1


def test_user_data_and_rollouts_in_the_mix(tmp_path, data_cache):
    lines = [json.dumps({"text": f"record {i}: " + "lorem ipsum " * 20, "bucket": "web" if i % 2 else "books"})
             for i in range(40)]
    (tmp_path / "data.jsonl").write_text("\n".join(lines))
    rollouts = [json.dumps({"text": f"attempt {i} " * 10, "success": i % 3 == 0}) for i in range(30)]
    (tmp_path / "rollouts.jsonl").write_text("\n".join(rollouts))
    config = DataConfig(source=str(tmp_path / "data.jsonl"), rollouts=(str(tmp_path / "rollouts.jsonl"),),
                        vocab_size=512, seq_len=32, batch_size=2, cache_dir=data_cache, val_fraction=0.1)
    bundle = build_data(config)
    names = {b.name for b in bundle.mixture_report.buckets}
    assert names == {"web", "books", "rollouts/success", "rollouts/failure"}
    success, failure = bundle.tokenizer.token_id("<|success|>"), bundle.tokenizer.token_id("<|failure|>")
    seen = torch.cat([next(bundle.train_loader)[0].flatten() for _ in range(60)])
    assert (seen == success).any() and (seen == failure).any()
    # the outcome tag comes right after the bos that opens a rollout
    tags = torch.nonzero((seen == success) | (seen == failure)).flatten()
    assert all(seen[i - 1] == bundle.tokenizer.bos_id for i in tags.tolist() if i > 0)


def test_config_validation(small_data_config):
    with pytest.raises(ValueError, match="data.proxy_of: a proxy run needs its own budget"):
        build_data(small_data_config(proxy_of=1000))
    with pytest.raises(ValueError, match="data.proxy_of: 1,000 is smaller than total_tokens 3,200"):
        build_data(small_data_config(proxy_of=1000), seq_len=32, total_sequences=100)
    with pytest.raises(ValueError, match="data.proxy_of: 100 is smaller than total_tokens 1,000"):
        DataConfig(proxy_of=100, total_tokens=1000)
    with pytest.raises(ValueError, match=r"data.val_fraction: expected a number in \[0, 1\)"):
        DataConfig(val_fraction=1.0)
    with pytest.raises(ValueError, match="data.seq_len: expected a positive integer, got 0"):
        DataConfig(seq_len=0)
    assert DataConfig(source="a.jsonl").source == ("a.jsonl",)
    with pytest.raises(ValueError, match="data.val_fraction: 0.001 holds out no document"):
        build_data(small_data_config(val_fraction=0.001))
    assert build_data(small_data_config(val_fraction=0.0)).val_batches == []
