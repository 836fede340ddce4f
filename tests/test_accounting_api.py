"""report(), the paper accountant, epsilon(ledger), calibration and max_steps."""

import json
import math
import warnings

import pytest

from widedp.accounting import (
    Ledger,
    PaperAccountantWarning,
    calibrate_noise_multiplier,
    calibrate_selection_epsilon,
    compose_epsilon,
    epsilon,
    epsilon_for_step,
    max_steps,
    paper_selection_epsilon,
    report,
)
from widedp.errors import ConfigError
from widedp.spend import ExponentialSpend, FreeSpend, GaussianSpend, SparseVectorSpend, StepSpend

DELTA = 1e-5
SMALL_Q, SMALL_T = 0.01, 400  # fast settings for calibration tests


def joint(sigma=0.9, eps2=0.05, k=10, q=SMALL_Q):
    return StepSpend(q, (GaussianSpend(sigma), ExponentialSpend(eps2, k)))


def test_report_fields_and_consistency():
    step = joint()
    with pytest.warns(PaperAccountantWarning, match="NOT a valid"):
        r = report(step, steps=SMALL_T, delta=DELTA)
    json.dumps(r)  # JSON-able
    for key in ("epsilon", "epsilon_rdp", "delta", "steps", "sampling_rate", "noise_multiplier", "adjacency", "parts",
                "epsilon_paper", "epsilon_paper_warning"):
        assert key in r
    assert r["adjacency"] == "add_remove" and r["steps"] == SMALL_T and r["sampling_rate"] == SMALL_Q
    assert r["noise_multiplier"] == 0.9
    parts = r["parts"]
    assert r["epsilon"] == parts["joint"]["pld"] == epsilon_for_step(step, steps=SMALL_T, delta=DELTA)
    assert r["epsilon_rdp"] == parts["joint"]["rdp"]
    for name in ("noise", "selection"):
        assert 0 < parts[name]["pld"] < parts["joint"]["pld"]
        assert 0 < parts[name]["rdp"] < parts["joint"]["rdp"]
    assert parts["joint"]["pld"] <= parts["joint"]["rdp"]
    # free selection: no paper figure, selection part costs nothing
    r2 = report(StepSpend(SMALL_Q, (GaussianSpend(0.9), FreeSpend("uniform"))), steps=SMALL_T, delta=DELTA)
    assert "epsilon_paper" not in r2 and r2["parts"]["selection"]["pld"] == 0.0
    assert r2["epsilon"] == pytest.approx(r2["parts"]["noise"]["pld"])


def test_paper_accountant_is_theorem_3_and_always_warns():
    q, t = 1e-4, 200_000
    e2 = paper_selection_epsilon(10.0, delta=5e-6, sampling_rate=q, steps=t, picks=100)
    step = StepSpend(q, (GaussianSpend(0.5), ExponentialSpend(e2, 100)))
    # By hand: delta' = delta / (4 q T); eps' = eps'' sqrt(2k ln 1/delta'); g = 2 sqrt(2 ln(1.25/delta')) / sigma;
    # eps = 4 q sqrt(T ln(1/(2 q T delta'))) (eps' + g).
    dp = DELTA / (4 * q * t)
    per = e2 * math.sqrt(200 * math.log(1 / dp)) + 2 * math.sqrt(2 * math.log(1.25 / dp)) / 0.5
    expected = 4 * q * math.sqrt(t * math.log(1 / (2 * q * t * dp))) * per
    for _ in range(2):  # every call warns
        with pytest.warns(PaperAccountantWarning, match=r"per-step eps = 37\.9 > 1"):
            got = epsilon_for_step(step, steps=t, delta=DELTA, accountant="paper")
        assert got == pytest.approx(expected, rel=1e-12)
    assert got == pytest.approx(23.72, abs=0.01)
    with pytest.warns(PaperAccountantWarning):  # count k == k single composes
        assert compose_epsilon([(step, 1)] * 5, delta=DELTA, accountant="paper") == pytest.approx(
            compose_epsilon([(step, 5)], delta=DELTA, accountant="paper"), rel=1e-12)


def test_epsilon_of_ledger_composes_runs():
    led = Ledger()
    led.add(StepSpend(SMALL_Q, (GaussianSpend(0.9), FreeSpend("uniform"))), 100)
    led.add(joint(), 50)
    led.add(StepSpend(SMALL_Q, (GaussianSpend(1.2), SparseVectorSpend(0.1, 2))), 30)
    for acc in ("pld", "rdp"):
        e = epsilon(led, delta=DELTA, accountant=acc)
        assert e == pytest.approx(compose_epsilon(list(led.runs), delta=DELTA, accountant=acc), rel=1e-12)
        assert e > epsilon_for_step(joint(), steps=50, delta=DELTA, accountant=acc)
    assert epsilon(Ledger(), delta=DELTA) == 0.0


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_calibrate_noise_multiplier_hits_target(accountant):
    target = 2.0
    sigma = calibrate_noise_multiplier(lambda s: joint(sigma=s), steps=SMALL_T, delta=DELTA, target_epsilon=target,
                                       accountant=accountant)
    e = epsilon_for_step(joint(sigma=sigma), steps=SMALL_T, delta=DELTA, accountant=accountant)
    assert 0.99 * target <= e <= target


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_calibrate_selection_epsilon_hits_target(accountant):
    target = 3.0
    e2 = calibrate_selection_epsilon(lambda x: joint(eps2=x), steps=SMALL_T, delta=DELTA, target_epsilon=target,
                                     accountant=accountant)
    e = epsilon_for_step(joint(eps2=e2), steps=SMALL_T, delta=DELTA, accountant=accountant)
    assert 0.99 * target <= e <= target


def test_infeasible_targets_raise_with_reason():
    # the selection alone (10 picks at eps'' = 0.5, 400 steps) already spends more than 0.5
    with pytest.raises(ConfigError, match="selection alone"):
        calibrate_noise_multiplier(lambda s: joint(sigma=s, eps2=0.5), steps=SMALL_T, delta=DELTA,
                                   target_epsilon=0.5)
    # sigma = 0.6 alone already spends more than 1
    with pytest.raises(ConfigError, match="noise alone"):
        calibrate_selection_epsilon(lambda x: joint(sigma=0.6, eps2=x), steps=SMALL_T, delta=DELTA,
                                    target_epsilon=1.0)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_max_steps_is_the_largest_within_budget(accountant):
    step, target = joint(), 1.5
    t = max_steps(step, delta=DELTA, target_epsilon=target, accountant=accountant)
    assert t > 1
    assert epsilon_for_step(step, steps=t, delta=DELTA, accountant=accountant) <= target
    assert epsilon_for_step(step, steps=t + 1, delta=DELTA, accountant=accountant) > target
    assert max_steps(step, delta=DELTA, target_epsilon=1e-3, accountant=accountant) == 0


def test_bad_input_raises_config_error():
    with pytest.raises(ConfigError, match="delta"):
        epsilon_for_step(joint(), steps=10, delta=0.0)
    with pytest.raises(ConfigError, match="accountant"):
        epsilon_for_step(joint(), steps=10, delta=DELTA, accountant="moments")
    with pytest.raises(ConfigError, match="sampling_rate"):
        epsilon_for_step(joint(q=0.0), steps=10, delta=DELTA)
    with pytest.raises(ConfigError, match="noise_multiplier"):
        epsilon_for_step(joint(sigma=-1.0), steps=10, delta=DELTA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PaperAccountantWarning)
        with pytest.raises(ConfigError, match="one sampling rate"):
            compose_epsilon([(joint(q=0.1), 1), (joint(q=0.2), 1)], delta=DELTA, accountant="paper")
