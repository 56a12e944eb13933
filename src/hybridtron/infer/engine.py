"""The serving engine: a checkpoint, its tokenizer and a decoder behind the `Engine` protocol of `server.py`.

`load_engine(dir)` reads the model (`hybridtron.checkpoint.load_pretrained`) and `dir/tokenizer.json`. `stream(prompt_ids,
params)` yields generated token ids one at a time; with `speculative` (the default) and a model that has an MTP
block, the MTP block drafts `draft_length` tokens per step and the stream yields every accepted token in order
(the output is distributed exactly as plain decoding's, token for token under greedy decoding). A stream ends by
itself at an end token (the tokenizer's eos, and <|im_end|> which closes a chat turn; neither is yielded) or when
the context is full. `stream_text` adds detokenization and stop strings for the command line.

Chat template: `hybridtron.data.chat`, the one definition the trainers and the HF export share (ChatML with
`<think>` reasoning: `<|bos|>`, `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then
`<|im_start|>assistant\\n`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import torch

from hybridtron.data.chat import render_chat, token_text
from hybridtron.data.tokenizer import EOS, IM_END, Tokenizer
from hybridtron.infer.generate import DEFAULT_PREFILL_CHUNK, make_decoder, stream_text
from hybridtron.infer.sampling import SamplingParams
from hybridtron.infer.speculative import AcceptanceStats, check_drafter

DEFAULT_DRAFT_LENGTH = 3


class HybridEngine:
    """A model and its tokenizer; one generation at a time (each stream allocates its own cache)."""

    def __init__(self, model, tokenizer: Tokenizer, *, model_name: str, speculative: bool = True,
                 draft_length: int = DEFAULT_DRAFT_LENGTH, max_context: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, state_quant: str = "fp32", compile: bool = False):
        config = model.config
        if tokenizer.vocab_size > config.vocab_size:
            raise ValueError(f"tokenizer.json has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                             f"{config.vocab_size}; they must come from the same checkpoint")
        if max_context is not None and not 2 <= max_context <= config.max_position_embeddings:
            raise ValueError(f"max_context must be in [2, max_position_embeddings={config.max_position_embeddings}]"
                             f", got {max_context}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = config.vocab_size
        self.max_context = max_context or config.max_position_embeddings
        # speculative decoding needs an MTP block; without one the engine decodes plainly
        self.speculative = bool(speculative) and model.mtp is not None
        if self.speculative:
            check_drafter(model, draft_length)
        self.draft_length = draft_length
        if compile and self.speculative:
            raise ValueError("compile applies to plain decoding; turn speculative decoding off to compile")
        self.decoder_options = dict(max_context=self.max_context, prefill_chunk=prefill_chunk,
                                    state_quant=state_quant, compile=compile)
        self.end_token_ids = tuple(tokenizer.token_id(t) for t in (EOS, IM_END))
        self.last_stats: AcceptanceStats | None = None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def chat_template(self, messages: list[dict[str, str]]) -> str:
        """The prompt text of a conversation, ending in the assistant's generation prompt; ValueError names a
        bad message's index and field."""
        return render_chat(messages, add_generation_prompt=True,
                           bos_token=token_text(self.tokenizer, self.tokenizer.bos_id)).text

    def _decoder(self, prompt_ids: Sequence[int], params: SamplingParams):
        # the end tokens stop the decoder too, so it never computes past the end of a sequence
        stops = tuple(dict.fromkeys((*params.stop_token_ids, *self.end_token_ids)))
        params = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                seed=params.seed, max_tokens=params.max_tokens, stop=params.stop,
                                stop_token_ids=stops)
        decoder = make_decoder(self.model, [list(prompt_ids)], params, speculative=self.speculative,
                               draft_length=self.draft_length, **self.decoder_options)
        self.last_stats = getattr(decoder, "stats", None)
        return decoder

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """Generated token ids, one at a time; ends at an end token (not yielded) or a full context."""
        decoder = self._decoder(prompt_ids, params)
        try:
            while not decoder.done:
                for token in decoder.step()[0]:
                    if token in self.end_token_ids:
                        return
                    yield token
        finally:
            del decoder  # the cache goes with it

    def stream_text(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[tuple[int, str]]:
        """(token id, text delta) pairs with stop strings applied; end tokens show no text."""
        decoder = self._decoder(prompt_ids, params)
        yield from stream_text(decoder, self.decode)


def load_engine(model_dir: str | Path, speculative: bool = True, draft_length: int | None = None, *,
                max_context: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                state_quant: str = "fp32", dtype: torch.dtype | None = None, compile: bool = False) -> HybridEngine:
    """The engine of a checkpoint directory (config.json, safetensors, tokenizer.json).

    `speculative`: draft with the MTP block when the model has one (on by default; a model without MTP decodes
    plainly). `draft_length`: tokens drafted per verification step (default 3). `compile`: plain decoding with a
    compiled decode step (`hybridtron.infer.generate`; the first generation pays the compile); with `speculative`
    left at None it turns speculative decoding off.
    """
    from hybridtron.checkpoint.hf import load_pretrained

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: no such checkpoint directory")
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{tokenizer_file} is missing: the checkpoint directory must hold the tokenizer.json its "
                         f"model was trained with")
    tokenizer = Tokenizer.load(tokenizer_file)
    model = load_pretrained(model_dir, **({"dtype": dtype} if dtype is not None else {}))
    return HybridEngine(model, tokenizer, model_name=model_dir.resolve().name,
                        speculative=(not compile) if speculative is None else speculative,
                        draft_length=DEFAULT_DRAFT_LENGTH if draft_length is None else draft_length,
                        max_context=max_context, prefill_chunk=prefill_chunk, state_quant=state_quant,
                        compile=compile)
