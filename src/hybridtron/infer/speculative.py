"""Self-speculative decoding: the model's own MTP block drafts k tokens, the backbone verifies them in one forward.

One step, for a sequence whose backbone cache holds positions 0..n-1 and whose last sampled token x_n is pending:

1. Draft (SPEC-algorithms.md, MTP as drafter). The shared MTP block is applied recursively: depth 1 reads the
   backbone's last hidden state h_{n-1} and the embedding of x_n and proposes d_1; depth j > 1 reads the block's own
   output of depth j-1 and the embedding of d_{j-1} and proposes d_j. The MTP block's attention has its own KV
   cache (`HybridCache.allocate(kinds=config.mtp_layers_block_type)`), one entry per position as in training's
   depth 1: entry i is built from (h_i, x_{i+1}). Depth j of the chain writes its entry at position n-1+j-1, as
   if its own output stood in for the backbone's hidden state one position further (EAGLE's convention); those
   chain entries are dropped after the draft. Before drafting, the entries of the positions accepted at the last
   step are computed from the backbone's real hidden states ("catch-up", in the same forward as depth 1), so the
   drafter's cache always holds exactly the real entries 0..n-1 between steps.
2. Verify: one backbone forward over [x_n, d_1, .., d_k] with `record_steps` on: the Mamba layers keep their conv
   and SSM state after every one of the k+1 tokens.
3. Accept: greedy (the longest prefix where the target's argmax equals the draft, then the target's argmax) or
   Leviathan rejection sampling (`hybridtron.infer.sampling`; draft and target distributions filtered alike), so
   the output is distributed exactly as plain decoding. The m accepted drafts and one more token are emitted.
4. Roll back: `cache.rewind_to(m + 1)` restores each Mamba layer to the state recorded after the last kept token
   and truncates the KV lengths; nothing is recomputed.

Acceptance length = accepted drafts + 1 per verification step (the report: 2.89x single-user decode at k = 6).

Batch size 1 is what this is for (large batches lose the gain: verification costs throughput), but every step is
batched: rows keep their own lengths, accept their own number of drafts and roll back to their own slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from hybridtron.config import MAMBA
from hybridtron.infer.cache import HybridCache
from hybridtron.infer.generate import Decoder
from hybridtron.infer.sampling import (
    SamplingParams, greedy, probs_from_logits, sample, speculative_accept_batch, speculative_accept_greedy_batch,
)

MAX_DRAFT_LENGTH = 16


@dataclass
class AcceptanceStats:
    """Verification steps of unfinished sequences and the drafts they accepted."""

    draft_length: int
    steps: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)  # steps that accepted 0, 1, .., k drafts

    def __post_init__(self):
        if not self.histogram:
            self.histogram = [0] * (self.draft_length + 1)

    def record(self, n_accepted: int) -> None:
        self.steps += 1
        self.accepted += n_accepted
        self.histogram[n_accepted] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step: accepted drafts + 1 (the target's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


def check_drafter(model, draft_length: int) -> None:
    config = model.config
    if model.mtp is None:
        raise ValueError("speculative decoding drafts with the MTP block, and this model has none "
                         "(num_nextn_predict_layers = 0); decode without --speculative")
    if MAMBA in config.mtp_layers_block_type:
        raise ValueError(f"mtp_layers_block_type {config.mtp_layers_block_type}: a Mamba layer inside the MTP block "
                         f"is not supported by the drafter (only attention, moe and mlp layers)")
    if not 1 <= draft_length <= MAX_DRAFT_LENGTH:
        raise ValueError(f"draft_length must be in [1, {MAX_DRAFT_LENGTH}], got {draft_length}")


class SpeculativeDecoder(Decoder):
    """`Decoder` with MTP drafts: each `step()` emits 1..k+1 tokens per sequence (the first step emits the token
    sampled from the prompt, as plain decoding does). `stats` holds the acceptance statistics."""

    def __init__(self, model, prompts: Sequence[Sequence[int]], params: SamplingParams, *, draft_length: int = 3,
                 **kwargs):
        check_drafter(model, draft_length)
        if kwargs.get("compile"):
            raise ValueError("compile: the compiled decode step is for plain decoding (a verification forward has "
                             "a different number of tokens at every step); decode without speculative drafts")
        self.draft_length = draft_length
        self.stats = AcceptanceStats(draft_length)
        # a verification writes k positions past the pending token
        super().__init__(model, prompts, params, extra_positions=draft_length, **kwargs)

    def allocate_extra_caches(self) -> None:
        config = self.model.config
        # The drafter's cache briefly holds up to k - 1 positions past the backbone's (chain entries, padding of a
        # batched catch-up). The MTP block has no positional encoding, so lifting the position bound is safe.
        mtp_len = self.max_len + self.draft_length
        mtp_config = config.replace(max_position_embeddings=max(config.max_position_embeddings, mtp_len))
        self.mtp_cache = HybridCache.allocate(mtp_config, self.batch_size, mtp_len, dtype=self.dtype,
                                              device=self.device, kinds=config.mtp_layers_block_type)
        # backbone hidden states whose drafter entries are not computed yet: [B, M, H], `pending_count` [B] valid
        self.pending_hidden = torch.zeros(self.batch_size, 1, config.hidden_size, dtype=self.dtype, device=self.device)
        self.pending_count = torch.ones(self.batch_size, dtype=torch.long, device=self.device)
        # the token after each of those positions, but the last (that one is `self.pending`)
        self.pending_next = torch.zeros(self.batch_size, 1, dtype=torch.long, device=self.device)

    def after_prefill_chunk(self, rows: list[int], ids_BT: torch.Tensor, start: int, out) -> None:
        """Fill the drafter's cache with the prompt's entries (h_i, x_{i+1}); the last position waits for x_P."""
        prompt_len, chunk = ids_BT.shape[1], out.hidden.shape[1]
        known = min(chunk, prompt_len - 1 - start)  # positions of this chunk whose next token is known
        if known > 0:
            view = self.mtp_cache if len(rows) == self.batch_size else self.mtp_cache.select(rows[0])
            self.mtp_forward(out.hidden[:, :known], ids_BT[:, start + 1:start + 1 + known], view)
        if start + chunk == prompt_len:
            self.pending_hidden[rows, 0] = out.hidden[:, -1]

    def mtp_forward(self, hidden_BTH: torch.Tensor, next_tokens_BT: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """The MTP block over T positions with its cache; returns its output hidden states [B, T, H]."""
        next_embedding = self.model.backbone.embeddings(next_tokens_BT)
        out = self.model.mtp(hidden_BTH, next_embedding, caches=cache.layers, lengths=cache.lengths)
        cache.lengths += next_tokens_BT.shape[1]
        return out

    # ---------------------------------------------------------------------------------------------- a step
    def effective_draft_length(self) -> int:
        """k, shortened near the end of the cache or of the longest remaining budget."""
        active = [b for b, s in enumerate(self.sequences) if not s.finished]
        lengths = self.cache.lengths.tolist()
        room = min(self.max_len - 1 - lengths[b] for b in active)
        remaining = max(self.params.max_tokens - len(self.sequences[b].tokens) for b in active)
        return max(0, min(self.draft_length, room, remaining - 1))

    def draft(self, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Catch the drafter's cache up, then propose k tokens: (drafts [B, k], draft probs [B, k, V] or None)."""
        rows = torch.arange(self.batch_size, device=self.device)
        next_tokens = self.pending_next.clone()
        next_tokens[rows, self.pending_count - 1] = self.pending
        hidden = self.mtp_forward(self.pending_hidden, next_tokens, self.mtp_cache)[rows, self.pending_count - 1]
        # real entries 0..n-1 (a batched catch-up also wrote padding past some rows' ends)
        self.mtp_cache.lengths.copy_(self.cache.lengths)
        drafts, probs = [], []
        for depth in range(1, k + 1):
            if depth > 1:
                hidden = self.mtp_forward(hidden[:, None], drafts[-1][:, None], self.mtp_cache)[:, 0]
            logits = self.model.lm_head(hidden)
            if self.params.greedy:
                drafts.append(greedy(logits))
            else:
                p = self.params
                probs.append(probs_from_logits(logits, p.temperature, p.top_k, p.top_p))
                drafts.append(sample(probs[-1], self.generator))
        self.mtp_cache.lengths.copy_(self.cache.lengths)  # drop the chain entries
        drafts_BK = torch.stack(drafts, 1) if drafts else torch.zeros(self.batch_size, 0, dtype=torch.long,
                                                                      device=self.device)
        if self.params.greedy:
            return drafts_BK, None
        if not probs:
            return drafts_BK, torch.zeros(self.batch_size, 0, self.model.config.vocab_size, device=self.device)
        return drafts_BK, torch.stack(probs, 1)

    def verify(self, drafts_BK: torch.Tensor, draft_probs_BKV: torch.Tensor | None):
        """One recorded backbone forward over [pending, drafts]; accept; roll back. Returns (n_accepted, next)."""
        k = drafts_BK.shape[1]
        ids = torch.cat([self.pending[:, None], drafts_BK], dim=1)
        self.cache.set_record_steps(True)
        out = self.forward(ids, self.cache)
        if self.params.greedy:
            n_accepted, next_token = speculative_accept_greedy_batch(drafts_BK, out.logits)
        else:
            p = self.params
            target_probs = probs_from_logits(out.logits, p.temperature, p.top_k, p.top_p)
            n_accepted, next_token = speculative_accept_batch(drafts_BK, draft_probs_BKV, target_probs,
                                                              self.generator)
        self.cache.rewind_to(n_accepted + 1, k + 1)
        self.cache.set_record_steps(False)
        # the drafter's entries for the kept positions are computed at the next draft
        self.pending_hidden = out.hidden
        self.pending_count = n_accepted + 1
        self.pending_next = torch.cat([drafts_BK, torch.zeros_like(drafts_BK[:, :1])], dim=1)
        return n_accepted, next_token

    @torch.inference_mode()
    def step(self) -> list[list[int]]:
        if self.done:
            return [[] for _ in self.sequences]
        if self.pending is None:  # the first token comes from the prompt's logits, as in plain decoding
            return super().step()
        active = [not s.finished for s in self.sequences]
        self.park_finished_rows(self.cache)
        self.park_finished_rows(self.mtp_cache)
        k = self.effective_draft_length()
        drafts, draft_probs = self.draft(k)
        n_accepted, next_token = self.verify(drafts, draft_probs)
        self.pending = next_token
        new_tokens = []
        for b, (drafts_b, m, token) in enumerate(zip(drafts.tolist(), n_accepted.tolist(), next_token.tolist())):
            if not active[b]:
                new_tokens.append([])
                continue
            self.stats.record(m)
            new_tokens.append(self.emit(b, drafts_b[:m] + [token]))
        return new_tokens
