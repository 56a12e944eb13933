"""Text from token streams: incremental detokenization with stop strings (`TextStream`), the end of a sequence's
text (`SequenceText`) and `stream_text`.

A decoder emits token ids; `TextStream` turns one sequence's ids into text deltas that never show half a character
or the beginning of a stop string. `SequenceText` adds the one rule set for where a sequence's text ends, which the
command line (`hybridtron generate`), the fixed-batch `stream_text` below and the HTTP server
(`hybridtron.infer.server`) share:

- a stop token (an end token, or one of the request's `stop_token_ids`) ends the text; its own text is never shown;
- a stop string ends the text before it (the caller then stops the sequence: `Decoder.finish`, `handle.cancel`);
- the decoder's own end (max_tokens, a full context, a cancellation) releases the text still held back.

The token budget itself (max_tokens, the context) belongs to the decoder, which checks it before computing a token;
the server refuses a request whose budget does not fit the context instead of cutting it.
Imports: decoder (for its finish reasons) < text < engine (the scheduler does not need it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from hybridtron.infer.decoder import STOP, Decoder


class TextStream:
    """Incremental detokenization of one generated sequence, with stop strings.

    Decoding token by token is wrong for byte-level and sentencepiece tokenizers (a character may span tokens;
    a leading space depends on the token before), so each delta is the difference between decoding a short window
    of tokens with and without the newest ones (the prefix/read offsets of TGI and vLLM). A window that ends in an
    incomplete character (U+FFFD) waits for the next token. The last few prompt tokens seed the window.
    """

    def __init__(self, decode_fn, prompt_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 stop_token_ids: Sequence[int] = ()):
        self.decode_fn = decode_fn
        self.ids = list(prompt_ids[-5:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = tuple(stop)
        self.stop_token_ids = set(stop_token_ids)
        self.text = ""  # the generated text decided so far (emitted or held back)
        self.emitted = 0  # characters of `text` already returned
        self.stopped = False

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token; returns (text to emit now, whether the sequence must stop)."""
        if self.stopped:
            return "", True
        if token_id in self.stop_token_ids:  # its text is never shown
            return self.finish(), True
        self.ids.append(token_id)
        prefix_text = self.decode_fn(self.ids[self.prefix_offset:self.read_offset])
        new_text = self.decode_fn(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release()

    def _release(self) -> tuple[str, bool]:
        longest = max((len(s) for s in self.stop), default=0)
        search_from = max(0, self.emitted - longest + 1)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
            return self._take(len(self.text)), True
        hold = 0  # the longest tail of the text that a stop string starts with
        for s in self.stop:
            for size in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:size]):
                    hold = size
                    break
        return self._take(len(self.text) - hold), False

    def _take(self, end: int) -> str:
        delta = self.text[self.emitted:max(end, self.emitted)]
        self.emitted += len(delta)
        return delta

    def finish(self) -> str:
        """The sequence ended: release the held-back text, and an incomplete character as U+FFFD."""
        if not self.stopped:
            tail = self.decode_fn(self.ids[self.prefix_offset:])
            head = self.decode_fn(self.ids[self.prefix_offset:self.read_offset])
            if len(tail) > len(head):
                self.text += tail[len(head):]
                self.prefix_offset = self.read_offset = len(self.ids)
            self.stopped = True
        return self._take(len(self.text))


@dataclass(frozen=True)
class TextStep:
    """What one token (or the end) adds to a sequence's text.

    text: the characters to show now (may be empty while text is held back). shown: whether the token belongs to
    the completion (False for a stop token, and for the end without a token). finish_reason: None while the text
    goes on; else "stop" (a stop token or string) or the decoder's own reason ("length", "cancelled")."""

    text: str
    shown: bool
    finish_reason: str | None


class SequenceText:
    """The text of one generated sequence, token by token, and where it ends (see the module docstring).

    `push(token_id, finish_reason)` takes the decoder's events in order: `finish_reason` is the decoder's reason on
    its last event ("stop" means that token is an end or stop token), None before; `token_id` None is an end without
    a token. After a step with a finish_reason the text is complete (`text`)."""

    def __init__(self, decode_fn, prompt_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 stop_token_ids: Sequence[int] = ()):
        self.stream = TextStream(decode_fn, prompt_ids, stop, stop_token_ids)
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        return self.stream.text

    def push(self, token_id: int | None, finish_reason: str | None = None) -> TextStep:
        assert self.finish_reason is None, "the sequence's text has ended"
        if token_id is None or (finish_reason == STOP and token_id not in self.stream.stop_token_ids):
            # the end without a token, or the decoder's stop token: its text is not shown
            self.finish_reason = finish_reason or STOP
            return TextStep(self.stream.finish(), False, self.finish_reason)
        shown = token_id not in self.stream.stop_token_ids
        text, stopped = self.stream.push(token_id)
        if stopped:
            self.finish_reason = STOP
        elif finish_reason is not None:
            text += self.stream.finish()
            self.finish_reason = finish_reason
        return TextStep(text, shown, self.finish_reason)


def stream_text(decoder: Decoder, decode_fn, index: int = 0) -> Iterator[tuple[int, str]]:
    """(token id, text delta) for sequence `index` of a fixed-batch decoder, until it finishes (a stop string ends it
    too). The delta of a stop token is the held-back text only; the last pair carries whatever was still held back.
    """
    seq = decoder.sequences[index]
    text = SequenceText(decode_fn, seq.prompt, decoder.params.stop, seq.stop_token_ids)
    for new in decoder:
        new_tokens = new[index]
        for position, token in enumerate(new_tokens):
            last = seq.finished and position == len(new_tokens) - 1
            step = text.push(token, seq.finish_reason if last else None)
            if step.finish_reason is not None and not seq.finished:  # a stop string
                decoder.finish(index, STOP)
            yield token, step.text
            if step.finish_reason is not None:
                return
        if seq.finished:
            return
