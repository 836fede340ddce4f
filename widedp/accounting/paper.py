"""The paper's Theorem 3 (Zhang, Mironov & Hejazinia), exactly as written — a labelled REFERENCE figure only.

It is NOT a valid DP bound and never drives a run (no calibration, no budget stop, no headline): its Lemma 1
(amplification) and Lemma 3 (Gaussian) need a per-step eps <= 1 but the paper runs at ~23 (Gaussian part alone at
sigma = 0.5); Lemma 1's amplification is misquoted; Alg. 4's eps'' = eps'/sqrt(2k ln(1/delta')) drops the
k eps''(e^eps'' - 1) term of strong composition and its loop makes k+1 picks (privacy.md §3). It under-reports, e.g.
q = 0.01, T = 1, sigma = 0.2: 5.77 where the PLD accountant gives 22.57. ``paper_theorem3_reference`` returns it as a
dict whose ``note`` says so; nothing here emits a Python warning (the label travels in the data).

Theorem 3 (b/n = q, T steps): with noise term g = 2 sqrt(2 ln(1.25/delta')) / sigma,
    eps   = 4 q sqrt(T ln(1 / (2 q T delta'))) (eps' + g),       delta = 4 q T delta'.
Our choices (the paper leaves them open):
- delta' is set so that the theorem's delta is the requested one: delta' = delta / (4 q T), hence
  ln(1/(2 q T delta')) = ln(2/delta).
- eps' (the per-step selection budget) is the k-pick exponential mechanism's total per Alg. 4:
  eps' = eps'' sqrt(2 k ln(1/delta')) with the same delta' (k = the record's picks, not the loop's k+1);
  for a sparse-vector record, eps' = cutoff (epsilon + epsilon_release) (basic composition); free: 0.
- A ledger with different records: every step is charged as the worst record (largest eps' + g) — Theorem 3 is
  stated for identical steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from widedp.dp.spend import (
    DiscreteGaussianSpend,
    ExponentialSpend,
    GaussianSelectionSpend,
    GaussianSpend,
    SparseVectorSpend,
    StepSpend,
)
from widedp.errors import ConfigError

#: The key under which reports carry the paper's figure (the name is the label).
REFERENCE_KEY = "paper_theorem3_reference_NOT_A_BOUND"

REFUSED = ("accountant 'paper' (the paper's Theorem 3) is not a valid DP bound (it under-reports, e.g. q=0.01, "
           "T=1, sigma=0.2: 5.8 where the true eps is >= 22.6), so it cannot calibrate, budget or report a run; use "
           f"pld or rdp. The paper's figure is shown, labelled, as {REFERENCE_KEY} in `widedp epsilon CONFIG "
           "--set dp.accountant=pld`, or by accounting.paper_theorem3_reference")


def _delta_prime(q: float, steps: int, delta: float) -> float:
    return delta / (4.0 * q * steps)


def per_step_epsilon(step: StepSpend, delta_prime: float) -> tuple[float, float]:
    """(eps', g): the unsubsampled per-step selection and noise epsilons the theorem composes."""
    sel, inv_var = 0.0, 0.0
    for p in step.parts:
        if isinstance(p, ExponentialSpend):
            sel += p.epsilon * math.sqrt(2.0 * p.picks * math.log(1.0 / delta_prime))
        elif isinstance(p, SparseVectorSpend):
            sel += p.cutoff * (p.epsilon + p.epsilon_release)
        elif isinstance(p, (GaussianSpend, GaussianSelectionSpend)) and math.isfinite(p.noise_multiplier):
            inv_var += p.noise_multiplier**-2
        elif isinstance(p, DiscreteGaussianSpend) and math.isfinite(p.noise_multiplier):
            inv_var += p.effective_multiplier**-2
    noise = 2.0 * math.sqrt(2.0 * math.log(1.25 / delta_prime)) * math.sqrt(inv_var)
    return sel, noise


def paper_epsilon(runs: Sequence[tuple[StepSpend, int]], delta: float) -> tuple[float, str]:
    """(eps, note) of Theorem 3 for ``runs`` at the theorem's delta ``delta``. NOT a bound; emits no warning."""
    runs = [(s, n) for s, n in runs if n > 0]
    steps = sum(n for _, n in runs)
    if steps == 0:
        return 0.0, "no steps"
    qs = {s.sampling_rate for s, _ in runs}
    if len(qs) != 1:
        raise ConfigError(f"paper reference: Theorem 3 needs one sampling rate, got {sorted(qs)}")
    q = qs.pop()
    dp = _delta_prime(q, steps, delta)
    per = max(sum(per_step_epsilon(s, dp)) for s, _ in runs)
    eps = 4.0 * q * math.sqrt(steps * math.log(1.0 / (2.0 * q * steps * dp))) * per
    problems = []
    if per > 1:
        problems.append(f"per-step eps = {per:.3g} > 1 (Lemmas 1 and 3 need <= 1)")
    if q * per > 1 / math.sqrt(steps):
        problems.append(f"its assumption q*eps_step = {q * per:.3g} <= 1/sqrt(T) = {1 / math.sqrt(steps):.3g} fails")
    note = (
        f"the paper's Theorem 3 as written (eps = {eps:.4g}), for comparison with its published numbers only: NOT a "
        "valid DP bound (its lemmas need per-step eps <= 1, its amplification lemma is misquoted, and it can "
        "under-report)" + (": here " + "; ".join(problems) if problems else "")
        + ". The run's privacy is the pld (or rdp) figure"
    )
    return eps, note


def paper_theorem3_reference(runs: Sequence[tuple[StepSpend, int]], delta: float) -> dict[str, Any]:
    """The paper's figure as a labelled, JSON-able reference: {"epsilon", "delta", "note"} (NOT a bound)."""
    eps, note = paper_epsilon(runs, delta)
    return {"epsilon": eps, "delta": float(delta), "note": note}


def paper_selection_epsilon(
    total_epsilon: float, *, delta: float, sampling_rate: float, steps: int, picks: int
) -> float:
    """eps'' per pick that the paper derives from a total selection budget (total_epsilon, delta) via Theorem 3's
    selection term and Alg. 4 (Sec. 6.4: eps = 10, delta = 5e-6 for selection; q = 1e-4, T = 200K, k = 100
    picks -> eps'' = 0.2702, which gives the 10.80 bounded-range RDP figure of privacy.md)."""
    dp = _delta_prime(sampling_rate, steps, delta)
    coef = 4.0 * sampling_rate * math.sqrt(steps * math.log(1.0 / (2.0 * sampling_rate * steps * dp)))
    eps_prime = total_epsilon / coef
    return eps_prime / math.sqrt(2.0 * picks * math.log(1.0 / dp))
