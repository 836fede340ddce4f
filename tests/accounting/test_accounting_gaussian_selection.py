"""Joint accounting of Gaussian contribution thresholding with the gradient noise on the same batch: the step's two
Gaussians fold into one, 1/σ_eff² = 1/σ² + 1/σ_sel² (PLD and RDP), checked against dp_accounting / Opacus and a
Monte Carlo of the two-dimensional mechanism; the joint eps exceeds either part; ledger, budget and calibration."""

import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pldm
from opacus.accountants import RDPAccountant

from widedp import accounting
from widedp.accounting import pld as P
from widedp.accounting.parts import costs_of
from widedp.config import DPConfig, GaussianThresholdSelectionConfig
from widedp.dp.spend import GaussianSelectionSpend, GaussianSpend, StepSpend
from widedp.run import plan

DELTA = 1e-5
SIGMA, SIGMA_SEL, D2 = 0.9, 2.0, 1e-3  # gradient noise (relative to its sensitivity Δ₂), selection noise
SIGMA_EFF = (SIGMA**-2 + SIGMA_SEL**-2) ** -0.5


def joint(q: float) -> StepSpend:
    return StepSpend(q, (GaussianSpend(SIGMA, D2), GaussianSelectionSpend(SIGMA_SEL)))


def test_costs_fold_the_two_gaussians():
    c = costs_of(joint(0.01))
    assert c.sigma == SIGMA and c.selection_sigma == SIGMA_SEL and c.is_gaussian and c.has_selection
    assert c.joint_sigma == pytest.approx(SIGMA_EFF, rel=1e-12)
    assert c.noise_only().joint_sigma == SIGMA and c.selection_only().joint_sigma == SIGMA_SEL


@pytest.mark.parametrize("q,steps", [(0.01, 1000), (0.005, 4000), (1.0, 3)])
def test_joint_step_is_one_gaussian_with_the_folded_sigma(q, steps):
    """eps of the joint step == eps of one Gaussian at σ_eff, by both accountants and by the references."""
    step = joint(q)
    single = StepSpend(q, (GaussianSpend(SIGMA_EFF),))
    for acc in ("pld", "rdp"):
        e = accounting.epsilon_for_step(step, steps=steps, delta=DELTA, accountant=acc)
        assert e == pytest.approx(accounting.epsilon_for_step(single, steps=steps, delta=DELTA, accountant=acc),
                                  rel=1e-9)
    ref_pld = pldm.from_gaussian_mechanism(SIGMA_EFF, sampling_prob=q).self_compose(steps)
    assert accounting.epsilon_for_step(step, steps=steps, delta=DELTA) == pytest.approx(
        ref_pld.get_epsilon_for_delta(DELTA), rel=2e-3)
    acc = RDPAccountant()
    acc.history = [(SIGMA_EFF, q, steps)]
    assert accounting.epsilon_for_step(step, steps=steps, delta=DELTA, accountant="rdp") == pytest.approx(
        acc.get_epsilon(DELTA), rel=1e-3)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_joint_exceeds_either_part(accountant):
    """The subsampled joint step costs more than the noise alone and than the selection alone (each subsampled)."""
    r = accounting.report(joint(0.01), steps=1000, delta=DELTA, accountant=accountant)
    parts = r["parts"]
    for name in ("noise", "selection"):
        assert 0 < parts[name][accountant] < parts["joint"][accountant]
    assert parts["noise"][accountant] > parts["selection"][accountant]  # σ < σ_sel
    assert r["noise_multiplier"] == SIGMA and r["joint_noise_multiplier"] == pytest.approx(SIGMA_EFF)
    assert r["selection"] == [{"kind": "gaussian_selection", "noise_multiplier": SIGMA_SEL, "sensitivity": 1.0}]


def test_folding_against_a_monte_carlo_of_the_two_dimensional_mechanism():
    """One Poisson(q) step of the pair (gradient noise on a Δ₂-sensitive value, selection noise on a 1-sensitive
    count), remove adjacency, privacy loss from the true 2-D densities: δ(ε) by Monte Carlo matches the folded
    accountant; folding as σ_eff = min(σ, σ_sel) (the stronger part alone) under-reports and is caught."""
    q, eps = 0.2, 0.4
    rng = np.random.default_rng(0)
    n = 2_000_000
    s1, s2 = SIGMA * D2, SIGMA_SEL * 1.0  # noise std of each coordinate
    mu = np.array([D2, 1.0])  # the removed sample shifts both means by their full sensitivity
    present = rng.random(n) < q
    y = rng.normal(size=(n, 2)) * [s1, s2] + present[:, None] * mu
    log_ratio = (y * mu / [s1**2, s2**2]).sum(1) - 0.5 * (mu**2 / [s1**2, s2**2]).sum()  # log N(mu)/N(0)
    loss = np.log1p(q * np.expm1(log_ratio))  # log (q N(mu) + (1-q) N(0)) / N(0), under P = mixture
    mc = float(np.mean(np.maximum(0.0, -np.expm1(eps - loss))))
    folded = P.pld_delta([(costs_of(joint(q)), 1)], eps)
    assert folded == pytest.approx(mc, rel=0.03)
    stronger_only = P.pld_delta([(costs_of(StepSpend(q, (GaussianSpend(SIGMA),))), 1)], eps)
    assert stronger_only < 0.9 * mc


def test_ledger_budget_and_calibration():
    sel = GaussianThresholdSelectionConfig(sigma=SIGMA_SEL, threshold_sigmas=3.0)
    dp = DPConfig(clip1=1.0, clip2=None, noise_multiplier=SIGMA, selection=sel)
    step = plan.step_spend(dp, num_rows=1000, batch_size=100, n=10_000)
    assert step == StepSpend(0.01, (GaussianSpend(SIGMA, 0.01), GaussianSelectionSpend(SIGMA_SEL, 1.0)))
    led = accounting.Ledger([(step, 7)])
    assert accounting.Ledger.from_json(led.to_json()) == led
    target, steps = 2.0, 300
    mk_sigma = lambda s: plan.step_spend(  # noqa: E731
        DPConfig(clip1=1.0, clip2=None, noise_multiplier=s, selection=sel), num_rows=1000, batch_size=100, n=10_000)
    sigma = accounting.calibrate_noise_multiplier(mk_sigma, steps=steps, delta=DELTA, target_epsilon=target)
    e = accounting.epsilon_for_step(mk_sigma(sigma), steps=steps, delta=DELTA)
    assert 0.99 * target <= e <= target
    # selection_epsilon calibration of a gaussian threshold solves its sigma (τ = 3 σ_sel follows)
    from widedp.config import Config, DataConfig, TrainConfig

    cfg = Config(data=DataConfig(splits=(10_000, 10, 10)), train=TrainConfig(epochs=3, batch_size=100),
                 dp=DPConfig(clip1=1.0, clip2=None, noise_multiplier=1.5, selection=sel, target_epsilon=target,
                             calibrate="selection_epsilon"))
    dp2 = plan.calibrated(cfg.dp, steps=plan.total_steps(cfg, 10_000), batch_size=100, num_rows=1000, n=10_000)
    s_sel = dp2.selection.sigma
    assert dp2.selection.tau == pytest.approx(3 * s_sel)
    e2 = accounting.epsilon_for_step(plan.step_spend(dp2, num_rows=1000, batch_size=100, n=10_000), steps=300,
                                     delta=DELTA)
    assert 0.99 * target <= e2 <= target
    assert math.isfinite(s_sel) and s_sel > 0
