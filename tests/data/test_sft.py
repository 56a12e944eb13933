"""SFT data: loss masks checked by hand (thinking masked or trained), packing boundaries, the document mask
(seq_idx), truncation, the split, malformed JSONL named by file and line, and the resumable loader."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridtron.data.sft import (
    SFTDataConfig, SFTLoader, build_sft_data, conversations_from, pack_conversations, read_conversations,
    row_tensors, tokenize_conversations,
)
from hybridtron.data.tokenizer import Tokenizer
from hybridtron.model.lm import IGNORE_INDEX

TEXTS = ["What is 2 + 3? The answer is 5.\n", "Let me think: 2 + 3 = 5, then 5 + 1 = 6.\n"] * 20
TWO_TURNS = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<think>\n2 + 3 = 5\n</think>\n5"},
    {"role": "user", "content": "Add 1."},
    {"role": "assistant", "reasoning_content": "5 + 1 = 6", "content": "6"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.train(TEXTS, vocab_size=512)


def conversation(i: int, words: int = 3) -> dict:
    """A distinct conversation whose length grows with `words`."""
    return {"messages": [{"role": "user", "content": f"Question {i}: " + "think " * words},
                         {"role": "assistant", "content": f"Answer {i}."}], "domain": "math" if i % 2 else "code"}


def trained_runs(tokenizer, ids, labels) -> list[str]:
    """The label tokens of each run of consecutive trained positions, as text."""
    runs, current = [], []
    for t, label in enumerate(labels.tolist()):
        if label != IGNORE_INDEX:
            assert label == ids[t + 1]  # already shifted: the label at t is the token at t + 1
            current.append(label)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    assert not current  # the last token of a conversation never has a label
    return runs


@pytest.mark.parametrize("train_on_thinking, history, expected", [
    # last_turn: the first turn's reasoning is not rendered; the second's is masked unless trained
    (False, "last_turn", ["5<|im_end|>", "\n6<|im_end|>"]),
    (True, "last_turn", ["5<|im_end|>", "<think>\n5 + 1 = 6\n</think>\n6<|im_end|>"]),
    (False, "all", ["\n5<|im_end|>", "\n6<|im_end|>"]),
    (True, "all", ["<think>\n2 + 3 = 5\n</think>\n5<|im_end|>", "<think>\n5 + 1 = 6\n</think>\n6<|im_end|>"]),
])
def test_loss_mask_of_two_turns(tokenizer, train_on_thinking, history, expected):
    store = tokenize_conversations([{"messages": TWO_TURNS}], tokenizer, seq_len=256,
                                   train_on_thinking=train_on_thinking, reasoning_history=history)
    ids, labels = store.ids.astype(np.int64), store.labels.astype(np.int64)
    assert trained_runs(tokenizer, ids, labels) == expected
    # the first trained label sits on the header's newline ("assistant\n" -> <think> or the answer), or, when
    # the first turn's reasoning is rendered and masked, on its </think> (-> "\n5")
    first_trained = int(np.flatnonzero(labels != IGNORE_INDEX)[0])
    shown_and_masked = history == "all" and not train_on_thinking
    assert tokenizer.decode([ids[first_trained]]) == ("</think>" if shown_and_masked else "\n")


def test_packing_is_first_fit_within_the_window():
    lengths = np.array([6, 6, 2, 2])
    assert pack_conversations(range(4), lengths, seq_len=8, window=1) == [[0], [1, 2], [3]]
    assert pack_conversations(range(4), lengths, seq_len=8, window=2) == [[0, 2], [1, 3]]
    assert pack_conversations([3, 2, 1, 0], lengths, seq_len=8, window=2) == [[3, 2], [1], [0]]


def seq_idx_ref(lengths: list[list[int]], seq_len: int) -> torch.Tensor:
    """The document mask of packed rows spelled out one position at a time: row r holds conversations of
    `lengths[r]` tokens; position t is in conversation j when it falls within the j-th, else in the pad tail,
    one document after the last conversation."""
    seq_idx = torch.zeros(len(lengths), seq_len, dtype=torch.int64)
    for r, row in enumerate(lengths):
        ends = np.cumsum(row)
        for t in range(seq_len):
            seq_idx[r, t] = int((ends <= t).sum())  # conversations that ended before t
    return seq_idx


def test_packed_rows_keep_conversations_whole_and_apart(tokenizer):
    conversations = [conversation(i, words=i % 7) for i in range(40)]
    data = build_sft_data(conversations, tokenizer, SFTDataConfig(seq_len=128, batch_size=4, val_fraction=0.1))
    loader, stats = data.train_loader, data.stats
    rows = loader.rows_of_epoch(0)
    seen = sorted(i for row in rows for i in row)
    assert seen == sorted(loader.indices.tolist())  # an epoch holds every training conversation once
    assert loader.rows_of_epoch(1) != rows  # and the next epoch another order
    batch = row_tensors(loader.store, rows, 128, tokenizer.pad_id, document_mask=True)
    input_ids, labels = batch.input_ids, batch.labels
    assert max(len(row) for row in rows) >= 3  # conversations of 35-41 tokens, packed three to a row
    # each conversation its own document, the pad tail one more: conversations sharing a row do not see each other
    assert torch.equal(batch.seq_idx, seq_idx_ref([loader.store.lengths()[row].tolist() for row in rows], 128))
    assert (batch.seq_idx[:, 0] == 0).all() and (batch.seq_idx[:, 1:] >= batch.seq_idx[:, :-1]).all()
    assert row_tensors(loader.store, rows, 128, tokenizer.pad_id).seq_idx is None
    assert any(sum(loader.store.lengths()[row]) < 128 for row in rows)  # a pad tail was among those checked
    bos, pad = tokenizer.bos_id, tokenizer.pad_id
    for r, row in enumerate(rows):
        starts = (input_ids[r] == bos).nonzero().flatten().tolist()
        assert starts[0] == 0 and len(starts) == len(row)  # whole conversations, each opening with bos
        ends = [s - 1 for s in starts[1:]] + [int(loader.store.lengths()[row].sum()) - 1]
        assert all(labels[r, e] == IGNORE_INDEX for e in ends)  # no label crosses a conversation boundary
        used = ends[-1] + 1
        assert (input_ids[r, used:] == pad).all() and (labels[r, used:] == IGNORE_INDEX).all()
    assert int((labels != IGNORE_INDEX).sum()) == sum(
        int((loader.store.labels[loader.store.offsets[i]:loader.store.offsets[i + 1]] != IGNORE_INDEX).sum())
        for i in loader.indices)
    assert stats.rows_per_epoch == len(rows) and 0 <= stats.padding_share < 0.5
    assert stats.conversations == 40 and stats.train_conversations + stats.val_conversations == 40
    assert stats.domains == {"math": 20, "code": 20} and 0 < stats.trained_share < 0.5
    assert "40 conversations" in stats.format() and stats.to_dict()["trained_share"] == stats.trained_share


def test_long_conversations_are_truncated_and_counted(tokenizer):
    long_answer = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "5 " * 100}]}
    long_prompt = {"messages": [{"role": "user", "content": "think " * 100}, {"role": "assistant", "content": "5"}]}
    conversations = [conversation(i) for i in range(6)] + [long_answer, long_prompt]
    with pytest.warns(UserWarning, match="2 of 8 conversations are longer than seq_len=48 .* 1 left with nothing"):
        data = build_sft_data(conversations, tokenizer, SFTDataConfig(seq_len=48, batch_size=2, val_fraction=0))
    assert (data.stats.truncated, data.stats.dropped) == (2, 1) and data.stats.truncated_tokens > 100
    assert len(data.train_loader.store) == 7 and data.train_loader.store.lengths().max() == 48
    with pytest.raises(ValueError, match="no conversation left to train on"):
        with pytest.warns(UserWarning):
            build_sft_data([long_prompt], tokenizer, SFTDataConfig(seq_len=48, val_fraction=0))


def test_validation_split(tokenizer):
    conversations = [conversation(i) for i in range(60)] + [conversation(3)] * 3  # conversation 3 four times
    data = build_sft_data(conversations, tokenizer, SFTDataConfig(seq_len=128, batch_size=2, val_fraction=0.2))
    store, train = data.train_loader.store, set(data.train_loader.indices.tolist())
    val = set(range(len(store))) - train
    assert 0 < len(val) < 30 and data.stats.val_conversations == len(val)
    same = {i for i, key in enumerate(store.keys) if key == store.keys[3]}
    assert same <= train or same <= val  # duplicates land on the same side
    again = build_sft_data(conversations[::-1], tokenizer, SFTDataConfig(seq_len=128, val_fraction=0.2, seed=5))
    assert again.stats.val_conversations == len(val)  # the split ignores order and seed
    held = torch.cat([batch.labels for batch in data.val_batches])
    assert held.shape[1] == 128 and (held != IGNORE_INDEX).any()
    assert all(batch.seq_idx is not None and batch.seq_idx.shape == batch.input_ids.shape  # masked by default
               for batch in data.val_batches)
    tiny = build_sft_data([conversation(0), conversation(1)], tokenizer, SFTDataConfig(seq_len=64))
    assert (tiny.stats.train_conversations, tiny.stats.val_conversations) == (1, 1)  # 5% of 2 still holds one out
    with pytest.raises(ValueError, match="holds out no conversation"):
        build_sft_data([conversation(0)] * 3, tokenizer, SFTDataConfig(seq_len=64))


def test_loader_resumes_where_it_stopped(tokenizer):
    conversations = [conversation(i, words=i % 5) for i in range(30)]
    config = SFTDataConfig(seq_len=96, batch_size=3, val_fraction=0.1, seed=7)
    straight = build_sft_data(conversations, tokenizer, config).train_loader
    rows = len(straight.rows_of_epoch(0))
    expected = [next(straight) for _ in range(2 * rows)]  # two epochs and more
    for stop in (1, rows // 3 + 1, rows):
        loader = build_sft_data(conversations, tokenizer, config).train_loader
        for _ in range(stop):
            next(loader)
        state = json.loads(json.dumps(loader.state_dict()))  # survives a JSON round trip, like a checkpoint's
        resumed = build_sft_data(conversations, tokenizer, config).train_loader
        resumed.load_state_dict(state)
        for i in range(stop, stop + 4):
            got, want = next(resumed), expected[i]
            for field in ("input_ids", "labels", "seq_idx"):  # the document mask is on by default
                assert torch.equal(getattr(got, field), getattr(want, field)), (stop, i, field)
    first = next(straight)
    assert first.input_ids.shape == first.seq_idx.shape == (3, 96)
    assert first.input_ids.dtype == first.labels.dtype == first.seq_idx.dtype == torch.int64


def test_document_mask_is_on_by_default_and_can_be_turned_off(tokenizer):
    conversations = [conversation(i, words=i % 5) for i in range(30)]
    assert SFTDataConfig().document_mask
    masked = build_sft_data(conversations, tokenizer, SFTDataConfig(seq_len=96, batch_size=3, val_fraction=0.1))
    plain = build_sft_data(conversations, tokenizer, SFTDataConfig(seq_len=96, batch_size=3, val_fraction=0.1,
                                                                   document_mask=False))
    # the mask adds seq_idx and changes nothing else: the same rows, the same loader position (fingerprint)
    assert masked.train_loader.fingerprint == plain.train_loader.fingerprint
    for _ in range(3):
        batch, unmasked = next(masked.train_loader), next(plain.train_loader)
        assert unmasked.seq_idx is None
        assert torch.equal(batch.input_ids, unmasked.input_ids) and torch.equal(batch.labels, unmasked.labels)
        # a new document at every conversation's bos, and where the pad tail begins
        ids, seq_idx = batch.input_ids, batch.seq_idx
        pad = tokenizer.pad_id
        opens = (ids[:, 1:] == tokenizer.bos_id) | ((ids[:, 1:] == pad) & (ids[:, :-1] != pad))
        assert torch.equal(seq_idx[:, 1:] != seq_idx[:, :-1], opens) and (seq_idx[:, 0] == 0).all()
    assert all(batch.seq_idx is None for batch in plain.val_batches)
    with pytest.raises(ValueError, match="sft.document_mask: expected true or false"):
        SFTDataConfig(document_mask=1)


def test_loader_refuses_another_runs_state(tokenizer):
    conversations = [conversation(i) for i in range(10)]
    loader = build_sft_data(conversations, tokenizer, SFTDataConfig(seq_len=64, val_fraction=0)).train_loader
    state = loader.state_dict()
    masked = build_sft_data(conversations, tokenizer, SFTDataConfig(seq_len=64, val_fraction=0,
                                                                    train_on_thinking=True)).train_loader
    with pytest.raises(ValueError, match="belongs to different data"):
        masked.load_state_dict(state)
    shorter = build_sft_data(conversations, tokenizer, SFTDataConfig(seq_len=48, val_fraction=0)).train_loader
    with pytest.raises(ValueError, match="packed for seq_len=64, this run has seq_len=48"):
        shorter.load_state_dict(state)
    with pytest.raises(ValueError, match="no training conversations"):
        SFTLoader(loader.store, [], seq_len=64, batch_size=1, seed=0, pad_id=0, fingerprint="x")


def test_the_model_trains_on_a_batch(tokenizer, small_config):
    from hybridtron.model.lm import HybridLM

    data = build_sft_data([{"messages": TWO_TURNS}, conversation(1)], tokenizer,
                          SFTDataConfig(seq_len=64, batch_size=2, val_fraction=0))
    batch = next(data.train_loader)
    model = HybridLM(small_config(vocab_size=tokenizer.vocab_size))
    out = model(batch.input_ids, batch.labels, seq_idx=batch.seq_idx)
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.backbone.embeddings.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------ reading files
LINES_AND_ERRORS = [
    ('{"messages": [{"role": "user", "content": "hi"}', r"line 2: not valid JSON"),
    ('[1, 2]', r"line 2: expected a JSON object, got list"),
    ('{"text": "hi"}', r"line 2: missing the 'messages' field \(found \['text'\]\)"),
    ('{"messages": "hi"}', r"line 2: messages: expected an array of messages, got string"),
    ('{"messages": []}', r"line 2: messages: empty"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', r"line 2: messages\[0\].role: expected one of .* 'robot'"),
    ('{"messages": [{"role": "user", "content": 5}]}', r"line 2: messages\[0\].content: expected a string, got int"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', r"line 2: messages: no assistant message"),
    ('{"messages": [{"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]}',
     r"line 2: messages\[0\]: a tool message must follow an assistant"),
    ('{"messages": [{"role": "assistant", "content": "a"}], "domain": 3}', r"line 2: 'domain' must be a string"),
]


@pytest.mark.parametrize("line, error", LINES_AND_ERRORS)
def test_malformed_jsonl_names_file_and_line(tmp_path, line, error):
    path = tmp_path / "chats.jsonl"
    good = json.dumps({"messages": TWO_TURNS})
    path.write_text(f"{good}\n{line}\n{good}\n")
    with pytest.raises(ValueError, match=f"{path} {error}"):
        read_conversations(path)


def test_sources(tmp_path):
    lines = [json.dumps(conversation(i)) for i in range(3)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:2]) + "\n\n")  # blank lines are skipped
    (tmp_path / "b.jsonl").write_text(lines[2] + "\n")
    assert [c["messages"] for c in conversations_from(tmp_path)] == [conversation(i)["messages"] for i in range(3)]
    assert conversations_from(str(tmp_path / "a.jsonl"))[1]["domain"] == "math"
    assert len(conversations_from([conversation(0), {"messages": TWO_TURNS}])) == 2
    with pytest.raises(ValueError, match=r"conversations\[1\]: messages\[0\].role: missing"):
        conversations_from([conversation(0), {"messages": [{"content": "x"}]}])
    with pytest.raises(ValueError, match="environment sources are resolved by hybridtron.post"):
        conversations_from("env:math")
    with pytest.raises(ValueError, match="no such file"):
        conversations_from(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no conversations"):
        conversations_from(tmp_path / "empty.jsonl")
    (tmp_path / "chats.csv").write_text("x")
    with pytest.raises(ValueError, match="expected a .jsonl file"):
        conversations_from(tmp_path / "chats.csv")
    with pytest.raises(ValueError, match="sft.reasoning_history"):
        SFTDataConfig(reasoning_history="none")
