"""Packing (labels never cross a document; seq_idx, the document mask), weighted sampling, exact resume, the
validation split, build_data."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridtron.data import DataConfig, build_data
from hybridtron.data.batch import TokenBatch
from hybridtron.data.loader import BLOCK, validation_batches
from hybridtron.data.packing import pack_rows, pack_rows_ref
from hybridtron.ops.cross_entropy import IGNORE_INDEX

LENGTHS = {"a": [3, 7, 1, 12, 5], "b": [40, 2, 9], "c": [4] * 20, "d": [25, 31]}


def _document_of(token: int) -> int | None:
    return token - 10 if token >= 10 else None  # synthetic store: token 10 + d belongs to document d


def test_labels_are_next_tokens_and_never_cross_a_document(synthetic_loader):
    loader, _ = synthetic_loader(LENGTHS, [0.25] * 4, seq_len=16, batch_size=3)
    BOS, EOS = loader.bos_id, loader.eos_id
    batches = [next(loader) for _ in range(30)]
    assert all(batch.seq_idx is None for batch in batches)  # no document mask by default
    ids = torch.cat([batch.input_ids for batch in batches]).flatten()
    labels = torch.cat([batch.labels for batch in batches]).flatten()
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


def _fields(batch: TokenBatch) -> list:
    return [batch.input_ids, batch.labels, batch.seq_idx, batch.following_ids]


def _same_batch(a: TokenBatch, b: TokenBatch) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(_fields(a), _fields(b)))


@pytest.mark.parametrize("document_mask", [False, True])
def test_pack_rows_matches_reference(document_mask):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 100, size=6 * 8 + 1)
    starts = rng.random(6 * 8 + 1) < 0.2
    padding = np.zeros(len(ids), dtype=bool)
    padding[37:] = True  # a padded tail across two rows: one document for seq_idx, each token its own for labels
    starts[37:] = True
    for pad in (None, padding):
        fast = pack_rows(ids, starts, 8, document_mask=document_mask, padding_N=pad)
        ref = pack_rows_ref(ids, starts, 8, document_mask=document_mask, padding_N=pad)
        for tensor in (fast.input_ids, fast.labels) + ((fast.seq_idx,) if document_mask else ()):
            assert tensor.dtype == torch.int64 and tensor.shape == (6, 8)
        assert _same_batch(fast, ref)
        assert (fast.seq_idx is None) == (not document_mask)


def test_seq_idx_counts_documents_within_each_row(synthetic_loader, seq_idx_by_hand):
    loader, _ = synthetic_loader(LENGTHS, [0.25] * 4, seq_len=16, batch_size=3, document_mask=True)
    plain, _ = synthetic_loader(LENGTHS, [0.25] * 4, seq_len=16, batch_size=3)
    opened_mid_document = opened_at_bos = 0
    for _ in range(30):
        batch, unmasked = next(loader), next(plain)
        # the mask adds seq_idx and changes nothing else: the stream is the same
        assert torch.equal(batch.input_ids, unmasked.input_ids) and torch.equal(batch.labels, unmasked.labels)
        seq_idx = batch.seq_idx
        assert seq_idx.dtype == torch.int64 and seq_idx.shape == batch.input_ids.shape
        assert (seq_idx[:, 0] == 0).all() and (seq_idx[:, 1:] >= seq_idx[:, :-1]).all()
        assert torch.equal(seq_idx, seq_idx_by_hand(batch.input_ids, loader.bos_id))
        # within a document the synthetic tokens name one document; across an index change, the next one
        for row_ids, row_idx in zip(batch.input_ids.tolist(), seq_idx.tolist()):
            documents = {}
            for token, index in zip(row_ids, row_idx):
                if _document_of(token) is not None:
                    assert documents.setdefault(index, _document_of(token)) == _document_of(token)
            opened_at_bos += row_ids[0] == loader.bos_id
            opened_mid_document += row_ids[0] != loader.bos_id
    assert opened_at_bos and opened_mid_document  # both kinds of row start were checked


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
    ids = torch.cat([next(loader).input_ids.flatten() for _ in range(400)]).numpy()
    documents = ids[ids >= 10] - 10
    first_document_of_next_bucket = np.cumsum([len(v) for v in LENGTHS.values()])
    tokens = np.bincount(np.searchsorted(first_document_of_next_bucket, documents, side="right"), minlength=4)
    shares = tokens / tokens.sum()
    # text-token shares differ from packed-token weights by the bos/eos overhead of each bucket's documents
    text_fraction = np.array([np.mean(v) / (np.mean(v) + 2) for v in LENGTHS.values()])
    expected = np.array(weights) * text_fraction / (np.array(weights) * text_fraction).sum()
    assert shares == pytest.approx(expected, abs=0.02), shares


@pytest.mark.parametrize("document_mask", [False, True])
def test_resume_repeats_and_skips_nothing(synthetic_loader, document_mask):
    def fresh():
        return synthetic_loader(LENGTHS, [0.1, 0.2, 0.3, 0.4], seq_len=16, batch_size=3, seed=5,
                                document_mask=document_mask)[0]

    # N batches, save, M more; a fresh loader restored from the state must produce the same M (seq_idx too)
    for n, m in [(0, 3), (7, 5), (1100, 20)]:  # 1100 batches: past the first 4096-draw RNG block
        loader = fresh()
        for _ in range(n):
            next(loader)
        state = json.loads(json.dumps(loader.state_dict()))  # the state survives a JSON checkpoint
        expected = [next(loader) for _ in range(m)]
        restored = fresh()
        restored.load_state_dict(state)
        for batch, again in zip(expected, (next(restored) for _ in range(m))):
            assert _same_batch(batch, again)
            assert (again.seq_idx is not None) == document_mask
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
        seen += [t - 10 for t in next(loader).input_ids.flatten().tolist() if t >= 10]
    documents = [seen[i] for i in range(0, len(seen), 2)]
    for epoch in range(3):
        assert sorted(documents[10 * epoch:10 * (epoch + 1)]) == list(range(10))
    assert documents[:10] != documents[10:20]  # a fresh order each epoch


# ------------------------------------------------------------------------------------------- build_data
def test_build_data_end_to_end(small_bundle, small_data_config):
    bundle = small_bundle
    batch = next(bundle.train_loader)
    x, y = batch.input_ids, batch.labels
    assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.int64
    assert batch.seq_idx is None and not small_data_config().document_mask  # off by default
    assert int(x.max()) < bundle.tokenizer.vocab_size and bundle.tokenizer.vocab_size <= 512
    assert bundle.stats["buckets"] == len(bundle.mixture_report.buckets)
    assert {b.name.split("/")[0] for b in bundle.mixture_report.buckets} == {"json", "config", "re"}
    assert sum(b.weight for b in bundle.mixture_report.buckets) == pytest.approx(1.0)
    assert bundle.stats["train_documents"] + bundle.stats["val_documents"] == bundle.stats["documents"]
    # a second build reuses the caches and yields the same batches
    again = build_data(small_data_config())
    assert again.stats["seconds"]["tokenizer"] < 0.5 and again.stats["seconds"]["tokenize"] < 0.5
    assert _same_batch(next(again.train_loader), batch)


def test_validation_split_is_fixed_and_disjoint(small_bundle, small_data_config):
    val = small_bundle.val_batches
    assert 0 < len(val) <= 8
    assert all(v.input_ids.shape[1] == 64 and v.seq_idx is None for v in val)
    train_starts = {int(s) for b in small_bundle.train_loader.buckets for s in b.starts}
    store = small_bundle.train_loader.store
    other_seed = build_data(small_data_config(seed=3))
    for batch, other in zip(val, other_seed.val_batches):  # the split does not depend on the seed
        assert _same_batch(batch, other)
    # the held-out documents are exactly those not drawn for training
    n_val = small_bundle.stats["val_documents"]
    assert len(train_starts) + n_val == len(store)
    assert n_val > 0


def test_validation_batches_pad_the_tail(small_data_config):
    bundle = build_data(small_data_config(val_batches=None, val_fraction=0.05))
    report, tokenizer = bundle.mixture_report, bundle.tokenizer
    inputs = torch.cat([batch.input_ids for batch in bundle.val_batches])
    labels = torch.cat([batch.labels for batch in bundle.val_batches])
    # rows of 64 cover the whole held-out stream; the tail of the last row is padding that is never a target
    assert inputs.shape[0] == -(-(report.val_tokens - 1) // 64)
    pads = inputs == tokenizer.pad_id
    assert int(pads.sum()) == inputs.numel() - report.val_tokens  # stream of rows*T + 1 tokens, last one peeked
    assert (labels[pads] == IGNORE_INDEX).all()
    # every held-out token except each document's bos is a target exactly once
    assert int((labels != IGNORE_INDEX).sum()) == report.val_tokens - report.val_documents


def test_document_mask_of_build_data(small_data_config, seq_idx_by_hand):
    """data.document_mask=true: training and validation batches carry seq_idx; the stream is unchanged."""
    masked = build_data(small_data_config(document_mask=True, val_batches=None))
    plain = build_data(small_data_config(val_batches=None))
    assert masked.train_loader.fingerprint == plain.train_loader.fingerprint  # the mask is not the data
    bos, pad = masked.tokenizer.bos_id, masked.tokenizer.pad_id
    for _ in range(3):
        batch, unmasked = next(masked.train_loader), next(plain.train_loader)
        assert torch.equal(batch.input_ids, unmasked.input_ids) and torch.equal(batch.labels, unmasked.labels)
        assert torch.equal(batch.seq_idx, seq_idx_by_hand(batch.input_ids, bos))
    for batch, unmasked in zip(masked.val_batches, plain.val_batches, strict=True):
        assert unmasked.seq_idx is None
        assert torch.equal(batch.input_ids, unmasked.input_ids) and torch.equal(batch.labels, unmasked.labels)
        seq_idx, ids = batch.seq_idx, batch.input_ids
        assert (seq_idx[:, 0] == 0).all() and (seq_idx[:, 1:] >= seq_idx[:, :-1]).all()
        starts = (seq_idx[:, 1:] != seq_idx[:, :-1])
        pad_opens = (ids[:, 1:] == pad) & (ids[:, :-1] != pad)  # the padded tail: one document of its own
        assert torch.equal(starts, (ids[:, 1:] == bos) | pad_opens)
    last = masked.val_batches[-1]
    assert (last.input_ids[-1] == pad).sum() > 1  # the tail checked above holds several pad tokens


def test_validation_padding_is_one_document(synthetic_loader):
    """A hand-built held-out stream, `bos 10 10 eos bos 11 eos` then padding, in rows of 5."""
    _, store = synthetic_loader({"a": [2, 1]}, [1.0])
    BOS_, EOS_, PAD = 1, 2, 0
    [batch] = validation_batches(store, [0, 1], seq_len=5, batch_size=4, max_batches=None, bos_id=BOS_,
                                 eos_id=EOS_, pad_id=PAD, document_mask=True)
    assert batch.input_ids.tolist() == [[BOS_, 10, 10, EOS_, BOS_], [11, EOS_, PAD, PAD, PAD]]
    # the first row opens at its bos (0) and starts one more at the next; the second opens mid-document (0)
    assert batch.seq_idx.tolist() == [[0, 0, 0, 0, 1], [0, 0, 1, 1, 1]]
    assert batch.labels.tolist() == [[10, 10, EOS_, IGNORE_INDEX, 11], [EOS_] + [IGNORE_INDEX] * 4]
    plain = validation_batches(store, [0, 1], seq_len=5, batch_size=4, max_batches=None, bos_id=BOS_,
                               eos_id=EOS_, pad_id=PAD)
    assert plain[0].seq_idx is None and torch.equal(plain[0].labels, batch.labels)


def test_budget_overrides_from_the_training_loop(small_data_config):
    bundle = build_data(small_data_config(), seq_len=32, batch_size=2, total_sequences=100, val_batches=1)
    assert next(bundle.train_loader).input_ids.shape == (2, 32)
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
    seen = torch.cat([next(bundle.train_loader).input_ids.flatten() for _ in range(60)])
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
    with pytest.raises(ValueError, match="data.document_mask: expected true or false, got 'yes'"):
        DataConfig(document_mask="yes")
    assert "document_mask" not in DataConfig.RESUMABLE  # a resume may not change what the model computes
    assert DataConfig(source="a.jsonl").source == ("a.jsonl",)
    with pytest.raises(ValueError, match="data.val_fraction: 0.001 holds out no document"):
        build_data(small_data_config(val_fraction=0.001))
    assert build_data(small_data_config(val_fraction=0.0)).val_batches == []
