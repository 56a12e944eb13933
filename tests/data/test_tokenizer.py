"""The byte-level BPE tokenizer: fixed special ids, lossless round trip, caching, foreign tokenizer.json files."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from hybridtron.config import ModelConfig
from hybridtron.data import SPECIAL_TOKENS, DataConfig, Tokenizer, load_documents
from hybridtron.data.tokenizer import BOS, EOS, PAD, SUCCESS, cached_tokenizer, training_sample

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
    "for i in range(10):\n    print(i * i)\n",
] * 30


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(TEXTS, vocab_size=600)


def test_special_ids_match_model_config_defaults(tokenizer):
    defaults = ModelConfig()
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (
        defaults.pad_token_id, defaults.bos_token_id, defaults.eos_token_id)
    assert [tokenizer.token_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tokenizer.vocab_size <= 600


def test_round_trip_is_lossless(tokenizer):
    texts = ["def f(x):\n\treturn x  # tab, spaces\n", "naïve café ☕ 日本語 \u0000 emoji 🐍", "", "   \n\n  "]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = tokenizer.encode(f"{SUCCESS}print(1)")
    assert ids[0] == tokenizer.token_id(SUCCESS)  # special-token strings in text map to their ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "print(1)"
    assert tokenizer.encode_batch(["a b", "c"]) == [tokenizer.encode("a b"), tokenizer.encode("c")]


def test_training_compresses_the_training_text(tokenizer):
    text = TEXTS[0]
    assert len(tokenizer.encode(text)) < len(text.encode()) / 2  # 13 tokens: about one per word


def test_save_and_load(tokenizer, tmp_path):
    path = tokenizer.save(tmp_path / "tok")
    assert path == tmp_path / "tok" / "tokenizer.json"
    loaded = Tokenizer.load(tmp_path / "tok")
    assert loaded.fingerprint == tokenizer.fingerprint
    assert loaded.encode(TEXTS[1]) == tokenizer.encode(TEXTS[1])
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.load(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        Tokenizer.load(tmp_path / "broken.json")


def test_foreign_tokenizer_keeps_its_ids_and_gains_missing_specials(tmp_path):
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    foreign = Tokenizer.load(tmp_path / "tokenizer.json")
    assert (foreign.bos_id, foreign.eos_id) == (1, 2)  # found by their aliases <s>, </s>
    assert foreign.pad_id >= 3  # <|pad|> was missing: appended after the existing vocabulary
    assert set(foreign.special_ids) == set(SPECIAL_TOKENS)
    assert len(set(foreign.special_ids.values())) == len(SPECIAL_TOKENS)


NUMBERS = ["What is 123456789 * 987?", "print(123456789 * 987)", "\\boxed{123456789}",
           "<tool_response>\n123456789\n"] * 20


def test_digits_are_spelt_alike_wherever_a_number_stands():
    """By default every digit is a token, so the number a tool printed after a newline is the same ids inside a
    call's "(" or an answer's "{"; GPT-2's merged digits ("merged") spell it differently after a space."""
    def spelt_alike(tokenizer):
        number = tokenizer.encode("123456789")
        return [any(ids[k:k + len(number)] == number for k in range(len(ids)))
                for ids in map(tokenizer.encode, NUMBERS[:4])]
    individual = Tokenizer.train(NUMBERS + TEXTS, vocab_size=600)
    assert len(individual.encode("123456789")) == 9
    assert spelt_alike(individual) == [True] * 4
    merged = Tokenizer.train(NUMBERS + TEXTS, vocab_size=600, digits="merged")
    assert len(merged.encode(" 123456789")) < 9  # runs of digits merged, as before `digits` existed
    assert not all(spelt_alike(merged))
    for text in NUMBERS[:4]:
        assert individual.decode(individual.encode(text)) == text
    with pytest.raises(ValueError, match="tokenizer digits: expected one of"):
        Tokenizer.train(TEXTS, vocab_size=600, digits="grouped")
    with pytest.raises(ValueError, match="data.tokenizer_digits: expected one of individual, merged"):
        DataConfig(tokenizer_digits="grouped")


def test_vocab_size_too_small():
    with pytest.raises(ValueError, match="vocab_size: 100 is too small"):
        Tokenizer.train(TEXTS, vocab_size=100)


def test_cache_reuse_and_key(tmp_path, monkeypatch):
    texts = [(f"doc{i}", text) for i, text in enumerate(TEXTS)]
    first = cached_tokenizer(texts, "fingerprint-a", 600, tmp_path, 10_000)

    def no_training(*args, **kwargs):
        raise AssertionError("trained again instead of reusing the cache")

    monkeypatch.setattr(Tokenizer, "train", no_training)
    again = cached_tokenizer(texts, "fingerprint-a", 600, tmp_path, 10_000)
    assert again.fingerprint == first.fingerprint
    with pytest.raises(AssertionError, match="trained again"):  # another corpus or size is another key
        cached_tokenizer(texts, "fingerprint-b", 600, tmp_path, 10_000)
    with pytest.raises(AssertionError, match="trained again"):
        cached_tokenizer(texts, "fingerprint-a", 700, tmp_path, 10_000)
    with pytest.raises(AssertionError, match="trained again"):  # the digits rule is part of the key
        cached_tokenizer(texts, "fingerprint-a", 600, tmp_path, 10_000, digits="merged")


def test_training_sample_is_deterministic_and_capped():
    items = [(f"id{i}", "x" * 100) for i in range(50)]
    sample = training_sample(items, 1050)
    assert sum(map(len, sample)) == 1050 and len(sample) == 11
    assert training_sample(list(reversed(items)), 1050) == sample  # order of the corpus does not matter


def test_stdlib_tokenizer_is_deterministic(tmp_path):
    docs = load_documents(DataConfig(families=("json",)))
    texts = [(d.doc_id, d.text) for d in docs]
    one = Tokenizer.train(training_sample(texts, 10**6), 512)
    two = Tokenizer.train(training_sample(texts, 10**6), 512)
    assert one.fingerprint == two.fingerprint
    assert all(one.decode(one.encode(d.text)) == d.text for d in docs)
    assert {PAD, BOS, EOS} <= set(one.special_ids)
