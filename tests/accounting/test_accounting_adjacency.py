"""Add/remove adjacency: the PLD accountant reports the max over BOTH directions.

For the Poisson-subsampled Gaussian the remove direction (qP + (1-q)Q vs Q) dominates, so a PLD that composes only
the remove pair agrees with the truth there. It does not for a subsampled pure-DP selection at large q: there the
ADD direction (Q vs qP + (1-q)Q) is worse after composition. Its exact eps is computed here independently of
widedp: T steps of Poisson(q)-subsampled randomized response RR_eps (the dominating pair of a pure eps-DP mechanism)
are, by sufficiency, Binomial(T, m) vs Binomial(T, 1 - p) counts, whose hockey-stick divergence is a finite sum.
"""

import math

import numpy as np
import pytest
from dp_accounting import GaussianDpEvent, NeighboringRelation, PoissonSampledDpEvent
from dp_accounting.pld import PLDAccountant
from scipy.optimize import brentq
from scipy.stats import binom

from widedp.accounting import compose_epsilon, epsilon_for_step
from widedp.accounting import pld as P
from widedp.accounting.parts import costs_of
from widedp.dp.spend import ExponentialSpend, GaussianSpend, SparseVectorSpend, StepSpend


def _rr_subsampled_laws(q: float, eps: float, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Laws of the number of 1s over ``steps`` steps: (with the record: mixture, without: Q)."""
    p = math.exp(eps) / (1 + math.exp(eps))  # RR_eps: P = (1-p, p) on {0, 1}, Q = (p, 1-p)
    k = np.arange(steps + 1)
    mix = binom.pmf(k, steps, q * p + (1 - q) * (1 - p))
    without = binom.pmf(k, steps, 1 - p)
    return mix, without


def _hockey(a: np.ndarray, b: np.ndarray, eps: float) -> float:
    return float(np.maximum(a - math.exp(eps) * b, 0.0).sum())


def _eps_for_delta(a: np.ndarray, b: np.ndarray, delta: float) -> float:
    if _hockey(a, b, 0.0) <= delta:
        return 0.0
    return brentq(lambda e: _hockey(a, b, e) - delta, 0.0, 60.0, xtol=1e-12)


def exact_remove_add(q: float, eps: float, steps: int, delta: float) -> tuple[float, float]:
    """Exact eps(delta) of T subsampled RR_eps steps: (remove: mixture vs Q, add: Q vs mixture)."""
    mix, without = _rr_subsampled_laws(q, eps, steps)
    return _eps_for_delta(mix, without, delta), _eps_for_delta(without, mix, delta)


# (q, eps per step, steps, delta): regimes where the add direction is worse by >= 0.1
CASES = [(0.8, 1.0, 5, 0.1), (0.9, 0.5, 20, 1e-2), (0.95, 1.0, 20, 1e-3)]


@pytest.mark.parametrize("q,eps,steps,delta", CASES)
@pytest.mark.parametrize("record", ["exponential_pure", "sparse_vector"])
def test_pld_reports_the_worse_of_add_and_remove(q, eps, steps, delta, record):
    rem, add = exact_remove_add(q, eps, steps, delta)
    assert add > rem + 0.1  # the case separates the directions: a remove-only PLD would report ~rem
    part = (ExponentialSpend(eps, 1, bounded_range=False) if record == "exponential_pure"
            else SparseVectorSpend(eps, 1))
    step = StepSpend(q, (part,))
    ours = epsilon_for_step(step, steps=steps, delta=delta)
    assert ours >= max(rem, add) - 1e-6  # an upper bound on the worse direction ...
    assert ours <= max(rem, add) + 1e-3  # ... and tight (pessimistic discretisation, interval 1e-4)
    # the same through a ledger of single steps (pairwise composition instead of self-composition)
    assert compose_epsilon([(step, 1)] * steps, delta=delta) == pytest.approx(ours, abs=1e-3)
    # delta(eps) too: at the remove direction's eps the add direction still exceeds delta
    mix, without = _rr_subsampled_laws(q, eps, steps)
    d_add = _hockey(without, mix, rem)
    assert d_add > 1.1 * delta
    assert P.pld_delta([(costs_of(step), steps)], rem) >= d_add * (1 - 1e-6)


def test_each_direction_matches_its_exact_value():
    """widedp's two PLDs separately: remove = the mixture on top, add = Q on top (not swapped, not merged)."""
    q, eps, steps, delta = CASES[0]
    rem, add = exact_remove_add(q, eps, steps, delta)
    pld = P.compose_pld([(costs_of(StepSpend(q, (SparseVectorSpend(eps, 1),))), steps)])
    # _pmf_remove/_pmf_add: the two adjacencies (no public accessor in dp_accounting 0.6.0)
    assert P.epsilon_for_delta(pld._pmf_remove, delta) == pytest.approx(rem, abs=1e-3)
    assert P.epsilon_for_delta(pld._pmf_add, delta) == pytest.approx(add, abs=1e-3)


@pytest.mark.parametrize("q,sigma,steps", [(0.5, 0.8, 10), (0.9, 1.0, 3), (0.2, 0.8, 1)])
def test_large_q_small_sigma_gaussian_matches_dp_accounting_add_or_remove(q, sigma, steps):
    """dp_accounting's PLDAccountant (ADD_OR_REMOVE_ONE: pessimistic max of both directions) on the same steps."""
    acc = PLDAccountant(NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4)
    acc.compose(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)
    for delta in (1e-5, 1e-2):
        ours = epsilon_for_step(StepSpend(q, (GaussianSpend(sigma),)), steps=steps, delta=delta)
        assert ours == pytest.approx(acc.get_epsilon(delta), rel=1e-3, abs=1e-4)
