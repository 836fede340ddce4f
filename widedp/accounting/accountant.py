"""Front door: eps of a ledger / of T equal steps under an accountant of the registry
(``widedp.accounting.registry``: pld the headline, rdp the cross-check), and the JSON ``report`` that
``widedp epsilon`` prints. The paper's Theorem 3 is not an accountant: it is refused here
(``PAPER_REFUSED``) and appears only as the labelled ``paper_theorem3_reference_NOT_A_BOUND`` entry of ``report``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from widedp.accounting import paper as paper_mod
from widedp.accounting import pld as pld_mod
from widedp.accounting import rdp as rdp_mod
from widedp.accounting.base import Accountant
from widedp.accounting.ledger import Ledger, spend_to_json
from widedp.accounting.parts import Costs, costs_of
from widedp.accounting.registry import ACCOUNTANTS, CROSS_CHECK, headline
from widedp.accounting.registry import accountant as named
from widedp.dp.spend import DiscreteGaussianSpend, GaussianSpend, StepSpend
from widedp.errors import ConfigError

#: Why ``accountant="paper"`` is refused (also the config error of ``dp.accountant: paper``).
PAPER_REFUSED = paper_mod.REFUSED


def _check(delta: float, accountant: str) -> Accountant:
    """The accountant called ``accountant`` (any in the registry), after checking ``delta``."""
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise ConfigError(f"dp.delta: must be in (0, 1), got {delta!r}")
    return named(accountant, baselines=True)


def _refused(acct: Accountant, costs: Costs) -> None:
    why = acct.refusal(costs)
    if why is not None:
        raise pld_mod.PLDNotApplicable(why)


def compose_epsilon(runs: Sequence[tuple[StepSpend, int]], *, delta: float, accountant: str = "pld") -> float:
    """eps at ``delta`` of ``count`` steps of each ``(StepSpend, count)`` run.

    Composition is commutative, so the counts of equal records are added up first (a ledger alternating between
    two records costs two self-compositions, not one per run).
    """
    acct = _check(delta, accountant)
    runs = [(s, int(n)) for s, n in runs]
    if any(n < 0 for _, n in runs):
        raise ConfigError("accounting: step counts must be >= 0")
    totals: dict[Costs, int] = {}
    for s, n in runs:
        c = costs_of(s)
        totals[c] = totals.get(c, 0) + n
    costed = [(c, n) for c, n in totals.items() if n > 0]
    for c, _ in costed:
        _refused(acct, c)
    return acct.epsilon(costed, delta)


def epsilon(ledger: Ledger, *, delta: float, accountant: str = "pld") -> float:
    """eps at ``delta`` spent by everything recorded in ``ledger`` (add/remove adjacency)."""
    return compose_epsilon(ledger.runs, delta=delta, accountant=accountant)


def epsilon_for_step(step: StepSpend, *, steps: int, delta: float, accountant: str = "pld") -> float:
    """eps at ``delta`` after ``steps`` identical steps."""
    return compose_epsilon([(step, steps)], delta=delta, accountant=accountant)


def headline_epsilons(ledger: Ledger, *, delta: float, accountant: str = "pld") -> dict[str, Any]:
    """What a run reports for its ledger (per epoch in metrics.jsonl, and in summary.json): ``epsilon`` by the run's
    accountant (the headline, ``epsilon_accountant`` names it) and ``epsilon_rdp``, the RDP cross-check.

    A PLD whose privacy-loss range is too wide for a grid (noise multiplier ~< 0.01) reports ``inf`` (a valid, if
    useless, upper bound) instead of stopping the run.
    """
    _check(delta, accountant)
    if not ledger.steps:
        return {"epsilon": 0.0, "epsilon_accountant": accountant, "epsilon_rdp": 0.0}
    try:
        head = epsilon(ledger, delta=delta, accountant=accountant)
    except pld_mod.PLDRangeError:
        head = math.inf
    rdp = head if accountant == CROSS_CHECK else epsilon(ledger, delta=delta, accountant=CROSS_CHECK)
    return {"epsilon": head, "epsilon_accountant": accountant, "epsilon_rdp": rdp}


#: The step's noise records (what ``noise_part`` keeps and ``selection_part`` drops).
_NOISE = (GaussianSpend, DiscreteGaussianSpend)


def noise_part(step: StepSpend) -> StepSpend:
    """The step with only its Gaussian parts (the step's noise, continuous or discrete; same sampling rate)."""
    return StepSpend(step.sampling_rate, tuple(p for p in step.parts if isinstance(p, _NOISE)))


def selection_part(step: StepSpend) -> StepSpend:
    """The step without its Gaussian parts (same sampling rate)."""
    return StepSpend(step.sampling_rate, tuple(p for p in step.parts if not isinstance(p, _NOISE)))


def _json_float(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _or_none(acct: Accountant, runs: list[tuple[Costs, int]], delta: float) -> float | None:
    """The accountant's figure, or None where it does not apply (e.g. no PLD of discrete Gaussian noise)."""
    if any(acct.refusal(c) is not None for c, _ in runs):
        return None
    return acct.epsilon(runs, delta)


def report(step: StepSpend, *, steps: int, delta: float, accountant: str = "pld") -> dict[str, Any]:
    """Everything spent by ``steps`` identical steps, as a JSON-able dict.

    ``epsilon`` is the headline by ``accountant`` (default PLD; max over add and remove), ``epsilon_pld`` and
    ``epsilon_rdp`` both accountants' figures; ``parts`` gives the noise alone, the selection alone (each
    Poisson-subsampled on its own) and the joint step (composed inside the step, then subsampled once: the valid
    one; noise + selection separately would under-report). ``paper_theorem3_reference_NOT_A_BOUND`` is the paper's
    Theorem 3 ({"epsilon", "delta", "note"}), a labelled reference that is NOT a valid bound (no warning is
    emitted: the label is in the key and the note). Infinite eps are reported as ``inf`` floats.
    """
    head = _check(delta, accountant)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"steps: must be an integer >= 0, got {steps!r}")
    costs = costs_of(step)
    _refused(head, costs)
    parts: dict[str, dict[str, Any]] = {}
    for name, c in (("noise", costs.noise_only()), ("selection", costs.selection_only()), ("joint", costs)):
        parts[name] = {a: _or_none(ACCOUNTANTS[a], [(c, steps)], delta) for a in headline()}
        parts[name]["rdp_order"] = _json_float(rdp_mod.rdp_epsilon([(c, steps)], delta)[1])
    out: dict[str, Any] = {
        "epsilon": parts["joint"][accountant],
        **{f"epsilon_{a}": parts["joint"][a] for a in headline()},
        "delta": float(delta),
        "steps": steps,
        "sampling_rate": costs.q,
        "noise_multiplier": costs.sigma,
        "joint_noise_multiplier": costs.joint_sigma,  # with a Gaussian selection folded in (else = noise_multiplier)
        "adjacency": "add_remove",
        "accountant": accountant,
        "selection": [spend_to_json(p) for p in step.parts if not isinstance(p, _NOISE)],
        "parts": parts,
        "method": {a: ACCOUNTANTS[a].method for a in headline()},
    }
    if costs.discrete:  # dp.noise: secure
        out["noise"] = ("discrete Gaussian (dp.noise: secure): accountants with its RDP bound alpha/(2 s^2) "
                        "(Canonne-Kamath-Steinke 2020) only, noise multiplier charged sigma/(1 + grid_slack)")
        out["method"] = {a: ACCOUNTANTS[a].refusal(costs) or ACCOUNTANTS[a].method for a in headline()}
    if steps > 0:
        out[paper_mod.REFERENCE_KEY] = paper_mod.paper_theorem3_reference([(step, steps)], delta)
    return out
