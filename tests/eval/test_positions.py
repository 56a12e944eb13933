"""Loss by position (hybridtron.eval.positions): the buckets and their token counts, the blockwise CE against the
plain CE of the logits, the deterministic draw of windows from long documents, the table / JSON / plot, and the
one-line refusals (a length beyond the model or the machine, documents too short, a tokenizer that does not
match, a checkpoint without its tokenizer)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from hybridtron.checkpoint import save_pretrained
from hybridtron.data.corpus import Document
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.eval import positions
from hybridtron.eval.positions import (
    DocumentWindows, bucket_ce_sums, check_length, forward_memory_bytes, load_model_and_tokenizer, loss_by_position,
    parse_lengths, plot_position_loss, position_buckets, source_documents,
)
from hybridtron.model.lm import HybridLM

WORDS = ("def", "return", "self", "value", "for", "in", "range", "if", "else", "import", "class", "None")


def document(index: int, words: int) -> Document:
    """A code-like text of `words` words (a few tokens each), named by `index`."""
    generator = torch.Generator().manual_seed(index)
    text = " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (words,), generator=generator))
    return Document(f"doc{index}", text, "test", f"doc{index}")


@pytest.fixture(scope="module")
def documents():
    """Eight long documents and four short ones."""
    return [document(i, 400) for i in range(8)] + [document(100 + i, 5) for i in range(4)]


@pytest.fixture(scope="module")
def tokenizer(documents):
    return Tokenizer.train([d.text for d in documents], 512)


@pytest.fixture(scope="module")
def model(small_config):
    torch.manual_seed(0)
    return HybridLM(small_config(vocab_size=512, max_position_embeddings=256)).eval()


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


# -------------------------------------------------------------------------------------- buckets and lengths
def test_buckets_are_powers_of_two_or_a_fixed_width():
    assert position_buckets(8) == [(0, 1), (1, 2), (2, 4), (4, 8)]
    assert position_buckets(10) == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 10)]
    assert position_buckets(1) == [(0, 1)]
    assert position_buckets(8, bucket_width=3) == [(0, 3), (3, 6), (6, 8)]
    # a shorter length's buckets are the longer one's, so the table's rows line up
    assert position_buckets(64)[:len(position_buckets(32))] == position_buckets(32)
    for length, width in ((0, None), (8, 0)):
        with pytest.raises(ValueError) as error:
            position_buckets(length, width)
        one_line(error)


def test_lengths_read_k_and_m_as_powers_of_two():
    assert parse_lengths("1k,4K, 16k,300,1m") == [1024, 4096, 16384, 300, 1024 ** 2]
    for bad in ("1x", "k", "0", "1k,,2k", "-4"):
        with pytest.raises(ValueError) as error:
            parse_lengths(bad)
        assert "1k,4k,16k" in one_line(error)


# -------------------------------------------------------------------------------------------- the loss
def test_the_blockwise_ce_is_the_plain_ce_of_the_logits(model, monkeypatch):
    ids = torch.randint(0, 512, (97,))
    buckets = position_buckets(96)
    with torch.no_grad():
        logits = model(ids[None, :-1], mtp=False).logits[0]
    per_token = F.cross_entropy(logits.double(), ids[1:], reduction="none")
    expected = torch.stack([per_token[start:end].sum() for start, end in buckets])
    # blocks of 7 rows (one block's logits at a time), so that the buckets span several blocks
    monkeypatch.setattr("hybridtron.ops.linear_cross_entropy.BLOCK_ELEMENTS", 7 * 512)
    got = bucket_ce_sums(model, ids, buckets)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_buckets_and_counts_over_deterministic_windows(model, tokenizer, documents):
    result = loss_by_position(model, tokenizer, [16, 64], documents=documents, source="test docs", windows=3)
    short, long = result.lengths
    assert [b for b in long.buckets] == [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64)]
    assert long.tokens == tuple(3 * (end - start) for start, end in long.buckets) and long.windows == 3
    assert short.buckets == long.buckets[:5]
    # the windows of both lengths start at the same documents: the first 16 positions score the same tokens
    torch.testing.assert_close(torch.tensor(short.mean_ce), torch.tensor(long.mean_ce[:5]), rtol=1e-5, atol=1e-5)

    # each bucket's mean is the mean CE of its positions over the drawn windows (bos + the document's start)
    windows = DocumentWindows(documents, tokenizer, seed=0).windows(64, 3, 512)
    assert windows.shape == (3, 65) and (windows[:, 0] == tokenizer.bos_id).all()
    with torch.no_grad():
        ce = torch.stack([F.cross_entropy(model(w[None, :-1], mtp=False).logits[0], w[1:], reduction="none")
                          for w in windows])
    expected = [ce[:, start:end].mean().item() for start, end in long.buckets]
    assert long.mean_ce == pytest.approx(expected, rel=1e-5)
    assert long.overall_ce == pytest.approx(ce.mean().item(), rel=1e-5)

    # the draw depends on the seed and the documents, not on their order in the list
    assert torch.equal(DocumentWindows(documents[::-1], tokenizer, seed=0).windows(64, 3, 512), windows)
    assert not torch.equal(DocumentWindows(documents, tokenizer, seed=1).windows(64, 3, 512), windows)


def test_fewer_long_documents_than_windows_give_their_later_windows_too(model, tokenizer, documents):
    drawn = DocumentWindows(documents, tokenizer, seed=0)
    firsts = drawn.windows(32, 8, 512)  # the eight long documents' starts; the short ones never fill 33 tokens
    assert (firsts[:, 0] == tokenizer.bos_id).all()
    more = drawn.windows(32, 1000, 512)
    assert torch.equal(more[:8], firsts)
    lengths = {i: len(drawn.tokens[i]) for i in drawn.tokens if len(drawn.tokens[i]) >= 33}
    # then each document's next windows, consecutive: tokens 32 .. 64, 64 .. 96, ... while they last
    assert len(more) == sum((n - 1) // 32 for n in lengths.values())
    second = drawn.tokens[next(iter(lengths))][32:65]
    assert any(torch.equal(window, torch.from_numpy(second).long()) for window in more[8:])
    result = loss_by_position(model, tokenizer, [32], documents=documents, source="test docs", windows=1000)
    assert result.lengths[0].windows == len(more) and result.lengths[0].tokens[-1] == len(more) * 16


def test_a_data_source_is_read_with_its_long_documents_whole(model, tokenizer, tmp_path):
    path = tmp_path / "long.jsonl"
    texts = [document(i, 400).text for i in range(2)] + [document(2, 6000).text]  # the last: ~40K characters
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    documents = source_documents(str(path))
    assert [d.text for d in documents] == texts  # not cut at pretraining's 32K characters a document
    result = loss_by_position(model, tokenizer, [16], source=str(path), windows=2)
    assert result.source == str(path) and result.lengths[0].windows == 2


def test_table_json_and_plot(model, tokenizer, documents, tmp_path):
    result = loss_by_position(model, tokenizer, [8, 32], documents=documents, source="test docs", windows=2,
                              bucket_width=8)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["source"] == "test docs" and data["buckets"] == "width 8"
    assert [entry["length"] for entry in data["lengths"]] == [8, 32]
    assert data["lengths"][1]["buckets"][3] == {"start": 24, "end": 32, "mean_ce": result.lengths[1].mean_ce[3],
                                                "tokens": 16}
    table = result.format_table().splitlines()
    assert table[1].split() == ["positions", "L=8", "L=32"]
    assert table[2].split()[0] == "0-7" and len(table[2].split()) == 3  # both lengths have positions 0-7
    assert table[3].split()[0] == "8-15" and len(table[3].split()) == 2  # only L=32 reaches past 8
    assert table[-1].split() == ["windows", "2", "2"]
    pytest.importorskip("matplotlib")  # the optional `plots` extra
    png = plot_position_loss(result, tmp_path / "loss.png", training_length=16)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------- refusals
def test_a_length_beyond_the_model_or_the_machine_is_refused(model, monkeypatch):
    with pytest.raises(ValueError) as error:
        check_length(model, 257)
    assert "max_position_embeddings (256)" in one_line(error)
    needed = forward_memory_bytes(model.config, 256)
    monkeypatch.setattr(positions, "available_memory", lambda device: needed - 1)
    with pytest.raises(ValueError) as error:
        check_length(model, 256)
    assert "needs about" in one_line(error) and "available" in str(error.value)
    monkeypatch.setattr(positions, "available_memory", lambda device: needed)
    check_length(model, 256)


def test_the_memory_estimate_grows_with_the_length(small_config):
    config = small_config()
    assert forward_memory_bytes(config, 2048) > forward_memory_bytes(config, 1024) > 1024 * config.hidden_size * 4


def test_documents_too_short_or_a_tokenizer_that_does_not_match(model, tokenizer, documents):
    with pytest.raises(ValueError) as error:
        loss_by_position(model, tokenizer, [200], documents=documents[8:], source="short docs", windows=2)
    assert one_line(error).startswith("short docs: no document reaches 201 tokens")
    with pytest.raises(ValueError) as error:
        DocumentWindows(documents, tokenizer, name="docs").windows(16, 2, vocab_size=100)
    assert "beyond the model's vocab_size 100" in one_line(error)


def test_a_checkpoint_without_its_tokenizer_is_refused(model, tmp_path):
    save_pretrained(model, tmp_path / "hf")
    with pytest.raises(ValueError) as error:
        load_model_and_tokenizer(tmp_path / "hf")
    assert "no tokenizer.json" in one_line(error)
