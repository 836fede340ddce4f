"""Noise scales, selection laws and reference implementations of the convex algorithms' mechanisms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from widedp import accounting
from widedp.convex import common, dp_agd, frank_wolfe, numeric_sparse, output_perturbation, sparse_mean
from widedp.dp.spend import GaussianSpend, StepSpend
from widedp.models import glm


def _rows(seed: int = 0, n: int = 60, d: int = 12, k: int = 3) -> glm.LabeledCSR:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, k, (n,), generator=g)
    dense = torch.rand(n, d, generator=g, dtype=torch.float64) * (torch.rand(n, d, generator=g) < 0.5)
    dense[torch.arange(n), y] += 1.0  # class-informative feature
    dense[:, -1] = 1.0
    dense = dense / dense.norm(dim=1, keepdim=True)
    csr = dense.to_sparse_csr()
    return glm.LabeledCSR.from_csr(csr.crow_indices(), csr.col_indices(), csr.values(), y, num_features=d,
                                   num_classes=k, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------- NoisyMax


def _exact_noisy_max(values: np.ndarray, scale: float) -> np.ndarray:
    lap = stats.laplace(scale=scale)
    out = []
    for j, v in enumerate(values):
        others = np.delete(values, j)
        def f(x, v=v, others=others):
            return lap.pdf(x - v) * np.prod(lap.cdf(x - others))

        out.append(integrate.quad(f, v - 40 * scale, v + 40 * scale, limit=200)[0])
    return np.asarray(out)


def test_noisy_max_law_matches_exact_probabilities():
    values = np.array([0.0, 0.5, 1.0, 1.6])
    eps, sens, draws = 1.0, 1.0, 20_000
    g = torch.Generator().manual_seed(0)
    counts = np.bincount([dp_agd.noisy_max(torch.tensor(values), sensitivity=sens, epsilon=eps, generator=g)
                          for _ in range(draws)], minlength=4)
    exact = _exact_noisy_max(values, sens / eps)
    assert abs(exact.sum() - 1) < 1e-6
    assert stats.chisquare(counts, exact * draws).pvalue > 1e-3
    wrong = _exact_noisy_max(values, 2 * sens / eps)  # negative control: the general (non-monotone) scale
    assert stats.chisquare(counts, wrong * draws).pvalue < 1e-6


def test_grad_avg_has_the_noise_of_one_larger_measurement():
    g = torch.Generator().manual_seed(1)
    clip, rho_old, rho_new = 2.0, 0.01, 0.011
    true = torch.zeros(200_000, dtype=torch.float64)
    first = true + common.gaussian(true.shape, clip / math.sqrt(2 * rho_old), g, torch.float64)
    avg = dp_agd.grad_avg(first, true, rho_old=rho_old, rho_new=rho_new, clip=clip, generator=g)
    want = clip / math.sqrt(2 * rho_new)
    assert stats.kstest((avg / want).numpy(), "norm").pvalue > 1e-3
    assert stats.kstest((avg / (2 * want)).numpy(), "norm").pvalue < 1e-6


def test_dp_agd_spends_its_budget_and_learns():
    data = _rows()
    rho = common.zcdp_rho_for(4.0, 1e-5)
    res = dp_agd.dp_agd(data, rho=rho, nominal_iterations=20, clip=1.0, loss_clip=3.0, nmax_share=0.2, gamma=0.1,
                        step_candidates=8, step_max=4.0, step_window=5, generator=torch.Generator().manual_seed(0))
    assert res.info["rho_spent"] <= rho * (1 + 1e-9) and res.info["rho_spent"] >= 0.999 * rho
    # zCDP records converted: sum of 1/(2 sigma^2) over Gaussians + eps^2/2 over NoisyMax = rho
    total = 0.0
    for s, n in res.ledger.runs:
        for p in s.parts:
            total += n * (0.5 / p.noise_multiplier**2 if isinstance(p, GaussianSpend) else p.epsilon**2 / 2 * p.picks)
    assert math.isclose(total, rho, rel_tol=1e-9)
    eps = common.ledger_epsilon(res.ledger, delta=1e-5, accountant="rdp")
    assert eps <= 4.0
    assert glm.mean_loss(res.w, data) < math.log(3) - 0.1


def test_collapse_full_batch_is_exact():
    led = accounting.Ledger()
    for s in (3.0, 4.0, 3.0):
        led.add(StepSpend(1.0, (GaussianSpend(s),)), count=2)
    collapsed = common.collapse_full_batch(led)
    assert collapsed.steps == 1
    for acc in ("rdp", "pld"):
        assert math.isclose(accounting.epsilon(collapsed, delta=1e-5, accountant=acc),
                            accounting.epsilon(led, delta=1e-5, accountant=acc), rel_tol=2e-3)


# ----------------------------------------------------------------------------------------- output perturbation


def test_output_perturbation_noise_matches_formula():
    data = _rows(n=40)
    lam, eps, delta = 0.1, 1.0, 1e-5
    w_star, sens, _ = output_perturbation.solve_private(data, l2_reg=lam, radius=1e9, lipschitz=glm.LIPSCHITZ_L2,
                                                        smooth=glm.SMOOTH_L2, iterations=100)
    # R' = L / lambda: (L + lambda R') / (lambda n) = 2 L / (lambda n), plus 0.1% for the solver residual
    assert math.isclose(sens, 2 * glm.LIPSCHITZ_L2 / (lam * len(data)) * 1.001, rel_tol=1e-12)
    samples, stds = [], []
    for seed in range(60):
        res = output_perturbation.output_perturbation(
            data, epsilon=eps, delta=delta, l2_reg=lam, mechanism="gaussian", sparsity=10, radius=1e9,
            generator=torch.Generator().manual_seed(seed))
        samples.append((res.w.double() - w_star).reshape(-1))
        stds.append(res.info["noise_std"])
    sigma = accounting.calibrate_noise_multiplier(lambda s: StepSpend(1.0, (GaussianSpend(s),)), steps=1,
                                                  delta=delta, target_epsilon=eps)
    want = sigma * sens
    assert math.isclose(stds[0], want, rel_tol=1e-9)
    z = torch.cat(samples).numpy()
    assert stats.kstest(z / want, "norm").pvalue > 1e-3
    assert stats.kstest(z / (2 * want), "norm").pvalue < 1e-6
    # the Laplace variant: the certified l1 sensitivity sqrt(d K) * Delta_2
    b = math.sqrt(w_star.numel()) * sens / eps
    lz = []
    for seed in range(30):
        res = output_perturbation.output_perturbation(
            data, epsilon=eps, delta=delta, l2_reg=lam, mechanism="laplace", sparsity=10, radius=1e9,
            generator=torch.Generator().manual_seed(seed))
        assert math.isclose(res.info["laplace_scale"], b, rel_tol=1e-12)
        lz.append((res.w.double() - w_star).reshape(-1))
    lz = torch.cat(lz).numpy()
    assert stats.kstest(lz / b, "laplace").pvalue > 1e-3
    assert stats.kstest(lz / (2 * b), "laplace").pvalue < 1e-6


def test_linf_projection_is_optimal():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, generator=g, dtype=torch.float64) * 3
    for radius in (1.0, 5.0, 30.0):
        z = output_perturbation.linf_project_l2_ball(x, radius)
        assert float(z.norm()) <= radius + 1e-9
        t = float((z - x).abs().max())
        # any point within l_inf distance 0.99 t of x has norm > radius (soft-thresholding is the min-norm point)
        if float(x.norm()) > radius:
            assert float(torch.clamp(x.abs() - 0.99 * t, min=0).norm()) > radius
        else:
            assert t == 0


# ------------------------------------------------------------------------------------------------ Frank-Wolfe


def test_oracle_returns_a_vertex():
    grad = torch.tensor([[0.1, -0.7], [0.3, 0.2]], dtype=torch.float64)
    v = frank_wolfe.l1_ball_oracle(grad, radius=2.0)
    assert torch.equal(v, torch.tensor([[0.0, 2.0], [0.0, 0.0]], dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        v = frank_wolfe.l1_ball_oracle(grad, radius=2.0, noise_scale=1.0, noise="gumbel", generator=g)
        assert int((v != 0).sum()) == 1 and float(v.abs().sum()) == 2.0


def _l1_constrained_optimum(data: glm.LabeledCSR, radius: float, iters: int = 3000) -> float:
    w = torch.zeros(data.num_features, data.num_classes, dtype=torch.float64)
    for _ in range(iters):
        _, r = glm.residuals(w, data)
        w = sparse_mean.project_l1_ball(w - 1.0 * glm.weighted_grad_sum(data, r) / len(data), radius)
    return glm.mean_loss(w, data)


def test_frank_wolfe_converges_nonprivately():
    data = _rows()
    f_star = _l1_constrained_optimum(data, 3.0)
    w = frank_wolfe.frank_wolfe_nonprivate(data, iterations=400, radius=3.0)
    assert float(w.abs().sum()) <= 3.0 + 1e-9
    assert glm.mean_loss(w, data) - f_star < 0.01
    assert glm.mean_loss(torch.zeros_like(w), data) - f_star > 0.2


def test_frank_wolfe_refuses_steps_outside_its_bound():
    """eta > 1 leaves the ball: s_t would turn negative, and a negative noise scale gave the exact argmax."""
    for eta in (0.0, 1.5):
        with pytest.raises(ValueError, match="step eta must be in"):
            frank_wolfe.sensitivities(iterations=4, n=84, eta=eta, radius=2.0, first_batch_fraction=0.5)
    with pytest.raises(ValueError, match="noise_scale must be >= 0"):
        frank_wolfe.l1_ball_oracle(torch.ones(3, 2), radius=1.0, noise_scale=-0.5, generator=torch.Generator())


def test_frank_wolfe_gradient_sensitivity_bound():
    """Replaying the iterates of dataset D on D + one sample: ||grad_t - grad'_t||_inf <= s_t for every t."""
    data = _rows(n=84)
    extra = _rows(seed=9, n=1)
    T, r, eta, f1 = 8, 2.0, 0.3, 0.5
    sens = frank_wolfe.sensitivities(iterations=T, n=84, eta=eta, radius=r, first_batch_fraction=f1)
    b1, b = f1 * 84, (1 - f1) * 84 / (T - 1)
    g = torch.Generator().manual_seed(0)
    batches = [torch.arange(0, 42)] + [torch.arange(42 + 6 * i, 42 + 6 * (i + 1)) for i in range(T - 1)]
    ws = [torch.zeros(12, 3, dtype=torch.float64)]
    for _ in range(T):  # iterates from noisy vertex choices
        v = frank_wolfe.l1_ball_oracle(torch.randn(12, 3, generator=g, dtype=torch.float64), radius=r)
        ws.append((1 - eta) * ws[-1] + eta * v)
    worst = 0.0
    for k in range(T):  # the extra sample joins batch k
        def est(with_extra: bool, k: int = k) -> list[torch.Tensor]:
            out = []
            for t in range(T):
                rows = data.rows(batches[t])
                def mean(w, rows=rows, t=t, k=k):
                    _, rr = glm.residuals(w, rows)
                    s = glm.weighted_grad_sum(rows, rr)
                    if with_extra and t == k:
                        _, re = glm.residuals(w, extra)
                        s = s + glm.weighted_grad_sum(extra, re)
                    return s / (b1 if t == 0 else b)
                if t == 0:
                    out.append(mean(ws[0]))
                else:
                    now = mean(ws[t])
                    out.append((1 - eta) * (out[-1] + now - mean(ws[t - 1])) + eta * now)
            return out
        a, a2 = est(False), est(True)
        for t in range(T):
            ratio = float((a[t] - a2[t]).abs().max()) / sens[t]
            assert ratio <= 1 + 1e-9
            worst = max(worst, ratio)
    assert worst > 0.05  # the bound is not vacuous


# -------------------------------------------------------------------------------------------- sparse mean


def test_project_l1_ball():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(30, generator=g, dtype=torch.float64)
    p = sparse_mean.project_l1_ball(v, 2.0)
    assert math.isclose(float(p.abs().sum()), 2.0, rel_tol=1e-9)
    # optimality (KKT): p = soft-threshold(v, theta) for one theta
    theta = (v.abs() - p.abs())[p != 0]
    assert torch.allclose(theta, theta[0].expand_as(theta))
    assert torch.all(v.abs()[p == 0] <= theta[0] + 1e-12)
    assert torch.equal(sparse_mean.project_l1_ball(v * 0.01, 2.0), v * 0.01)


def _sparse_means(d: int, s: int, trials: int, g: torch.Generator) -> list[torch.Tensor]:
    out = []
    for _ in range(trials):
        z = torch.zeros(d, dtype=torch.float64)
        idx = torch.randperm(d, generator=g)[:s]
        z[idx] = torch.randn(s, generator=g, dtype=torch.float64)
        out.append(z / z.norm())  # L = 1
    return out


def test_projection_mechanism_beats_plain_gaussian_on_sparse_means():
    g = torch.Generator().manual_seed(0)
    d, s = 2000, 5
    std = sparse_mean.poster_projection_noise(lipschitz=1.0, sparsity=s, n=200, epsilon=1.0, delta=1e-5)
    err_p, err_g = [], []
    for z in _sparse_means(d, s, 20, g):
        plain = z + common.gaussian(z.shape, std, g, torch.float64)
        proj = sparse_mean.projection_mechanism(z, radius=math.sqrt(s), noise_std=std, generator=g)
        err_g.append(float((plain - z).norm() ** 2))
        err_p.append(float((proj - z).norm() ** 2))
    assert np.mean(err_p) < 0.25 * np.mean(err_g)
    assert math.isclose(np.mean(err_g), d * std**2, rel_tol=0.1)


def test_l1_recovery_beats_plain_gaussian_on_sparse_means():
    g = torch.Generator().manual_seed(1)
    d, s, m, std = 300, 3, 60, 0.03
    err_r, err_g = [], []
    for z in _sparse_means(d, s, 6, g):
        rec = sparse_mean.gaussian_l1_recovery(z, measurements=m, noise_std=std, generator=g)
        err_r.append(float((rec - z).norm() ** 2))
        err_g.append(float((common.gaussian(z.shape, std, g, torch.float64)).norm() ** 2))
    assert np.mean(err_r) < 0.3 * np.mean(err_g)
    # without noise, exact recovery (basis pursuit)
    z = _sparse_means(d, s, 1, g)[0]
    assert float((sparse_mean.gaussian_l1_recovery(z, measurements=m, noise_std=0.0, generator=g) - z).norm()) < 1e-6
    m_p, sig_p = sparse_mean.poster_recovery_parameters(lipschitz=1.0, sparsity=3, dim=300, n=1000, epsilon=1.0,
                                                        delta=1e-5)
    assert m_p == math.ceil(1000 * math.sqrt(3 * math.log(100) / math.log(1e5)))
    assert math.isclose(sig_p, math.sqrt(18 * math.log(2.5e5)) / 1000)


def test_dp_gd_noise_std():
    data = _rows(n=50)
    sigma, clip = 2.0, 0.5
    w0 = torch.zeros(12, 3, dtype=torch.float64)
    _, r, _ = common.clipped_residuals(w0, data, data.row_norms(2.0), clip)
    g_true = glm.weighted_grad_sum(data, r) / 50
    z = []
    for seed in range(40):
        res = sparse_mean.dp_gd(data, noise_multiplier=sigma, iterations=1, lr=1.0, clip=clip, batch_size=0,
                                estimator="gaussian", generator=torch.Generator().manual_seed(seed))
        z.append((-res.w - g_true).reshape(-1))
    want = sigma * 2 * clip / 50  # full batch: the mean over the dataset's own n moves by up to 2 C / n
    z = torch.cat(z).numpy()
    assert stats.kstest(z / want, "norm").pvalue > 1e-3
    assert stats.kstest(z / (2 * want), "norm").pvalue < 1e-6
    assert stats.kstest(z / (want / 2), "norm").pvalue < 1e-6  # the old C / n scale
    assert res.ledger.runs[0][0] == StepSpend(1.0, (GaussianSpend(sigma, 2 * clip / 50),))


# ------------------------------------------------------------------------------------------ NumericSparse


@pytest.mark.parametrize("seed, cutoff, alpha", [(0, 5, 1.0), (1, 50, 0.5), (2, 3, 10.0), (3, 1000, -5.0)])
def test_numeric_sparse_matches_reference(seed, cutoff, alpha):
    rng = np.random.default_rng(seed)
    p = 997
    u = rng.normal(size=p) * (rng.random(p) < 0.05) * 3
    noise = numeric_sparse.SparseNoise.draw(p, cutoff=cutoff, b_t=0.3, b_q=0.6, b_r=0.2,
                                            generator=torch.Generator().manual_seed(seed))
    ref = numeric_sparse.numeric_sparse_reference(u, alpha=alpha, cutoff=cutoff, noise=noise)
    idx, val = numeric_sparse.numeric_sparse(u, alpha=alpha, cutoff=cutoff, noise=noise, block=31)
    fast = np.zeros(p)
    fast[idx] = val
    assert np.array_equal(fast, ref)
    assert len(idx) <= cutoff and np.count_nonzero(ref) == len(idx)


def test_numeric_sparse_noise_scales_and_record():
    b_t, b_q, b_r = numeric_sparse.noise_scales(sensitivity=0.01, segment_epsilon=0.5, release_share=0.05)
    assert math.isclose(b_t, 0.04) and math.isclose(b_q, 0.08) and math.isclose(b_r, 2 * 0.04 * 19)
    rec = numeric_sparse.spend(segment_epsilon=0.5, cutoff=7, release_share=0.05)
    assert rec.cutoff == 7 and math.isclose(rec.epsilon_release, 0.01 / b_r)
