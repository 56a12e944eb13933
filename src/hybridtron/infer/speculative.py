"""Self-speculative decoding: the model's own MTP block drafts k tokens, the backbone verifies them in one forward.

One step (`SpeculativeBatch.step`), for a row whose backbone cache holds positions 0..n-1 and whose last sampled
token x_n is pending:

0. Catch up. The drafter's cache (the MTP block's attention keys and values, `HybridCache.allocate(kinds=
   config.mtp_layers_block_type)`) has one entry per position, as in training's depth 1: entry i is the block's
   forward over (h_i, x_{i+1}), h_i the backbone's last hidden state. The entries of the positions the backbone
   read since the last draft wait in a per-row buffer: one for a row that just joined (its prompt's last position,
   with the first sampled token), the m + 1 kept positions after a verification, one per token of a plain step
   while drafting is off (a full buffer, `CATCH_UP_WIDTH` positions, is caught up at once, so the drafter never
   falls behind). One forward of the block over them fills the cache; its output at position n-1 is depth 1's.
1. Draft (the MTP block as its own drafter). Depth 1 proposes d_1 from that output; depth j > 1 reads the
   block's own output of depth j-1 and the embedding of d_{j-1} (`MTPBlock.decode_step`) and proposes d_j, writing
   its entry at position n+j-2 as if its own output stood in for the backbone's hidden state one position further
   (EAGLE's convention); the next catch-up overwrites those chain entries. A draft is the token the row's noise
   picks from the drafter's distribution (`hybridtron.infer.sampling`; greedy: the argmax).
2. Verify: one recorded backbone forward over [x_n, d_1, .., d_k]: the Mamba layers keep their conv and SSM state
   after every one of the k+1 tokens.
3. Accept: the target's token at each of the k+1 positions under the same noise (greedy: its argmax); the m leading
   drafts equal to the target's tokens are accepted, then the target's own next token is added: m + 1 tokens, the
   very tokens plain decoding emits with that noise (greedy: token for token; sampling: seed for seed).
4. Roll back: each row's Mamba states go to the state recorded after its last kept token and its KV length is
   truncated; nothing is recomputed (eager, when every row kept all k+1 tokens, nothing is copied either). The
   kept positions' hidden states wait for the next catch-up.

Acceptance length = accepted drafts + 1 per verification step (the report: 2.89x single-user decode at k = 6).

Draft length. `draft_length=None` (the default) lets `DraftLengthController` choose k for every step from what it
measures: the acceptance rate of each depth (decayed counts, so it follows the text) and the wall time of steps of
each k at the batch's size. It picks the k with the most tokens per second, expected tokens = 1 + sum over depths
of the chance that every draft up to it is accepted; an untried k is priced by extrapolating the measured times
and each depth's rate is shrunk toward the depth before it (depth 1: toward 1) by two pseudo-verifications, so an
untried depth is taken optimistically (as good as the one before), k grows while drafting pays and stops at the
first depth the MTP block cannot predict, and a depth that a few early steps rejected is not written off for good
(at a smaller k it is never reached again to be measured). When no k beats plain decoding, drafting turns off
and is probed again after 16 steps, then after twice as many each time it still does not pay (up to 512). An
integer `draft_length` fixes k.

Every step is batched: rows keep their own lengths, accept their own number of drafts and roll back to their own
slot; k is one per step. Large batches lose the gain (verification costs throughput), which the controller sees in
the step times of that batch size.

Compiled (`compile=True`): the catch-up (`hybridtron.infer.steps.mtp_tokens`, one graph per power-of-two width) and
the rest of the step (drafts, the verification forward with its states kept, acceptance, rollback: one graph per
row count and k) run as static-shape graphs; a step reads its tokens back to the host once. An adaptive k
compiles the graph of each k it tries (tens of seconds each on a small CPU), so a compiled server may prefer a
fixed `draft_length`.

Log-probabilities of the emitted tokens are those of the target at their positions (from the verification
forward), never the drafter's, so they equal what plain decoding reports. The routing kept for `expert_ids` is the
verification forward's, at the positions it kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from hybridtron.config import MAMBA
from hybridtron.infer import fastpath, steps
from hybridtron.infer.cache import resized_rows
from hybridtron.infer.decoder import DecodeBatch, Decoder
from hybridtron.infer.steps import compile_static, compiled_size
from hybridtron.infer.memory import CATCH_UP_WIDTH  # positions a row's drafter may lag behind before catching up
from hybridtron.infer.sampling import RowSampling, choose_tokens, exponential_noise, stream_ids

MAX_DRAFT_LENGTH = 16
DEFAULT_MAX_DRAFT_LENGTH = 6  # what an adaptive draft length may grow to (the report's anchor is k = 6)


@dataclass
class AcceptanceStats:
    """Verification steps of unfinished sequences (one per row and step) and the drafts they accepted."""

    draft_length: int = 0  # the longest draft length used
    steps: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)  # steps that accepted 0, 1, .., draft_length drafts
    draft_lengths: dict[int, int] = field(default_factory=dict)  # steps by draft length
    # the draft lengths were chosen by `DraftLengthController` (from measured step times: they differ run to run),
    # and it had turned drafting off when the stats were taken (drafting did not pay at the measured times)
    adaptive: bool = False
    drafting_off: bool = False

    def record(self, n_accepted: int, draft_length: int) -> None:
        if draft_length > self.draft_length:
            self.draft_length = draft_length
        self.draft_lengths[draft_length] = self.draft_lengths.get(draft_length, 0) + 1
        if len(self.histogram) <= self.draft_length:
            self.histogram += [0] * (self.draft_length + 1 - len(self.histogram))
        self.steps += 1
        self.accepted += n_accepted
        self.histogram[n_accepted] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts + 1 (the target's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def drafted(self) -> int:
        """Drafts verified."""
        return sum(k * steps for k, steps in self.draft_lengths.items())


def why_no_drafting(model) -> str | None:
    """Why this model cannot decode speculatively (None: it can)."""
    config = model.config
    if model.mtp is None:
        return ("speculative decoding drafts with the MTP block, and this model has none "
                "(num_nextn_predict_layers = 0); decode without --speculative")
    if MAMBA in config.mtp_layers_block_type:
        return (f"mtp_layers_block_type {config.mtp_layers_block_type}: a Mamba layer inside the MTP block is not "
                f"supported by the drafter (only attention, moe and mlp layers)")
    if config.sliding_window is not None:  # verification rewinds the caches; a windowed layer's ring cannot
        return (f"sliding_window {config.sliding_window}: speculative decoding rewinds the KV caches, and a windowed "
                "layer's ring has overwritten the positions a rewind needs; decode without --speculative")
    return None


def check_drafter(model, draft_length: int) -> None:
    reason = why_no_drafting(model)
    if reason is not None:
        raise ValueError(reason)
    if isinstance(draft_length, bool) or not isinstance(draft_length, int) or \
            not 1 <= draft_length <= MAX_DRAFT_LENGTH:
        raise ValueError(f"draft_length must be an integer in [1, {MAX_DRAFT_LENGTH}], got {draft_length!r}")


# ------------------------------------------------------------------------------------------ the draft length
def step_clock() -> Callable[[], float]:
    """The clock that times steps: the calling thread's CPU time when torch runs one intra-op thread (a step is
    then all in this thread, and its time does not grow when other processes take the cores), else the elapsed
    time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


class DraftLengthController:
    """The draft length of each step: `fixed`, or chosen from measured acceptance and step times (see the module
    docstring). `clock` times the steps (default `step_clock()`; a test passes its own)."""

    PROBE_FIRST, PROBE_MAX = 16, 512
    DECAY = 0.99  # per recorded step, for the acceptance counts (a window of ~100 steps)
    TIME_EMA = 0.2  # weight of a new step time
    HYSTERESIS = 1.03  # a new k must promise this much more throughput than the current one
    # Without it, two rejections of draft 2 in the first steps gave depth 2 a rate of 0 that k = 1 never measures
    # again: on `deep` a whole reply ran at k = 1 (the adaptive default 1.45x over three prompts; 1.84x with it)
    PRIOR_WEIGHT = 2.0

    def __init__(self, max_draft_length: int = DEFAULT_MAX_DRAFT_LENGTH, fixed: int | None = None,
                 clock: Callable[[], float] | None = None):
        self.fixed = fixed
        self.max_draft_length = fixed or max_draft_length
        self.clock = clock or step_clock()
        self.reached = [0.0] * (self.max_draft_length + 1)  # by depth j: decayed verifications that got to draft j
        self.accepted = [0.0] * (self.max_draft_length + 1)  # ... and accepted it
        self.seconds: dict[tuple[int, int], float] = {}  # (batch bucket, k) -> EMA of a step's wall time
        self.current: dict[int, int] = {}  # batch bucket -> k of its last step
        self.off: dict[int, bool] = {}  # bucket -> drafting turned off
        self.probe_in: dict[int, int] = {}  # bucket -> plain steps until drafting is tried again
        self.probe_every: dict[int, int] = {}

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << (rows - 1).bit_length()

    def acceptance(self, depth: int) -> float:
        """P(draft `depth` accepted | drafts before it accepted): the decayed counts with PRIOR_WEIGHT
        pseudo-verifications at the rate of the depth before (depth 1: at 1, so that drafting is tried)."""
        prior = 1.0 if depth == 1 else self.acceptance(depth - 1)
        return (self.accepted[depth] + self.PRIOR_WEIGHT * prior) / (self.reached[depth] + self.PRIOR_WEIGHT)

    def expected_tokens(self, k: int) -> float:
        """Tokens a row emits per step at draft length k."""
        total, chain = 1.0, 1.0
        for depth in range(1, k + 1):
            chain *= self.acceptance(depth)
            total += chain
        return total

    def step_seconds(self, bucket: int, k: int) -> float | None:
        """Measured step time at draft length k, or extrapolated from the measured ones (None: nothing measured)."""
        if (bucket, k) in self.seconds:
            return self.seconds[bucket, k]
        measured = sorted((kk, s) for (b, kk), s in self.seconds.items() if b == bucket)
        if not measured:
            return None
        if len(measured) == 1:  # a draft costs about a third of a plain step on small models: a prior
            k0, s0 = measured[0]
            per_draft = s0 / 3 if k0 == 0 else s0 / (3 + k0)
            return s0 + (k - k0) * per_draft
        (k0, s0), (k1, s1) = measured[-2], measured[-1]
        if k < k0:
            (k0, s0), (k1, s1) = measured[0], measured[1]
        slope = max((s1 - s0) / (k1 - k0), 0.0)
        return max(s1 + (k - k1) * slope, 1e-9)

    def rate(self, bucket: int, k: int) -> float | None:
        seconds = self.step_seconds(bucket, k)
        return None if seconds is None else self.expected_tokens(k) / seconds

    def drafted(self, bucket: int) -> bool:
        return any(b == bucket and k > 0 for b, k in self.seconds)

    def draft_length(self, rows: int) -> int:
        """k for the next step of a batch of `rows` rows (0: a plain step)."""
        if self.fixed is not None:
            return self.fixed
        bucket = self.bucket(rows)
        if (bucket, 0) not in self.seconds:
            return 0  # measure plain decoding first
        if self.off.get(bucket):  # drafting does not pay: a plain step, or now and then a probe
            self.probe_in[bucket] -= 1
            return 0 if self.probe_in[bucket] > 0 else self.best(bucket, exclude_plain=True)
        best, current = self.best(bucket), self.current.get(bucket)
        if current is not None and best != current and \
                self.rate(bucket, best) < self.HYSTERESIS * self.rate(bucket, current):
            best = current
        if best == 0 and self.drafted(bucket):
            self.turn_off(bucket)
        return best

    def turn_off(self, bucket: int) -> None:
        """Stop drafting at this batch size until a probe in `probe_every` steps (twice as long as last time)."""
        every = min(2 * self.probe_every.get(bucket, self.PROBE_FIRST // 2), self.PROBE_MAX)
        self.probe_every[bucket] = self.probe_in[bucket] = every
        self.off[bucket] = True

    def best(self, bucket: int, exclude_plain: bool = False) -> int:
        """The k with the most expected tokens per second (the smaller on a tie)."""
        candidates = range(1 if exclude_plain else 0, self.max_draft_length + 1)
        return max(candidates, key=lambda k: (self.rate(bucket, k), -k))

    def record(self, rows: int, k: int, seconds: float | None, accepted: list[int]) -> None:
        """A step of `rows` rows at draft length k took `seconds` (None: not timed, e.g. it compiled) and each row
        accepted `accepted[b]` drafts."""
        bucket = self.bucket(rows)
        if seconds is not None:
            old = self.seconds.get((bucket, k))
            self.seconds[bucket, k] = seconds if old is None else old + self.TIME_EMA * (seconds - old)
        if k > 0:
            for depth in range(1, self.max_draft_length + 1):
                self.reached[depth] *= self.DECAY
                self.accepted[depth] *= self.DECAY
            for m in accepted:
                for depth in range(1, min(m + 1, k) + 1):  # drafts 1..m accepted, draft m+1 reached and rejected
                    self.reached[depth] += 1
                    self.accepted[depth] += depth <= m
        if self.fixed is None and k > 0 and self.off.get(bucket):  # a probe
            if self.best(bucket) == 0:
                self.turn_off(bucket)
            else:
                self.off[bucket] = False
                self.probe_every.pop(bucket, None)
        self.current[bucket] = k


# --------------------------------------------------------------------------------------------------- the step
class FastForms:
    """The step's forwards as eager calls: `hybridtron.infer.fastpath` (`fast`) or the model's reference forward;
    each slices the caches to what it reads."""

    def __init__(self, fast: bool):
        self.fast = fast

    def catch_up(self, model, mtp_cache, hidden_BWH, next_BW, counts_B, lengths_B) -> torch.Tensor:
        width = int(counts_B.max())
        out = fastpath.mtp_forward(model, hidden_BWH[:, :width], model.backbone.embeddings(next_BW[:, :width]),
                                   mtp_cache, fast=self.fast)
        mtp_cache.lengths.copy_(lengths_B)
        return out[torch.arange(counts_B.shape[0], device=counts_B.device), counts_B - 1]

    def chain(self, model, hidden_BH, token_B, mtp_cache, depth: int) -> torch.Tensor:
        # mtp_forward writes at the lengths and advances them: depth j writes at n + j - 2
        return fastpath.mtp_forward(model, hidden_BH[:, None], model.backbone.embeddings(token_B)[:, None], mtp_cache,
                                    fast=self.fast)[:, 0]

    def end_chain(self, mtp_cache, cache) -> None:
        mtp_cache.lengths.copy_(cache.lengths)  # drop the chain's entries

    def verify(self, model, ids_BT, cache):
        out = fastpath.forward(model, ids_BT, cache, fast=self.fast, record=True)
        cache.store_states()
        return out.logits, out.hidden, None

    def rewind(self, cache, recorded, kept_B, tokens: int) -> None:
        # every row kept every token: its Mamba states are already those after the last one (fp32 only: a rounded
        # state format rounds the final and the recorded states apart)
        if cache.state_quant == "fp32" and bool((kept_B == tokens).all()):
            cache.recorded.clear()
            return
        cache.rewind_to(kept_B, tokens)


class StaticForms:
    """The step's forwards with static shapes (`hybridtron.infer.steps`), for one compiled graph per row count and
    k; the catch-up runs over a fixed width (the first `counts[b]` positions of row b real)."""

    def catch_up(self, model, mtp_cache, hidden_BWH, next_BW, counts_B, lengths_B) -> torch.Tensor:
        out = steps.mtp_tokens(model, hidden_BWH, next_BW, mtp_cache, mtp_cache.lengths)
        mtp_cache.lengths.copy_(lengths_B)
        return out[torch.arange(counts_B.shape[0], device=counts_B.device), counts_B - 1]

    def chain(self, model, hidden_BH, token_B, mtp_cache, depth: int) -> torch.Tensor:
        return model.mtp.decode_step(hidden_BH, model.backbone.embeddings(token_B), mtp_cache.layers,
                                     mtp_cache.lengths + (depth - 2))

    def end_chain(self, mtp_cache, cache) -> None:
        pass  # the chain wrote past the lengths without moving them

    def verify(self, model, ids_BT, cache):
        recorded = []
        logits, hidden = steps.forward_tokens(model, ids_BT, cache, recorded)
        return logits, hidden, recorded

    def rewind(self, cache, recorded, kept_B, tokens: int) -> None:
        steps.rewind(cache, recorded, kept_B, tokens)


STATIC = StaticForms()


def speculative_step(forms, model, cache, mtp_cache, pending_B: torch.Tensor, hidden_BWH: torch.Tensor,
                     next_BW: torch.Tensor, counts_B: torch.Tensor, noise_BTV: torch.Tensor | None,
                     sampling: RowSampling, k: int):
    """One speculative step of every row (see the module docstring): catch up, draft k tokens, verify, accept, roll
    back. Updates the caches, the pending tokens and the catch-up buffer (`hidden`, `next`, `counts`) in place;
    returns (the target's tokens [B, k+1], accepted drafts [B], logits [B, k+1, V], the sampled rows'
    distributions or None). Row b emits targets[b, :accepted[b] + 1]."""
    hidden_BH = forms.catch_up(model, mtp_cache, hidden_BWH, next_BW, counts_B, cache.lengths)
    drafts = []
    for depth in range(1, k + 1):
        if depth > 1:
            hidden_BH = forms.chain(model, hidden_BH, drafts[-1], mtp_cache, depth)
        draft_B1, _ = choose_tokens(model.lm_head(hidden_BH)[:, None], sampling,
                                    None if noise_BTV is None else noise_BTV[:, depth - 1:depth])
        drafts.append(draft_B1[:, 0])
    forms.end_chain(mtp_cache, cache)
    drafts_BK = torch.stack(drafts, 1)
    logits_BTV, verified_BTH, recorded = forms.verify(model, torch.cat([pending_B[:, None], drafts_BK], 1), cache)
    targets_BT, probs_BTV = choose_tokens(logits_BTV, sampling, noise_BTV)
    accepted_B = (targets_BT[:, :k] == drafts_BK).long().cumprod(1).sum(1)
    forms.rewind(cache, recorded, accepted_B + 1, k + 1)
    # the kept positions' entries (h_i, x_{i+1}) wait for the next catch-up: x_{i+1} is the target's token at i
    hidden_BWH[:, :k + 1] = verified_BTH
    next_BW[:, :k + 1] = targets_BT
    counts_B.copy_(accepted_B + 1)
    pending_B.copy_(targets_BT[torch.arange(targets_BT.shape[0], device=targets_BT.device), accepted_B])
    return targets_BT, accepted_B, logits_BTV, probs_BTV


def catch_up_static(model, mtp_cache, hidden_BWH, next_BW, counts_B, lengths_B) -> torch.Tensor:
    """`StaticForms.catch_up` alone: a full catch-up buffer, while drafting is off."""
    return STATIC.catch_up(model, mtp_cache, hidden_BWH, next_BW, counts_B, lengths_B)


# -------------------------------------------------------------------------------------------------- the batch
class SpeculativeBatch(DecodeBatch):
    """`DecodeBatch` with MTP drafts: each `step()` emits 1..k+1 tokens per sequence. `draft_length`: None (adaptive,
    up to `max_draft_length`) or a fixed k. `stats` holds the acceptance statistics, `controller` the draft length."""

    def __init__(self, model, *, draft_length: int | None = None,
                 max_draft_length: int = DEFAULT_MAX_DRAFT_LENGTH, clock: Callable[[], float] | None = None,
                 **kwargs):
        check_drafter(model, max_draft_length if draft_length is None else draft_length)
        self.controller = DraftLengthController(max_draft_length, draft_length, clock)
        self.stats = AcceptanceStats()
        super().__init__(model, **kwargs)
        config = model.config
        rows = self.cache.batch_size
        # the drafter's cache holds up to CATCH_UP_WIDTH positions past the backbone's (a batched catch-up writes
        # padding past a row's end); the MTP block has no positional encoding, so lifting the bound is safe
        self.mtp_kinds = config.mtp_layers_block_type
        self.mtp_cache = self.allocate(rows, self.mtp_kinds, self.cache.max_len + CATCH_UP_WIDTH)
        self.mtp_staging = self.allocate(1, self.mtp_kinds, self.max_len + CATCH_UP_WIDTH)
        self.staged_hidden = torch.zeros(1, config.hidden_size, dtype=self.dtype, device=self.device)
        # per row: the entries not yet in the drafter's cache: backbone hidden states and the token after each
        self.uncaught_hidden = torch.zeros(rows, CATCH_UP_WIDTH, config.hidden_size, dtype=self.dtype,
                                           device=self.device)
        self.uncaught_next = torch.zeros(rows, CATCH_UP_WIDTH, dtype=torch.long, device=self.device)
        self.uncaught = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.lagging = 0  # an upper bound of the rows' waiting entries, kept on the host
        self._mtp_views: dict[int, object] = {}
        self.forms = FastForms(self.fast_paths)
        self.compiled_spec = self.compiled_catch_up = None
        if self.compiled_step is not None:
            self.compiled_spec = compile_static(partial(speculative_step, STATIC))
            self.compiled_catch_up = compile_static(catch_up_static)
        self.compiled_keys: set[tuple] = set()  # (kind, size, k) of graphs compiled, whose first call is not timed
        self.last_draft_length = 0

    # -------------------------------------------------------------------------------------- per-row state
    def resize_buffers(self, rows: int, positions: int) -> None:
        self.mtp_cache = self.mtp_cache.resized(rows, positions + CATCH_UP_WIDTH)
        self.uncaught_hidden = resized_rows(self.uncaught_hidden, rows)
        self.uncaught_next = resized_rows(self.uncaught_next, rows)
        self.uncaught = resized_rows(self.uncaught, rows)
        self._mtp_views.clear()

    def positions_needed(self, seq) -> int:
        # a verification writes up to k positions past the pending token
        return super().positions_needed(seq) + self.controller.max_draft_length + 1

    def memory_bytes(self) -> int:
        return super().memory_bytes() + self.mtp_cache.memory_bytes() + self.mtp_staging.memory_bytes() + \
            self.buffer_bytes() * self.cache.batch_size

    def slot_bytes(self) -> int:
        return super().slot_bytes() + self.mtp_cache.slot_bytes() + self.buffer_bytes()

    def buffer_bytes(self) -> int:
        """Bytes of one row's catch-up buffer."""
        row = slice(0, 1)
        return self.uncaught_hidden[row].nbytes + self.uncaught_next[row].nbytes + self.uncaught[row].nbytes

    def mtp_view(self, rows: int):
        if rows not in self._mtp_views:
            self._mtp_views[rows] = self.mtp_cache.rows(0, rows)
        return self._mtp_views[rows]

    def move_row(self, source: int, target: int) -> None:
        super().move_row(source, target)
        self.mtp_cache.copy_row(source, [target])
        self.uncaught_hidden[target] = self.uncaught_hidden[source]
        self.uncaught_next[target] = self.uncaught_next[source]
        self.uncaught[target] = self.uncaught[source]

    def park_rows(self, start: int, stop: int) -> None:
        super().park_rows(start, stop)
        self.mtp_cache.lengths[start:stop] = 0
        self.uncaught[start:stop] = 0

    # -------------------------------------------------------------------------------------------- prefill
    def reset_staging(self) -> None:
        self.mtp_staging.reset_rows(0, 1)

    def after_prefill_chunk(self, seq, start: int, ids_1T: torch.Tensor, out) -> None:
        """Fill the drafter's staging cache with the prompt's entries (h_i, x_{i+1}); the last position waits for
        the first sampled token."""
        chunk, prompt_len = ids_1T.shape[1], len(seq.prompt)
        known = min(chunk, prompt_len - 1 - start)  # positions of this chunk whose next token is in the prompt
        if known > 0:
            following = torch.tensor([seq.prompt[start + 1:start + 1 + known]], device=self.device)
            fastpath.mtp_forward(self.model, out.hidden[:, :known], self.model.backbone.embeddings(following),
                                 self.mtp_staging, fast=self.fast_paths)
        if start + chunk == prompt_len:
            self.staged_hidden.copy_(out.hidden[:, -1])

    def after_join(self, start: int, count: int) -> None:
        self.mtp_cache.copy_row_from(self.mtp_staging, 0, range(start, start + count))
        self.uncaught_hidden[start:start + count, 0] = self.staged_hidden
        self.uncaught_next[start:start + count, 0] = self.pending[start:start + count]
        self.uncaught[start:start + count] = 1
        self.lagging = max(self.lagging, 1)

    # ---------------------------------------------------------------------------------------------- a step
    @torch.inference_mode()
    def step(self) -> list[list[int]]:
        rows = len(self.sequences)
        if rows == 0:
            return []
        k = self.controller.draft_length(rows)
        if self.compiled_spec is None:  # no draft is worth verifying when every row wants one more token at most
            # (compiled, a shorter k would compile another graph: the drafts past the end are dropped instead)
            remaining = max(min(s.params.max_tokens - len(s.tokens), s.limit - len(s.prompt) - len(s.tokens))
                            for s in self.sequences)
            k = min(k, remaining - 1)
        self.last_draft_length = max(k, 0)
        started = self.controller.clock()
        if k <= 0:
            k, accepted = 0, []
            emitted, timed = self.plain_step(rows)
        else:
            emitted, accepted, timed = self.speculative_step(rows, k)
        self.controller.record(rows, k, self.controller.clock() - started if timed else None, accepted)
        return emitted

    def plain_step(self, rows: int) -> tuple[list[list[int]], bool]:
        """One token per row; the position read joins the drafter's catch-up buffer."""
        timed = self.timed(("plain", compiled_size(rows, self.compiled_sizes, self.cache.batch_size), 0))
        logits_BV, hidden_BH = self.one_token(rows)
        self.last_logits_BV = logits_BV
        emitted = self.sample_one(logits_BV)
        index = self.uncaught[:rows]
        every_row = torch.arange(rows, device=self.device)
        self.uncaught_hidden[every_row, index] = hidden_BH
        self.uncaught_next[every_row, index] = self.pending[:rows]
        self.uncaught[:rows] += 1
        self.lagging += 1
        if self.lagging == CATCH_UP_WIDTH:
            self.catch_up_all_but_newest(rows)
        return emitted, timed

    def catch_up_all_but_newest(self, rows: int) -> None:
        """Catch the drafter up on every waiting entry but each row's newest, whose output a draft needs."""
        every_row = torch.arange(rows, device=self.device)
        newest = self.uncaught[:rows] - 1
        hidden, following = self.uncaught_hidden[every_row, newest], self.uncaught_next[every_row, newest]
        self.catch_up(rows)
        self.uncaught_hidden[:rows, 0] = hidden
        self.uncaught_next[:rows, 0] = following
        self.uncaught[:rows] = 1
        self.mtp_cache.lengths[:rows] -= 1
        self.lagging = 1

    def timed(self, key: tuple) -> bool:
        """Whether a step that runs graph `key` is timed: eager always, compiled after its first (compiling) call."""
        if self.compiled_step is None:
            return True
        first = key not in self.compiled_keys
        self.compiled_keys.add(key)
        return not first

    def catch_up(self, rows: int) -> torch.Tensor:
        """Fill the drafter's cache with the waiting entries of rows 0..rows-1; returns depth 1's input [rows, H]."""
        if self.compiled_catch_up is None:
            depth1 = self.forms.catch_up(self.model, self.mtp_view(rows), self.uncaught_hidden[:rows],
                                         self.uncaught_next[:rows], self.uncaught[:rows], self.cache.lengths[:rows])
        else:
            size = compiled_size(rows, self.compiled_sizes, self.cache.batch_size)
            key = ("catch-up", size)
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=key in self.guards_checked):
                depth1 = self.compiled_catch_up(self.model, self.mtp_view(size), self.uncaught_hidden[:size],
                                                self.uncaught_next[:size], self.uncaught[:size].clamp(min=1),
                                                self.cache.lengths[:size])[:rows]
            self.guards_checked.add(key)
            self.park_rows(rows, size)
        self.uncaught[:rows] = 0
        return depth1

    def speculative_step(self, rows: int, k: int) -> tuple[list[list[int]], list[int], bool]:
        """One speculative step of the running rows (`speculative_step`); returns (emitted per row, accepted drafts
        per row, whether the step is timed)."""
        sequences = self.sequences
        size = rows if self.compiled_spec is None else compiled_size(rows, self.compiled_sizes, self.cache.batch_size)
        key = ("spec", size, k)
        timed = self.timed(key)
        sampling = self.sampling() if size == rows else self.sampling().pad(size)
        noise = None
        if not sampling.all_greedy:
            indices = self.generated_indices(k + 1)
            if size > rows:
                indices = torch.cat([indices, indices.new_zeros(size - rows, k + 1)])
            noise = exponential_noise(stream_ids(self.keys[:size], indices), self.model.config.vocab_size)
        width = k + 1  # the catch-up's width: what a verification of k drafts leaves waiting
        if self.lagging > width:  # more wait (plain steps, or a longer draft before): catch up on them first
            self.catch_up_all_but_newest(rows)
        self.lagging = k + 1
        arguments = (self.model, self.view(size), self.mtp_view(size), self.pending[:size],
                     self.uncaught_hidden[:size, :width], self.uncaught_next[:size, :width], self.uncaught[:size],
                     noise, sampling, k)
        if self.compiled_spec is None:
            targets, accepted, logits, probs = speculative_step(self.forms, *arguments)
            self.keep_routing(sequences, (accepted + 1).tolist(), k + 1)
        else:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=key in self.guards_checked):
                out = self.compiled_spec(*arguments)
            self.compiled_sizes.add(size)
            self.guards_checked.add(key)
            self.view(size).store_states()
            self.park_rows(rows, size)
            targets, accepted, logits, probs = (t if t is None else t[:rows] for t in out)
        logprobs, tops = self.logprobs_of(logits, self.sampling(), probs, targets, sequences)
        emitted, accepted_list = [], accepted.tolist()
        for b, (seq, row_tokens, m) in enumerate(zip(sequences, targets.tolist(), accepted_list)):
            seq.draft_lengths[k] = seq.draft_lengths.get(k, 0) + 1
            seq.accepted += m
            self.stats.record(m, k)
            emitted.append(self.emit(seq, row_tokens[:m + 1], logprobs[b] if logprobs else None,
                                     tops[b] if tops else None))
        return emitted, accepted_list, timed


class SpeculativeDecoder(Decoder):
    """`Decoder` with MTP drafts (a `SpeculativeBatch`): each `step()` emits 1..k+1 tokens per sequence (the first
    step the token sampled from the prompt, as plain decoding does). `stats` holds the acceptance statistics.
    `draft_length`: a fixed k (3 unless given), or None for the adaptive controller."""

    batch_class = SpeculativeBatch

    def __init__(self, model, prompts, params, *, draft_length: int | None = 3, **kwargs):
        check_drafter(model, DEFAULT_MAX_DRAFT_LENGTH if draft_length is None else draft_length)
        self.max_draft = draft_length or kwargs.get("max_draft_length", DEFAULT_MAX_DRAFT_LENGTH)
        super().__init__(model, prompts, params, draft_length=draft_length, **kwargs)

    def slack(self) -> int:
        return self.max_draft + 1  # a verification writes up to k positions past the pending token

    @property
    def stats(self) -> AcceptanceStats:
        return self.batch.stats

    @property
    def mtp_cache(self):
        return self.batch.mtp_cache
