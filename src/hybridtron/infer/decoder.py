"""Batched decoding in slots: sequences in the rows of one preallocated cache, stepped together, joining and leaving.

`DecodeBatch` is the core that the engine's loop (`hybridtron.infer.scheduler`) and the fixed-batch `Decoder`
share. What it holds and does:

- Slots. Up to `slots` sequences decode together, one per row of one `HybridCache` (allocated in powers of two up
  to `slots` rows as sequences arrive). The running sequences are always rows 0..n-1: when one finishes, the last
  row's sequence moves into its row (its states are copied: its keys and values up to its length, its Mamba
  states), so a step computes exactly the running rows and a freed slot is the next sequence's. Rows past n are
  parked at length 0, so a fixed-size compiled step that runs over them writes in bounds.
- Prefill. A new sequence's prompt goes into a one-row staging cache, `prefill_chunk` tokens per forward so that a
  long prompt never builds one huge attention or scan; the chunk boundaries are fixed by the prompt (not by what
  else is running), so the prefill's numbers do not depend on the batch. The engine's loop feeds as many chunks per
  step as its token budget allows, between decode steps. `join` then copies the staged prefill into a row for each
  sequence that shares the prompt (the n samples of a prompt share one prefill) and picks each one's first token
  from the prompt's last logits.
- Steps. `step()` emits one token per running sequence (plain decoding); `SpeculativeBatch`
  (`hybridtron.infer.speculative`) drafts with the MTP block and verifies several. A sequence finishes on one of its
  stop tokens ("stop"), after its `max_tokens` or at the context limit ("length"), or when its owner cancels it;
  `retire_finished()` frees the rows of the finished ones.
- Sampling. Every sequence has its own `SamplingParams` and noise key (`hybridtron.infer.sampling`): its tokens
  depend on its seed alone, never on the other rows. The token sampled last is fed to the model only when another
  token is asked for, so no forward is wasted after the last one.

What a sequence keeps, when asked (`SequenceState`):
- `keep_logprobs`: the log-probability of each generated token under the distribution it was drawn from (the
  filtered distribution of its row, fp32; greedy: log_softmax of the unscaled, unfiltered logits); `top_n` > 0 adds
  the `top_n` most likely tokens of that same distribution at each position, {token: log-prob}.
- `routing` (a dict; None: not kept): for each backbone MoE layer (by its `HybridLM.routers()` name), the experts
  its router chose for every token the model read: the prompt (in the prefill) and every generated token but the
  last (nothing is generated after the last, so it is never fed). Row t belongs to position t of prompt + generated
  tokens, as the input of the forward that read it; routing replay (R3) replays them over those inputs.

The model is not changed: the batch allocates its own caches and runs the model's forward (`fast_paths`: with the
decoding fast paths of `hybridtron.infer.fastpath`, the default on a CPU). Laying weights out for decoding is the
engine's explicit step (`hybridtron.infer.engine`), never a decoder's.

Context limit: a prompt may use at most `max_context - 1` positions (one is left to generate); `max_context`
defaults to the model's `max_position_embeddings` and can only be lowered. A longer or empty prompt raises
ValueError. The SSM state can be stored in lower precision (`state_quant`, see `hybridtron.infer.cache`).

Compiled decoding (`compile=True`, `hybridtron generate --compile`; what gpt-fast and SGLang's
`--enable-torch-compile` do): eager decoding of a small model spends most of a token in the dispatch of ~1000
small aten calls, the rest in matrix-vector products; `torch.compile` fuses the work between the products into a
few C++ loops (bench/decode.py, BENCHMARKS.md). The compiled function is the static-shape one-token step
(`hybridtron.infer.steps.decode_tokens`, every block's `decode_step`): attention reads the whole preallocated KV
cache under a mask built from `cache.lengths` and writes at `lengths` by tensor indexing, the Mamba states are
advanced in place, the routed experts are read by index. Why static shapes: a compiled graph is only reused while
its guards hold; a shape that grew with the context, a length read back into Python or a branch on a value would
recompile (seconds each) or break the graph back into eager calls. So there is one graph (`fullgraph=True,
dynamic=False`) per (model shapes, rows, cache size): the step runs over a power-of-two number of rows (the
running ones and parked ones after them; a size already compiled is reused when it is large enough), and a
fixed-batch decoder's cache is allocated at a power of two of at least `COMPILED_CACHE_MIN` positions (capped at
the context limit) so that decoders of different lengths share graphs, at the cost of attention reading up to
twice the positions it needs. The first step of a size pays the compile (a 2-core CPU: 8-18 s; a few seconds when
inductor's on-disk cache has the graph); later batches of the same shapes in the process reuse the code. Use it
for long or repeated generations with one model (a server, a benchmark), not for one short answer. Prefill stays
eager. The compiled step keeps no expert choices, so `routing` needs eager decoding.

`Decoder` is a fixed batch of prompts decoded to the end (scripts, tests, evaluation): every prompt is prefilled
and joined at construction; its first `step()` reports the tokens picked from the prompts' logits, each later one
the tokens of one decode step. `state_quant_drift` measures what a lower-precision SSM state (`state_quant`)
costs: the KL from the fp32-state model over a teacher-forced decode.

Imports: cache, fastpath, steps, sampling < decoder < speculative (subclasses), text < scheduler < engine <
generate (the command), server; the decoder imports nothing above it.

Shapes: B batch, T time, V vocabulary, H hidden, K top-k experts.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from hybridtron.infer import fastpath, steps
from hybridtron.infer.steps import check_compilable, compile_static, compiled_cache_length, compiled_size
from hybridtron.infer.cache import HybridCache, check_state_quant, resized_rows
from hybridtron.infer.sampling import (
    RowSampling, SamplingParams, choose_tokens, exponential_noise, noise_key, row_logprobs, stream_ids,
)

DEFAULT_PREFILL_CHUNK = 512
STOP, LENGTH, CANCELLED = "stop", "length", "cancelled"  # finish reasons (the first two as the OpenAI API names them)


@dataclass(eq=False)
class SequenceState:
    """One sequence of a batch: what it was asked, and what it generated so far."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    key: tuple[int, int] = (0, 0)  # its noise key (`sampling.noise_key`)
    stop_token_ids: frozenset[int] = frozenset()
    limit: int = 0  # prompt + generated tokens at most (the context limit)
    keep_logprobs: bool = False
    top_n: int = 0  # top log-probs kept per position
    # per backbone router: [positions, K] blocks of chosen experts, in position order (None: not kept)
    routing: dict[str, list[torch.Tensor]] | None = None
    tokens: list[int] = field(default_factory=list)  # generated so far (a stop token included)
    logprobs: list[float] = field(default_factory=list)  # per generated token, when kept
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per generated token, when top_n > 0
    finish_reason: str | None = None
    prefilled: int = 0  # prompt tokens already fed (while staged)
    # speculative verification steps it took part in, by draft length, and the drafts they accepted
    draft_lengths: dict[int, int] = field(default_factory=dict)
    accepted: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def expert_ids(self) -> dict[str, torch.Tensor]:
        """{router: LongTensor [positions read, K]}: one row per token the model read (see the module docstring)."""
        read = len(self.prompt) + max(len(self.tokens) - 1, 0)
        return {name: torch.cat(blocks)[:read] for name, blocks in (self.routing or {}).items()}


def context_limit(model, max_context: int | None) -> int:
    limit = model.config.max_position_embeddings
    if max_context is not None:
        if max_context < 2 or max_context > limit:
            raise ValueError(f"max_context must be in [2, max_position_embeddings={limit}], got {max_context}")
        limit = max_context
    return limit


def check_max_tokens(max_tokens: int, prompt_tokens: int, limit: int, *, option: str = "max_tokens",
                     prompt: str = "the prompt") -> None:
    """ValueError naming `option` when `max_tokens` after a prompt of `prompt_tokens` does not fit in the context
    `limit`: asked for more, a generation would be cut by the context, not by `max_tokens`."""
    room = limit - prompt_tokens
    if max_tokens > room:
        raise ValueError(f"{option} {max_tokens}: {prompt} has {prompt_tokens} tokens and the model's context is "
                         f"{limit}, so at most {room} tokens can be generated")


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, limit: int) -> list[list[int]]:
    """Lists of ints in [0, vocab), 1 <= length <= limit - 1; ValueError naming the prompt otherwise."""
    if len(prompts) == 0:
        raise ValueError("prompts: expected at least one prompt")
    checked = []
    for index, prompt in enumerate(prompts):
        try:
            if isinstance(prompt, (str, bytes)):
                raise TypeError
            ids = [operator.index(t) for t in prompt]
        except TypeError:
            raise ValueError(f"prompt {index} must be a list of integer token ids, got {prompt!r:.80}") from None
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


class DecodeBatch:
    """Sequences decoding together in the slots of one cache (see the module docstring).

    `slots`: sequences at most; `max_len`: positions per slot at most (the context limit plus what a step may write
    past it); `positions`: per slot at first (default `max_len`), doubled as longer sequences join;
    `compile`: run the one-token steps through the compiled static step; `fast_paths`: run the eager forwards with
    `hybridtron.infer.fastpath` (default: on a CPU)."""

    def __init__(self, model, *, slots: int, max_len: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 state_quant: str = "fp32", compile: bool = False, fast_paths: bool | None = None,
                 rows: int | None = None, positions: int | None = None):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        check_state_quant(state_quant)
        if compile:
            check_compilable(model)
        self.model = model
        self.slots = slots
        self.max_len = max_len
        self.prefill_chunk = prefill_chunk
        self.state_quant = state_quant
        self.fast_paths = self.device.type == "cpu" if fast_paths is None else fast_paths
        self.compiled_step = compile_static(steps.decode_tokens) if compile else None
        self.compiled_sizes: set[int] = set()  # row counts whose compiled graphs exist
        self.guards_checked: set[int] = set()  # ... and whose guards the current caches passed
        # the backbone's routers, by name; the MTP block's routers only ever see drafts
        self.routers = {name: moe for name, moe in model.routers().items() if not name.startswith("mtp.")}
        self.sequences: list[SequenceState] = []  # row i holds sequences[i]
        self.staging = self.allocate(1)
        self.staged: SequenceState | None = None  # the sequence whose prompt is in the staging cache
        self.staged_logits: torch.Tensor | None = None  # [1, V] at the staged prompt's last position
        self.staged_routing: dict[str, list[torch.Tensor]] | None = None  # the prefill's experts
        self.last_logits_BV: torch.Tensor | None = None  # of the running rows, after the last one-token step
        self.cache = self.allocate(min(slots, rows or 1), max_len=min(max_len, positions or max_len))
        self.pending = torch.zeros(self.cache.batch_size, dtype=torch.long, device=self.device)  # sampled, not fed
        self.keys = torch.zeros(self.cache.batch_size, 2, dtype=torch.long, device=self.device)  # noise keys
        self._views: dict[int, HybridCache] = {}
        self._sampling: RowSampling | None = None

    # ------------------------------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype

    @property
    def running(self) -> int:
        return len(self.sequences)

    @property
    def free_slots(self) -> int:
        return self.slots - len(self.sequences)

    def memory_bytes(self) -> int:
        """Bytes of the caches allocated now (the slots' rows and the staging row)."""
        return self.cache.memory_bytes() + self.staging.memory_bytes()

    def slot_bytes(self) -> int:
        """Bytes of one slot (one sequence's row in every cache the batch keeps)."""
        return self.cache.slot_bytes()

    # ---------------------------------------------------------------------------------------------- caches
    def allocate(self, rows: int, kinds: tuple[str, ...] | None = None, max_len: int | None = None) -> HybridCache:
        config = self.model.config
        max_len = max_len or self.max_len
        if max_len > config.max_position_embeddings:  # the slack past the context limit a step writes into
            config = config.replace(max_position_embeddings=max_len)
        return HybridCache.allocate(config, rows, max_len, dtype=self.dtype, device=self.device, kinds=kinds,
                                    state_quant="fp32" if kinds else self.state_quant)

    def ensure_room(self, rows: int, positions: int) -> None:
        """Allocate rows for `rows` sequences (a power of two, at most `slots`) of `positions` positions (a power of
        two, at most `max_len`), keeping what the running ones hold."""
        old_rows, old_positions = self.cache.batch_size, self.cache.max_len
        assert rows <= self.slots, f"{rows} sequences do not fit in {self.slots} slots"
        new_rows = old_rows if rows <= old_rows else min(self.slots, 1 << (rows - 1).bit_length())
        new_positions = old_positions if positions <= old_positions else \
            min(self.max_len, max(1 << (positions - 1).bit_length(), 2 * old_positions))
        if (new_rows, new_positions) == (old_rows, old_positions):
            return
        self.cache = self.cache.resized(new_rows, new_positions)
        self.pending = resized_rows(self.pending, new_rows)
        self.keys = resized_rows(self.keys, new_rows)
        self.resize_buffers(new_rows, new_positions)
        self._views.clear()
        self.guards_checked.clear()

    def resize_buffers(self, rows: int, positions: int) -> None:
        """Hook for subclasses: grow their per-row buffers to `rows` rows of `positions` positions."""

    def view(self, rows: int) -> HybridCache:
        """Rows 0..rows-1 of the cache (writes go through); kept, so a step's views are made once."""
        if rows not in self._views:
            self._views[rows] = self.cache.rows(0, rows)
        return self._views[rows]

    def forward(self, ids_BT: torch.Tensor, cache: HybridCache, record: bool = False):
        """One eager model forward on the cache (`fastpath.forward`); the SSM states are then stored in the cache's
        format. `record`: keep the Mamba states after each token, for `cache.rewind_to`."""
        out = fastpath.forward(self.model, ids_BT, cache, fast=self.fast_paths, record=record)
        cache.store_states()
        return out

    def keep_routing(self, sequences: Sequence[SequenceState], kept: Sequence[int], tokens: int) -> None:
        """After a forward of `tokens` tokens per row over `sequences`' rows: keep the experts of the first
        `kept[i]` positions of the sequences that keep their routing."""
        keeping = [i for i, seq in enumerate(sequences) if seq.routing is not None and kept[i]]
        if not keeping:
            return
        for name, moe in self.routers.items():
            ids_BTK = moe.last_expert_ids.view(len(sequences), tokens, -1)
            for i in keeping:
                sequences[i].routing[name].append(ids_BTK[i, :kept[i]])

    # ---------------------------------------------------------------------------------------------- prefill
    @torch.inference_mode()
    def stage(self, seq: SequenceState) -> None:
        """Start feeding `seq`'s prompt into the staging cache (what it held is dropped)."""
        self.staging.reset_rows(0, 1)
        self.staging.recorded.clear()
        self.reset_staging()
        seq.prefilled = 0
        if seq.routing is not None:
            seq.routing = {name: [] for name in self.routers}
        self.staged, self.staged_logits, self.staged_routing = seq, None, None

    def unstage(self) -> None:
        """The staged prompt is done with (every sequence sharing it joined, or they were cancelled)."""
        self.staged = self.staged_logits = self.staged_routing = None

    def reset_staging(self) -> None:
        """Hook for subclasses: empty their own staging caches."""

    def next_chunk(self) -> int:
        """Tokens of the staged prompt's next chunk (0 when it is all in)."""
        seq = self.staged
        return min(self.prefill_chunk, len(seq.prompt) - seq.prefilled) if seq is not None else 0

    @torch.inference_mode()
    def prefill_next_chunk(self) -> int:
        """Feed the staged prompt's next chunk; returns its length (0 when the prompt is all in)."""
        seq, size = self.staged, self.next_chunk()
        if size == 0:
            return 0
        start = seq.prefilled
        ids_1T = torch.tensor([seq.prompt[start:start + size]], device=self.device)
        out = self.forward(ids_1T, self.staging)
        self.keep_routing([seq], [size], size)
        self.after_prefill_chunk(seq, start, ids_1T, out)
        seq.prefilled += size
        if seq.prefilled == len(seq.prompt):
            self.staged_logits = out.logits[:, -1]
            if seq.routing is not None:  # the prefill's experts, which every sample of the prompt starts from
                self.staged_routing = {name: list(blocks) for name, blocks in seq.routing.items()}
        return size

    def after_prefill_chunk(self, seq: SequenceState, start: int, ids_1T: torch.Tensor, out) -> None:
        """Hook for subclasses (the speculative batch fills its drafter's staging cache here)."""

    @torch.inference_mode()
    def join(self, sequences: Sequence[SequenceState]) -> list[list[int]]:
        """Give each of `sequences` (samples of the staged prompt, whose prefill is complete) a slot holding the
        staged prefill, and pick its first token; returns what each emitted (nothing for a sequence that may
        generate nothing: max_tokens 0). The staged prefill stays for more samples until `unstage`."""
        assert self.staged_logits is not None, "join needs a complete prefill"
        assert len(sequences) <= self.free_slots, f"{len(sequences)} sequences, {self.free_slots} free slots"
        start, count = len(self.sequences), len(sequences)
        rows = range(start, start + count)
        self.ensure_room(start + count, max(self.positions_needed(seq) for seq in sequences))
        self.cache.copy_row_from(self.staging, 0, rows)
        for seq in sequences:
            seq.prefilled = len(seq.prompt)
            if seq.routing is not None:
                seq.routing = {name: list(blocks) for name, blocks in (self.staged_routing or {}).items()}
        self.sequences.extend(sequences)
        self._sampling = None
        self.keys[start:start + count] = torch.tensor([list(s.key) for s in sequences], device=self.device)
        logits_G1V = self.staged_logits.expand(count, -1)[:, None]
        tokens_G1, lp_G1, top_G1 = self.choose(logits_G1V, sequences, self.keys[start:start + count],
                                               torch.zeros(count, 1, dtype=torch.long, device=self.device))
        self.pending[start:start + count] = tokens_G1[:, 0]
        emitted = []
        for i, seq in enumerate(sequences):
            if seq.params.max_tokens == 0:
                seq.finish_reason = LENGTH
                emitted.append([])
            else:
                emitted.append(self.emit(seq, tokens_G1[i].tolist(), lp_G1[i] if lp_G1 else None,
                                         top_G1[i] if top_G1 else None))
        self.after_join(start, count)
        return emitted

    def positions_needed(self, seq: SequenceState) -> int:
        """Cache positions a sequence may write: its prompt, its tokens but the last (subclasses add their slack)."""
        return min(seq.limit, len(seq.prompt) + max(seq.params.max_tokens, 1))

    def after_join(self, start: int, count: int) -> None:
        """Hook for subclasses: rows start..start+count-1 joined (their pending tokens are set)."""

    # ----------------------------------------------------------------------------------------------- sampling
    def sampling(self) -> RowSampling:
        """The running rows' sampling parameters (rebuilt when the batch changes)."""
        if self._sampling is None:
            self._sampling = RowSampling.of([s.params for s in self.sequences], self.device)
        return self._sampling

    def choose(self, logits_BTV: torch.Tensor, sequences: Sequence[SequenceState], keys_B2: torch.Tensor,
               indices_BT: torch.Tensor, sampling: RowSampling | None = None):
        """Tokens [B, T] for positions whose generated-token indices are `indices_BT`, and, for the sequences that
        keep them, the tokens' log-probs and top log-probs (per row: a list per position, else None)."""
        sampling = sampling or RowSampling.of([s.params for s in sequences], self.device)
        noise = None if sampling.all_greedy else \
            exponential_noise(stream_ids(keys_B2, indices_BT), logits_BTV.shape[-1])
        tokens_BT, probs_BTV = choose_tokens(logits_BTV, sampling, noise)
        logprobs, tops = self.logprobs_of(logits_BTV, sampling, probs_BTV, tokens_BT, sequences)
        return tokens_BT, logprobs, tops

    def logprobs_of(self, logits_BTV, sampling: RowSampling, probs_BTV, tokens_BT, sequences):
        """Per row, the log-probs of `tokens_BT` under their sampled distributions (None for a row that keeps none)
        and the top_n log-probs {token: log-prob} per position (None when no row keeps them)."""
        wanted = [i for i, s in enumerate(sequences) if s.keep_logprobs or s.top_n]
        if not wanted:
            return None, None
        logprobs_BTV = row_logprobs(logits_BTV, sampling, probs_BTV)
        chosen = logprobs_BTV.gather(-1, tokens_BT[..., None])[..., 0].tolist()
        top_n = max(s.top_n for s in sequences)
        tops = None
        if top_n:
            values, ids = logprobs_BTV.topk(top_n, dim=-1)
            values, ids = values.tolist(), ids.tolist()
            tops = [[dict(zip(ids[b][t][:sequences[b].top_n], values[b][t][:sequences[b].top_n]))
                     for t in range(len(ids[b]))] for b in range(len(sequences))]
        return chosen, tops

    def emit(self, seq: SequenceState, tokens: Sequence[int], logprobs: Sequence[float] | None = None,
             tops: Sequence[dict[int, float]] | None = None) -> list[int]:
        """Append tokens (and what is kept of them) to a sequence up to its first stop condition; returns those
        appended."""
        emitted = []
        for position, token in enumerate(tokens):
            if seq.finished:
                break
            seq.tokens.append(token)
            emitted.append(token)
            if seq.keep_logprobs:
                seq.logprobs.append(logprobs[position])
            if seq.top_n:
                seq.top_logprobs.append(tops[position])
            if token in seq.stop_token_ids:
                seq.finish_reason = STOP
            elif len(seq.tokens) >= seq.params.max_tokens or len(seq.prompt) + len(seq.tokens) >= seq.limit:
                seq.finish_reason = LENGTH
        return emitted

    def generated_indices(self, tokens: int) -> torch.Tensor:
        """[B, tokens] the generated-token indices of the running rows' next `tokens` positions."""
        counts = torch.tensor([len(s.tokens) for s in self.sequences], device=self.device)
        return counts[:, None] + torch.arange(tokens, device=self.device)

    # -------------------------------------------------------------------------------------------------- steps
    def one_token(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the pending token of rows 0..rows-1: (logits [rows, V], hidden [rows, H] after norm_f)."""
        if self.compiled_step is None:
            view = self.view(rows)
            out = self.forward(self.pending[:rows, None], view)
            self.keep_routing(self.sequences, [1] * rows, 1)
            return out.logits[:, -1], out.hidden[:, -1]
        size = compiled_size(rows, self.compiled_sizes, self.cache.batch_size)
        view = self.view(size)
        # Guards: the first call at a size compiles, or evaluates every guard of the compiled graphs and so picks
        # the graph made for this model, size and cache. Later calls pass the same model and cache tensors, whose
        # shapes, dtypes and devices do not change between steps, so they check only the guards that tell graphs
        # apart (`skip_guard_eval_unsafe`): full guard evaluation of ~100 tensors costs 10% of a bench22m step
        # (2.89 -> 2.60 ms/token without it; tiny 0.43 -> 0.38). New caches (`ensure_room`) check them again.
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=size in self.guards_checked):
            logits, hidden = self.compiled_step(self.model, self.pending[:size], view)
        self.compiled_sizes.add(size)
        self.guards_checked.add(size)
        view.store_states()
        self.park_rows(rows, size)  # the step advanced the free rows too
        return logits[:rows], hidden[:rows]

    @torch.inference_mode()
    def step(self) -> list[list[int]]:
        """One token for every running sequence; returns the tokens each row emitted (rows in order)."""
        rows = len(self.sequences)
        if rows == 0:
            return []
        logits_BV, _ = self.one_token(rows)
        self.last_logits_BV = logits_BV
        return self.sample_one(logits_BV)

    def sample_one(self, logits_BV: torch.Tensor) -> list[list[int]]:
        """Pick, emit and make pending the next token of every running row from its logits."""
        tokens_B1, logprobs, tops = self.choose(logits_BV[:, None], self.sequences, self.keys[:len(self.sequences)],
                                                self.generated_indices(1), self.sampling())
        self.pending[:len(self.sequences)] = tokens_B1[:, 0]
        return [self.emit(seq, [token], logprobs[b] if logprobs else None, tops[b] if tops else None)
                for b, (seq, token) in enumerate(zip(self.sequences, tokens_B1[:, 0].tolist()))]

    # -------------------------------------------------------------------------------------------- retirement
    @torch.inference_mode()
    def retire_finished(self) -> list[SequenceState]:
        """Free the slots of the finished sequences (the last rows move into them); returns those sequences."""
        finished = [row for row, seq in enumerate(self.sequences) if seq.finished]
        if not finished:
            return []
        before = len(self.sequences)
        retired = []
        for row in reversed(finished):  # every finished row after `row` is gone, so the last row is running
            last = len(self.sequences) - 1
            retired.append(self.sequences[row])
            if row != last:
                self.move_row(last, row)
                self.sequences[row] = self.sequences[last]
            self.sequences.pop()
        self.park_rows(len(self.sequences), before)
        self._sampling = None
        return retired[::-1]

    def move_row(self, source: int, target: int) -> None:
        """Give row `target` what row `source` holds (subclasses move their own per-row state too)."""
        self.cache.copy_row(source, [target])
        self.pending[target] = self.pending[source]
        self.keys[target] = self.keys[source]

    def park_rows(self, start: int, stop: int) -> None:
        """Rows start..stop-1 are free: length 0, so a fixed-size compiled step that runs over them writes in
        bounds."""
        self.cache.lengths[start:stop] = 0


class Decoder:
    """A fixed batch of prompts, decoded together to the end (see the module docstring).

    Every prompt gets a slot; identical prompts share one prefill. `params` applies to every sequence; with a
    `params.seed`, sequence b's noise key is `noise_key(seed, first_sample + b)` (`first_sample`: the position of
    this batch's first prompt in a longer list decoded batch by batch, so that a prompt's sample does not depend on
    the batch it fell in). `logprobs` / `expert_ids`: keep them per sequence. Other keywords go to the batch
    (`DecodeBatch`; `SpeculativeDecoder` adds the drafter's)."""

    batch_class = DecodeBatch

    def __init__(self, model, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 max_context: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 state_quant: str = "fp32", compile: bool = False, fast_paths: bool | None = None,
                 logprobs: bool = False, expert_ids: bool = False, first_sample: int = 0, **batch_options):
        if compile and expert_ids:
            raise ValueError("expert_ids: the compiled decode step keeps no routing choices; decode without compile")
        self.params = params
        self.limit = context_limit(model, max_context)
        prompts = check_prompts(prompts, model.config.vocab_size, self.limit)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2 ** 62, ()))
        self.sequences = [SequenceState(prompt, params, key=noise_key(seed, first_sample + b),
                                        stop_token_ids=frozenset(params.stop_token_ids), limit=self.limit,
                                        keep_logprobs=logprobs, routing={} if expert_ids else None)
                          for b, prompt in enumerate(prompts)]
        # positions ever written: the prompt, every generated token but the last, and what a step writes past them
        longest = max(len(p) for p in prompts)
        positions = min(self.limit, longest + max(params.max_tokens, 1))
        self.batch = self.batch_class(model, slots=len(prompts), rows=len(prompts), prefill_chunk=prefill_chunk,
                                      state_quant=state_quant, compile=compile, fast_paths=fast_paths,
                                      max_len=self.cache_length(positions, compile), **batch_options)
        groups: dict[tuple[int, ...], list[SequenceState]] = {}
        for seq in self.sequences:
            groups.setdefault(tuple(seq.prompt), []).append(seq)
        first: dict[int, list[int]] = {}
        prompt_logits: dict[int, torch.Tensor] = {}
        for group in groups.values():
            self.batch.stage(group[0])
            while self.batch.prefill_next_chunk():
                pass
            for seq, tokens in zip(group, self.batch.join(group)):
                first[id(seq)], prompt_logits[id(seq)] = tokens, self.batch.staged_logits[0]
            self.batch.unstage()
        self.first_tokens: list[list[int]] | None = [first[id(s)] for s in self.sequences]
        # [B, V] the logits at each prompt's last position, which picked its first token
        self.prompt_logits = torch.stack([prompt_logits[id(s)] for s in self.sequences])

    def cache_length(self, positions: int, compile: bool) -> int:
        """Positions per slot: `positions` and the slack a step writes past them (`slack`), rounded up to a shared
        size when compiled."""
        slack = self.slack()
        return compiled_cache_length(positions + slack, self.limit + slack) if compile else positions + slack

    def slack(self) -> int:
        """Positions a step may write past the last one a sequence keeps (`SpeculativeDecoder`: its drafts)."""
        return 0

    # ------------------------------------------------------------------------------------------ properties
    @property
    def cache(self) -> HybridCache:
        return self.batch.cache

    @property
    def fast_paths(self) -> bool:
        return self.batch.fast_paths

    @property
    def batch_size(self) -> int:
        return len(self.sequences)

    @property
    def done(self) -> bool:
        return self.first_tokens is None and all(s.finished for s in self.sequences)

    def row(self, index: int) -> int:
        """The cache row of sequence `index` (rows move as sequences finish)."""
        return self.batch.sequences.index(self.sequences[index])

    def finish(self, index: int, reason: str = STOP) -> None:
        """End sequence `index` early (a stop string was found in its text)."""
        if not self.sequences[index].finished:
            self.sequences[index].finish_reason = reason

    # ------------------------------------------------------------------------------------------- decoding
    def step(self) -> list[list[int]]:
        """The next tokens of every sequence (the first call: those picked from the prompts' logits)."""
        if self.first_tokens is not None:
            tokens, self.first_tokens = self.first_tokens, None
            return tokens
        self.batch.retire_finished()
        emitted = {id(seq): tokens for seq, tokens in zip(list(self.batch.sequences), self.batch.step())}
        return [emitted.get(id(seq), []) for seq in self.sequences]

    def __iter__(self) -> Iterator[list[list[int]]]:
        while not self.done:
            yield self.step()
