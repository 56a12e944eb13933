"""Sampling: logits -> a filtered distribution -> a token; and the acceptance rule of speculative decoding.

Recipe (the order of Hugging Face and vLLM): divide the logits by the temperature, keep the top-k logits, take the
softmax, keep the nucleus (the smallest set of most likely tokens whose mass reaches top_p), renormalise, sample.
Temperature 0 is greedy: the distribution is one-hot on the argmax, so every function below (speculative
acceptance included) treats greedy and sampled decoding alike.

Speculative decoding (Leviathan et al. 2023, Algorithm 1): a drafter proposed k tokens x_i ~ q_i; the target scored
the k+1 positions in one forward, giving p_0..p_k. Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the
first rejection sample the next token from norm(max(0, p_i - q_i)); if all k are accepted sample a bonus token from
p_k. The emitted tokens are distributed exactly as sampling from p one token at a time, whatever q is, provided
p and q are the distributions after the same filtering (both from `probs_from_logits` with the same parameters).
The greedy variant accepts the longest prefix where the target's argmax equals the draft, then adds the target's
argmax at the first mismatch (or after the last draft): it emits exactly the target's greedy tokens.

Every sampler here draws its randomness as uniforms and maps them through the inverse CDF, so that the vectorised
`speculative_accept_batch` and its sequential twin `speculative_accept_ref` are comparable token for token.

Shapes: B batch, K draft length, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class ParamError(ValueError):
    """A sampling parameter out of range; `param` names the field (the HTTP server reports it to the client)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param} {message}")
        self.param = param


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_filter_args(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ParamError unless temperature >= 0, top_k >= 0 (0 = off) and top_p in (0, 1]."""
    if not _is_number(temperature) or math.isnan(temperature) or temperature < 0 or math.isinf(temperature):
        raise ParamError("temperature", f"must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if not _is_int(top_k) or top_k < 0:
        raise ParamError("top_k", f"must be an integer >= 0 (0 = no top-k filter), got {top_k!r}")
    if not _is_number(top_p) or not (0.0 < top_p <= 1.0):
        raise ParamError("top_p", f"must be a number in (0, 1] (1 = no nucleus filter), got {top_p!r}")


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick tokens, and when to stop. Defaults sample from the model's plain distribution.

    temperature: 0 = greedy; top_k: 0 = off; top_p: 1 = off. seed: a fixed seed makes a request reproducible.
    max_tokens: most tokens to generate (0 allowed: nothing is generated). stop: strings that end the text (not
    included in it); stop_token_ids: token ids that end it (their text is not included either).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        check_filter_args(self.temperature, self.top_k, self.top_p)
        if self.seed is not None and not _is_int(self.seed):
            raise ParamError("seed", f"must be an integer or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ParamError("max_tokens", f"must be an integer >= 0, got {self.max_tokens!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise ParamError("stop", f"must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        set_("stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ParamError("stop_token_ids", f"must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        set_("stop_token_ids", tuple(ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: str | torch.device = "cpu") -> torch.Generator | None:
        """A generator seeded with `seed`, or None (the global RNG) when no seed is set."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


# ------------------------------------------------------------------------------------------ distributions
def greedy(logits_BV: torch.Tensor) -> torch.Tensor:
    """The most likely token of each row (the first one on ties)."""
    return logits_BV.argmax(dim=-1)


def probs_from_logits(logits_BV: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                      top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then top-k, then nucleus (top-p) filtering: an fp32 distribution over the last axis.

    Top-k keeps every logit >= the k-th largest (ties at the boundary are all kept, as vLLM does). The nucleus keeps
    a token while the mass of the more likely tokens before it is < top_p, so the most likely token always stays.
    Works on any leading shape [..., V].
    """
    check_filter_args(temperature, top_k, top_p)
    logits = logits_BV.float()
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth_largest = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, -math.inf)
    probs = logits.softmax(dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def inverse_cdf_sample(probs_BV: torch.Tensor, uniforms_B: torch.Tensor) -> torch.Tensor:
    """Token i such that cdf[i-1] <= u * total < cdf[i]; rows need not be normalised; shape [...] from [..., V].

    A zero-probability token is never returned: the search skips flat stretches of the CDF, and the result is capped
    at the last token with positive mass in case u * total rounds up to the total.
    """
    cdf = probs_BV.float().cumsum(dim=-1)
    target = uniforms_B.float().unsqueeze(-1) * cdf[..., -1:]
    index = (cdf <= target).sum(dim=-1)
    vocab = probs_BV.shape[-1]
    last_positive = vocab - 1 - (probs_BV > 0).flip(-1).float().argmax(dim=-1)
    return torch.minimum(index, last_positive)


def sample(probs_BV: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of a distribution [..., V] (rows need not be normalised)."""
    uniforms = torch.rand(probs_BV.shape[:-1], generator=generator, device=probs_BV.device)
    return inverse_cdf_sample(probs_BV, uniforms)


# ------------------------------------------------------------------------------------- speculative decoding
def _check_speculative_shapes(draft_tokens_BK, draft_probs_BKV, target_probs_BKV):
    if draft_tokens_BK.dim() != 2:
        raise ValueError(f"draft_tokens must be [batch, k], got shape {tuple(draft_tokens_BK.shape)}")
    batch, k = draft_tokens_BK.shape
    if draft_probs_BKV.dim() != 3 or draft_probs_BKV.shape[:2] != (batch, k):
        raise ValueError(f"draft_probs must be [batch={batch}, k={k}, vocab], got {tuple(draft_probs_BKV.shape)}")
    vocab = draft_probs_BKV.shape[-1]
    if tuple(target_probs_BKV.shape) != (batch, k + 1, vocab):
        raise ValueError(f"target_probs must be [batch={batch}, k+1={k + 1}, vocab={vocab}], "
                         f"got {tuple(target_probs_BKV.shape)}")


def speculative_accept_batch(draft_tokens_BK: torch.Tensor, draft_probs_BKV: torch.Tensor,
                             target_probs_BKV: torch.Tensor, generator: torch.Generator | None = None,
                             uniforms_BK: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan rejection sampling for a batch: (n_accepted [B], next_token [B]).

    draft_tokens [B, K] were sampled from draft_probs [B, K, V]; target_probs [B, K+1, V] is the target's
    distribution at each draft position plus the one after the last draft. Sequence b emits
    draft_tokens[b, :n_accepted[b]] and then next_token[b]. `uniforms` [B, K+1] (K for the acceptance tests, one
    for the final sample) replaces the generator's draws, to replay a decision exactly.
    """
    _check_speculative_shapes(draft_tokens_BK, draft_probs_BKV, target_probs_BKV)
    batch, k = draft_tokens_BK.shape
    if uniforms_BK is None:
        uniforms_BK = torch.rand(batch, k + 1, generator=generator, device=target_probs_BKV.device)
    draft = draft_tokens_BK.unsqueeze(-1)
    p_BK = target_probs_BKV[:, :k].float().gather(-1, draft).squeeze(-1)
    q_BK = draft_probs_BKV.float().gather(-1, draft).squeeze(-1)
    # u < p/q, written without a division: a draft with q = 0 (impossible unless the caller passes a q that did
    # not produce the draft) is accepted iff p > 0.
    accepted_BK = uniforms_BK[:, :k] * q_BK < p_BK
    n_accepted = accepted_BK.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(batch, device=n_accepted.device)
    p_next_BV = target_probs_BKV[rows, n_accepted].float()
    if k > 0:
        rejected = (n_accepted < k).unsqueeze(-1)
        q_next_BV = draft_probs_BKV[rows, n_accepted.clamp(max=k - 1)].float() * rejected
        residual = (p_next_BV - q_next_BV).clamp(min=0)
        # After a rejection the residual has positive mass in exact arithmetic; fall back to p if rounding ate it.
        p_next_BV = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next_BV)
    next_token = inverse_cdf_sample(p_next_BV, uniforms_BK[:, k])
    return n_accepted, next_token


def speculative_accept(draft_tokens_K: torch.Tensor, draft_probs_KV: torch.Tensor, target_probs_KV: torch.Tensor,
                       generator: torch.Generator | None = None) -> tuple[int, int]:
    """Leviathan rejection sampling for one sequence: (n_accepted, next_token).

    draft_tokens [K] sampled from draft_probs [K, V]; target_probs [K+1, V]. Emit draft_tokens[:n_accepted], then
    next_token.
    """
    n_accepted, next_token = speculative_accept_batch(
        torch.as_tensor(draft_tokens_K, dtype=torch.long, device=target_probs_KV.device).unsqueeze(0),
        draft_probs_KV.unsqueeze(0), target_probs_KV.unsqueeze(0), generator)
    return int(n_accepted[0]), int(next_token[0])


def speculative_accept_ref(draft_tokens_K: torch.Tensor, draft_probs_KV: torch.Tensor,
                           target_probs_KV: torch.Tensor, uniforms_K: torch.Tensor) -> tuple[int, int]:
    """Algorithm 1 of Leviathan et al., one position at a time: the twin of `speculative_accept_batch`.

    uniforms [K+1] are the same draws the batched version takes (row b of its `uniforms`).
    """
    k = len(draft_tokens_K)
    for i in range(k):
        token = int(draft_tokens_K[i])
        p, q = target_probs_KV[i, token].float(), draft_probs_KV[i, token].float()
        if not bool(uniforms_K[i].float() * q < p):  # same comparison as the batched version, rounding included
            residual = (target_probs_KV[i].float() - draft_probs_KV[i].float()).clamp(min=0)
            if residual.sum() <= 0:
                residual = target_probs_KV[i].float()
            return i, int(inverse_cdf_sample(residual, uniforms_K[k]))
    return k, int(inverse_cdf_sample(target_probs_KV[k].float(), uniforms_K[k]))


def speculative_accept_greedy_batch(draft_tokens_BK: torch.Tensor,
                                    target_logits_BKV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification for a batch: (n_accepted [B], next_token [B]).

    target_logits [B, K+1, V] (logits or probabilities: only the argmax matters). n_accepted is the length of the
    longest prefix where the target's argmax equals the draft; next_token is the target's argmax right after it.
    """
    if draft_tokens_BK.dim() != 2:
        raise ValueError(f"draft_tokens must be [batch, k], got shape {tuple(draft_tokens_BK.shape)}")
    batch, k = draft_tokens_BK.shape
    if target_logits_BKV.dim() != 3 or target_logits_BKV.shape[:2] != (batch, k + 1):
        raise ValueError(f"target_logits must be [batch={batch}, k+1={k + 1}, vocab], "
                         f"got {tuple(target_logits_BKV.shape)}")
    target_tokens_BK = target_logits_BKV.argmax(dim=-1)
    matches = (target_tokens_BK[:, :k] == draft_tokens_BK).long()
    n_accepted = matches.cumprod(dim=1).sum(dim=1)
    next_token = target_tokens_BK.gather(1, n_accepted.unsqueeze(1)).squeeze(1)
    return n_accepted, next_token


def speculative_accept_greedy(draft_tokens_K: torch.Tensor, target_logits_KV: torch.Tensor) -> tuple[int, int]:
    """Greedy verification for one sequence: (n_accepted, next_token); see `speculative_accept_greedy_batch`."""
    n_accepted, next_token = speculative_accept_greedy_batch(
        torch.as_tensor(draft_tokens_K, dtype=torch.long, device=target_logits_KV.device).unsqueeze(0),
        target_logits_KV.unsqueeze(0))
    return int(n_accepted[0]), int(next_token[0])
