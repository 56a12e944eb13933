"""Sampling: logits -> a filtered distribution -> a token, per row of a batch, with noise that belongs to the request.

Recipe (the order of Hugging Face and vLLM): divide the logits by the temperature, keep the top-k logits, take the
softmax, keep the nucleus (the smallest set of most likely tokens whose mass reaches top_p), renormalise, sample.
Temperature 0 is greedy: the most likely token of the unfiltered logits. Every row of a batch has its own
parameters (`RowSampling`: one request's temperature, top-k and top-p per row).

Drawing (the exponential race, i.e. the Gumbel-max trick): token = argmax_v p_v / E_v with E_v ~ Exp(1) independent
per token, which is exactly a draw from p. The noise E of a row comes from a counter-based hash of (the request's
key, the index of the generated token, the token id) (`exponential_noise`), never from a stateful generator, so:

- a request's tokens depend on its seed alone: not on the other rows of the batch, on when it joined, on
  speculative decoding being on or off, or on the draft length;
- speculative verification is greedy verification on the perturbed scores: the draft of a position is the argmax of
  the drafter's distribution under the same noise, and the target accepts it iff its own perturbed argmax is the
  same token. The emitted tokens are exactly those of plain sampling with that noise, whatever the drafts were, so
  the output is distributed as plain sampling (and identical to it, seed for seed).

Where this departs from Leviathan et al. (2023, rejection sampling with min(1, p/q), the SPEC's rule): both keep
the target's distribution exactly, but Leviathan's maximal coupling accepts a draft with probability sum_v min(p, q)
while the shared-noise coupling accepts less often (at least (1 - TV) / (1 + TV)): on the quickstart checkpoint at
T = 1, 0.72 against 0.77 per depth-1 draft (BENCHMARKS.md). What it buys is the reproducibility above: with
rejection sampling a draw depends on how many drafts each step verified, which an adaptive draft length and
continuous batching change from run to run.

Log-probabilities reported for a token are under the distribution it was drawn from: the filtered distribution of
its row (`row_probs`); for a greedy row, log_softmax of the unscaled, unfiltered logits.

Shapes: B batch (rows), T positions, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

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

    temperature: 0 = greedy; top_k: 0 = off; top_p: 1 = off. seed: a fixed seed makes a request reproducible (its
    noise key comes from it, `noise_key`); None draws a key from torch's global RNG.
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


# ---------------------------------------------------------------------------------------- per-row sampling
@dataclass
class RowSampling:
    """The sampling parameters of every row of a batch, as tensors [B] (one request per row).

    Greedy rows carry temperature 1 and no filter (their distribution only serves their log-probs); rows without
    top-k carry top_k = 0, rows without top-p carry top_p = 1. The flags let the common cases skip work."""

    temperature_B: torch.Tensor  # float32
    top_k_B: torch.Tensor  # long, 0 = off
    top_p_B: torch.Tensor  # float32, 1 = off
    greedy_B: torch.Tensor  # bool
    all_greedy: bool
    max_top_k: int  # the largest top-k of a row (0: none), as a Python int: a compiled step does not read tensors
    any_top_p: bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams], device: str | torch.device = "cpu") -> "RowSampling":
        greedy_rows = [p.greedy for p in params]
        return cls(
            temperature_B=torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device),
            top_k_B=torch.tensor([0 if p.greedy else p.top_k for p in params], dtype=torch.long, device=device),
            top_p_B=torch.tensor([1.0 if p.greedy else p.top_p for p in params], device=device),
            greedy_B=torch.tensor(greedy_rows, dtype=torch.bool, device=device),
            all_greedy=all(greedy_rows), max_top_k=max((p.top_k for p in params if not p.greedy), default=0),
            any_top_p=any(not p.greedy and p.top_p < 1.0 for p in params))

    def pad(self, rows: int) -> "RowSampling":
        """The same rows followed by greedy rows up to `rows` (the padding of a fixed-size compiled batch)."""
        extra = rows - self.greedy_B.shape[0]
        if extra <= 0:
            return self

        def grow(t, value):
            return torch.cat([t, t.new_full((extra, *t.shape[1:]), value)])
        return RowSampling(grow(self.temperature_B, 1.0), grow(self.top_k_B, 0), grow(self.top_p_B, 1.0),
                           grow(self.greedy_B, True), self.all_greedy, self.max_top_k, self.any_top_p)


def row_probs(logits_BTV: torch.Tensor, rows: RowSampling) -> torch.Tensor:
    """Each row's filtered distribution (fp32), as `probs_from_logits` gives it for that row's parameters; greedy
    rows get the unfiltered softmax at temperature 1."""
    logits = logits_BTV.float() / rows.temperature_B.view(-1, *[1] * (logits_BTV.dim() - 1))
    extra = logits_BTV.dim() - 1  # dims after the row axis
    if rows.max_top_k:
        top_k = rows.top_k_B.view(-1, *[1] * extra)
        kth_largest = logits.topk(min(rows.max_top_k, logits.shape[-1]), dim=-1).values.gather(
            -1, (top_k.clamp(1, logits.shape[-1]) - 1).expand(*logits.shape[:-1], 1))
        logits = logits.masked_fill((top_k > 0) & (top_k < logits.shape[-1]) & (logits < kth_largest), -math.inf)
    probs = logits.softmax(dim=-1)
    if rows.any_top_p:
        top_p = rows.top_p_B.view(-1, *[1] * extra)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter_(-1, order, mass_before >= top_p)
        nucleus = probs.masked_fill(drop, 0.0)
        probs = torch.where(top_p < 1.0, nucleus / nucleus.sum(dim=-1, keepdim=True), probs)
    return probs


def choose_tokens(logits_BTV: torch.Tensor, rows: RowSampling,
                  noise_BTV: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens [B, T], the sampled rows' distributions [B, T, V] or None when every row is greedy): greedy rows
    take the argmax of their logits, the others the exponential race against `noise` (`exponential_noise`)."""
    argmax = logits_BTV.argmax(dim=-1)
    if rows.all_greedy:
        return argmax, None
    probs = row_probs(logits_BTV, rows)
    raced = (probs / noise_BTV).argmax(dim=-1)
    greedy = rows.greedy_B.view(-1, *[1] * (argmax.dim() - 1))
    return torch.where(greedy, argmax, raced), probs


def row_logprobs(logits_BTV: torch.Tensor, rows: RowSampling, probs_BTV: torch.Tensor | None) -> torch.Tensor:
    """log p over the vocabulary under each row's sampled distribution (see the module docstring)."""
    greedy = torch.log_softmax(logits_BTV.float(), dim=-1)
    if probs_BTV is None:
        return greedy
    return torch.where(rows.greedy_B.view(-1, *[1] * (logits_BTV.dim() - 1)), greedy, probs_BTV.log())


# ------------------------------------------------------------------------------------------ the noise
MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9
_token_hashes: dict[tuple[int, str], torch.Tensor] = {}


def fmix32(h: int) -> int:
    """MurmurHash3's finalizer on a 32-bit value: every input bit flips about half the output bits."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def _signed32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def fmix32_(h: torch.Tensor) -> torch.Tensor:
    """`fmix32` in place on an int32 tensor (two's complement: products wrap, shifts are masked to be logical)."""
    h.bitwise_xor_((h >> 16) & 0xFFFF)
    h.mul_(_signed32(0x85EBCA6B))
    h.bitwise_xor_((h >> 13) & 0x7FFFF)
    h.mul_(_signed32(0xC2B2AE35))
    h.bitwise_xor_((h >> 16) & 0xFFFF)
    return h


def noise_key(seed: int, sample: int = 0) -> tuple[int, int]:
    """The noise key of sample `sample` of a request seeded `seed` (any integer): two 32-bit words."""
    x = (seed * 0x9E3779B97F4A7C15 + sample * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) % (1 << 64)
    for _ in range(2):  # splitmix64's finalizer
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) % (1 << 64)
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) % (1 << 64)
        x ^= x >> 31
    return x & MASK32, x >> 32


def stream_id(key: tuple[int, int], index: int) -> int:
    """The 32-bit word of one (row, generated-token index) that the noise of every token is hashed from."""
    return fmix32(key[0] ^ fmix32(key[1] ^ fmix32(index & MASK32)))


def _fmix32_long(h: torch.Tensor) -> torch.Tensor:
    """`fmix32` on 32-bit values held in an int64 tensor (the products pass 2^63 and wrap; the mask keeps the low
    32 bits, which wrapping does not change)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def stream_ids(keys_B2: torch.Tensor, indices_BT: torch.Tensor) -> torch.Tensor:
    """`stream_id` of every (row, index) as int32 [B, T]: `keys` int64 [B, 2], `indices` int64 [B, T]."""
    inner = _fmix32_long(keys_B2[:, 1:] ^ _fmix32_long(indices_BT & MASK32))
    sid = _fmix32_long(keys_B2[:, :1] ^ inner)
    return (sid - ((sid >> 31) << 32)).to(torch.int32)  # the same 32 bits, two's complement


def token_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    cached = (vocab, str(device))
    if cached not in _token_hashes:
        values = [_signed32(fmix32((v * GOLDEN32 + 1) & MASK32)) for v in range(vocab)]
        _token_hashes[cached] = torch.tensor(values, dtype=torch.int32, device=device)
    return _token_hashes[cached]


def exponential_noise(stream_ids_BT: torch.Tensor, vocab: int) -> torch.Tensor:
    """E [B, T, V] ~ Exp(1): token v's value is fmix32(stream id ^ hash(v)), read as a uniform u in (0, 1) with 23
    bits and turned into -log(u). `stream_ids` (int32, `stream_id` of each row's key and token index) make it a
    function of (request, index, token) only. One hash round per value: the values of two indices of a row are a
    fixed pseudo-random permutation of each other's, which no sampling statistic can see."""
    h = stream_ids_BT[..., None] ^ token_hashes(vocab, stream_ids_BT.device)
    # u = (23 bits + 1/2) / 2^23 is exact in fp32 and below 1, so -log(u) > 0 (never 0: p / E stays finite)
    uniform = ((fmix32_(h) >> 9) & 0x7FFFFF).float().add_(0.5).mul_(2.0 ** -23)
    return uniform.log_().neg_()


def exponential_noise_ref(key: tuple[int, int], index: int, vocab: int) -> list[float]:
    """`exponential_noise` of one (row, index) in plain Python integers: the reference its tensors must match."""
    sid = stream_id(key, index)
    return [-math.log((((fmix32(sid ^ fmix32((v * GOLDEN32 + 1) & MASK32)) >> 9) & 0x7FFFFF) + 0.5) * 2.0 ** -23)
            for v in range(vocab)]
