"""Bucket weights, proportional sub-sampling for proxy runs, the repetition guard and the mixture report.

A weight is the share of the run's tokens a bucket should supply. Presets:
- `natural`: proportional to the bucket's training tokens (every bucket seen at the same rate);
- `uniform`: every bucket the same share (small buckets repeat, so the guard usually objects);
- `quality`: natural x `QUALITY_MULTIPLIERS[level]` for buckets named `.../q1` .. `.../q5` (x1 otherwise),
  so level 5 gets 4x the share of level 1 relative to its size.

A TOML file refines a preset (rules are bucket names or `fnmatch` patterns such as `"json/*"`, `"*/q5"`):

    base = "natural"          # the starting preset (default natural)
    [weights]                 # set the weight (a share before renormalization); a later rule wins
    "test/*" = 0.02
    [multipliers]             # then multiply; every matching rule applies
    "*/q5" = 2.0

Proportional sub-sampling (Marin/levanter "simulated epoching"): a proxy run of `total_tokens` = b for a full
run of `proxy_of` = B keeps, in every bucket, the first b/B of its training tokens in a fixed order (documents
ordered by a hash of their id, independent of the seed; the last kept document is cut to hit the count). The
weights stay those of the full run, so each bucket is repeated at the full run's rate: epochs = w * B / tokens.

The guard: a plan that draws more than `max_epochs` passes over any bucket raises a ValueError naming the bucket
and by how much, unless `allow_repeat`. (The sampler draws documents at random, so a run's realized count
differs from the plan by sampling noise, about the square root of a bucket's number of draws.)
"""

from __future__ import annotations

import difflib
import fnmatch
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PRESETS = ("natural", "uniform", "quality")
QUALITY_MULTIPLIERS = {1: 0.5, 2: 0.75, 3: 1.0, 4: 1.5, 5: 2.0}
_QUALITY_SUFFIX = re.compile(r"/q([1-5])$")
_TOML_KEYS = ("base", "weights", "multipliers")


def bucket_quality(bucket: str) -> int | None:
    """The quality level of a `"{topic}/q{level}"` bucket, None for buckets without one."""
    match = _QUALITY_SUFFIX.search(bucket)
    return int(match.group(1)) if match else None


def _normalized(weights: Mapping[str, float], source: str) -> dict[str, float]:
    total = sum(weights.values())
    if not total > 0:
        raise ValueError(f"mixture {source}: every bucket weight is zero; expected at least one positive weight")
    return {name: weight / total for name, weight in sorted(weights.items())}


def preset_weights(preset: str, bucket_tokens: Mapping[str, int]) -> dict[str, float]:
    """Normalized weights of a preset over the buckets (`bucket_tokens`: training tokens per bucket)."""
    if preset == "natural":
        raw = {name: float(tokens) for name, tokens in bucket_tokens.items()}
    elif preset == "uniform":
        raw = {name: 1.0 for name in bucket_tokens}
    elif preset == "quality":
        raw = {name: tokens * QUALITY_MULTIPLIERS.get(bucket_quality(name), 1.0)
               for name, tokens in bucket_tokens.items()}
    else:
        raise ValueError(f"mixture: unknown preset {preset!r}; expected one of {', '.join(PRESETS)} or a .toml path")
    return _normalized(raw, repr(preset))


def mixture_weights(spec: str, bucket_tokens: Mapping[str, int]) -> dict[str, float]:
    """Weights from a preset name or a TOML file path."""
    if spec in PRESETS:
        return preset_weights(spec, bucket_tokens)
    if not spec.endswith(".toml"):
        raise ValueError(f"mixture: unknown preset {spec!r}; expected one of {', '.join(PRESETS)} or a .toml path")
    return toml_weights(Path(spec), bucket_tokens)


def toml_weights(path: Path, bucket_tokens: Mapping[str, int]) -> dict[str, float]:
    if not path.is_file():
        raise ValueError(f"mixture: {path} does not exist; expected a TOML file or a preset ({', '.join(PRESETS)})")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"mixture: {path} is not valid TOML ({exc})") from exc
    unknown = sorted(set(data) - set(_TOML_KEYS))
    if unknown:
        raise ValueError(f"mixture {path}: unknown keys {unknown}; expected {', '.join(_TOML_KEYS)}")
    base = data.get("base", "natural")
    if base not in PRESETS:
        raise ValueError(f"mixture {path}: base = {base!r}; expected one of {', '.join(PRESETS)}")
    weights = preset_weights(base, bucket_tokens)
    for rule, value in _rules(data, "weights", path):
        for name in _matching(rule, weights, path, "weights"):
            weights[name] = value
    for rule, value in _rules(data, "multipliers", path):
        for name in _matching(rule, weights, path, "multipliers"):
            weights[name] *= value
    return _normalized(weights, str(path))


def _rules(data: dict, table: str, path: Path) -> list[tuple[str, float]]:
    rules = data.get(table, {})
    if not isinstance(rules, dict):
        raise ValueError(f"mixture {path}: [{table}] must be a table of bucket = number")
    out = []
    for rule, value in rules.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"mixture {path}: [{table}] {rule!r} = {value!r}; expected a finite number >= 0")
        out.append((rule, float(value)))
    return out


def _matching(rule: str, buckets: Mapping[str, float], path: Path, table: str) -> list[str]:
    if any(char in rule for char in "*?["):
        names = fnmatch.filter(buckets, rule)
        if not names:
            raise ValueError(f"mixture {path}: [{table}] pattern {rule!r} matches no bucket")
        return names
    if rule not in buckets:
        close = difflib.get_close_matches(rule, list(buckets), n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(f"mixture {path}: [{table}] unknown bucket {rule!r}{hint} ({len(buckets)} buckets exist)")
    return [rule]


def proxy_keep(packed_lengths: list[int], ratio: float) -> tuple[int, int]:
    """How much of a bucket a proxy keeps: `(whole_documents, tokens_of_the_cut_document)` so that the kept
    packed tokens equal ceil(total * ratio) (at least 2: a bos and one token). `packed_lengths` is the
    bucket's documents in the fixed order; a cut document keeps its bos and loses its eos."""
    target = max(math.ceil(sum(packed_lengths) * ratio), 2)
    kept = 0
    for index, length in enumerate(packed_lengths):
        if kept + length > target:
            remaining = target - kept
            return index, (remaining if remaining >= 2 else 0)
        kept += length
    return len(packed_lengths), 0


@dataclass(frozen=True)
class BucketPlan:
    name: str
    documents: int  # training documents this run draws from (after proxy sub-sampling)
    tokens: int  # their packed tokens (bos + text + eos)
    full_tokens: int  # the bucket's packed training tokens before proxy sub-sampling
    weight: float  # share of the run's tokens
    planned_tokens: float  # weight x the run's token budget

    @property
    def epochs(self) -> float:
        return self.planned_tokens / self.tokens if self.tokens else (math.inf if self.planned_tokens else 0.0)


@dataclass(frozen=True)
class MixtureReport:
    """Tokens, share and planned epochs per bucket, plus the run's budget and the validation split."""

    mixture: str
    total_tokens: int
    proxy_of: int | None
    max_epochs: float
    buckets: tuple[BucketPlan, ...]
    val_documents: int
    val_tokens: int

    @property
    def proxy_ratio(self) -> float:
        return self.total_tokens / self.proxy_of if self.proxy_of else 1.0

    def check_epochs(self, allow_repeat: bool) -> None:
        """Raise if the plan repeats a bucket more than `max_epochs` times (unless `allow_repeat`)."""
        over = sorted((b for b in self.buckets if b.epochs > self.max_epochs * (1 + 1e-9)), key=lambda b: -b.epochs)
        if not over or allow_repeat:
            return
        worst = over[0]
        others = ""
        if len(over) > 1:
            listed = ", ".join(f"{b.name} ({b.epochs:.2f})" for b in over[1:6])
            others = f"; {len(over) - 1} more buckets exceed it too: {listed}" + (" ..." if len(over) > 6 else "")
        raise ValueError(
            f"mixture {self.mixture}: bucket {worst.name!r} would be repeated {worst.epochs:.2f} times "
            f"({worst.planned_tokens:,.0f} planned tokens of {worst.tokens:,} available, "
            f"{worst.epochs / self.max_epochs:.2f}x max_epochs={self.max_epochs:g}){others}. "
            f"Lower its weight, raise max_epochs, shrink total_tokens, or set allow_repeat=True"
        )

    def to_dict(self) -> dict:
        return {
            "mixture": self.mixture, "total_tokens": self.total_tokens, "proxy_of": self.proxy_of,
            "proxy_ratio": self.proxy_ratio, "max_epochs": self.max_epochs,
            "val_documents": self.val_documents, "val_tokens": self.val_tokens,
            "buckets": [{**asdict(b), "epochs": b.epochs} for b in self.buckets],
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    def format(self, max_rows: int | None = None) -> str:
        """A table, largest share first; `max_rows` keeps the first rows and summarizes the rest."""
        rows = sorted(self.buckets, key=lambda b: (-b.weight, b.name))
        available = sum(b.tokens for b in self.buckets)
        proxy = f", proxy of {self.proxy_of:,} (ratio {self.proxy_ratio:.4g})" if self.proxy_of else ""
        lines = [
            f"mixture {self.mixture}: {len(rows)} buckets, {available:,} training tokens available, "
            f"budget {self.total_tokens:,} tokens{proxy}",
            f"{'bucket':<28} {'docs':>6} {'tokens':>11} {'share':>7} {'planned':>11} {'epochs':>7}",
        ]
        shown = rows if max_rows is None else rows[:max_rows]
        for b in shown:
            lines.append(f"{b.name:<28} {b.documents:>6} {b.tokens:>11,} {b.weight:>7.2%} "
                         f"{b.planned_tokens:>11,.0f} {b.epochs:>7.3f}")
        if len(shown) < len(rows):
            rest = rows[len(shown):]
            lines.append(f"... {len(rest)} more buckets: {sum(b.weight for b in rest):.2%} of the tokens, "
                         f"max epochs {max(b.epochs for b in rest):.3f}")
        lines.append(f"validation: {self.val_documents:,} documents, {self.val_tokens:,} tokens")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()
