"""Generation: batched chunked prefill into a `HybridCache`, a decode loop, and streaming text; `hybridtron generate`.

Layers, bottom up:

- `Decoder` (token ids only): prefills each prompt into its row of one `HybridCache` (prompts of different lengths
  are prefilled one at a time through `cache.select(b)`, in chunks of `prefill_chunk` tokens so a long prompt never
  builds one huge attention or scan), then decodes the whole batch one token per `step()`. Each sequence keeps its
  own length in the cache, so sequences of different prompt lengths decode together. A sequence finishes on a stop
  token ("stop"), after `max_tokens` tokens or when the context is full ("length"). The token that was sampled
  last is fed to the model only when another token is asked for, so no forward is wasted after the last one.
  It runs in inference mode, on weights stored for matrix-vector products (`lay_out_for_decoding`).
  `hybridtron.infer.speculative.SpeculativeDecoder` has the same interface and emits several tokens per step.
  `compile=True`: the one-token forward of each step runs compiled (`compile_decode_step`; below).
- `TextStream`: incremental detokenization of one sequence with stop strings (the text of a stop string and of a
  stop token is never emitted; text that may be the start of a stop string is held back until it is decided); the
  HTTP server's text layer (`hybridtron.infer.server.generate_text`) uses it too.
- `stream_text` / `generate`: (token id, text delta) pairs for one prompt, token lists for a batch.

Context limit: a prompt may use at most `max_context - 1` positions (one is left to generate);
`max_context` defaults to the model's `max_position_embeddings` and can only be lowered. A longer or empty prompt
raises ValueError. Sampling follows `hybridtron.infer.sampling` (temperature, top-k, top-p, seed; temperature 0 is
greedy). The SSM state can be stored in lower precision (`state_quant`, see `hybridtron.infer.cache`).

Compiled decoding (`Decoder(compile=True)`, `hybridtron generate --compile`; what gpt-fast and SGLang's
`--enable-torch-compile` do): eager decoding of a small model spends most of a token in the dispatch of ~1000
small aten calls, the rest in matrix-vector products; `torch.compile` fuses the work between the products into a
few C++ loops (1 thread, bench/decode.py: `tiny` 1.0 -> 0.32-0.42 ms/token, bench22m 3.4 -> 2.6-2.9, where
bench22m's 32000 x 256 lm_head alone reads 33 MB a token). The compiled function is `HybridLM.decode_step`, the
static-shape form of a one-token forward: attention reads the whole preallocated KV cache under a mask built from `cache.lengths` and writes at
`lengths` by tensor indexing, the Mamba states are advanced in place, the routed experts are read by index.
Why static shapes: a compiled graph is only reused while its guards hold; a shape that grew with the context, a
length read back into Python or a branch on a value would recompile (seconds each) or break the graph back into
eager calls. So there is one graph (`fullgraph=True, dynamic=False`) per (model shapes, batch size, cache size);
the cache is allocated at a power of two of at least `COMPILED_CACHE_MIN` positions (capped at the context limit)
so that decoders of different lengths share graphs, at the cost of attention reading up to twice the positions it
needs. The first step pays the compile (a 2-core CPU: `tiny` 14-17 s, bench22m 8-18 s; a few seconds when
inductor's on-disk cache has the graph); later decoders of the same shapes in the process reuse the code. Use it
for long or repeated generations with one model (a server, a benchmark), not for one short answer. Prefill stays
eager. Plain decoding only: a speculative step's forwards change length from step to step.

Shapes: B batch, T time, V vocabulary, H hidden.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch import nn

from hybridtron.infer.cache import HybridCache, check_state_quant
from hybridtron.infer.sampling import SamplingParams, greedy, probs_from_logits, sample
from hybridtron.model.moe import RoutedExperts
from hybridtron.ops.grouped_mm import grouped_mm

DEFAULT_PREFILL_CHUNK = 512
COMPILED_CACHE_MIN = 256
STOP, LENGTH = "stop", "length"  # finish reasons, as the OpenAI API names them


@dataclass
class SequenceState:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated so far (a stop token included)
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def context_limit(model, max_context: int | None) -> int:
    limit = model.config.max_position_embeddings
    if max_context is not None:
        if max_context < 2 or max_context > limit:
            raise ValueError(f"max_context must be in [2, max_position_embeddings={limit}], got {max_context}")
        limit = max_context
    return limit


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, limit: int) -> list[list[int]]:
    """Lists of ints in [0, vocab), 1 <= length <= limit - 1; ValueError naming the prompt otherwise."""
    if len(prompts) == 0:
        raise ValueError("prompts: expected at least one prompt")
    checked = []
    for index, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {index} is empty; expected at least one token (e.g. the bos token)")
        if len(ids) > limit - 1:
            raise ValueError(f"prompt {index} has {len(ids)} tokens; this model allows at most {limit - 1} prompt "
                             f"tokens (context {limit}, one position left to generate)")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {index} holds token id {bad[0]} outside the vocabulary [0, {vocab_size})")
        checked.append(ids)
    return checked


def lay_out_for_decoding(model: nn.Module) -> None:
    """Store every fp32 CPU weight matrix transposed in memory ([in, out] strides; same shapes and values): the
    nn.Linear weights, and each routed expert's matrices.

    A decode step multiplies one vector per sequence by each weight matrix, and MKL's matrix-vector product reads
    a matrix stored [in, out] at close to memory speed but the [out, in] one nn.Linear keeps 1.5-2.2x slower (AMD
    EPYC; bench22m's 32000 x 256 lm_head: 1.0 against 2.2 ms). Matrix-matrix products and the grouped GEMM take
    either layout alike (a tiny training step: 916 against 923 ms), so the model is changed in place, once; state
    dicts and checkpoints hold the same values.
    """
    def transposed_storage(weight: torch.Tensor, dims: tuple[int, int]) -> torch.Tensor:
        return weight.detach().transpose(*dims).contiguous().transpose(*dims)

    for module in model.modules():
        if type(module) is nn.Linear:
            matrices = {"weight": (0, 1)}
        elif isinstance(module, RoutedExperts) and module.grouped_mm is grouped_mm:  # not a swapped-in GEMM
            matrices = {"up_proj": (1, 2), "down_proj": (1, 2)}
        else:
            continue
        for name, dims in matrices.items():
            weight = getattr(module, name)
            if weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous():
                with torch.inference_mode(False):  # a weight made in inference mode could not be trained later
                    weight.data = transposed_storage(weight, dims)


def compiled_cache_length(positions: int, limit: int) -> int:
    """The cache size of a compiled decoder: `positions` rounded up to a power of two >= COMPILED_CACHE_MIN, at most
    `limit` (few sizes, so few compiled graphs)."""
    return min(limit, max(COMPILED_CACHE_MIN, 1 << (positions - 1).bit_length()))


def compile_decode_step(model):
    """`model.decode_step` compiled with static shapes (see the module docstring). Compiling happens at the first
    call; dynamo keeps the code with `HybridLM.decode_step`, so later decoders of the same shapes reuse it."""
    for module in model.modules():
        if isinstance(module, RoutedExperts) and module.grouped_mm is not grouped_mm:
            raise ValueError("compile: the routed experts run a swapped-in grouped GEMM, which the compiled decode "
                             "step (experts read by index) would bypass; decode without compile")
    # cpp_wrapper: the compiled graph's launcher is C++ instead of Python, which saves what is left of the per-step
    # overhead once the ops are fused (1 thread: tiny 0.55 -> 0.43 ms/token, bench22m 3.22 -> ~3.0; compile
    # ~11 -> ~18 s)
    return torch.compile(model.decode_step, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})


class Decoder:
    """Plain batched decoding: one token per sequence per `step()` (see the module docstring). `compile`: run the
    one-token forwards through `compile_decode_step`."""

    def __init__(self, model, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 max_context: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 state_quant: str = "fp32", extra_positions: int = 0, compile: bool = False):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        check_state_quant(state_quant)
        self.model = model
        self.params = params
        self.limit = context_limit(model, max_context)
        self.sequences = [SequenceState(p) for p in check_prompts(prompts, model.config.vocab_size, self.limit)]
        self.prefill_chunk = prefill_chunk
        self.generator = params.generator(self.device)
        self.stop_token_ids = set(params.stop_token_ids)
        longest = max(len(s.prompt) for s in self.sequences)
        # positions ever written: the prompt, every generated token but the last, and what a subclass adds
        self.max_len = min(self.limit, longest + max(params.max_tokens, 1) + extra_positions)
        self.decode_step = compile_decode_step(model) if compile else None
        self.guards_checked = False
        cache_len = compiled_cache_length(self.max_len, self.limit) if compile else self.max_len
        self.cache = HybridCache.allocate(model.config, len(self.sequences), cache_len, dtype=self.dtype,
                                          device=self.device, state_quant=state_quant)
        lay_out_for_decoding(model)
        self.allocate_extra_caches()
        self.pending: torch.Tensor | None = None  # [B] the last sampled tokens, not yet fed to the model
        for seq in self.sequences:
            if params.max_tokens == 0:
                seq.finish_reason = LENGTH
        self.next_logits_BV = self.prefill()

    # ------------------------------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    @property
    def batch_size(self) -> int:
        return len(self.sequences)

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.sequences)

    def finish(self, index: int, reason: str = STOP) -> None:
        """End sequence `index` early (a stop string was found in its text)."""
        if not self.sequences[index].finished:
            self.sequences[index].finish_reason = reason

    # ------------------------------------------------------------------------------------------- forward
    def forward(self, ids_BT: torch.Tensor, cache: HybridCache):
        """One model forward on the cache; the SSM states are then stored in the cache's format."""
        out = self.model(ids_BT, cache=cache, mtp=False)
        cache.store_states()
        return out

    @torch.inference_mode()
    def prefill(self) -> torch.Tensor:
        """Feed every prompt into the cache; returns the logits [B, V] of each prompt's last position."""
        lengths = {len(s.prompt) for s in self.sequences}
        if len(lengths) == 1:  # one batched prefill
            ids = torch.tensor([s.prompt for s in self.sequences], device=self.device)
            return self.prefill_rows(ids, self.cache, rows=list(range(self.batch_size)))
        logits = []
        for b, seq in enumerate(self.sequences):
            ids = torch.tensor([seq.prompt], device=self.device)
            logits.append(self.prefill_rows(ids, self.cache.select(b), rows=[b]))
        return torch.cat(logits)

    def prefill_rows(self, ids_BT: torch.Tensor, cache: HybridCache, rows: list[int]) -> torch.Tensor:
        last = None
        for start in range(0, ids_BT.shape[1], self.prefill_chunk):
            chunk = ids_BT[:, start:start + self.prefill_chunk]
            out = self.forward(chunk, cache)
            self.after_prefill_chunk(rows, ids_BT, start, out)
            last = out.logits[:, -1]
        return last

    def allocate_extra_caches(self) -> None:
        """Hook for subclasses, called before the prefill (the speculative decoder allocates its drafter's cache)."""

    def after_prefill_chunk(self, rows: list[int], ids_BT: torch.Tensor, start: int, out) -> None:
        """Hook for subclasses (the speculative decoder fills its drafter's cache here)."""

    # ------------------------------------------------------------------------------------------ sampling
    def choose(self, logits_BV: torch.Tensor) -> torch.Tensor:
        if self.params.greedy:
            return greedy(logits_BV)
        p = self.params
        return sample(probs_from_logits(logits_BV, p.temperature, p.top_k, p.top_p), self.generator)

    def emit(self, index: int, tokens: Sequence[int]) -> list[int]:
        """Append tokens to a sequence up to its first stop condition; returns those appended."""
        seq, emitted = self.sequences[index], []
        for token in tokens:
            if seq.finished:
                break
            token = int(token)
            seq.tokens.append(token)
            emitted.append(token)
            if token in self.stop_token_ids:
                seq.finish_reason = STOP
            elif len(seq.tokens) >= self.params.max_tokens or len(seq.prompt) + len(seq.tokens) >= self.limit:
                seq.finish_reason = LENGTH
        return emitted

    def park_finished_rows(self, cache: HybridCache) -> None:
        """Finished rows still ride along in batched forwards; keep their writes at the start of the cache so
        they never run past its end (their state is garbage from here on, and nobody reads it)."""
        finished = [b for b, s in enumerate(self.sequences) if s.finished]
        if finished:
            cache.lengths[finished] = 0

    def compiled_forward(self, ids_B: torch.Tensor) -> torch.Tensor:
        """One token per sequence through the compiled decode step -> logits [B, V].

        The first call compiles, or evaluates every guard of the compiled graphs and so picks the graph made for
        this model, batch and cache. Later calls of this decoder pass the same model and cache objects, whose
        shapes, dtypes and devices do not change between steps, so they check only the guards that tell compiled
        graphs apart (`skip_guard_eval_unsafe`): full guard evaluation of ~100 tensors costs 10% of a bench22m
        step (2.89 -> 2.60 ms/token without it; tiny 0.43 -> 0.38). It is unsafe only where an input changed
        between steps (a model moved or converted in the middle of a generation), which would run a stale graph."""
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=self.guards_checked):
            logits_BV = self.decode_step(ids_B, self.cache)
        self.guards_checked = True
        self.cache.store_states()
        return logits_BV

    @torch.inference_mode()
    def step(self) -> list[list[int]]:
        """Generate the next token of every unfinished sequence; returns the new tokens per sequence."""
        if self.done:
            return [[] for _ in self.sequences]
        if self.pending is not None:
            self.park_finished_rows(self.cache)
            if self.decode_step is None:
                self.next_logits_BV = self.forward(self.pending[:, None], self.cache).logits[:, -1]
            else:
                self.next_logits_BV = self.compiled_forward(self.pending)
        tokens = self.choose(self.next_logits_BV)
        self.pending = tokens
        active = [not s.finished for s in self.sequences]
        return [self.emit(b, [t]) if active[b] else [] for b, t in enumerate(tokens.tolist())]

    def __iter__(self) -> Iterator[list[list[int]]]:
        while not self.done:
            yield self.step()


# ---------------------------------------------------------------------------------------------------- text
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


def make_decoder(model, prompts: Sequence[Sequence[int]], params: SamplingParams, *, speculative: bool = False,
                 draft_length: int = 3, **kwargs) -> Decoder:
    """A `Decoder`, or a `SpeculativeDecoder` (MTP drafts) when `speculative`; kwargs go to the decoder."""
    if speculative:
        from hybridtron.infer.speculative import SpeculativeDecoder
        return SpeculativeDecoder(model, prompts, params, draft_length=draft_length, **kwargs)
    return Decoder(model, prompts, params, **kwargs)


def stream_text(decoder: Decoder, decode_fn, index: int = 0) -> Iterator[tuple[int, str]]:
    """(token id, text delta) for sequence `index` of a decoder, until it finishes (a stop string ends it too).

    The delta of a stop token is the held-back text only; the last pair carries whatever was still held back.
    """
    seq = decoder.sequences[index]
    text = TextStream(decode_fn, seq.prompt, decoder.params.stop, decoder.params.stop_token_ids)
    while not seq.finished:
        new_tokens = decoder.step()[index]
        for position, token in enumerate(new_tokens):
            delta, stopped = text.push(token)
            if stopped:
                decoder.finish(index, STOP)
            elif seq.finished and position == len(new_tokens) - 1:
                delta += text.finish()
            yield token, delta
            if stopped:
                return


def generate(model, prompts: Sequence[Sequence[int]], params: SamplingParams, **kwargs) -> list[list[int]]:
    """Token ids generated for each prompt (stop tokens included); kwargs as for `make_decoder`."""
    decoder = make_decoder(model, prompts, params, **kwargs)
    for _ in decoder:
        pass
    return [s.tokens for s in decoder.sequences]


# -------------------------------------------------------------------------------------------------- command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="checkpoint directory (config.json, safetensors, tokenizer.json)")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    parser.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=None,
                        help="MTP self-speculative decoding (default: on when the model has an MTP block)")
    parser.add_argument("--draft-length", type=int, default=None, help="draft tokens per verification step")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK)
    parser.add_argument("--state-quant", default="fp32",
                        help="SSM state storage: fp32, fp16_sr, fp16_rtn, bf16_sr, bf16_rtn, int8_sr, int8_rtn")
    parser.add_argument("--compile", action="store_true",
                        help="plain decoding with the one-token step compiled by torch.compile (static shapes; "
                             "the first token waits for the compile, tens of seconds on a CPU; faster per token "
                             "after). Turns speculative decoding off unless --speculative is given, which is an "
                             "error")


def run(args) -> int:
    from hybridtron.infer.engine import load_engine
    from hybridtron.infer.sampling import ParamError

    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                max_tokens=args.max_tokens, stop=tuple(args.stop))
    except ParamError as exc:
        raise ValueError(f"--{exc.param.replace('_', '-')}: {exc}") from None
    if args.compile and args.speculative:
        raise ValueError("--compile applies to plain decoding; drop --speculative")
    engine = load_engine(args.model, speculative=args.speculative, draft_length=args.draft_length,
                         prefill_chunk=args.prefill_chunk, state_quant=args.state_quant, compile=args.compile)
    if args.speculative and not engine.speculative:
        raise ValueError(f"--speculative: {args.model} has no MTP block to draft with; use --no-speculative")
    prompt_ids = engine.encode(args.prompt)
    start = time.perf_counter()
    count = 0
    for _, delta in engine.stream_text(prompt_ids, params):
        count += 1
        sys.stdout.write(delta)
        sys.stdout.flush()
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    line = f"[{count} tokens in {elapsed:.2f}s, {count / max(elapsed, 1e-9):.1f} tokens/s"
    if args.compile:
        line += " including the one-time compile"
    stats = engine.last_stats
    if stats is not None and stats.steps:
        line += f"; speculative, draft length {stats.draft_length}: mean acceptance length " \
                f"{stats.mean_acceptance_length:.2f}"
    print(line + "]", file=sys.stderr)
    return 0
