"""report(), the paper's Theorem 3 (a labelled reference, refused as an accountant), epsilon(ledger), calibration
and max_steps."""

import json
import math
import warnings

import pytest

from widedp.accounting import (
    REFERENCE_KEY,
    Ledger,
    calibrate_noise_multiplier,
    calibrate_selection_epsilon,
    compose_epsilon,
    epsilon,
    epsilon_for_step,
    headline_epsilons,
    max_steps,
    paper_selection_epsilon,
    paper_theorem3_reference,
    report,
)
from widedp.dp.spend import ExponentialSpend, FreeSpend, GaussianSpend, SparseVectorSpend, StepSpend
from widedp.errors import ConfigError

DELTA = 1e-5
SMALL_Q, SMALL_T = 0.01, 400  # fast settings for calibration tests


def joint(sigma=0.9, eps2=0.05, k=10, q=SMALL_Q):
    return StepSpend(q, (GaussianSpend(sigma), ExponentialSpend(eps2, k)))


def test_report_fields_and_consistency():
    step = joint()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the paper's figure comes as labelled data, never as a Python warning
        r = report(step, steps=SMALL_T, delta=DELTA)
    json.dumps(r)  # JSON-able
    for key in ("epsilon", "epsilon_pld", "epsilon_rdp", "delta", "steps", "sampling_rate", "noise_multiplier",
                "adjacency", "parts", "accountant", REFERENCE_KEY):
        assert key in r
    assert REFERENCE_KEY == "paper_theorem3_reference_NOT_A_BOUND"
    assert "NOT a valid DP bound" in r[REFERENCE_KEY]["note"] and r["accountant"] == "pld"
    assert r["adjacency"] == "add_remove" and r["steps"] == SMALL_T and r["sampling_rate"] == SMALL_Q
    assert r["noise_multiplier"] == 0.9
    parts = r["parts"]
    assert r["epsilon"] == r["epsilon_pld"] == parts["joint"]["pld"] == epsilon_for_step(step, steps=SMALL_T,
                                                                                         delta=DELTA)
    assert r["epsilon_rdp"] == parts["joint"]["rdp"]
    for name in ("noise", "selection"):
        assert 0 < parts[name]["pld"] < parts["joint"]["pld"]
        assert 0 < parts[name]["rdp"] < parts["joint"]["rdp"]
    assert parts["joint"]["pld"] <= parts["joint"]["rdp"]
    # free selection: the selection part costs nothing
    r2 = report(StepSpend(SMALL_Q, (GaussianSpend(0.9), FreeSpend("uniform"))), steps=SMALL_T, delta=DELTA)
    assert r2["parts"]["selection"]["pld"] == 0.0
    assert r2["epsilon"] == pytest.approx(r2["parts"]["noise"]["pld"])
    # the headline follows the accountant asked for; both figures are always there
    r3 = report(step, steps=SMALL_T, delta=DELTA, accountant="rdp")
    assert r3["accountant"] == "rdp" and r3["epsilon"] == r["epsilon_rdp"] and r3["epsilon_pld"] == r["epsilon"]


def test_paper_reference_is_theorem_3_labelled_and_silent():
    q, t = 1e-4, 200_000
    e2 = paper_selection_epsilon(10.0, delta=5e-6, sampling_rate=q, steps=t, picks=100)
    step = StepSpend(q, (GaussianSpend(0.5), ExponentialSpend(e2, 100)))
    # By hand: delta' = delta / (4 q T); eps' = eps'' sqrt(2k ln 1/delta'); g = 2 sqrt(2 ln(1.25/delta')) / sigma;
    # eps = 4 q sqrt(T ln(1/(2 q T delta'))) (eps' + g).
    dp = DELTA / (4 * q * t)
    per = e2 * math.sqrt(200 * math.log(1 / dp)) + 2 * math.sqrt(2 * math.log(1.25 / dp)) / 0.5
    expected = 4 * q * math.sqrt(t * math.log(1 / (2 * q * t * dp))) * per
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref = paper_theorem3_reference([(step, t)], DELTA)
    assert ref["epsilon"] == pytest.approx(expected, rel=1e-12)
    assert ref["epsilon"] == pytest.approx(23.72, abs=0.01) and ref["delta"] == DELTA
    assert "NOT a valid DP bound" in ref["note"] and "per-step eps = 37.9 > 1" in ref["note"]
    assert report(step, steps=t, delta=DELTA)[REFERENCE_KEY] == ref
    # count k == k single runs
    assert paper_theorem3_reference([(step, 1)] * 5, DELTA)["epsilon"] == pytest.approx(
        paper_theorem3_reference([(step, 5)], DELTA)["epsilon"], rel=1e-12)


def test_paper_theorem3_under_reports_so_it_is_refused_as_an_accountant():
    # q=0.01, T=1, sigma=0.2: Theorem 3 says 5.8, the PLD (an upper bound) 22.6 and RDP more: a true eps is far above
    step = StepSpend(0.01, (GaussianSpend(0.2), FreeSpend("uniform")))
    paper = paper_theorem3_reference([(step, 1)], DELTA)["epsilon"]
    assert paper == pytest.approx(5.77, abs=0.01)
    assert epsilon_for_step(step, steps=1, delta=DELTA) == pytest.approx(22.57, abs=0.01)
    # every entry point that drives or reports a run refuses it, with the reason and where the figure is shown
    calls = [
        lambda: epsilon_for_step(step, steps=1, delta=DELTA, accountant="paper"),
        lambda: compose_epsilon([(step, 1)], delta=DELTA, accountant="paper"),
        lambda: epsilon(Ledger([(step, 1)]), delta=DELTA, accountant="paper"),
        lambda: headline_epsilons(Ledger([(step, 1)]), delta=DELTA, accountant="paper"),
        lambda: report(step, steps=1, delta=DELTA, accountant="paper"),
        lambda: calibrate_noise_multiplier(lambda s: joint(sigma=s), steps=SMALL_T, delta=DELTA, target_epsilon=2.0,
                                           accountant="paper"),
        lambda: calibrate_selection_epsilon(lambda x: joint(eps2=x), steps=SMALL_T, delta=DELTA,
                                            target_epsilon=3.0, accountant="paper"),
        lambda: max_steps(joint(), delta=DELTA, target_epsilon=1.5, accountant="paper"),
    ]
    for call in calls:
        with pytest.raises(ConfigError, match=r"^dp\.accountant: .*not a valid DP bound.*" + REFERENCE_KEY):
            call()


def test_headline_epsilons_is_the_summary_accountant_plus_rdp():
    led = Ledger([(joint(), 50)])
    for acc in ("pld", "rdp"):
        got = headline_epsilons(led, delta=DELTA, accountant=acc)
        assert got == {"epsilon": epsilon(led, delta=DELTA, accountant=acc), "epsilon_accountant": acc,
                       "epsilon_rdp": epsilon(led, delta=DELTA, accountant="rdp")}
    assert headline_epsilons(Ledger(), delta=DELTA)["epsilon"] == 0.0
    tiny = Ledger([(StepSpend(0.01, (GaussianSpend(0.01), ExponentialSpend(0.1, 1))), 10)])
    assert headline_epsilons(tiny, delta=DELTA)["epsilon"] == math.inf  # PLD grid too wide: inf, not a crash


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
    with pytest.raises(ConfigError, match="one sampling rate"):
        paper_theorem3_reference([(joint(q=0.1), 1), (joint(q=0.2), 1)], DELTA)
