"""The one-run ε lower bound (Steinke, Nasr & Jagielski, NeurIPS 2023, "Privacy auditing with one (1) training run").

m canaries, each included by an independent fair secret coin; after training the auditor scores them, guesses
"included" for the k₊ highest scores and "excluded" for the k₋ lowest (r = k₊ + k₋ guesses, the others abstain) and
counts the v correct guesses. If the training is (ε, δ)-DP for adding/removing one canary then (their main theorem
for δ = 0, and its δ > 0 refinement, which JAX Privacy's ``canary_score_auditor`` also computes)::

    P[V ≥ v] ≤ p(ε, δ) = P[Bin(r, σ(ε)) ≥ v] + 2mδ · max_{i=1..v} P[v − i ≤ Bin(r, σ(ε)) < v] / i,

with σ(ε) = e^ε / (1 + e^ε). The lower bound at confidence 1 − β is the largest ε with p(ε, δ) ≤ β (p decreases in
ε), 0 when even ε = 0 is not rejected. A guessing rule must be fixed before looking at the coins: here a fixed grid of
(k₊, k₋) pairs (``guess_grid``), each tested at β / |grid| (a union bound), and the best bound over the grid reported.
Ties in the scores are broken by a public generator (independent of the coins).

The cap: with r guesses all correct the bound is at most about logit(β^(1/r)) (``bound_cap``): a one-run audit can
never certify more than that, whatever the mechanism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import optimize, special, stats

#: Default guesses, as fractions of m: r = round(f·m) for f in this grid, both sides (k₊ = k₋ = r/2) and top only.
GUESS_FRACTIONS = (0.05, 0.1, 0.2, 0.5)
#: ε searched in [0, EPS_MAX].
EPS_MAX = 50.0


def p_value(*, m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """p(ε, δ) above: how likely v or more of r guesses are correct under (ε, δ)-DP with m canaries."""
    if v <= 0:
        return 1.0
    p = float(special.expit(epsilon))
    tail = float(stats.binom.sf(v - 1, r, p))  # P[Bin ≥ v]
    if delta <= 0:
        return tail
    i = np.arange(1, v + 1)
    gaps = stats.binom.sf(v - i - 1, r, p) - tail  # P[v − i ≤ Bin < v]
    return min(1.0, tail + 2 * m * delta * float(np.max(gaps / i)))


def epsilon_lower_bound(*, m: int, r: int, v: int, beta: float, delta: float = 0.0) -> float:
    """The largest ε with ``p_value(m, r, v, ε, δ) ≤ beta`` (0 when ε = 0 is not rejected), to 1e-6."""
    if not (0 <= v <= r <= m) or not 0 < beta < 1 or delta < 0:
        raise ValueError(f"need 0 <= v <= r <= m, 0 < beta < 1, delta >= 0; got m={m}, r={r}, v={v}, beta={beta}, "
                         f"delta={delta}")

    def slack(eps: float) -> float:
        return beta - p_value(m=m, r=r, v=v, epsilon=eps, delta=delta)

    if r == 0 or slack(0.0) <= 0:
        return 0.0
    if slack(EPS_MAX) > 0:
        return EPS_MAX
    return float(optimize.brentq(slack, 0.0, EPS_MAX, xtol=1e-7))


def bound_cap(*, m: int, r: int, beta: float, delta: float = 0.0) -> float:
    """The bound when all r guesses are correct: the most a one-run audit with these r guesses can show."""
    return epsilon_lower_bound(m=m, r=r, v=r, beta=beta, delta=delta)


def guess_grid(m: int, fractions: tuple[float, ...] = GUESS_FRACTIONS) -> list[tuple[int, int]]:
    """The fixed (k₊, k₋) grid for m canaries: for each f, (r/2, r/2) and (r, 0) with r = max(2, round(f·m))."""
    grid: list[tuple[int, int]] = []
    for f in fractions:
        r = min(m, max(2, round(f * m)))
        for pair in ((r // 2, r - r // 2), (r, 0)):
            if pair not in grid:
                grid.append(pair)
    return grid


@dataclass(frozen=True)
class Guesses:
    """One (k₊, k₋) guess: r = k₊ + k₋ guesses, v of them correct, and the bound at β / |grid|."""

    k_plus: int
    k_minus: int
    correct: int
    epsilon_lower: float

    @property
    def guesses(self) -> int:
        return self.k_plus + self.k_minus


def rank_order(scores: np.ndarray, *, generator: torch.Generator) -> np.ndarray:
    """[m] canary indices from the highest score to the lowest, ties in a random order of ``generator`` (public)."""
    jitter = torch.rand(len(scores), generator=generator, dtype=torch.float64).numpy()
    return np.lexsort((jitter, -np.asarray(scores, dtype=np.float64)))


def audit(scores: np.ndarray, included: np.ndarray, *, beta: float, delta: float, grid: list[tuple[int, int]],
          generator: torch.Generator) -> tuple[Guesses, list[Guesses]]:
    """(best, all) guesses of ``grid`` on ``scores`` [m] (higher = more likely included) against the coins
    ``included`` [m] bool; each bound at β / len(grid), so the best is a valid one-sided 1 − β bound."""
    scores, included = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    m = len(scores)
    if scores.shape != included.shape or not np.isfinite(scores).all():
        raise ValueError("scores and coins must be [m] arrays and the scores finite")
    order = rank_order(scores, generator=generator)
    out = []
    for kp, km in grid:
        v = int(included[order[:kp]].sum()) + (int((~included[order[m - km:]]).sum()) if km else 0)
        out.append(Guesses(kp, km, v, epsilon_lower_bound(m=m, r=kp + km, v=v, beta=beta / len(grid), delta=delta)))
    best = max(out, key=lambda g: (g.epsilon_lower, g.correct / max(g.guesses, 1)))
    return best, out


def logit_cap(r: int, beta: float) -> float:
    """logit(β^(1/r)): the δ = 0 bound of r correct guesses out of r, in closed form (for docs and checks)."""
    p = beta ** (1.0 / r)
    return math.log(p / (1 - p))


def lower_bound(scores: np.ndarray, included: np.ndarray, *, delta: float, confidence: float = 0.95,
                seed: int = 0) -> dict[str, float | int]:
    """The audit's bound for any trainer (e.g. a ``make_private`` model): ``scores`` [m] (higher = more likely
    included) of m canaries whose ``included`` [m] coins were fair and secret during training; the default guess
    grid, its union bound, one-sided ``confidence``. Returns epsilon_lower, guesses, correct, epsilon_cap."""
    m = len(scores)
    grid = guess_grid(m)
    beta = 1.0 - confidence
    best, _ = audit(scores, included, beta=beta, delta=delta, grid=grid, generator=torch.Generator().manual_seed(seed))
    cap = max(bound_cap(m=m, r=kp + km, beta=beta / len(grid), delta=delta) for kp, km in grid)
    return {"epsilon_lower": best.epsilon_lower, "guesses": best.guesses, "correct": best.correct,
            "epsilon_cap": cap}
