"""The ladder's plan: for each compute budget C, a few models of one family, each trained on the tokens D that spend
C, so that the loss at a fixed C can be read as a function of how C is split between parameters and tokens.

The family of a preset (`family_member`): the preset's architecture at another width and depth. Width: hidden_size
in steps of WIDTH_STEP; the attention heads, Mamba heads and every intermediate width (dense MLP, experts, shared
expert, LatentMoE latent) scale with it by the preset's own ratios; head dims, state size, expert count and top-k
stay. Depth: the preset's layer pattern repeated, round(hidden / preset hidden) times and at least once, so every
member keeps the preset's kinds of layer (Mamba, attention, MoE, MLP) in their order, and the preset's width to
depth ratio where whole repeats allow it.

The points of a budget (`plan_ladder`): centred on the member that would train on 20 tokens per parameter
(Chinchilla's split, a guess the fit then corrects; `centre_ratio` moves it: a CPU ladder of small budgets centres
lower, where the family still has models), `points` models spaced by a factor `spread` in parameters, each the
family member nearest its target; each trains D = C / (FLOPs per token) tokens, in whole steps of the base's batch.
FLOPs per token are counted as bench/pretrain.py counts them (hybridtron.train.flops), so a rung's FLOPs are C up to
that rounding, and 6 N D (N: the active matmul parameters) is C less the share of attention, the scan and MTP.

Each rung is an ordinary pretraining run (its run config under DIR/configs/), a proportional proxy of one mixture:
`data.proxy_of` is the ladder's largest token count, so every rung sees each bucket in the same proportion and at
the same rate of repetition (hybridtron.data.mixture), and the schedule keeps the base run's shape (the warmup the
same share of the steps, the same decay fraction).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from hybridtron.config import PRESETS, ModelConfig, preset
from hybridtron.files import atomic_write_json
from hybridtron.model.lm import HybridLM
from hybridtron.train.config import RunConfig
from hybridtron.train.flops import config_flops_per_token

PLAN_FILE = "plan.json"
BASE_FILE = "base_config.json"  # the run every rung starts from, as a run config
CONFIGS_DIR = "configs"  # one run config per rung, which `hybridtron pretrain --config` also reads
WIDTH_STEP = 32  # hidden sizes of a family: multiples of this
CHINCHILLA_TOKENS_PER_PARAM = 20.0  # the default centre of each budget's points (a guess the fit corrects)
MIN_STEPS = 10  # fewer optimizer steps than this measure the warmup, not the model
DEFAULT_SPREAD = 2.0  # neighbouring points of a budget differ by this factor in parameters


@dataclass(frozen=True)
class Member:
    """A model of the family: its width, its depth (layers), its configuration and parameter counts."""

    hidden: int
    layers: int
    config: ModelConfig
    params: int  # backbone and lm_head, every expert, embedding included (HybridLM.num_parameters())
    active_params: int  # what one token's matmuls use: the N of 6ND and of the loss law


@dataclass(frozen=True)
class Rung:
    """One run of the ladder."""

    name: str
    budget: float  # the compute budget C it belongs to
    hidden: int
    layers: int
    params: int
    active_params: int
    steps: int
    tokens: int  # D
    flops: float  # FLOPs per token x D: C up to the rounding to whole steps
    six_nd: float  # 6 x active_params x tokens

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def scaled(value: int, scale: float, multiple: int = 8) -> int:
    """`value` x `scale`, rounded to a positive multiple of `multiple` (matmul widths that tile well)."""
    return max(multiple, multiple * round(value * scale / multiple))


def largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0)


def family_member(base: ModelConfig, hidden: int) -> ModelConfig:
    """The member of `base`'s family at width `hidden` (see the module docstring)."""
    scale = hidden / base.hidden_size
    heads = max(1, round(base.num_attention_heads * scale))
    mamba_heads = max(1, round(base.mamba_num_heads * scale))
    # the preset's query heads per key-value head and Mamba groups, as far as the new head counts divide
    kv_ratio = base.num_key_value_heads / base.num_attention_heads
    kv_heads = largest_divisor_at_most(heads, max(1, round(heads * kv_ratio)))
    repeats = max(1, round(hidden / base.hidden_size))
    return base.replace(
        hidden_size=hidden, layers_block_type=base.layers_block_type * repeats,
        num_attention_heads=heads, num_key_value_heads=kv_heads,
        mamba_num_heads=mamba_heads, n_groups=largest_divisor_at_most(mamba_heads, base.n_groups),
        intermediate_size=scaled(base.intermediate_size, scale),
        moe_intermediate_size=scaled(base.moe_intermediate_size, scale),
        moe_shared_expert_intermediate_size=scaled(base.moe_shared_expert_intermediate_size, scale),
        moe_latent_size=None if base.moe_latent_size is None else scaled(base.moe_latent_size, scale))


@lru_cache(maxsize=1024)
def member(base: ModelConfig, hidden: int) -> Member:
    config = family_member(base, hidden)
    model = HybridLM.on_meta(config)  # the structure only: counting needs no memory
    return Member(hidden, config.num_hidden_layers, config, model.num_parameters(),
                  model.num_parameters(active=True))


def members_up_to(base: ModelConfig, active_params: float) -> list[Member]:
    """The family from its smallest member up to the first with at least `active_params`."""
    found, hidden = [], WIDTH_STEP
    while not found or found[-1].active_params < active_params:
        found.append(member(base, hidden))
        hidden += WIDTH_STEP
    return found


@lru_cache(maxsize=4096)
def flops_per_token(member_: Member, seq_len: int) -> float:
    return config_flops_per_token(member_.config, seq_len)


def tokens_per_param(member_: Member, budget: float, seq_len: int) -> float:
    """D / N of `member_` when it spends `budget`."""
    return budget / flops_per_token(member_, seq_len) / member_.active_params


def budget_members(base: ModelConfig, budget: float, points: int, spread: float, seq_len: int,
                   centre_ratio: float) -> list[Member] | None:
    """The `points` members of `budget`, smallest first, or None when the smallest point would need a model smaller
    than the family's smallest (the budget is too small for the family). The centre is the member nearest
    `centre_ratio` tokens per parameter (by default Chinchilla's 20: a guess the fit corrects); the others `spread` x
    apart from it."""
    family, hidden = [], WIDTH_STEP
    while not family or tokens_per_param(family[-1], budget, seq_len) > centre_ratio:
        family.append(member(base, hidden))
        hidden += WIDTH_STEP
    centre = min(family, key=lambda m: abs(math.log(tokens_per_param(m, budget, seq_len) / centre_ratio)))
    targets = [centre.active_params * spread ** (i - (points - 1) // 2) for i in range(points)]
    if targets[0] < family[0].active_params / math.sqrt(spread):
        return None
    family = members_up_to(base, targets[-1] * spread)
    chosen, last = [], -1
    for target in targets:  # the nearest member in log parameters, each one above the one before
        index = min(range(len(family)), key=lambda i: abs(math.log(family[i].active_params / target)))
        last = max(index, last + 1)
        chosen.append(family[min(last, len(family) - 1)])
    return chosen


def rung_of(member_: Member, budget: float, base: RunConfig) -> Rung:
    tokens_per_step = base.data.batch_size * base.data.seq_len * base.train.grad_accum
    per_token = flops_per_token(member_, base.data.seq_len)
    steps = max(1, round(budget / (per_token * tokens_per_step)))
    tokens = steps * tokens_per_step
    return Rung(name=f"{budget:.2g}".replace("e+", "e") + f"_h{member_.hidden}_L{member_.layers}", budget=budget,
                hidden=member_.hidden, layers=member_.layers, params=member_.params,
                active_params=member_.active_params, steps=steps, tokens=tokens, flops=per_token * tokens,
                six_nd=6.0 * member_.active_params * tokens)


def budget_rungs(base: RunConfig, budget: float, points: int, spread: float,
                 centre_ratio: float) -> list[Rung] | None:
    """The rungs of `budget`, or None when it is too small: a point below the family or a rung under MIN_STEPS."""
    chosen = budget_members(base.model, budget, points, spread, base.data.seq_len, centre_ratio)
    if chosen is None:
        return None
    rungs = [rung_of(m, budget, base) for m in chosen]
    return rungs if min(r.steps for r in rungs) >= MIN_STEPS else None


def smallest_budget(base: RunConfig, points: int, spread: float, centre_ratio: float, start: float) -> float:
    """The smallest budget on a grid of 10 a decade, from `start` up, that the family can spend in `points` rungs."""
    exponent = math.floor(10 * math.log10(start))
    while budget_rungs(base, 10 ** (exponent / 10), points, spread, centre_ratio) is None:
        exponent += 1
    return float(f"{10 ** (exponent / 10):.2g}")


@dataclass(frozen=True)
class LadderPlan:
    family: str
    budgets: tuple[float, ...]
    points: int
    spread: float
    centre_ratio: float  # the tokens per parameter each budget's points are centred on
    base: RunConfig  # the run every rung starts from: the preset, batch, schedule shape, data, --set
    rungs: tuple[Rung, ...]

    def rung_config(self, rung: Rung) -> RunConfig:
        """The pretraining run of `rung`: its family member, steps, a schedule of the base's shape, a proportional
        proxy of the ladder's largest run, a held-out loss at its start and end, a few checkpoints to resume from."""
        base = self.base
        train = dataclasses.replace(
            base.train, steps=rung.steps,
            warmup_steps=round(rung.steps * min(1.0, base.train.warmup_steps / base.train.steps)),
            val_every=rung.steps, checkpoint_every=max(1, rung.steps // 4), keep_checkpoints=1)
        proxy_of = base.data.proxy_of or max(r.tokens for r in self.rungs)
        data = dataclasses.replace(base.data, proxy_of=proxy_of)
        return dataclasses.replace(base, model=member(base.model, rung.hidden).config, data=data, train=train)

    def to_dict(self) -> dict:
        return {"family": self.family, "budgets": list(self.budgets), "points": self.points, "spread": self.spread,
                "centre_ratio": self.centre_ratio, "rungs": [r.to_dict() for r in self.rungs]}

    def save(self, out: Path) -> None:
        """DIR/plan.json (written last: a plan is whole once it is there), DIR/base_config.json and
        DIR/configs/NAME.json per rung."""
        (out / CONFIGS_DIR).mkdir(parents=True, exist_ok=True)
        for rung in self.rungs:
            self.rung_config(rung).save(out / CONFIGS_DIR / f"{rung.name}.json")
        self.base.save(out / BASE_FILE)
        atomic_write_json(out / PLAN_FILE, self.to_dict())

    @classmethod
    def load(cls, directory: Path) -> LadderPlan:
        path = Path(directory) / PLAN_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no ladder plan here (make one with: hybridtron ladder plan --out DIR)")
        raw = json.loads(path.read_text())
        return cls(raw["family"], tuple(raw["budgets"]), raw["points"], raw["spread"], raw["centre_ratio"],
                   RunConfig.load(Path(directory) / BASE_FILE), tuple(Rung(**r) for r in raw["rungs"]))

    def format(self) -> str:
        """The plan as a table, with how FLOPs are counted."""
        lines = [f"family {self.family}: {len(self.rungs)} rungs, {self.points} per budget, neighbours "
                 f"{self.spread:g}x apart in parameters; batch {self.base.data.batch_size} x "
                 f"{self.base.data.seq_len} tokens x {self.base.train.grad_accum} micro-batches a step", "",
                 "| rung | budget C | hidden | layers | params | active N | steps | tokens D | D/N | FLOPs | 6ND/C |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in self.rungs:
            lines.append(f"| {r.name} | {r.budget:.2g} | {r.hidden} | {r.layers} | {r.params / 1e6:.2f}M | "
                         f"{r.active_params / 1e6:.3f}M | {r.steps} | {r.tokens:,} | {r.tokens / r.active_params:.2g} "
                         f"| {r.flops:.3g} | {r.six_nd / r.budget:.2f} |")
        lines += ["", f"total {sum(r.flops for r in self.rungs):.3g} FLOPs, {sum(r.tokens for r in self.rungs):,} "
                      f"tokens. FLOPs = D x FLOPs per token of a training step (hybridtron.train.flops: 6 x the active "
                      f"matmul parameters + attention's scores + the Mamba scan + MTP), so 6ND < C by their share."]
        return "\n".join(lines)


def plan_ladder(base: RunConfig, family: str, budgets: list[float], points: int = 5, spread: float = DEFAULT_SPREAD,
                centre_ratio: float = CHINCHILLA_TOKENS_PER_PARAM) -> LadderPlan:
    """The ladder of `budgets` over the family of `base.model` (named `family`); a ValueError for a budget too small
    for the family, naming the smallest that works."""
    if points < 3:
        raise ValueError(f"--points {points}: a quadratic through each budget's losses needs at least 3")
    if not centre_ratio > 0:
        raise ValueError(f"--centre {centre_ratio}: expected a positive number of tokens per parameter")
    if spread <= 1:
        raise ValueError(f"--spread {spread}: the points of a budget must differ in size, so a factor above 1")
    if not budgets or any(not (b > 0 and math.isfinite(b)) for b in budgets):
        raise ValueError(f"--budgets {budgets}: expected positive FLOP counts, e.g. 1e12,3e12,1e13")
    rungs = []
    for budget in sorted(budgets):
        found = budget_rungs(base, budget, points, spread, centre_ratio)
        if found is None:
            smallest = smallest_budget(base, points, spread, centre_ratio, budget)
            raise ValueError(f"budget {budget:.2g} is too small for family {family} ({points} points, {spread:g}x "
                             f"apart, centred on {centre_ratio:g} tokens per parameter, at least {MIN_STEPS} steps "
                             f"each): the smallest that works is {smallest:.2g}")
        rungs += found
    return LadderPlan(family, tuple(sorted(budgets)), points, spread, centre_ratio, base, tuple(rungs))


def family_base(family: str) -> ModelConfig:
    if family not in PRESETS:
        raise ValueError(f"--family {family!r}: expected a preset, one of {', '.join(PRESETS)}")
    return preset(family)
