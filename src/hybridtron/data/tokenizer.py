"""Byte-level BPE tokenizer (Hugging Face `tokenizers`), trained on the corpus on first use and cached.

Recipe: GPT-2 style byte-level pre-tokenization (lossless for any UTF-8 text, so `decode(encode(s)) == s`),
by default after splitting every digit off as its own pre-token (`digits="individual"`, as LLaMA's SentencePiece
`split_digits` and Qwen2's `\p{N}` pattern do: GPT-2's merges spell a number differently after a space, a "(" or a
"{", so a model cannot copy it token for token from a prompt or a tool's output into a call or an answer), BPE
merges learned from a deterministic sample of the corpus (documents ordered by a hash of their id, taken until
`max_train_chars`), `min_frequency=2`. The special tokens come first so their ids are fixed and match
`ModelConfig`'s defaults: pad=0, bos=1, eos=2, then the chat, reasoning, rollout-outcome, file-header and tool
tokens that post-training and the data mixture use (`SPECIAL_TOKENS`).

Any `tokenizer.json` can be loaded instead. Its pad/bos/eos are found by our names or common aliases (`<s>`,
`</s>`, `<|endoftext|>`, ...); special tokens it lacks are appended to its vocabulary, so every hybridtron
tokenizer has all of them (then pad/bos/eos need not be 0/1/2: set ModelConfig from `pad_id`/`bos_id`/`eos_id`).

The trained tokenizer is cached as `<cache_dir>/tokenizers/<key>/tokenizer.json`, key = hash of the corpus
fingerprint, vocabulary size, sample size and this recipe's version.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from hybridtron.files import atomic_write_text

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"
SUCCESS, FAILURE = "<|success|>", "<|failure|>"  # outcome tag in front of a synthetic rollout document
FILE_TOKEN = "<|file|>"  # path header of a file inside a stitched repository document
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
SPECIAL_TOKENS = (
    PAD, BOS, EOS, IM_START, IM_END, THINK_START, THINK_END, SUCCESS, FAILURE, FILE_TOKEN,
    TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END,
)
# Where a foreign tokenizer.json spells pad/bos/eos differently.
ALIASES = {
    PAD: ("<pad>", "[PAD]", "<|padding|>", "<|finetune_right_pad_id|>"),
    BOS: ("<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>", "[BOS]"),
    EOS: ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[EOS]"),
}
RECIPE_VERSION = 1
DIGITS = ("individual", "merged")
MIN_VOCAB_SIZE = 512  # 256 byte symbols + the special tokens + room for merges


class Tokenizer:
    """A thin wrapper over a `tokenizers.Tokenizer` that knows hybridtron's special tokens.

    `encode` never adds special tokens by itself (the packer places bos/eos); text that contains a special
    token's string (such as `<|success|>`) is encoded to that token's id.
    """

    def __init__(self, backend: BackendTokenizer):
        self.backend = backend
        vocab = backend.get_vocab(with_added_tokens=True)
        missing = []
        self.special_ids: dict[str, int] = {}
        for token in SPECIAL_TOKENS:
            found = next((name for name in (token, *ALIASES.get(token, ())) if name in vocab), None)
            if found is None:
                missing.append(token)
            else:
                self.special_ids[token] = vocab[found]
        if missing:
            backend.add_special_tokens(missing)
            for token in missing:
                self.special_ids[token] = backend.token_to_id(token)
        self.appended_special_tokens = tuple(missing)  # ids past the vocabulary a model was trained with

    # ------------------------------------------------------------------------------------ construction
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, digits: str = "individual") -> "Tokenizer":
        """Learn byte-level BPE merges on `texts`; ids 0.. are `SPECIAL_TOKENS` in order. `digits` (`DIGITS`):
        "merged" lets BPE merge a run of digits as it merges letters; "individual" makes every digit a token."""
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"vocab_size: {vocab_size} is too small; expected at least {MIN_VOCAB_SIZE}")
        if digits not in DIGITS:
            raise ValueError(f"tokenizer digits: expected one of {DIGITS}, got {digits!r}")
        backend = BackendTokenizer(models.BPE())
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.pre_tokenizer = byte_level if digits == "merged" else pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer)
        return cls(backend)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load a `tokenizer.json` file (or the `tokenizer.json` inside a directory)."""
        path = _tokenizer_file(path)
        if not path.is_file():
            raise ValueError(f"tokenizer: {path} does not exist; expected a tokenizer.json file or its directory")
        try:
            backend = BackendTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
            raise ValueError(f"tokenizer: {path} is not a valid tokenizer.json ({exc})") from exc
        return cls(backend)

    def save(self, path: str | os.PathLike) -> Path:
        """Write `path` if it ends in `.json`, else `path/tokenizer.json`; returns the file written."""
        path = _tokenizer_file(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, self.backend.to_str())
        return path

    # --------------------------------------------------------------------------------------- encoding
    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts at once (parallel in Rust)."""
        return [encoding.ids for encoding in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        token_id = self.special_ids.get(token, self.backend.token_to_id(token))
        if token_id is None:
            raise ValueError(f"token {token!r} is not in the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        return self.special_ids[PAD]

    @property
    def bos_id(self) -> int:
        return self.special_ids[BOS]

    @property
    def eos_id(self) -> int:
        return self.special_ids[EOS]

    @property
    def fingerprint(self) -> str:
        """The encoding's identity. The post-processor is left out: `encode` never applies it, and an export's adds
        bos for other readers (`data.chat.save_tokenizer_files`), so the exported tokenizer is the trained one."""
        backend = self.backend
        if backend.post_processor is not None:
            backend = BackendTokenizer.from_str(backend.to_str())
            backend.post_processor = None
        return hashlib.sha256(backend.to_str().encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, pad={self.pad_id}, bos={self.bos_id}, eos={self.eos_id})"


def training_sample(texts_by_id: Iterable[tuple[str, str]], max_chars: int) -> list[str]:
    """Deterministic sample for BPE training: texts ordered by sha1 of their id (which spreads the sample
    over all buckets), taken until `max_chars` characters."""
    ordered = sorted(texts_by_id, key=lambda item: hashlib.sha1(item[0].encode()).digest())
    sample, total = [], 0
    for _, text in ordered:
        if total >= max_chars:
            break
        sample.append(text[: max_chars - total])
        total += len(sample[-1])
    return sample


def cached_tokenizer(
    texts_by_id: Sequence[tuple[str, str]],
    corpus_fingerprint: str,
    vocab_size: int,
    cache_dir: str | os.PathLike,
    max_train_chars: int,
    digits: str = "individual",
) -> Tokenizer:
    """Train (or reuse from `cache_dir`) the byte-level BPE tokenizer of a corpus."""
    recipe = [corpus_fingerprint, vocab_size, max_train_chars, RECIPE_VERSION]
    key_text = json.dumps(recipe + ([digits] if digits != "merged" else []))  # merged: the keys from before `digits`
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    path = Path(cache_dir) / "tokenizers" / key / "tokenizer.json"
    if path.is_file():
        return Tokenizer.load(path)
    tokenizer = Tokenizer.train(training_sample(texts_by_id, max_train_chars), vocab_size, digits)
    tokenizer.save(path)
    return tokenizer


def _tokenizer_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path if path.suffix == ".json" else path / "tokenizer.json"
