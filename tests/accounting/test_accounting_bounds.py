"""What the accountants will compute, bounded: the PLD's composed grid is checked before its FFT allocates it, and a
target ε beyond what the accountant resolves is refused in one line naming dp.target_epsilon (instead of a search
that exhausts memory), while the privacy arithmetic stays dp_accounting's."""

import numpy as np
import pytest

from widedp.accounting import calibrate_noise_multiplier, epsilon_for_step, max_steps
from widedp.accounting import pld as P
from widedp.accounting.parts import costs_of
from widedp.dp.spend import ExponentialSpend, FreeSpend, GaussianSpend, StepSpend
from widedp.errors import ConfigError

DELTA = 1e-5


def _step(sigma: float, q: float = 0.01) -> StepSpend:
    return StepSpend(q, (GaussianSpend(sigma), ExponentialSpend(0.05, 20)))


@pytest.mark.parametrize("sigma,steps", [(0.8, 500), (1.5, 3000)])
def test_self_composition_is_dp_accounting_s_bit_for_bit(sigma, steps):
    one = P.step_pld(costs_of(_step(sigma)))
    ours, ref = P._self_compose(one, steps), one.self_compose(steps)
    for a, b in ((ours._pmf_remove, ref._pmf_remove), (ours._pmf_add, ref._pmf_add)):
        assert a._lower_loss == b._lower_loss and a._infinity_mass == b._infinity_mass
        np.testing.assert_array_equal(a._probs, b._probs)


def test_a_composed_grid_over_the_limit_is_refused_before_the_fft(monkeypatch):
    monkeypatch.setattr(P, "_MAX_COMPOSED_GRID", 1000)
    with pytest.raises(P.PLDRangeError, match="composed steps need a .*-point privacy-loss grid"):
        P.compose_pld([(costs_of(_step(1.0, q=0.011)), 400)])


def test_a_target_beyond_the_pld_ceiling_is_refused_at_once():
    make = lambda s: StepSpend(0.2, (GaussianSpend(s), FreeSpend("u")))  # noqa: E731
    for solve in (lambda: calibrate_noise_multiplier(make, steps=4000, delta=DELTA, target_epsilon=1000.0),
                  lambda: max_steps(make(1.0), delta=DELTA, target_epsilon=1000.0)):
        with pytest.raises(ConfigError, match=r"^dp\.target_epsilon: 1000 is beyond what the pld accountant "
                                              r"resolves \(at most 100"):
            solve()
    sigma = calibrate_noise_multiplier(make, steps=4000, delta=DELTA, target_epsilon=1000.0, accountant="rdp")
    assert epsilon_for_step(make(sigma), steps=4000, delta=DELTA, accountant="rdp") <= 1000.0


def test_a_target_the_grid_cannot_reach_is_refused_not_undershot(monkeypatch):
    """Points the PLD cannot resolve stand between the search and the target: one line, not a σ far below it."""
    make = lambda s: StepSpend(0.05, (GaussianSpend(s), FreeSpend("u")))  # noqa: E731
    monkeypatch.setattr(P, "_MAX_COMPOSED_GRID", 60_000)
    P._pld_epsilon.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"^dp\.target_epsilon: 20 is beyond what the pld accountant resolves "
                                              r"here \(the largest epsilon it could compute was"):
            calibrate_noise_multiplier(make, steps=200, delta=DELTA, target_epsilon=20.0)
    finally:
        P._pld_epsilon.cache_clear()
