"""Front door: eps of a ledger / of T equal steps under the pld (headline), rdp (cross-check) or paper accountant,
and the JSON ``report`` written to summary.json."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from widedp.accounting import paper as paper_mod
from widedp.accounting import pld as pld_mod
from widedp.accounting import rdp as rdp_mod
from widedp.accounting.ledger import Ledger, spend_to_json
from widedp.accounting.parts import Costs, costs_of
from widedp.errors import ConfigError
from widedp.spend import ExponentialSpend, GaussianSpend, StepSpend

Accountant = Literal["pld", "rdp", "paper"]
ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp", "paper")


def _check(delta: float, accountant: str) -> None:
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ConfigError(f"dp.delta: must be in (0, 1), got {delta!r}")
    if accountant not in ACCOUNTANTS:
        raise ConfigError(f"dp.accountant: expected one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")


def compose_epsilon(runs: Sequence[tuple[StepSpend, int]], *, delta: float, accountant: Accountant = "pld") -> float:
    """eps at ``delta`` of ``count`` steps of each ``(StepSpend, count)`` run.

    Composition is commutative, so the counts of equal records are added up first (a ledger alternating between
    two records costs two self-compositions, not one per run).
    """
    _check(delta, accountant)
    runs = [(s, int(n)) for s, n in runs]
    if any(n < 0 for _, n in runs):
        raise ConfigError("accounting: step counts must be >= 0")
    if accountant == "paper":
        return paper_mod.paper_epsilon(runs, delta)[0]
    totals: dict[Costs, int] = {}
    for s, n in runs:
        c = costs_of(s)
        totals[c] = totals.get(c, 0) + n
    costed = [(c, n) for c, n in totals.items() if n > 0]
    if accountant == "rdp":
        return rdp_mod.rdp_epsilon(costed, delta)[0]
    return pld_mod.pld_epsilon(costed, delta)


def epsilon(ledger: Ledger, *, delta: float, accountant: Accountant = "pld") -> float:
    """eps at ``delta`` spent by everything recorded in ``ledger`` (add/remove adjacency)."""
    return compose_epsilon(ledger.runs, delta=delta, accountant=accountant)


def epsilon_for_step(step: StepSpend, *, steps: int, delta: float, accountant: Accountant = "pld") -> float:
    """eps at ``delta`` after ``steps`` identical steps."""
    return compose_epsilon([(step, steps)], delta=delta, accountant=accountant)


def noise_part(step: StepSpend) -> StepSpend:
    """The step with only its Gaussian parts (same sampling rate)."""
    return StepSpend(step.sampling_rate, tuple(p for p in step.parts if isinstance(p, GaussianSpend)))


def selection_part(step: StepSpend) -> StepSpend:
    """The step without its Gaussian parts (same sampling rate)."""
    return StepSpend(step.sampling_rate, tuple(p for p in step.parts if not isinstance(p, GaussianSpend)))


def _json_float(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def report(step: StepSpend, *, steps: int, delta: float) -> dict[str, Any]:
    """Everything spent by ``steps`` identical steps, as a JSON-able dict.

    ``epsilon`` is the PLD headline (max over add and remove), ``epsilon_rdp`` the RDP cross-check; ``parts`` gives
    the noise alone, the selection alone (each Poisson-subsampled on its own) and the joint step (composed inside
    the step, then subsampled once: the valid one; noise + selection separately would under-report).
    ``epsilon_paper`` (+ ``epsilon_paper_warning``) is the paper's Theorem 3 when the selection is exponential:
    NOT a valid bound. Infinite eps are reported as ``inf`` floats.
    """
    _check(delta, "pld")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"steps: must be an integer >= 0, got {steps!r}")
    costs = costs_of(step)
    parts: dict[str, dict[str, Any]] = {}
    for name, c in (("noise", costs.noise_only()), ("selection", costs.selection_only()), ("joint", costs)):
        e_rdp, order = rdp_mod.rdp_epsilon([(c, steps)], delta)
        parts[name] = {"pld": pld_mod.pld_epsilon([(c, steps)], delta), "rdp": e_rdp, "rdp_order": _json_float(order)}
    out: dict[str, Any] = {
        "epsilon": parts["joint"]["pld"],
        "epsilon_rdp": parts["joint"]["rdp"],
        "delta": float(delta),
        "steps": steps,
        "sampling_rate": costs.q,
        "noise_multiplier": costs.sigma,
        "adjacency": "add_remove",
        "accountant": "pld",
        "selection": [spend_to_json(p) for p in step.parts if not isinstance(p, GaussianSpend)],
        "parts": parts,
        "method": {
            "pld": "dominating pair per step: N(1,s^2) x selection pair (bounded-range envelope per exponential pick, "
            "randomized response per pure-DP mechanism), Poisson-subsampled once, pessimistic connect-the-dots "
            f"(interval {pld_mod.DEFAULT_DISCRETIZATION:g}), FFT self-composition, max over add/remove",
            "rdp": "sum of parts' RDP, Zhu-Wang general subsampling once per step (exact sampled Gaussian when the "
            "selection is free), Balle et al. conversion",
        },
    }
    if any(isinstance(p, ExponentialSpend) for p in step.parts) and steps > 0:
        e_paper, warn = paper_mod.paper_epsilon([(step, steps)], delta)
        out["epsilon_paper"] = e_paper
        out["epsilon_paper_warning"] = warn
    return out
