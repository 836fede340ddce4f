"""Privacy accounting: compose StepSpend records (PLD headline, RDP cross-check; the paper's Theorem 3 only as a
labelled reference).

Each DP step emits ``StepSpend(sampling_rate=q, parts=(GaussianSpend(sigma), <selection spend>))``. The parts saw
the same Poisson batch, so they are composed inside the step and amplified by sampling ONCE (privacy.md §3);
adjacency is add/remove and the max over the two directions is reported.

Accountants are small classes (``widedp.accounting.base.Accountant``) behind one registry
(``widedp.accounting.registry.ACCOUNTANTS``, name -> instance; a new one is its file and one line there):

- ``pld`` (``widedp.accounting.pld``): dominating pair per step, pessimistic discretisation, FFT composition.
- ``rdp`` (``widedp.accounting.rdp``): RDP curves, Zhu-Wang subsampling (exact sampled Gaussian when the selection
  is free), Balle et al. conversion.
- ``opacus_prv`` (``widedp.accounting.opacus_prv``): Opacus' PRV accountant, an adapter for the DP-SGD baseline
  (sampled Gaussian steps only; not a headline: it cannot drive a run of widedp's own step).
- ``dp.noise: secure`` steps record ``DiscreteGaussianSpend`` (discrete Gaussian on a grid): RDP only (its curve,
  at σ/(1 + grid_slack), with the general subsampling bound); the PLD accountant refuses them (``parts``).

``paper`` is NOT an accountant: the paper's Theorem 3 (``widedp.accounting.paper``) is not a valid bound (it
under-reports, e.g. q=0.01, T=1, sigma=0.2: 5.8 vs >= 22.6), so every function taking ``accountant=`` refuses it with
a ConfigError (``PAPER_REFUSED``); ``report`` carries its figure as ``paper_theorem3_reference_NOT_A_BOUND``.

Public API::

    Ledger().add(step, count=1); Ledger.to_json() / Ledger.from_json(d); ledger.steps
    epsilon(ledger, *, delta, accountant="pld") -> float
    epsilon_for_step(step, *, steps, delta, accountant="pld") -> float
    compose_epsilon([(step, count), ...], *, delta, accountant="pld") -> float
    headline_epsilons(ledger, *, delta, accountant="pld") -> {"epsilon", "epsilon_accountant", "epsilon_rdp"}
    report(step, *, steps, delta, accountant="pld") -> dict
    paper_theorem3_reference([(step, count), ...], delta) -> {"epsilon", "delta", "note"}   # NOT a bound
    calibrate_noise_multiplier(make_step, *, steps, delta, target_epsilon, accountant="pld") -> float
    calibrate_selection_epsilon(make_step, *, steps, delta, target_epsilon, accountant="pld") -> float
    max_steps(step, *, delta, target_epsilon, accountant="pld") -> int
    paper_selection_epsilon(total_epsilon, *, delta, sampling_rate, steps, picks) -> float
"""

import importlib
from typing import Any

#: public name -> the module that defines it (imported on first use, so that importing a submodule never runs the
#: others: no import cycle through this package)
_HOME = {
    **dict.fromkeys(("PAPER_REFUSED", "compose_epsilon", "epsilon", "epsilon_for_step", "headline_epsilons",
                     "noise_part", "report", "selection_part"), "widedp.accounting.accountant"),
    **dict.fromkeys(("calibrate_noise_multiplier", "calibrate_selection_epsilon", "max_steps"),
                    "widedp.accounting.calibrate"),
    **dict.fromkeys(("Ledger", "step_from_json", "step_to_json"), "widedp.accounting.ledger"),
    **dict.fromkeys(("REFERENCE_KEY", "paper_selection_epsilon", "paper_theorem3_reference"),
                    "widedp.accounting.paper"),
    "Accountant": "widedp.accounting.base",
    "ACCOUNTANTS": "widedp.accounting.registry",
}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'widedp.accounting' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
