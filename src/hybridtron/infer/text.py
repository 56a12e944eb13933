"""Text from token streams: incremental detokenization with stop strings (`TextStream`) and `stream_text`.

A decoder emits token ids; `TextStream` turns one sequence's ids into text deltas that never show half a character
or the beginning of a stop string, and `stream_text` drives a decoder with it. The command line (`hybridtron
generate`), the engine and the HTTP server's text layer (`hybridtron.infer.server.generate_text`) share them.
Imports: decoder (for its finish reasons) < text < engine (the scheduler does not need it).
"""

from __future__ import annotations

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


def stream_text(decoder: Decoder, decode_fn, index: int = 0) -> Iterator[tuple[int, str]]:
    """(token id, text delta) for sequence `index` of a fixed-batch decoder, until it finishes (a stop string ends it
    too). The delta of a stop token is the held-back text only; the last pair carries whatever was still held back.
    """
    seq = decoder.sequences[index]
    text = TextStream(decode_fn, seq.prompt, decoder.params.stop, seq.stop_token_ids)
    for new in decoder:
        new_tokens = new[index]
        for position, token in enumerate(new_tokens):
            delta, stopped = text.push(token)
            if stopped:
                decoder.finish(index, STOP)
            elif seq.finished and position == len(new_tokens) - 1:
                delta += text.finish()
            yield token, delta
            if stopped:
                return
        if seq.finished:
            return
