"""Supervised fine-tuning data: conversations -> chat tokens with loss masks -> packed rows -> resumable loader.

Recipe (Nemotron 3 Ultra's SFT stage, at any scale):
1. Conversations come from JSONL, one `{"messages": [...], "domain": "math"}` per line (`domain` optional;
   `tools`, optional, the OpenAI-style tool declarations the conversation was held with, rendered into its system
   turn as at inference; other fields are metadata and ignored), or from a list of such dicts
   (`conversations_from`; the post layer turns `env:NAME` into such a list). Every message is validated by the
   chat format (`hybridtron.data.chat`); a mistake names the file, the line and the field. A conversation needs
   at least one assistant message.
2. Each conversation is rendered in the chat format and tokenized. The loss is on the assistant's tokens only:
   its answers, tool calls and the `<|im_end|>` that closes each of its turns (so the model learns to stop); the
   tool declarations and `tool` messages (the tools' responses) are prompt, never trained.
   Reasoning (`<think>` ... `</think>`, tags included) is masked by default, as the report trained on the answers
   that follow the traces and not on the traces themselves; `train_on_thinking=True` trains on it too.
   Labels follow the model contract (`labels[t]` = the token at t+1 or IGNORE_INDEX), so the last token of a
   conversation has no label and no label crosses into the next conversation.
3. A conversation longer than `seq_len` is truncated to its first `seq_len` tokens (a warning counts them;
   one left with no trained token is dropped and counted). Nothing is split across rows: a continuation without
   its prompt would teach answers to questions the model never saw.
4. Packing: each epoch orders the training conversations by a permutation of `(seed, epoch)` and places them
   first-fit into a window of `pack_window` open rows of `seq_len` tokens (a row leaves the window, in opening
   order, when a new one is needed and the window is full); the rest of a row is pad tokens with label
   IGNORE_INDEX. Conversations sharing a row do not see each other (`document_mask`, on by default): the rows
   carry `seq_idx`, each conversation's index within its row and the pad tail one more, so attention, the Mamba
   scan and its conv restart at every conversation, which is then computed as if it were alone in its row. With
   `document_mask=False` they share the attention and SSM context, as pretraining's documents do by default; each
   opens with bos, the same reset the model saw at every pretraining document.
5. Split: a conversation is held out for validation when a hash of its messages falls below `val_fraction`
   (deterministic, independent of the seed and of the other conversations; duplicates land on the same side).
   At least one conversation is held out when two or more differ. Validation rows are packed once, in hash
   order, and kept fixed (`val_batches` batches at most).
6. `SFTLoader` matches `PackedLoader`: `next()` -> a `TokenBatch` (input_ids [B, T], labels [B, T], seq_idx
   [B, T] with the mask, int64; hybridtron.data.batch), and its position
   (epoch, row) is `state_dict()`; a resumed loader yields the batches an uninterrupted one would. The batch size
   may change on resume, `seq_len` may not (it decides the packing).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from hybridtron.data.batch import TokenBatch
from hybridtron.data.chat import REASONING_HISTORY, Segment, tokenize_chats, validate_messages
from hybridtron.data.corpus import jsonl_records
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.data.tools import check_tools
from hybridtron.model.lm import IGNORE_INDEX

STATE_VERSION = 1
PACK_WINDOW = 64  # open rows first-fit searches: padding falls with it, so does the shuffle's reach
_ENCODE_CHUNK = 64  # conversations per encode_batch call


# ---------------------------------------------------------------------------------------------- reading
def _conversation(record, where: str, require_reply: bool = True) -> dict:
    """`{"messages": [...], "domain": str | None}` from a record, validated; errors are prefixed by `where`.
    `require_reply`: an assistant message must be there (SFT trains on them; a prompt set does not)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with 'messages', got {type(record).__name__}")
    if "messages" not in record:
        raise ValueError(f"{where}: missing the 'messages' field (found {sorted(record)})")
    try:
        checked = validate_messages(record["messages"])
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if require_reply and not any(message.role == "assistant" for message in checked):
        raise ValueError(f"{where}: messages: no assistant message, so nothing to train on")
    domain = record.get("domain")
    if domain is not None and not isinstance(domain, str):
        raise ValueError(f"{where}: 'domain' must be a string, got {type(domain).__name__}")
    tools = check_tools(record["tools"], f"{where}: tools") if record.get("tools") else None
    return {"messages": record["messages"], "domain": domain, "tools": tools}


def read_conversations(path: str | os.PathLike, require_reply: bool = True) -> list[dict]:
    """The conversations of a JSONL file, in line order (blank lines skipped); `require_reply`: see _conversation."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"SFT data {str(path)!r}: no such file; expected a .jsonl file of "
                         f'{{"messages": [...]}} lines')
    conversations = [_conversation(record, f"{path} line {line}", require_reply)
                     for line, record in jsonl_records(path)]
    if not conversations:
        raise ValueError(f"SFT data {str(path)!r}: no conversations (the file is empty)")
    return conversations


def conversations_from(source: str | Path | list[dict]) -> list[dict]:
    """Conversations from a `.jsonl` file, a directory of them (sorted by name), or a list of records like
    the lines of such a file. (`env:NAME` sources are resolved by `hybridtron.post`, which passes a list.)"""
    if isinstance(source, (list, tuple)):
        if not source:
            raise ValueError("SFT data: the list of conversations is empty")
        return [_conversation(record, f"conversations[{i}]") for i, record in enumerate(source)]
    if isinstance(source, str) and source.startswith("env:"):
        raise ValueError(f"SFT data {source!r}: environment sources are resolved by hybridtron.post "
                         f"(its SFT command turns env:NAME into a list of conversations)")
    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise ValueError(f"SFT data {str(path)!r}: a directory without .jsonl files")
        return [conversation for file in files for conversation in read_conversations(file)]
    if path.exists() and path.suffix != ".jsonl":
        raise ValueError(f"SFT data {str(path)!r}: expected a .jsonl file (or a directory of them), "
                         f"got {path.suffix or 'no suffix'}")
    return read_conversations(path)


# ------------------------------------------------------------------------------------------- tokenizing
@dataclass(frozen=True)
class ConversationStore:
    """Tokenized conversations, flat: conversation i is `ids[offsets[i]:offsets[i + 1]]`, its labels (already
    shifted, IGNORE_INDEX where the next token is not trained and at its last token) likewise."""

    ids: np.ndarray  # [total] int32
    labels: np.ndarray  # [total] int32
    offsets: np.ndarray  # [conversations + 1] int64
    keys: tuple[str, ...]  # a hash of each conversation's messages: the split and the fingerprint

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass
class SFTStats:
    """What the data holds and what the loss sees; `format()` for people, `to_dict()` for a JSON file."""

    conversations: int = 0
    train_conversations: int = 0
    val_conversations: int = 0
    val_conversations_used: int = 0  # fewer when val_batches caps the validation rows
    tokens: int = 0  # every kept conversation's tokens, after truncation
    trained_tokens: int = 0  # tokens that are a loss target
    thinking_tokens: int = 0  # tokens inside <think> ... </think> (trained only with train_on_thinking)
    train_on_thinking: bool = False
    truncated: int = 0  # conversations longer than seq_len, cut to it
    truncated_tokens: int = 0  # tokens the cuts removed
    dropped: int = 0  # conversations with no trained token (truncated before their first assistant token)
    rows_per_epoch: int = 0
    padding_share: float = 0.0  # of the first epoch's training rows
    domains: dict[str, int] = field(default_factory=dict)  # conversations per `domain`, where one is given

    @property
    def trained_share(self) -> float:
        return self.trained_tokens / max(1, self.tokens)

    def format(self) -> str:
        thinking = "trained" if self.train_on_thinking else "masked"
        lines = [
            f"SFT data: {self.conversations:,} conversations ({self.train_conversations:,} train, "
            f"{self.val_conversations:,} validation), {self.tokens:,} tokens",
            f"  loss on {self.trained_tokens:,} tokens ({self.trained_share:.1%}); "
            f"{self.thinking_tokens:,} reasoning tokens {thinking}",
            f"  {self.rows_per_epoch:,} rows per epoch, {self.padding_share:.1%} padding",
        ]
        if self.truncated:
            lines.append(f"  {self.truncated:,} conversations truncated to seq_len ({self.truncated_tokens:,} "
                         f"tokens cut), {self.dropped:,} of them dropped (nothing left to train on)")
        if self.domains:
            lines.append("  domains: " + ", ".join(f"{name}={n:,}" for name, n in sorted(self.domains.items())))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {**asdict(self), "trained_share": self.trained_share}


def _key(conversation: dict) -> str:
    """A hash of the messages (and of the tools, where declared: a conversation without them hashes as before)."""
    content = conversation["messages"]
    if conversation.get("tools"):
        content = {"messages": content, "tools": conversation["tools"]}
    return hashlib.sha256(json.dumps(content, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _tokenize(tokenizer: Tokenizer, conversations: Sequence[dict], reasoning_history: str):
    """`tokenize_chats` of the conversations, each with its own tools: one batch per distinct declaration."""
    groups: dict[str, list[int]] = {}
    for index, conversation in enumerate(conversations):
        groups.setdefault(json.dumps(conversation.get("tools"), sort_keys=True), []).append(index)
    chats = [None] * len(conversations)
    for indices in groups.values():
        tools = conversations[indices[0]].get("tools")
        batch = tokenize_chats(tokenizer, [conversations[i]["messages"] for i in indices], tools=tools,
                               reasoning_history=reasoning_history)
        for index, chat in zip(indices, batch):
            chats[index] = chat
    return chats


def tokenize_conversations(conversations: Sequence[dict], tokenizer: Tokenizer, *, seq_len: int,
                           train_on_thinking: bool = False, reasoning_history: str = "last_turn",
                           stats: SFTStats | None = None) -> ConversationStore:
    """Render, tokenize, mask and truncate every conversation (see the module docstring); counts go to
    `stats`. Dropped conversations are left out of the store."""
    stats = stats if stats is not None else SFTStats()
    ids_parts, label_parts, keys = [], [], []
    for start in range(0, len(conversations), _ENCODE_CHUNK):
        chunk = conversations[start:start + _ENCODE_CHUNK]
        chats = _tokenize(tokenizer, chunk, reasoning_history)
        for conversation, chat in zip(chunk, chats):
            trained = chat.trained(train_on_thinking)
            if len(chat) > seq_len:
                stats.truncated += 1
                stats.truncated_tokens += len(chat) - seq_len
            ids, trained = chat.ids[:seq_len], trained[:seq_len]
            labels = np.where(trained[1:], ids[1:], IGNORE_INDEX)
            if not (labels != IGNORE_INDEX).any():
                stats.dropped += 1
                continue
            ids_parts.append(ids.astype(np.int32))
            label_parts.append(np.append(labels, IGNORE_INDEX).astype(np.int32))
            keys.append(_key(conversation))
            stats.tokens += len(ids)
            stats.trained_tokens += int((labels != IGNORE_INDEX).sum())
            stats.thinking_tokens += int((chat.segments[:seq_len] == Segment.THINKING).sum())
            if conversation.get("domain") is not None:
                stats.domains[conversation["domain"]] = stats.domains.get(conversation["domain"], 0) + 1
    if stats.truncated:
        warnings.warn(f"SFT data: {stats.truncated} of {len(conversations)} conversations are longer than "
                      f"seq_len={seq_len} and were truncated ({stats.truncated_tokens} tokens cut; {stats.dropped} "
                      f"left with nothing to train on were dropped)", stacklevel=2)
    if not ids_parts:
        raise ValueError(f"SFT data: no conversation left to train on: none of the {len(conversations)} has an "
                         f"assistant token within its first seq_len={seq_len} tokens; raise seq_len")
    offsets = np.zeros(len(ids_parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in ids_parts], out=offsets[1:])
    return ConversationStore(np.concatenate(ids_parts), np.concatenate(label_parts), offsets, tuple(keys))


# ---------------------------------------------------------------------------------------------- packing
def pack_conversations(order: Sequence[int], lengths: np.ndarray, seq_len: int,
                       window: int = PACK_WINDOW) -> list[list[int]]:
    """Rows of conversation indices: each index of `order` goes to the first open row with room, else a new row
    (the oldest open row is closed first when `window` rows are open). Every row's lengths sum to <= seq_len."""
    rows: list[list[int]] = []
    open_rows: list[list[int]] = []
    room: list[int] = []
    for index in order:
        length = int(lengths[index])
        assert 0 < length <= seq_len, (index, length)
        slot = next((j for j, r in enumerate(room) if r >= length), None)
        if slot is None:
            if len(open_rows) == window:
                rows.append(open_rows.pop(0))
                room.pop(0)
            open_rows.append([])
            room.append(seq_len)
            slot = len(room) - 1
        open_rows[slot].append(int(index))
        room[slot] -= length
    return rows + open_rows


def row_tensors(store: ConversationStore, rows: Sequence[Sequence[int]], seq_len: int, pad_id: int,
                document_mask: bool = False) -> TokenBatch:
    """A `TokenBatch` of packed rows: input_ids [R, T] and labels [R, T] int64; the tail of a row is pad, label
    IGNORE_INDEX. `document_mask`: seq_idx [R, T] too, conversation j of a row at index j, its pad tail at one
    more."""
    input_ids = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
    seq_idx = np.zeros((len(rows), seq_len), dtype=np.int64)
    for r, row in enumerate(rows):
        t = 0
        for j, index in enumerate(row):
            start, end = store.offsets[index], store.offsets[index + 1]
            input_ids[r, t:t + end - start] = store.ids[start:end]
            labels[r, t:t + end - start] = store.labels[start:end]
            seq_idx[r, t:t + end - start] = j
            t += end - start
        assert t <= seq_len
        seq_idx[r, t:] = len(row)
    return TokenBatch(torch.from_numpy(input_ids), torch.from_numpy(labels),
                      torch.from_numpy(seq_idx) if document_mask else None)


class SFTLoader:
    """Infinite iterator of `TokenBatch`es of packed training conversations (`row_tensors`), epoch after epoch,
    each epoch in its own seeded order. `document_mask` (seq_idx) is not in `fingerprint`: the rows stay the same."""

    def __init__(self, store: ConversationStore, indices: Sequence[int], *, seq_len: int, batch_size: int,
                 seed: int, pad_id: int, fingerprint: str, pack_window: int = PACK_WINDOW,
                 document_mask: bool = False):
        if not len(indices):
            raise ValueError("SFTLoader: no training conversations")
        if seq_len < 2 or batch_size < 1:
            raise ValueError(f"SFTLoader: expected seq_len >= 2 and batch_size >= 1, got {seq_len}, {batch_size}")
        self.store, self.indices = store, np.asarray(indices, dtype=np.int64)
        self.seq_len, self.batch_size, self.seed, self.pad_id = seq_len, batch_size, seed, pad_id
        self.fingerprint, self.pack_window, self.document_mask = fingerprint, pack_window, document_mask
        self._rows_epoch, self._rows = -1, []
        self.epoch, self.row, self.batches = 0, 0, 0

    def rows_of_epoch(self, epoch: int) -> list[list[int]]:
        if epoch != self._rows_epoch:
            order = self.indices[np.random.default_rng([self.seed, epoch]).permutation(len(self.indices))]
            self._rows = pack_conversations(order, self.store.lengths(), self.seq_len, self.pack_window)
            self._rows_epoch = epoch
        return self._rows

    def __iter__(self) -> "SFTLoader":
        return self

    def __next__(self) -> TokenBatch:
        batch = []
        while len(batch) < self.batch_size:
            rows = self.rows_of_epoch(self.epoch)
            take = rows[self.row:self.row + self.batch_size - len(batch)]
            batch += take
            self.row += len(take)
            if self.row == len(rows):
                self.epoch, self.row = self.epoch + 1, 0
        self.batches += 1
        return row_tensors(self.store, batch, self.seq_len, self.pad_id, self.document_mask)

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "fingerprint": self.fingerprint, "seq_len": self.seq_len,
                "epoch": self.epoch, "row": self.row, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"SFT loader state: version {state.get('version')!r}; expected {STATE_VERSION}")
        if state["seq_len"] != self.seq_len:
            raise ValueError(f"SFT loader state: packed for seq_len={state['seq_len']}, this run has "
                             f"seq_len={self.seq_len}; resume with the run's seq_len")
        if state["fingerprint"] != self.fingerprint:
            raise ValueError("SFT loader state: it belongs to different data (conversations, tokenizer, masking, "
                             f"split or seed changed: fingerprint {state['fingerprint']} != {self.fingerprint}); "
                             "resume with the run's data")
        self.epoch, self.row, self.batches = state["epoch"], state["row"], state["batches"]


# ---------------------------------------------------------------------------------------------- building
@dataclass(frozen=True, kw_only=True)
class SFTDataConfig:
    """How conversations become SFT batches (the data source itself is passed to `build_sft_data`)."""

    seq_len: int = 512  # tokens per packed row; longer conversations are truncated
    batch_size: int = 8  # rows per batch
    train_on_thinking: bool = False  # loss on <think> ... </think> too (the report masked it)
    reasoning_history: str = "last_turn"  # reasoning kept in earlier assistant turns: "last_turn" or "all"
    val_fraction: float = 0.05  # share of conversations held out (by a hash of their messages)
    val_batches: int | None = 8  # validation batches kept; None = all
    seed: int = 0  # epoch order
    pack_window: int = PACK_WINDOW  # open rows first-fit packing searches
    document_mask: bool = True  # rows carry seq_idx: conversations sharing a row do not see each other

    def __post_init__(self):
        for name in ("seq_len", "batch_size", "pack_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"sft.{name}: expected a positive integer, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ValueError(f"sft.seq_len: expected at least 2, got {self.seq_len}")
        if self.val_batches is not None and self.val_batches < 1:
            raise ValueError(f"sft.val_batches: expected a positive integer or None, got {self.val_batches}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"sft.val_fraction: expected a number in [0, 1), got {self.val_fraction}")
        if self.reasoning_history not in REASONING_HISTORY:
            raise ValueError(f"sft.reasoning_history: expected one of {', '.join(REASONING_HISTORY)}, "
                             f"got {self.reasoning_history!r}")
        for name in ("train_on_thinking", "document_mask"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sft.{name}: expected true or false, got {getattr(self, name)!r}")


@dataclass
class SFTData:
    train_loader: SFTLoader
    val_batches: list[TokenBatch]
    stats: SFTStats


def _unit_hash(key: str) -> float:
    return int(key[:16], 16) / 2**64


def split_conversations(keys: Sequence[str], val_fraction: float) -> tuple[list[int], list[int]]:
    """`(train indices, validation indices in hash order)`: held out when the key's hash < val_fraction, except
    that the largest hash is always kept for training and, with two or more distinct keys, the smallest is always
    held out (when val_fraction > 0)."""
    hashes = [_unit_hash(key) for key in keys]
    distinct = sorted(set(hashes))
    threshold = min(val_fraction, distinct[-1])
    if val_fraction > 0 and len(distinct) >= 2:
        threshold = max(threshold, np.nextafter(distinct[0], 1))
    val = sorted((i for i, h in enumerate(hashes) if h < threshold), key=lambda i: hashes[i])
    train = [i for i, h in enumerate(hashes) if h >= threshold]
    return train, val


def build_sft_data(conversations: Sequence[dict], tokenizer: Tokenizer, config: SFTDataConfig = SFTDataConfig(),
                   *, seq_len: int | None = None, batch_size: int | None = None,
                   val_batches: int | None = None) -> SFTData:
    """The training loader, fixed validation batches and counts of `conversations` (from `conversations_from`).
    A training run passes its own `seq_len`, `batch_size` and `val_batches`; they replace the config's."""
    overrides = {k: v for k, v in dict(seq_len=seq_len, batch_size=batch_size, val_batches=val_batches).items()
                 if v is not None}
    config = replace(config, **overrides)
    stats = SFTStats(conversations=len(conversations), train_on_thinking=config.train_on_thinking)
    store = tokenize_conversations(conversations, tokenizer, seq_len=config.seq_len, stats=stats,
                                   train_on_thinking=config.train_on_thinking,
                                   reasoning_history=config.reasoning_history)
    train, val = split_conversations(store.keys, config.val_fraction)
    if config.val_fraction > 0 and not val:
        raise ValueError(f"sft.val_fraction: {config.val_fraction} holds out no conversation: these "
                         f"{len(store)} are all the same; add data, or set val_fraction=0 for no validation")
    fingerprint = hashlib.sha256(json.dumps([
        tokenizer.fingerprint, store.keys, config.train_on_thinking, config.reasoning_history, config.seq_len,
        config.val_fraction, config.seed, config.pack_window]).encode()).hexdigest()[:16]
    loader = SFTLoader(store, train, seq_len=config.seq_len, batch_size=config.batch_size, seed=config.seed,
                       pad_id=tokenizer.pad_id, fingerprint=fingerprint, pack_window=config.pack_window,
                       document_mask=config.document_mask)

    val_rows = pack_conversations(val, store.lengths(), config.seq_len, config.pack_window)
    if config.val_batches is not None:
        val_rows = val_rows[:config.val_batches * config.batch_size]
    rows = row_tensors(store, val_rows, config.seq_len, tokenizer.pad_id, config.document_mask)
    held_out = [rows.rows(i, i + config.batch_size) for i in range(0, len(val_rows), config.batch_size)]

    first_epoch = loader.rows_of_epoch(0)
    stats.train_conversations, stats.val_conversations = len(train), len(val)
    stats.val_conversations_used = sum(len(row) for row in val_rows)
    stats.rows_per_epoch = len(first_epoch)
    stats.padding_share = 1 - int(store.lengths()[train].sum()) / (len(first_epoch) * config.seq_len)
    return SFTData(loader, held_out, stats)
