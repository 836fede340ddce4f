"""The run's privacy plan (widedp.run.plan): the DP vocabulary's Gaussian composed with the training steps in one
ledger, its threshold's delta, calibration and the budget stop with it; a selection's calibration knob."""

import math
from dataclasses import replace

import pytest

from widedp import accounting
from widedp.config import (
    Config,
    DataConfig,
    DPConfig,
    ExponentialSelectionConfig,
    GaussianThresholdSelectionConfig,
    TrainConfig,
    UniformSelectionConfig,
    VocabDPConfig,
)
from widedp.dp.spend import ExponentialSpend, GaussianSpend, StepSpend
from widedp.errors import ConfigError
from widedp.run import plan

DELTA, DELTA_TAU = 1e-5, 1e-6
STEP = StepSpend(0.01, (GaussianSpend(1.0, 0.001), ExponentialSpend(epsilon=0.05, picks=10)))


def _cfg(*, vocabulary="dp", **dp_kw):
    data = DataConfig(privacy_unit="sentence", vocabulary=vocabulary,
                      vocab_dp=VocabDPConfig(noise_multiplier=4.0, delta=DELTA_TAU))
    dp = DPConfig(clip1=1.0, clip2=1.0, noise_multiplier=1.0, delta=DELTA,
                  selection=ExponentialSelectionConfig(k=50, epsilon=0.02, score_clip=0.01), **dp_kw)
    return Config(data=data, train=TrainConfig(epochs=2, batch_size=100), dp=dp)


def test_vocabulary_entry_and_threshold_delta():
    rb = plan.prefix_of(_cfg())
    assert rb.entries == (StepSpend(1.0, (GaussianSpend(4.0, 1.0),)),) and rb.threshold_delta == DELTA_TAU
    assert rb.accounting_delta(DELTA) == pytest.approx(DELTA - DELTA_TAU)
    assert rb.epsilon_extra == pytest.approx(-math.log1p(-DELTA_TAU))
    assert plan.prefix_of(_cfg(vocabulary="private_top")) == plan.Prefix()
    with pytest.raises(ConfigError, match="below dp.delta"):
        plan.prefix_of(replace(_cfg(), dp=replace(_cfg().dp, delta=DELTA_TAU)))


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_joint_ledger_covers_vocabulary_and_training(accountant):
    cfg = _cfg(accountant=accountant)
    rb = plan.prefix_of(cfg)
    ledger = accounting.Ledger()
    for p in rb.entries:
        ledger.add(p)
    ledger.add(STEP, count=500)
    eps = plan.epsilons(cfg.dp, ledger, rb)
    head = eps["epsilon"] if accountant == "pld" else eps["epsilon_rdp"]
    # exactly: the vocabulary Gaussian composed with the steps, at delta - delta_tau, plus ln(1/(1 - delta_tau))
    joint = accounting.compose_epsilon([(rb.entries[0], 1), (STEP, 500)], delta=DELTA - DELTA_TAU,
                                       accountant=accountant)
    assert head == pytest.approx(joint - math.log1p(-DELTA_TAU), rel=1e-12)
    training = accounting.compose_epsilon([(STEP, 500)], delta=DELTA, accountant=accountant)
    vocab_alone = accounting.compose_epsilon([(rb.entries[0], 1)], delta=DELTA, accountant=accountant)
    assert head >= training  # the ledger's eps covers more than training alone
    assert head <= training + vocab_alone + 0.05  # and composes (not worse than adding the two, up to delta split)
    # the per-run figures agree: per epoch, summary (same function), and an empty ledger spends nothing
    assert plan.epsilons(cfg.dp, accounting.Ledger(), rb)["epsilon"] == 0.0


def test_calibration_and_budget_stop_include_the_vocabulary():
    cfg = _cfg(target_epsilon=3.0, calibrate="noise_multiplier")
    rb = plan.prefix_of(cfg)
    n, rows = 20_000, 2000
    steps = plan.total_steps(cfg, n)
    dp = plan.calibrated(cfg.dp, steps=steps, batch_size=100, num_rows=rows, n=n, prefix=rb)
    step = plan.step_spend(dp, num_rows=rows, batch_size=100, n=n)
    led = accounting.Ledger([(rb.entries[0], 1), (step, steps)])
    eps = plan.epsilons(dp, led, rb)["epsilon"]
    assert 0.99 * 3.0 <= eps <= 3.0
    only_training = plan.calibrated(cfg.dp, steps=steps, batch_size=100, num_rows=rows, n=n)
    assert dp.noise_multiplier > only_training.noise_multiplier  # the vocabulary's share needs more noise
    # budget stop: the most training steps with the prefix within the target
    dp_fixed = replace(cfg.dp, target_epsilon=2.0, calibrate="none", noise_multiplier=1.0)
    step1 = plan.step_spend(dp_fixed, num_rows=rows, batch_size=100, n=n)
    cap = plan.budget_steps(dp_fixed, step1, rb)
    assert 0 < cap < plan.budget_steps(dp_fixed, step1)
    at = plan.epsilons(dp_fixed, accounting.Ledger([(rb.entries[0], 1), (step1, cap)]), rb)["epsilon"]
    over = plan.epsilons(dp_fixed, accounting.Ledger([(rb.entries[0], 1), (step1, cap + 1)]), rb)["epsilon"]
    assert at <= 2.0 < over
    # a target below the vocabulary's own spend: infeasible / zero steps
    with pytest.raises(ConfigError, match="vocabulary alone"):
        plan.calibrated(replace(cfg.dp, target_epsilon=0.1), steps=steps, batch_size=100, num_rows=rows, n=n,
                        prefix=rb)
    assert plan.budget_steps(replace(dp_fixed, target_epsilon=0.1), step1, rb) == 0


@pytest.mark.parametrize("selection", [ExponentialSelectionConfig(k=50, epsilon=0.02, score_clip=0.01),
                                       GaussianThresholdSelectionConfig(sigma=4.0, threshold_sigmas=1.0)])
def test_selection_calibration_moves_the_selections_own_knob_with_the_prefix(selection):
    cfg = _cfg(target_epsilon=3.0, calibrate="selection_epsilon")
    cfg = replace(cfg, dp=replace(cfg.dp, noise_multiplier=2.0, selection=selection))
    rb, n, rows = plan.prefix_of(cfg), 20_000, 2000
    steps = plan.total_steps(cfg, n)
    dp = plan.calibrated(cfg.dp, steps=steps, batch_size=100, num_rows=rows, n=n, prefix=rb)
    assert dp.noise_multiplier == 2.0 and dp.selection != selection and type(dp.selection) is type(selection)
    step = plan.step_spend(dp, num_rows=rows, batch_size=100, n=n)
    eps = plan.epsilons(dp, accounting.Ledger([(rb.entries[0], 1), (step, steps)]), rb)["epsilon"]
    assert 0.99 * 3.0 <= eps <= 3.0


def test_a_selection_without_a_knob_cannot_calibrate_its_epsilon():
    cfg = _cfg(target_epsilon=3.0, calibrate="selection_epsilon")
    with pytest.raises(ConfigError, match="dp.calibrate: selection_epsilon needs a selection with a privacy"):
        replace(cfg.dp, selection=UniformSelectionConfig(k=10))


def test_a_new_runs_delta_must_be_below_one_over_n_whatever_its_size():
    cfg = _cfg()  # δ = 1e-5, the shipped configs' and DPConfig's default, on sentences
    plan.check_data(cfg, 99_999)  # 1/N = 1.00001e-5 > δ
    for n, many in ((100_000, "1.0"), (199_584, "2.0")):  # δ = 1/N exactly; the default job's N (δ·N = 2)
        with pytest.raises(ConfigError) as e:
            plan.check_data(cfg, n)
        assert str(e.value) == (f"dp.delta: 1e-05 is not below 1/N = {1 / n:.3g} (N = {n:,} training sentences): "
                                f"publishing each sentence in the clear with probability δ meets it (about {many} "
                                "of them); lower it, or set dp.allow_large_delta: true")
    plan.check_data(cfg, 199_584, new=False)  # a resumed run keeps the δ it started with
    plan.check_data(_cfg(allow_large_delta=True), 199_584)
    with pytest.raises(ConfigError, match=r"dp.delta: 0.5 is not below 1/N = 0.5 \(N = 2 training sentences\)"):
        plan.check_data(replace(cfg, dp=replace(cfg.dp, delta=0.5, sampling_rate=0.5)), 2)
