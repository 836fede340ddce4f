"""RDP accountant: Opacus agreement, the paper's joint step, joint vs separately subsampled (the contract every
accountant meets, reference figures and count=k composition included: test_accounting_contract.py)."""

import numpy as np
import pytest
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp

from widedp.accounting import epsilon_for_step, paper_selection_epsilon
from widedp.accounting import rdp as R
from widedp.accounting.parts import costs_of
from widedp.dp.spend import ExponentialSpend, FreeSpend, GaussianSpend, SparseVectorSpend, StepSpend

Q, T, DELTA = 1e-4, 200_000, 1e-5  # the paper's setting: n = 200K, b = 20, 20 epochs


def paper_eps2() -> float:
    return paper_selection_epsilon(10.0, delta=5e-6, sampling_rate=Q, steps=T, picks=100)


@pytest.mark.parametrize("q,sigma,steps", [(1e-4, 0.5, 200_000), (0.01, 1.0, 1000), (0.05, 2.0, 300), (1.0, 3.0, 5)])
def test_gaussian_only_matches_opacus(q, sigma, steps):
    acc = RDPAccountant()
    acc.history = [(sigma, q, steps)]
    ref = acc.get_epsilon(DELTA)
    ours = epsilon_for_step(StepSpend(q, (GaussianSpend(sigma), FreeSpend("uniform"))), steps=steps, delta=DELTA,
                            accountant="rdp")
    assert ours == pytest.approx(ref, rel=1e-3)


def test_paper_selection_reproduces_10_80():
    # Sec. 6.4: selection budget eps = 10 at delta = 5e-6 through Theorem 3 and Alg. 4, k = floor(gamma p) = 100.
    e2 = paper_eps2()
    assert e2 == pytest.approx(0.27023, abs=1e-4)
    joint = StepSpend(Q, (GaussianSpend(0.5), ExponentialSpend(e2, 100)))
    assert epsilon_for_step(joint, steps=T, delta=DELTA, accountant="rdp") == pytest.approx(10.80, rel=0.01)


def test_separately_subsampled_shortcut_is_not_what_we_compute():
    e2 = paper_eps2()
    joint = costs_of(StepSpend(Q, (GaussianSpend(0.5), ExponentialSpend(e2, 100))))
    orders = R.INTEGER_ORDERS
    gauss_alone = np.asarray(compute_rdp(q=Q, noise_multiplier=0.5, steps=1, orders=list(orders)))
    sel_alone = R.step_rdp(joint.selection_only(), orders)
    shortcut, _ = R.rdp_to_epsilon(orders, T * (gauss_alone + sel_alone), DELTA)
    ours, _ = R.rdp_epsilon([(joint, T)], DELTA)
    assert shortcut == pytest.approx(3.54, rel=0.01)
    assert ours == pytest.approx(10.80, rel=0.01)
    assert ours > 2.5 * shortcut


def test_zhu_wang_upper_bounds_exact_sampled_gaussian():
    q, sigma = 0.01, 1.0
    orders = tuple(float(a) for a in range(2, 65))
    curve = R.gaussian_rdp(sigma, np.arange(65, dtype=float).clip(min=2))
    zw = R.zhu_wang_subsampled_rdp(curve, q, orders)
    exact = np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(orders)))
    assert np.all(zw >= exact * (1 - 1e-9))
    assert np.all(zw[:7] <= 2.0 * exact[:7])  # the general bound is loose, but not absurdly at small orders
    np.testing.assert_allclose(R.zhu_wang_subsampled_rdp(curve, 1.0, orders), curve[2:65])


def test_mechanism_curves():
    a = np.array([1.5, 2.0, 10.0, 1000.0])
    eps = 0.3
    np.testing.assert_allclose(R.bounded_range_rdp(eps, a), np.minimum(eps, a * eps**2 / 8))
    rr = R.pure_dp_rdp(eps, a)
    assert np.all(rr <= eps + 1e-12) and np.all(np.diff(rr) >= 0)
    # small eps: D_alpha(RR_eps) ~ alpha eps^2 / 2 (4x the bounded-range curve)
    assert R.pure_dp_rdp(0.01, np.array([2.0]))[0] == pytest.approx(2 * 0.01**2 / 2, rel=0.02)
    # SVT record = cutoff segments + cutoff releases, each pure
    c = costs_of(StepSpend(0.1, (SparseVectorSpend(0.5, 3, 0.2),)))
    np.testing.assert_allclose(R.mechanism_rdp(c, a), 3 * R.pure_dp_rdp(0.5, a) + 3 * R.pure_dp_rdp(0.2, a))


def test_sampled_gaussian_port_matches_opacus():
    assert tuple(float(a) for a in RDPAccountant.DEFAULT_ALPHAS) == R.OPACUS_ORDERS
    orders = [*R.OPACUS_ORDERS, 100.0, 256.0, 1024.0]
    for q, sigma in ((1e-4, 0.5), (0.01, 1.0), (0.2, 0.8), (0.5, 3.0)):
        ref = np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=orders))
        ours = np.array([R.sampled_gaussian_rdp(q, sigma, a) for a in orders])
        np.testing.assert_allclose(ours, ref, rtol=1e-6)
