"""The engine: a model, its tokenizer and the continuous-batching loop; request handles for the server, completions
for rollouts.

Building one:
- `load_engine(dir)` reads a checkpoint directory (config.json, safetensors, tokenizer.json; or a run directory,
  whose HF export is `dir/hf`). The engine owns that model, so it lays its weights out for decoding
  (`fastpath.lay_out_for_decoding`, in place) as part of loading.
- `HybridEngine.from_model(model, tokenizer)` wraps a model in memory, a trainer's policy: by default the engine
  decodes its own copy of the weights (laid out for decoding; the caller's model is never changed), and
  `update_weights(model)` / `load_weights(state_dict)` hand each new version over (between two steps of the loop).
  `copy_weights=False` decodes the caller's model itself, as it is (nothing laid out), so it sees every update at
  once.
- `HybridEngine(model, tokenizer, ...)` uses the model as given and changes nothing about it.

Decoding: every request runs through one loop (`hybridtron.infer.scheduler`) over one batch of slots
(`max_slots` sequences at once, or as many as `memory_budget_gib` holds: `hybridtron memory --budget-gib`). With
`speculative` (the default) and a model that has an MTP block, the MTP block drafts tokens that one backbone forward
verifies (`hybridtron.infer.speculative`); `draft_length=None` (the default) adapts the number of drafts to the
measured acceptance and step times, and turns drafting off where it does not pay. Greedy output is exactly plain
decoding's, and a sampled request's tokens depend on its seed alone (not on the batch, nor on drafting). The end
tokens (the tokenizer's eos, and <|im_end|> which closes a chat turn) end a sequence.

The serving API (stable; what `hybridtron serve` builds on):

    engine.start()                                   # run the loop in a background thread
    handle = engine.submit(prompt_ids, params, logprobs=None, request_id=None)   # thread-safe; -> RequestHandle
        # raises QueueFull when `max_queue` requests wait, ValueError for a bad prompt or argument
    handles = engine.submit_samples(prompt_ids, params, n)   # n samples sharing one prefill
    for event in handle: ...                         # TokenEvent(token_id, logprob, top_logprobs, finish_reason),
    async for event in handle.events(): ...          #   the last one with finish_reason "stop" | "length" |
                                                     #   "cancelled" (token_id None when it ended without a token)
    handle.cancel()                                  # frees its slot at the next step
    completion = handle.result(timeout=None)         # the whole Completion
    engine.stats()                                   # EngineStats: requests, queue, slots, occupancy, tokens/s,
                                                     #   acceptance length, draft length, cache bytes
    engine.shutdown(cancel=False, timeout=None)      # finish (or cancel) what is in flight, stop the thread

`logprobs`: None (none), 0 (the sampled token's log-prob in each event), n <= 20 (and the n most likely tokens'
`top_logprobs`), all under the distribution the token was drawn from (see `Completion.logprobs`). Stop strings
are the text layer's (`hybridtron.infer.text.TextStream`): a caller cancels a handle whose text hit one.

- `generate(prompts, params, n)` is the offline batch API for rollouts: `n` completions per prompt through the same
  loop (the samples of a prompt share its prefill), each with the log-probability of every sampled token and, when
  asked, the experts every backbone MoE layer chose (routing replay). See `Completion` for exact semantics. Without
  a background thread it drives the loop in the calling thread.
- `stream(prompt_ids, params)` yields generated token ids one at a time, the end token not included;
  `stream_text` adds detokenization and stop strings for the command line.

Chat template: `hybridtron.data.chat`, the one definition the trainers and the HF export share (ChatML with
`<think>` reasoning: `<|bos|>`, `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, then
`<|im_start|>assistant\\n`).

Imports: decoder < speculative < scheduler < engine < generate (the command) and server; `make_decoder` and
`generate_tokens` (token ids of a fixed batch, for scripts and tests) live here, the lowest module that knows both
decoders.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch

from hybridtron.checkpoint.hf import load_pretrained, resolve_checkpoint_dir
from hybridtron.data.chat import render_chat, token_text
from hybridtron.data.tokenizer import EOS, IM_END, Tokenizer
from hybridtron.infer.decoder import (
    DEFAULT_PREFILL_CHUNK,
    STOP,
    DecodeBatch,
    Decoder,
    SequenceState,
    check_prompts,
    context_limit,
)
from hybridtron.infer.fastpath import lay_out_for_decoding
from hybridtron.infer.memory import slots_for_budget
from hybridtron.infer.sampling import SamplingParams, noise_key
from hybridtron.infer.scheduler import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_STEP_TOKENS,
    MAX_TOP_LOGPROBS,
    Completion,
    EngineError,
    EngineStats,
    QueueFull,
    RequestHandle,
    Scheduler,
    TokenEvent,
    completion_of,
)
from hybridtron.infer.speculative import (
    DEFAULT_MAX_DRAFT_LENGTH,
    AcceptanceStats,
    SpeculativeBatch,
    SpeculativeDecoder,
    check_drafter,
    why_no_drafting,
)
from hybridtron.infer.steps import COMPILED_CACHE_MIN
from hybridtron.infer.text import SequenceText, TextStream

__all__ = ["Completion", "EngineError", "EngineStats", "HybridEngine", "QueueFull", "RequestHandle", "TokenEvent",
           "generate_tokens", "load_engine", "make_decoder"]

DEFAULT_MAX_SLOTS = 64
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def make_decoder(model, prompts: Sequence[Sequence[int]], params: SamplingParams, *, speculative: bool = False,
                 draft_length: int | None = 3, **kwargs) -> Decoder:
    """A fixed-batch `Decoder`, or a `SpeculativeDecoder` (MTP drafts) when `speculative`; kwargs go to the
    decoder."""
    if speculative:
        return SpeculativeDecoder(model, prompts, params, draft_length=draft_length, **kwargs)
    return Decoder(model, prompts, params, **kwargs)


def generate_tokens(model, prompts: Sequence[Sequence[int]], params: SamplingParams, **kwargs) -> list[list[int]]:
    """Token ids generated for each prompt (stop tokens included); kwargs as for `make_decoder`."""
    decoder = make_decoder(model, prompts, params, **kwargs)
    for _ in decoder:
        pass
    return [s.tokens for s in decoder.sequences]


class HybridEngine:
    """A model, its tokenizer and the loop that serves them (see the module docstring).

    `max_slots`: sequences decoding at once; `memory_budget_gib`: size the slots to this much cache memory instead
    (`hybridtron.infer.memory.slots_for_budget`); `max_queue`: requests waiting at most before `submit` raises
    QueueFull; `max_step_tokens`: the tokens one iteration of the loop feeds the model (decode tokens first, prompt
    chunks in what is left). `draft_length`: None adapts it (up to `max_draft_length`), an int fixes it."""

    def __init__(self, model, tokenizer: Tokenizer, *, model_name: str, speculative: bool = True,
                 draft_length: int | None = None, max_draft_length: int = DEFAULT_MAX_DRAFT_LENGTH,
                 max_context: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 state_quant: str = "fp32", compile: bool = False, fast_paths: bool | None = None,
                 max_slots: int = DEFAULT_MAX_SLOTS, memory_budget_gib: float | None = None,
                 max_queue: int = DEFAULT_MAX_QUEUE, max_step_tokens: int = DEFAULT_MAX_STEP_TOKENS):
        config = model.config
        if tokenizer.vocab_size > config.vocab_size:
            raise ValueError(f"tokenizer.json has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                             f"{config.vocab_size}; they must come from the same checkpoint")
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = config.vocab_size
        self.max_context = context_limit(model, max_context)
        # speculative decoding needs an MTP block it can draft with (and caches it can rewind); without them the
        # engine decodes plainly, and `why_no_drafting` says why
        self.speculative = bool(speculative) and why_no_drafting(model) is None
        if self.speculative:
            check_drafter(model, max_draft_length if draft_length is None else draft_length)
        self.draft_length = draft_length
        self.compiled = compile
        self.end_token_ids = tuple(tokenizer.token_id(t) for t in (EOS, IM_END))
        self.last_stats: AcceptanceStats | None = None
        extra = (draft_length or max_draft_length) + 1 if self.speculative else 0  # a verification writes past
        if memory_budget_gib is not None:
            activations = DTYPE_NAMES[model.lm_head.weight.dtype]
            stored = "fp32" if state_quant == "fp32" else state_quant.split("_")[0]
            max_slots = slots_for_budget(config, memory_budget_gib, self.max_context + extra, kv_dtype=activations,
                                         state_dtype=stored, conv_dtype=activations, include_mtp=self.speculative)
        # the slots' positions start at COMPILED_CACHE_MIN and double as longer sequences come
        options = dict(slots=max_slots, max_len=self.max_context + extra, positions=COMPILED_CACHE_MIN,
                       prefill_chunk=prefill_chunk, state_quant=state_quant, compile=compile, fast_paths=fast_paths)
        batch = SpeculativeBatch(model, draft_length=draft_length, max_draft_length=max_draft_length, **options) \
            if self.speculative else DecodeBatch(model, **options)
        self.scheduler = Scheduler(batch, max_queue=max_queue, max_step_tokens=max_step_tokens)

    @classmethod
    def from_model(cls, model, tokenizer: Tokenizer, *, copy_weights: bool = True, model_name: str = "model",
                   **options) -> "HybridEngine":
        """An engine around a model in memory (see the module docstring); options as for `HybridEngine`."""
        if copy_weights:
            model = copy.deepcopy(model)
            for param in model.parameters():
                param.grad = None
            model.requires_grad_(False).eval()
            lay_out_for_decoding(model)  # the engine's own copy
        return cls(model, tokenizer, model_name=model_name, **options)

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy new values into the engine's weights (and buffers, the routers' correction biases), in place, between
        two steps of the loop: the names and shapes must be those of the engine's model (`model.state_dict()` of the
        same architecture)."""
        own = self.model.state_dict()
        missing, unexpected = sorted(own.keys() - state_dict.keys()), sorted(state_dict.keys() - own.keys())
        if missing or unexpected:
            raise ValueError(f"load_weights: the state dict does not match the engine's model: missing "
                             f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected "
                             f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        for name, value in state_dict.items():
            if tuple(value.shape) != tuple(own[name].shape):
                raise ValueError(f"load_weights: {name} has shape {tuple(value.shape)}, the engine's model "
                                 f"{tuple(own[name].shape)}")
        with self.scheduler.step_lock:
            for name, value in state_dict.items():
                own[name].copy_(value)

    def update_weights(self, model) -> None:
        """Hand a model's current weights over to the engine (after a training step)."""
        if model is not self.model:
            self.load_weights(model.state_dict())

    # ----------------------------------------------------------------------------------------------- text
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def chat_template(self, messages: list[dict[str, str]], tools: list[dict] | None = None) -> str:
        """The prompt text of a conversation (with its `tools` declared, if any), ending in the assistant's
        generation prompt; ValueError names a bad message's index and field."""
        return render_chat(messages, add_generation_prompt=True, tools=tools,
                           bos_token=token_text(self.tokenizer, self.tokenizer.bos_id)).text

    # ------------------------------------------------------------------------------------------- the loop
    def start(self) -> None:
        """Run the loop in a background thread (see the module docstring); no-op when it runs."""
        self.scheduler.start()

    def shutdown(self, cancel: bool = False, timeout: float | None = None) -> None:
        """Take no new requests; let the ones in flight finish (`cancel`: cancel them; `timeout`: cancel those
        still running after it), then stop the loop's thread. `start()` serves again."""
        self.scheduler.shutdown(cancel=cancel, timeout=timeout)

    def stats(self) -> EngineStats:
        return self.scheduler.stats()

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, *, logprobs: int | None = None,
               request_id: str | None = None) -> RequestHandle:
        """Queue one request (thread-safe) and return its handle; see the module docstring."""
        return self.submit_samples(prompt_ids, params, 1, logprobs=logprobs, request_id=request_id)[0]

    def submit_samples(self, prompt_ids: Sequence[int], params: SamplingParams, n: int, *, first_sample: int = 0,
                       logprobs: int | None = None, request_id: str | None = None) -> list[RequestHandle]:
        """Queue `n` samples of one prompt (thread-safe), which share its prefill; their handles. Sample j has the
        noise key of (seed, first_sample + j), as `generate`'s sample j of prompt i has (seed, i * n + j) (the
        server's choices of a seeded request are `generate`'s samples). QueueFull unless all n fit in the queue;
        request ids `{request_id}-{j}` when n > 1."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {logprobs!r}")
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string or None, got {request_id!r}")
        prompt = check_prompts([prompt_ids], self.vocab_size, self.max_context)[0]
        seed = self._seed(params)
        sequences = [self.sequence(prompt, params, noise_key(seed, first_sample + j), logprobs=logprobs is not None,
                                   top_n=logprobs or 0) for j in range(n)]
        ids = [request_id] if n == 1 else [None if request_id is None else f"{request_id}-{j}" for j in range(n)]
        return self.scheduler.submit(sequences, ids)

    def prompt_logprobs(self, prompt_ids: Sequence[int], top_n: int = 0) -> list[tuple[float, dict[int, float]]]:
        """(log p(prompt[t] | prompt[:t]), the top_n most likely tokens there {token: log-prob}) for t = 1.. (the
        first token has none), under the model's plain distribution (log_softmax of the logits): what scoring a
        text needs (the server's `echo` with `logprobs`). One forward over the prompt, between two steps of the
        loop."""
        if isinstance(top_n, bool) or not isinstance(top_n, int) or not 0 <= top_n <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_n must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top_n!r}")
        prompt = check_prompts([prompt_ids], self.vocab_size, self.max_context)[0]
        with self.scheduler.step_lock, torch.inference_mode():
            logits_TV = self.model(torch.tensor([prompt]), mtp=False).logits[0, :-1].float()
        logprobs_TV = torch.log_softmax(logits_TV, dim=-1)
        chosen = logprobs_TV.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
        if top_n == 0:
            return [(value, {}) for value in chosen]
        values, ids = logprobs_TV.topk(top_n, dim=-1)
        return [(value, dict(zip(i, v))) for value, i, v in zip(chosen, ids.tolist(), values.tolist())]

    def sequence(self, prompt: list[int], params: SamplingParams, key: tuple[int, int], *, logprobs: bool = False,
                 top_n: int = 0, expert_ids: bool = False) -> SequenceState:
        # the end tokens stop a sequence too, so the loop never computes past the end of one
        stops = frozenset((*params.stop_token_ids, *self.end_token_ids))
        return SequenceState(prompt, params, key=key, stop_token_ids=stops, limit=self.max_context,
                             keep_logprobs=logprobs, top_n=top_n, routing={} if expert_ids else None)

    @staticmethod
    def _seed(params: SamplingParams) -> int:
        return params.seed if params.seed is not None else int(torch.randint(0, 2 ** 62, ()))

    def _run(self, handles: Sequence[RequestHandle], on_progress=None) -> None:
        """Wait until every handle is done: on the loop's thread if it runs, else by running the loop here.
        `on_progress()` is called after every iteration (in this thread)."""
        scheduler = self.scheduler
        done = lambda: all(h.done for h in handles)  # noqa: E731
        if not scheduler.threaded:
            while not done() and scheduler.has_work():
                scheduler.step()
                if on_progress is not None:
                    on_progress()
            return
        with scheduler.lock:
            iterations = scheduler.iterations
        while not done():
            with scheduler.lock:
                scheduler.progress.wait_for(lambda: scheduler.iterations != iterations or done(), timeout=1.0)
                iterations = scheduler.iterations
            if on_progress is not None:
                on_progress()

    # ------------------------------------------------------------------------------------------- decoding
    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """Generated token ids, one at a time; ends at an end token (not yielded) or a full context."""
        for event in self._events(self.submit(prompt_ids, params)):
            if event.token_id is None or event.token_id in self.end_token_ids:
                return
            yield event.token_id

    def _events(self, handle: RequestHandle) -> Iterator[TokenEvent]:
        """A handle's events (without a background thread the loop runs here between them); closing the iterator
        cancels the request."""
        try:
            yield from handle
        finally:
            if not handle.done:
                handle.cancel()
                if not self.scheduler.threaded:  # free its slot now: nobody else runs the loop
                    self.scheduler.run_until(lambda: handle.done)
            self._keep_stats([handle.sequence])

    def stream_text(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[tuple[int, str]]:
        """(token id, text delta) pairs with stop strings applied; end tokens show no text. The delta of a stop
        token is the held-back text only; the last pair carries whatever was still held back."""
        handle = self.submit(prompt_ids, params)
        text = SequenceText(self.decode, handle.sequence.prompt, params.stop)  # the server's rules too
        events = self._events(handle)
        try:
            for event in events:
                step = text.push(event.token_id, event.finish_reason)
                if event.token_id is not None:
                    yield event.token_id, step.text
                if step.finish_reason is not None:
                    return
        finally:
            events.close()

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1, *, logprobs: bool = True,
                 expert_ids: bool = False, first_prompt: int = 0) -> list[list[Completion]]:
        """`n` completions of each prompt (token id lists), as `result[prompt][sample]` (see `Completion`).

        Every prompt x n samples goes through the engine's loop (its slots fill and refill as sequences finish);
        the samples of identical prompts share one prefill. A seeded `params.seed` makes the whole call reproducible
        (sample j of prompt i has the noise key of (seed, (first_prompt + i) * n + j)), whatever else the engine
        runs; `first_prompt` lets engines that each take a slice of one list of prompts sample it as one call would
        (`hybridtron.post.rl.roles.WorkShare`). Stop strings
        (`params.stop`) end a sequence at the token that completes one. `expert_ids` needs eager decoding (an engine
        built without `compile`)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts: expected a non-empty list of prompts, each a list of token ids")
        if expert_ids and self.compiled:
            raise ValueError("expert_ids: the compiled decode step keeps no routing choices; use an engine built "
                             "without compile")
        prompts = check_prompts(prompts, self.vocab_size, self.max_context)
        seed = self._seed(params)
        sequences = [[self.sequence(prompt, params, noise_key(seed, (first_prompt + i) * n + j), logprobs=logprobs,
                                    expert_ids=expert_ids) for j in range(n)] for i, prompt in enumerate(prompts)]
        groups: dict[tuple[int, ...], list[SequenceState]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(tuple(prompt), []).extend(sequences[i])
        handles = {}
        for group in groups.values():
            for seq, handle in zip(group, self.scheduler.submit(group, [None] * len(group), bypass_queue=True)):
                handles[id(seq)] = handle
        every = [handles[id(seq)] for row in sequences for seq in row]
        kept: dict[int, int] = {}  # tokens kept per sequence where a stop string cut it
        if params.stop:
            texts = {id(h): (TextStream(self.decode, h.sequence.prompt, params.stop), [0]) for h in every}

            def check_stops():
                for handle in every:
                    if id(handle.sequence) in kept:
                        continue
                    text, read = texts[id(handle)]
                    tokens = handle.sequence.tokens
                    while read[0] < len(tokens) and not handle.cancel_requested:
                        token = tokens[read[0]]
                        read[0] += 1
                        if token in handle.sequence.stop_token_ids:
                            continue
                        if text.push(token)[1]:
                            kept[id(handle.sequence)] = read[0]
                            handle.cancel()
            self._run(every, check_stops)
            check_stops()
        else:
            self._run(every)
        for handle in every:
            handle.result()  # raises what failed
        self._keep_stats([h.sequence for h in every])
        return [[completion_of(seq, kept.get(id(seq)), STOP if id(seq) in kept else None) for seq in row]
                for row in sequences]

    def _keep_stats(self, sequences: Sequence[SequenceState]) -> None:
        """`last_stats`: the acceptance of the last generation's sequences (None without speculative decoding)."""
        if not self.speculative:
            return
        controller = self.scheduler.batch.controller
        lengths: dict[int, int] = {}
        for seq in sequences:
            for k, steps in seq.draft_lengths.items():
                lengths[k] = lengths.get(k, 0) + steps
        # the draft lengths these sequences were verified at, not the controller's latest: their acceptance is
        # averaged over those steps (the controller's k of the last step reported beside it read as "k = 1: 2.70")
        self.last_stats = AcceptanceStats(
            draft_length=max(lengths, default=0), steps=sum(lengths.values()),
            accepted=sum(s.accepted for s in sequences), draft_lengths=lengths, adaptive=controller.fixed is None,
            drafting_off=controller.fixed is None and any(controller.off.values()))


def load_engine(model_dir: str | Path, speculative: bool | None = True, draft_length: int | None = None, *,
                dtype: torch.dtype | None = None, **options) -> HybridEngine:
    """The engine of a checkpoint directory (config.json, safetensors, tokenizer.json) or of a run directory (its
    `hf/` export). The engine owns the model it loads and lays its weights out for decoding.

    `speculative`: draft with the MTP block when the model has one (on by default, and with None; a model without
    MTP decodes plainly). `draft_length`: tokens drafted per verification step (None: adapted to the measured
    acceptance). Other options as for `HybridEngine` (`compile`: the decode steps compiled, see
    `hybridtron.infer.decoder`; the first generation of each shape pays the compile).
    """

    model_dir, name = resolve_checkpoint_dir(model_dir)
    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{tokenizer_file} is missing: the checkpoint directory must hold the tokenizer.json its "
                         f"model was trained with")
    tokenizer = Tokenizer.load(tokenizer_file)
    model = load_pretrained(model_dir, **({"dtype": dtype} if dtype is not None else {})).eval()
    lay_out_for_decoding(model)
    return HybridEngine(model, tokenizer, model_name=name, speculative=True if speculative is None else speculative,
                        draft_length=draft_length, **options)
