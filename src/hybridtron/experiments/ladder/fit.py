"""Fitting a ladder's results: the isoFLOP minima, the compute-optimal frontier, the loss law and its projection.

Three fits, as Marin's scaling ladder and arXiv 2412.04403 (the Chinchilla replication) make them:

1. Per budget C, a robust quadratic of the held-out loss in x = log10(tokens) (a Huber loss, so that one bad rung
   does not move it): its minimum is D*, the compute-optimal tokens at C. A quadratic that opens downward, or whose
   minimum lies outside the tokens trained, says which rungs to add.
2. The frontier: log10 D* = log10 A + alpha log10 C by least squares over the budgets; N* = C / (k D*), where k is
   the FLOPs per parameter per token of the ladder's rows (6 for a plain 6ND count; here hybridtron.train.flops's
   count over the active parameters, a little more for attention, the scan and MTP).
3. The loss law L(N, D) = E + A / N^a + B / D^b over every rung (N: active parameters, D: tokens), fitted as
   2412.04403 does: log E, log A, log B, a and b minimizing the Huber loss (delta 1e-3) of log L_pred - log L, by
   L-BFGS-B from a grid of starts (the best GRID_KEEP of the grid by the objective, to keep it fast). Its
   compute-optimal split of a target C (N D = C / k) gives the projected loss, with a 90% interval from refitting
   resampled rows (bootstrap). Under the same law: the compute-optimal tokens per parameter, and what a run
   overtrained OVERTRAIN times (that many times the optimal tokens per parameter, at the same compute) loses.

The effective speedup of a candidate ladder over a baseline: the compute the baseline needs, on its own law's
compute-optimal curve, to reach the loss the candidate's law reaches at C, divided by C (2 = the candidate gets there
with half the compute); with its bootstrap interval from resampling both ladders.

scipy is an optional dependency (the `ladder` extra): imported where a fit needs it.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

REQUIRED_FIELDS = ("budget", "flops", "params", "active_params", "tokens", "loss")
ISOFLOP_HUBER_DELTA = 0.01  # nats: residuals beyond this count linearly (a ladder's loss noise is about this)
LAW_HUBER_DELTA = 1e-3  # on log-loss residuals, 2412.04403's (and Chinchilla's) choice
GRID_KEEP = 16  # L-BFGS-B starts: the best of the grid by the objective
BOOTSTRAP_STARTS = 4  # a resample's starts: the full fit and this many of the grid's best
BOOTSTRAPS = 200
INTERVAL = (5.0, 95.0)  # percentiles of the bootstrap: a 90% interval
OVERTRAIN = 13.0


def scipy_optimize():
    try:
        import scipy.optimize  # optional dependency (the `ladder` extra): only the fits need it
    except ImportError:
        raise ValueError("the ladder's fits need scipy: pip install -e .[ladder]") from None
    return scipy.optimize


# ---------------------------------------------------------------------------------------------------- input
def load_results(path: str | Path) -> list[dict]:
    """The rows of a results.jsonl; a ValueError naming the file, line and field of a bad one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no results file (hybridtron ladder run writes DIR/results.jsonl)")
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
        for name in REQUIRED_FIELDS:
            if name not in row:
                raise ValueError(f"{path}:{number}: missing field {name!r} (a row needs {', '.join(REQUIRED_FIELDS)})")
            if not isinstance(row[name], (int, float)) or not math.isfinite(row[name]) or row[name] <= 0:
                raise ValueError(f"{path}:{number}: field {name!r} is {row[name]!r}; expected a positive number")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def by_budget(rows: list[dict]) -> dict[float, list[dict]]:
    groups: dict[float, list[dict]] = {}
    for row in rows:
        groups.setdefault(float(row["budget"]), []).append(row)
    return dict(sorted(groups.items()))


# --------------------------------------------------------------------------------------------- 1. isoFLOPs
@dataclass(frozen=True)
class IsoflopFit:
    """loss = a x^2 + b x + c with x = log10(tokens), at one budget."""

    budget: float
    flops: float  # C: the geometric mean of the rungs' FLOPs (the budget up to rounding to whole steps)
    a: float
    b: float
    c: float
    tokens_opt: float  # D*
    loss_opt: float
    tokens: tuple[float, ...]
    losses: tuple[float, ...]


def tokens_step(tokens: np.ndarray) -> float:
    """The typical factor between neighbouring token counts of a budget (what to step by to add a rung)."""
    ordered = np.sort(tokens)
    return float(np.exp(np.mean(np.diff(np.log(ordered))))) if len(ordered) > 1 else 2.0


def fit_isoflop(budget: float, rows: list[dict]) -> IsoflopFit:
    if len(rows) < 3:
        raise ValueError(f"budget {budget:.3g}: {len(rows)} point(s); a quadratic needs at least three rungs")
    tokens = np.array([r["tokens"] for r in rows], dtype=float)
    losses = np.array([r["loss"] for r in rows], dtype=float)
    x = np.log10(tokens)
    start = np.polyfit(x, losses, 2)
    fitted = scipy_optimize().least_squares(lambda p: np.polyval(p, x) - losses, start, loss="huber",
                                            f_scale=ISOFLOP_HUBER_DELTA).x
    a, b, c = (float(v) for v in fitted)
    step = tokens_step(tokens)
    if a <= 0:
        raise ValueError(f"budget {budget:.3g}: the loss opens downward in log tokens (no minimum between its "
                         f"rungs); add rungs further out, e.g. {tokens.min() / step:.3g} and {tokens.max() * step:.3g} "
                         f"tokens")
    x_opt = -b / (2 * a)
    if x_opt < x.min():
        raise ValueError(f"budget {budget:.3g}: the minimum (about {10 ** x_opt:.3g} tokens) lies below its fewest "
                         f"tokens {tokens.min():.3g}; add rungs with fewer tokens (larger models), e.g. "
                         f"{tokens.min() / step:.3g} and {tokens.min() / step ** 2:.3g} tokens")
    if x_opt > x.max():
        raise ValueError(f"budget {budget:.3g}: the minimum (about {10 ** x_opt:.3g} tokens) lies above its most "
                         f"tokens {tokens.max():.3g}; add rungs with more tokens (smaller models), e.g. "
                         f"{tokens.max() * step:.3g} and {tokens.max() * step ** 2:.3g} tokens")
    flops = float(np.exp(np.mean(np.log([r["flops"] for r in rows]))))
    return IsoflopFit(budget, flops, a, b, c, float(10 ** x_opt), float(np.polyval(fitted, x_opt)),
                      tuple(tokens.tolist()), tuple(losses.tolist()))


# -------------------------------------------------------------------------------------------- 2. frontier
@dataclass(frozen=True)
class Frontier:
    """D* = coefficient x C^alpha."""

    alpha: float
    coefficient: float

    def tokens(self, flops: float) -> float:
        return self.coefficient * flops ** self.alpha


def fit_frontier(isoflops: list[IsoflopFit]) -> Frontier:
    if len(isoflops) < 2:
        raise ValueError(f"{len(isoflops)} budget(s): the frontier D* = A C^alpha needs at least two")
    slope, intercept = np.polyfit(np.log10([f.flops for f in isoflops]), np.log10([f.tokens_opt for f in isoflops]), 1)
    return Frontier(float(slope), float(10 ** intercept))


def flops_per_param_token(rows: list[dict]) -> float:
    """k in C = k N D: the median over the rows of FLOPs / (active parameters x tokens)."""
    return float(np.median([r["flops"] / (r["active_params"] * r["tokens"]) for r in rows]))


# -------------------------------------------------------------------------------------------- 3. the law
@dataclass(frozen=True)
class LossLaw:
    """L(N, D) = E + A / N^a + B / D^b."""

    E: float
    A: float
    B: float
    a: float
    b: float

    def loss(self, params, tokens):
        return self.E + self.A / np.power(params, self.a) + self.B / np.power(tokens, self.b)

    def optimal(self, flops: float, k: float) -> tuple[float, float, float]:
        """(N, D, loss) minimizing L under k N D = `flops`: N = G (C/k)^(b/(a+b)), G = (a A / (b B))^(1/(a+b))."""
        product = flops / k
        params = (self.a * self.A / (self.b * self.B)) ** (1 / (self.a + self.b)) * product ** (
            self.b / (self.a + self.b))
        tokens = product / params
        return float(params), float(tokens), float(self.loss(params, tokens))

    def theta(self) -> np.ndarray:
        return np.array([math.log(self.E), math.log(self.A), math.log(self.B), self.a, self.b])


def law_objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_loss: np.ndarray):
    """The summed Huber loss of log L_pred - log L, and its gradient in (log E, log A, log B, a, b)."""
    e, log_a, log_b, a, b = theta
    terms = np.stack([log_a - a * log_n, log_b - b * log_d, np.full_like(log_n, e)])
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    residual = top + np.log(total) - log_loss
    weights /= total  # d log L_pred / d term
    quadratic = np.abs(residual) <= LAW_HUBER_DELTA
    value = np.where(quadratic, 0.5 * residual ** 2, LAW_HUBER_DELTA * (np.abs(residual) - 0.5 * LAW_HUBER_DELTA))
    slope = np.clip(residual, -LAW_HUBER_DELTA, LAW_HUBER_DELTA)
    gradient = np.array([np.sum(slope * weights[2]), np.sum(slope * weights[0]), np.sum(slope * weights[1]),
                         -np.sum(slope * weights[0] * log_n), -np.sum(slope * weights[1] * log_d)])
    return float(value.sum()), gradient


# the starts' grid, after 2412.04403's (log E, log A, log B, a, b), coarser
START_GRID = np.array(list(itertools.product((-1.0, 0.0, 0.5, 1.0, 1.5), (0.0, 5.0, 10.0, 20.0),
                                             (0.0, 5.0, 10.0, 20.0), (0.2, 0.5, 1.0), (0.2, 0.5, 1.0))))
EXPONENT_BOUNDS = (0.0, 5.0)


def fit_law(params, tokens, losses, starts: np.ndarray | None = None) -> LossLaw:
    """The law through (N, D, L) points by the module docstring's recipe; `starts`: L-BFGS-B's starting points
    (default: the best GRID_KEEP of START_GRID)."""
    log_n, log_d, log_loss = np.log(params), np.log(tokens), np.log(losses)
    if starts is None:
        scores = [law_objective(theta, log_n, log_d, log_loss)[0] for theta in START_GRID]
        starts = START_GRID[np.argsort(scores)[:GRID_KEEP]]
    minimize = scipy_optimize().minimize
    bounds = [(None, None)] * 3 + [EXPONENT_BOUNDS] * 2
    best = min((minimize(law_objective, start, args=(log_n, log_d, log_loss), jac=True, method="L-BFGS-B",
                         bounds=bounds) for start in starts), key=lambda result: result.fun)
    e, log_a, log_b, a, b = best.x
    return LossLaw(math.exp(e), math.exp(log_a), math.exp(log_b), float(a), float(b))


def fit_rows_law(rows: list[dict], starts=None) -> LossLaw:
    return fit_law(np.array([r["active_params"] for r in rows], float), np.array([r["tokens"] for r in rows], float),
                   np.array([r["loss"] for r in rows], float), starts)


def bootstrap_laws(rows: list[dict], law: LossLaw, count: int, rng: np.random.Generator) -> list[LossLaw]:
    """The law refitted on `count` resamples of the rows (with replacement), each started from the full fit and the
    best few grid starts of the full data (a resample's optimum lies near the full data's; the whole grid per
    resample would take minutes)."""
    log_n, log_d, log_loss = (np.log([r[key] for r in rows]) for key in ("active_params", "tokens", "loss"))
    scores = [law_objective(theta, log_n, log_d, log_loss)[0] for theta in START_GRID]
    starts = np.vstack([law.theta(), START_GRID[np.argsort(scores)[:BOOTSTRAP_STARTS]]])
    return [fit_rows_law([rows[i] for i in rng.integers(0, len(rows), len(rows))], starts) for _ in range(count)]


def interval(values) -> list[float]:
    """The bootstrap's 90% interval; "nearest" picks values that occurred, so an infinite speedup (a baseline that
    never gets there) can be an end of it."""
    return [float(np.percentile(list(values), p, method="nearest")) for p in INTERVAL]


# ------------------------------------------------------------------------------------------------ analysis
def analyze(rows: list[dict], target: float, *, overtrain: float = OVERTRAIN, bootstraps: int = BOOTSTRAPS,
            seed: int = 0) -> dict:
    """Every fit of one ladder, as a JSON-ready report (`format_report` prints it)."""
    isoflops = [fit_isoflop(budget, group) for budget, group in by_budget(rows).items()]
    frontier = fit_frontier(isoflops)
    k = flops_per_param_token(rows)
    law = fit_rows_law(rows)
    params, tokens, loss = law.optimal(target, k)
    laws = bootstrap_laws(rows, law, bootstraps, np.random.default_rng(seed))
    ratio = tokens / params
    over_params, over_tokens = params / math.sqrt(overtrain), tokens * math.sqrt(overtrain)
    over_loss = float(law.loss(over_params, over_tokens))
    target_tokens = frontier.tokens(target)
    return {
        "target": target, "flops_per_param_token": k,
        "budgets": [{"budget": f.budget, "flops": f.flops, "tokens_opt": f.tokens_opt,
                     "params_opt": f.flops / (k * f.tokens_opt), "loss_opt": f.loss_opt,
                     "quadratic": [f.a, f.b, f.c], "tokens": list(f.tokens), "losses": list(f.losses)}
                    for f in isoflops],
        "alpha": frontier.alpha, "frontier_coefficient": frontier.coefficient,
        "frontier_at_target": {"tokens": target_tokens, "params": target / (k * target_tokens)},
        "law": asdict(law),
        "projected_loss": loss, "projected_interval": interval([b.optimal(target, k)[2] for b in laws]),
        "optimal_params": params, "optimal_tokens": tokens, "tokens_per_param": ratio,
        "overtrained": {"factor": overtrain, "tokens_per_param": ratio * overtrain, "params": over_params,
                        "tokens": over_tokens, "loss": over_loss, "penalty": over_loss - loss,
                        "relative_penalty": (over_loss - loss) / loss},
        "bootstraps": bootstraps,
    }


def compute_to_reach(law: LossLaw, k: float, loss: float, near: float) -> float:
    """The FLOPs at which `law`'s compute-optimal loss falls to `loss` (inf when it never does: loss <= E)."""
    if loss <= law.E:
        return math.inf
    gap = lambda log_c: law.optimal(math.exp(log_c), k)[2] - loss  # noqa: E731 (decreasing in log C)
    low, high = math.log(near) - 1.0, math.log(near) + 1.0
    while gap(low) < 0:
        low -= 5.0
    while gap(high) > 0:
        high += 5.0
    return math.exp(scipy_optimize().brentq(gap, low, high, xtol=1e-10))


def speedup(candidate: LossLaw, k_candidate: float, baseline: LossLaw, k_baseline: float, flops: float) -> float:
    """The baseline's compute to reach the candidate's compute-optimal loss at `flops`, over `flops`."""
    loss = candidate.optimal(flops, k_candidate)[2]
    return compute_to_reach(baseline, k_baseline, loss, flops) / flops


def effective_speedup(candidate_rows: list[dict], baseline_rows: list[dict], target: float, *,
                      bootstraps: int = BOOTSTRAPS, seed: int = 0) -> dict:
    """The candidate's effective speedup over the baseline at each of its budgets and at `target`, with the target's
    bootstrap interval."""
    k_c, k_b = flops_per_param_token(candidate_rows), flops_per_param_token(baseline_rows)
    law_c, law_b = fit_rows_law(candidate_rows), fit_rows_law(baseline_rows)
    rng = np.random.default_rng(seed)
    resampled = zip(bootstrap_laws(candidate_rows, law_c, bootstraps, rng),
                    bootstrap_laws(baseline_rows, law_b, bootstraps, rng))
    return {"target": target, "speedup": speedup(law_c, k_c, law_b, k_b, target),
            "interval": interval([speedup(c, k_c, b, k_b, target) for c, b in resampled]),
            "by_budget": {str(budget): speedup(law_c, k_c, law_b, k_b, budget)
                          for budget in by_budget(candidate_rows)},
            "baseline_law": asdict(law_b)}


def format_report(report: dict) -> str:
    law, over = report["law"], report["overtrained"]
    lo, hi = report["projected_interval"]
    lines = ["| budget C | D* (tokens) | N* = C/(kD*) | D*/N* | loss at D* |", "|---|---|---|---|---|"]
    lines += [f"| {b['budget']:.3g} | {b['tokens_opt']:.3g} | {b['params_opt']:.3g} | "
              f"{b['tokens_opt'] / b['params_opt']:.1f} | {b['loss_opt']:.4f} |" for b in report["budgets"]]
    lines += ["",
              f"frontier: D* = {report['frontier_coefficient']:.3g} C^{report['alpha']:.3f}  (N* ~ C^"
              f"{1 - report['alpha']:.3f}; k = {report['flops_per_param_token']:.2f} FLOPs per parameter per token)",
              f"loss law: L(N, D) = {law['E']:.3f} + {law['A']:.4g} / N^{law['a']:.3f} + {law['B']:.4g} / "
              f"D^{law['b']:.3f}",
              f"at C = {report['target']:.3g}: projected loss {report['projected_loss']:.4f} (90% interval "
              f"{lo:.4f} - {hi:.4f}, {report['bootstraps']} bootstraps) with N = {report['optimal_params']:.3g}, "
              f"D = {report['optimal_tokens']:.3g}; the frontier gives D* = "
              f"{report['frontier_at_target']['tokens']:.3g}",
              f"compute-optimal: {report['tokens_per_param']:.1f} tokens per parameter; {over['factor']:g}x "
              f"overtrained ({over['tokens_per_param']:.0f} tokens per parameter, the same compute) loses "
              f"{over['penalty']:.4f} ({over['relative_penalty']:.2%})"]
    if "effective_speedup" in report:
        fast = report["effective_speedup"]
        lo, hi = fast["interval"]
        per_budget = ", ".join(f"{float(b):.2g}: {s:.2f}x" for b, s in fast["by_budget"].items())
        lines.append(f"effective speedup over the baseline at C = {fast['target']:.3g}: {fast['speedup']:.2f}x "
                     f"(90% interval {lo:.2f} - {hi:.2f}); at its budgets {per_budget}")
    return "\n".join(lines)


def plot_report(report: dict, path: str | Path) -> None:
    """The isoFLOP parabolas with their minima, and the frontier with the law's projection to the target."""
    import matplotlib  # optional dependency (the `plots` extra): only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for budget in report["budgets"]:
        tokens = np.array(budget["tokens"])
        x = np.linspace(np.log10(tokens.min()) - 0.1, np.log10(tokens.max()) + 0.1, 100)
        line, = left.plot(10 ** x, np.polyval(budget["quadratic"], x), linewidth=1, label=f"C = {budget['budget']:.2g}")
        left.scatter(tokens, budget["losses"], color=line.get_color(), s=16)
        left.scatter([budget["tokens_opt"]], [budget["loss_opt"]], color=line.get_color(), marker="*", s=120)
    left.set_xscale("log")
    left.set_xlabel("tokens D")
    left.set_ylabel("held-out loss")
    left.set_title("isoFLOP profiles (stars: D*)")
    left.legend(fontsize="small")
    flops = np.array([b["flops"] for b in report["budgets"]])
    reach = np.geomspace(flops.min(), max(report["target"], flops.max()), 50)
    right.scatter(flops, [b["tokens_opt"] for b in report["budgets"]], label="D* per budget")
    right.plot(reach, report["frontier_coefficient"] * reach ** report["alpha"], linestyle="--",
               label=f"D* = A C^{report['alpha']:.2f}")
    right.scatter([report["target"]], [report["optimal_tokens"]], marker="*", s=120,
                  label=f"law at target: loss {report['projected_loss']:.3f}")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("compute C (FLOPs)")
    right.set_ylabel("compute-optimal tokens")
    right.set_title("frontier and projection")
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
