"""Privacy accounting: compose StepSpend records (PLD headline, RDP cross-check; the paper's Theorem 3 only as a
labelled reference).

Each DP step emits ``StepSpend(sampling_rate=q, parts=(GaussianSpend(sigma), <selection spend>))``. The parts saw
the same Poisson batch, so they are composed inside the step and amplified by sampling ONCE (privacy.md §3);
adjacency is add/remove and the max over the two directions is reported.

- ``pld`` (``widedp.accounting.pld``): dominating pair per step, pessimistic discretisation, FFT composition.
- ``rdp`` (``widedp.accounting.rdp``): RDP curves, Zhu-Wang subsampling (exact sampled Gaussian when the selection
  is free), Balle et al. conversion.
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

from widedp.accounting.accountant import (
    ACCOUNTANTS,
    PAPER_REFUSED,
    Accountant,
    compose_epsilon,
    epsilon,
    epsilon_for_step,
    headline_epsilons,
    noise_part,
    report,
    selection_part,
)
from widedp.accounting.calibrate import calibrate_noise_multiplier, calibrate_selection_epsilon, max_steps
from widedp.accounting.ledger import Ledger, step_from_json, step_to_json
from widedp.accounting.paper import REFERENCE_KEY, paper_selection_epsilon, paper_theorem3_reference

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "Ledger",
    "PAPER_REFUSED",
    "REFERENCE_KEY",
    "calibrate_noise_multiplier",
    "calibrate_selection_epsilon",
    "compose_epsilon",
    "epsilon",
    "epsilon_for_step",
    "headline_epsilons",
    "max_steps",
    "noise_part",
    "paper_selection_epsilon",
    "paper_theorem3_reference",
    "report",
    "selection_part",
    "step_from_json",
    "step_to_json",
]
