"""Sensitivity search for every convex mechanism: over random and adversarial neighbouring datasets
D, D' = D +- one example (signed features, large norms, clipped examples, conflicting labels), the quantity each
mechanism noises, computed on D and on D' exactly as the code computes it (each with its own size n), never moves
by more than the sensitivity the code charges (read from its ledger / info). Each mechanism that divides by the
dataset's own size also has a negative control: the old charge (C / n, L / (lambda n)) IS exceeded.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from widedp.convex import common, dp_agd, frank_wolfe, numeric_sparse, output_perturbation, sparse_mean
from widedp.models import glm

TOL = 1e-9


def _rows(x: torch.Tensor, y: torch.Tensor, k: int) -> glm.LabeledCSR:
    csr = x.to_sparse_csr()
    return glm.LabeledCSR.from_csr(csr.crow_indices(), csr.col_indices(), csr.values(), y, num_features=x.shape[1],
                                   num_classes=k, dtype=torch.float64)


def _dataset(g: torch.Generator, *, n: int, d: int, k: int, unit: bool, aligned: bool) -> tuple[torch.Tensor, ...]:
    """Signed features; ``unit``: rows with ||x||_2 <= 1, else norms up to 30 (clipped); ``aligned``: every row the
    same x and label (gradients aligned, the worst case for a mean over n)."""
    if aligned:
        x = torch.randn(1, d, generator=g, dtype=torch.float64).repeat(n, 1)
        y = torch.full((n,), int(torch.randint(0, k, (1,), generator=g)))
    else:
        x = torch.randn(n, d, generator=g, dtype=torch.float64) * (torch.rand(n, d, generator=g) < 0.7)
        y = torch.randint(0, k, (n,), generator=g)
    scale = torch.rand(n, 1, generator=g, dtype=torch.float64) * (1.0 if unit else 30.0)
    x = x / x.norm(dim=1, keepdim=True).clamp_min(1e-12) * (scale if not aligned else 1.0)
    return x, y


def _neighbours(g: torch.Generator, x: torch.Tensor, y: torch.Tensor, k: int):
    """D' = D + z for adversarial / random z, and D' = D - one example; yields (x', y')."""
    i = int(torch.randint(0, len(y), (1,), generator=g))
    for xz, yz in ((-x[i], y[i]), (-x[i] * 5, y[i]), (x[i], (y[i] + 1) % k),
                   (torch.randn(x.shape[1], generator=g, dtype=torch.float64), torch.randint(0, k, ()))):
        if float(x.norm(dim=1).max()) <= 1.0 + 1e-12:  # unit rows stay unit rows
            xz = xz / max(1.0, float(xz.norm()))
        yield torch.cat([x, xz[None]]), torch.cat([y, torch.as_tensor(yz).reshape(1)])
    keep = torch.arange(len(y)) != i
    if keep.sum() > 0:
        yield x[keep], y[keep]


def _trials(seed: int, count: int, **kw):
    g = torch.Generator().manual_seed(seed)
    for t in range(count):
        n, d, k = int(torch.randint(3, 25, (1,), generator=g)), int(torch.randint(2, 7, (1,), generator=g)), \
            int(torch.randint(2, 9, (1,), generator=g))
        x, y = _dataset(g, n=n, d=d, k=k, aligned=t % 3 == 0, **kw)
        w = torch.randn(d, k, generator=g, dtype=torch.float64) * float(torch.rand(1, generator=g) * 3)
        yield g, x, y, k, w


# ---------------------------------------------------------------------------------------- DP-SGD / sparse mean


def _dp_gd_charge(data: glm.LabeledCSR, clip: float, batch_size: int, estimator: str = "gaussian") -> float:
    res = sparse_mean.dp_gd(data, noise_multiplier=1.0, iterations=1, lr=0.0, clip=clip, batch_size=batch_size,
                            estimator=estimator, generator=torch.Generator().manual_seed(0), block_size=4,
                            l1_radius=1.0)
    (step, _), = res.ledger.runs
    return step.parts[0].sensitivity


def test_dp_gd_full_batch_mean_sensitivity_and_the_old_charge_fails():
    worst_new = worst_old = 0.0
    for g, x, y, k, w in _trials(0, 60, unit=False):
        clip = float(torch.rand(1, generator=g)) * 2 + 0.1
        data = _rows(x, y, k)
        charged = _dp_gd_charge(data, clip, 0)
        assert math.isclose(charged, 2 * clip / len(y))
        g_d, _ = sparse_mean.clipped_grad_mean(w, data, clip=clip, denominator=len(y))
        for x2, y2 in _neighbours(g, x, y, k):
            g_d2, _ = sparse_mean.clipped_grad_mean(w, _rows(x2, y2, k), clip=clip, denominator=len(y2))
            moved = float((g_d - g_d2).norm())
            worst_new = max(worst_new, moved / min(charged, 2 * clip / len(y2)))
            worst_old = max(worst_old, moved / (clip / len(y)))
    assert worst_new <= 1 + TOL
    assert worst_old > 1.5  # the old C / n is exceeded (all gradients aligned, z opposite: 2n / (n + 1))


def test_dp_gd_poisson_batches_fixed_denominator():
    worst = 0.0
    for g, x, y, k, w in _trials(1, 40, unit=False):
        clip, b = 1.3, 7
        big = _rows(torch.cat([x] * 10), torch.cat([y] * 10), k)  # n >= b: Poisson batches, denominator b
        charged = _dp_gd_charge(big, clip, b)
        assert math.isclose(charged, clip / b)
        g_d, _ = sparse_mean.clipped_grad_mean(w, _rows(x, y, k), clip=clip, denominator=b)  # z not sampled
        for x2, y2 in _neighbours(g, x, y, k):
            g_d2, _ = sparse_mean.clipped_grad_mean(w, _rows(x2, y2, k), clip=clip, denominator=b)
            worst = max(worst, float((g_d - g_d2).norm()) / charged)
    assert 0.9 < worst <= 1 + TOL  # tight: a clipped z moves the sum by C


def test_projection_and_l1_recovery_charge():
    g = torch.Generator().manual_seed(2)
    x, y = _dataset(g, n=12, d=3, k=3, unit=False, aligned=True)
    data = _rows(x, y, 3)
    gauss = _dp_gd_charge(data, 1.0, 0)
    assert _dp_gd_charge(data, 1.0, 0, "projection") == gauss  # the projection is post-processing
    rec = sparse_mean.BlockRecovery(9, block_size=4, ratio=0.5, generator=torch.Generator().manual_seed(0))
    assert math.isclose(_dp_gd_charge(data, 1.0, 0, "l1_recovery"), gauss * rec.op_norm)
    worst = 0.0
    for _, x, y, k, w in _trials(3, 30, unit=False):
        dk = x.shape[1] * k
        rec = sparse_mean.BlockRecovery(dk, block_size=4, ratio=0.5, generator=torch.Generator().manual_seed(0))
        amat = torch.block_diag(*(torch.from_numpy(a) for a in rec.mats))
        charged = 2 * 1.0 / len(y) * rec.op_norm
        m_d = amat @ sparse_mean.clipped_grad_mean(w, _rows(x, y, k), clip=1.0, denominator=len(y))[0].reshape(-1)
        for x2, y2 in _neighbours(g, x, y, k):
            g2 = sparse_mean.clipped_grad_mean(w, _rows(x2, y2, k), clip=1.0, denominator=len(y2))[0]
            worst = max(worst, float((m_d - amat @ g2.reshape(-1)).norm()) / charged)
    assert worst <= 1 + TOL


# --------------------------------------------------------------------------------------------- NumericSparse


def test_numeric_sparse_linf_sensitivity():
    worst_full = worst_old = worst_b = 0.0
    for g, x, y, k, w in _trials(4, 50, unit=False):
        clip, n = 0.7, len(y)
        data = _rows(x, y, k)
        res = numeric_sparse.numeric_sparse_erm(data, segment_epsilon=1.0, iterations=1, lr=0.0, clip=clip,
                                                batch_size=n, cutoff=2, threshold_scale=1.0, release_share=0.5,
                                                generator=torch.Generator().manual_seed(0))
        charged = res.info["sensitivity_linf"]
        assert math.isclose(charged, 2 * clip / n)
        u = numeric_sparse.linf_clipped_mean(w, data, clip=clip, denominator=n)
        u_b = numeric_sparse.linf_clipped_mean(w, data, clip=clip, denominator=5.0)
        for x2, y2 in _neighbours(g, x, y, k):
            d2 = _rows(x2, y2, k)
            moved = float(np.abs(u - numeric_sparse.linf_clipped_mean(w, d2, clip=clip, denominator=len(y2))).max())
            worst_full = max(worst_full, moved / min(charged, 2 * clip / len(y2)))
            worst_old = max(worst_old, moved / (clip / n))
            moved_b = np.abs(u_b - numeric_sparse.linf_clipped_mean(w, d2, clip=clip, denominator=5.0)).max()
            worst_b = max(worst_b, float(moved_b) / (clip / 5.0))
    assert worst_full <= 1 + TOL and worst_b <= 1 + TOL
    assert worst_old > 1.5


# ---------------------------------------------------------------------------------------------------- DP-AGD


def _agd_quantities(w, data, clip, c_obj, steps):
    """DP-AGD's noised quantities: the clipped gradient SUM and the NoisyMax candidates -omega."""
    _, r, _ = common.clipped_residuals(w, data, data.row_norms(2.0), clip)
    direction = torch.randn(w.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    omega = dp_agd.clipped_loss_sums(glm.logits(w, data), glm.logits(direction, data), data.y, steps, c_obj)
    return glm.weighted_grad_sum(data, r), -omega


def test_dp_agd_gradient_sum_and_monotone_noisy_max_queries():
    worst_g = worst_q = 0.0
    steps = torch.linspace(0.0, 3.0, 6, dtype=torch.float64)
    for g, x, y, k, w in _trials(5, 50, unit=False):
        clip, c_obj = 1.5, 2.0
        s_d, q_d = _agd_quantities(w, _rows(x, y, k), clip, c_obj, steps)
        for x2, y2 in _neighbours(g, x, y, k):
            s_d2, q_d2 = _agd_quantities(w, _rows(x2, y2, k), clip, c_obj, steps)
            worst_g = max(worst_g, float((s_d - s_d2).norm()) / clip)
            diff = (q_d2 - q_d) * (1 if len(y2) > len(y) else -1)  # adding lowers every candidate
            assert float(diff.max()) <= 1e-12 and float(diff.min()) >= -c_obj * (1 + TOL)
            worst_q = max(worst_q, float(-diff.min()) / c_obj)
    assert 0.9 < worst_g <= 1 + TOL and 0.5 < worst_q <= 1 + TOL


# ----------------------------------------------------------------------------------------------- Frank-Wolfe


def _fw_scaled_estimates(data, slots, ws, *, f1, eta):
    """m grad_t for t < T as private_frank_wolfe computes them on ``data`` (size m, own b1 and b), iterates ``ws``."""
    m, T = len(data), len(ws) - 1
    b1, b = f1 * m, (1 - f1) * m / (T - 1)
    out = [frank_wolfe._grad_mean(ws[0], data.rows(torch.nonzero(slots == 0)[:, 0]), b1)]
    for t in range(1, T):
        bt = data.rows(torch.nonzero(slots == t)[:, 0])
        out.append(frank_wolfe.vr_update(out[-1], ws[t], ws[t - 1], bt, denom=b, eta=eta))
    return [m * e for e in out]


def test_frank_wolfe_estimates_are_n_free_and_within_the_charge():
    """(n') grad_t(D') vs n grad_t(D), each with its own b1 = f n, b = (1 - f) n / (T - 1): within n s_t(n)."""
    T, r, eta, f1 = 5, 1.5, 0.3, 0.5
    worst = 0.0
    for g, x, y, k, _ in _trials(6, 25, unit=True):
        n, d = len(y), x.shape[1]
        s_hat = [n * s for s in frank_wolfe.sensitivities(iterations=T, n=n, eta=eta, radius=r,
                                                           first_batch_fraction=f1)]
        s_hat2 = [(n + 1) * s for s in frank_wolfe.sensitivities(iterations=T, n=n + 1, eta=eta, radius=r,
                                                                  first_batch_fraction=f1)]
        assert np.allclose(s_hat, s_hat2, rtol=1e-12)  # n-free: the noisy argmax is the same mechanism
        slot = torch.randint(0, T, (n,), generator=g)
        ws = [torch.zeros(d, k, dtype=torch.float64)]
        for _ in range(T):
            v = frank_wolfe.l1_ball_oracle(torch.randn(d, k, generator=g, dtype=torch.float64), radius=r)
            ws.append((1 - eta) * ws[-1] + eta * v)
        base = _fw_scaled_estimates(_rows(x, y, k), slot, ws, f1=f1, eta=eta)
        for x2, y2 in list(_neighbours(g, x, y, k))[:4]:  # the added z, in every slot
            for kz in range(T):
                other = _fw_scaled_estimates(_rows(x2, y2, k), torch.cat([slot, torch.tensor([kz])]), ws, f1=f1,
                                             eta=eta)
                for t in range(T):
                    worst = max(worst, float((base[t] - other[t]).abs().max()) / s_hat[t])
    assert 0.05 < worst <= 1 + TOL


def test_frank_wolfe_oracle_is_scale_invariant():
    grad = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for noise in ("laplace", "gumbel"):
        for seed in range(20):
            a = frank_wolfe.l1_ball_oracle(grad, radius=2.0, noise_scale=0.3, noise=noise,
                                           generator=torch.Generator().manual_seed(seed))
            b = frank_wolfe.l1_ball_oracle(grad / 1234.0, radius=2.0, noise_scale=0.3 / 1234.0, noise=noise,
                                           generator=torch.Generator().manual_seed(seed))
            assert torch.equal(a, b)


# --------------------------------------------------------------------------------------- output perturbation


def _op_charge_and_solution(x, y, k, lam, radius):
    return output_perturbation.solve_private(_rows(x, y, k), l2_reg=lam, radius=radius,
                                             lipschitz=glm.LIPSCHITZ_L2, smooth=glm.SMOOTH_L2, iterations=1)


def test_output_perturbation_sensitivity_with_solver_residual_and_the_old_charge_fails():
    worst_new = worst_old = 0.0
    for g, x, y, k, _ in _trials(7, 30, unit=True):
        lam = float(10 ** (torch.rand(1, generator=g) * 2 - 1))  # 0.1 .. 10
        radius = [1e9, 0.3, 2.0][int(torch.randint(0, 3, (1,), generator=g))]
        w_d, charged, _ = _op_charge_and_solution(x, y, k, lam, radius)
        for x2, y2 in _neighbours(g, x, y, k):
            w_d2, charged2, _ = _op_charge_and_solution(x2, y2, k, lam, radius)
            moved = float((w_d - w_d2).norm())
            worst_new = max(worst_new, moved / min(charged, charged2))
            worst_old = max(worst_old, moved / (glm.LIPSCHITZ_L2 / (lam * len(y))))
    # adversarial: identical unit rows with one label, x_z = -x with the same label, lambda >> H, many classes:
    # grad f_z(x*) and lambda x* = -mean grad f(x*) align, ||sum|| ~ 2 sqrt(1 - 1/K) > L = sqrt(2)
    # (D = 30 copies, D' = D + z; from D' the same pair is a removal)
    for lam, k in ((5.0, 8), (10.0, 15), (2.0, 4)):
        x = torch.nn.functional.normalize(torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64), dim=1).repeat(30, 1)
        y = torch.zeros(30, dtype=torch.long)
        w_d, charged, _ = _op_charge_and_solution(x, y, k, lam, 1e9)
        w_d2, charged2, _ = _op_charge_and_solution(torch.cat([x, -x[:1]]), torch.zeros(31, dtype=torch.long), k,
                                                    lam, 1e9)
        moved = float((w_d - w_d2).norm())
        worst_new = max(worst_new, moved / min(charged, charged2))
        worst_old = max(worst_old, moved / (glm.LIPSCHITZ_L2 / (lam * 31)))  # even charged at the larger n
    assert worst_new <= 1 + TOL
    assert worst_old > 1.25  # the old L / (lambda n) is exceeded (~1.3x here)


def test_output_perturbation_noise_uses_the_charge():
    g = torch.Generator().manual_seed(8)
    x, y = _dataset(g, n=10, d=4, k=3, unit=True, aligned=False)
    data = _rows(x, y, 3)
    res = output_perturbation.output_perturbation(data, epsilon=1.0, delta=1e-5, l2_reg=0.5, mechanism="gaussian",
                                                  sparsity=4, radius=0.0, generator=g)
    want = (glm.LIPSCHITZ_L2 + 0.5 * glm.LIPSCHITZ_L2 / 0.5) / (0.5 * 10) * 1.001
    assert math.isclose(res.info["sensitivity_l2"], want, rel_tol=1e-12)
    assert res.ledger.runs[0][0].parts[0].sensitivity == res.info["sensitivity_l2"]
    assert math.isclose(res.info["noise_std"], res.info["noise_multiplier"] * want)


def test_solver_residual_bound():
    """||x^ - x*|| <= 2 ||G|| / lambda at the stopping point, and k* iterations guarantee 2 tol / lambda."""
    g = torch.Generator().manual_seed(9)
    for t in range(6):
        x, y = _dataset(g, n=15, d=5, k=4, unit=True, aligned=False)
        data = _rows(x, y, 4)
        lam, radius = [0.05, 0.3][t % 2], [1e9, 1.0][t // 3]
        x_star, info = output_perturbation.solve_regularized(data, l2_reg=lam, radius=radius, iterations=20000,
                                                             tol=1e-13)
        assert info["grad_mapping_norm"] <= 1e-13
        for tol in (1e-2, 1e-4):
            w, i2 = output_perturbation.solve_regularized(data, l2_reg=lam, radius=radius, iterations=20000, tol=tol)
            assert float((w - x_star).norm()) <= 2 * i2["grad_mapping_norm"] / lam + 1e-11
            k_star = output_perturbation.guaranteed_iterations(tol=tol, lipschitz=glm.LIPSCHITZ_L2,
                                                               smooth=glm.SMOOTH_L2, l2_reg=lam, radius=radius)
            w_k, i3 = output_perturbation.solve_regularized(data, l2_reg=lam, radius=radius, iterations=k_star,
                                                            tol=0.0)
            assert i3["iterations"] == k_star and float((w_k - x_star).norm()) <= 2 * tol / lam
    try:  # rows beyond the Lipschitz constants' assumption are refused
        output_perturbation.solve_private(_rows(x * 3, y, 4), l2_reg=0.1, radius=1.0, lipschitz=glm.LIPSCHITZ_L2,
                                          smooth=glm.SMOOTH_L2, iterations=1)
        raise AssertionError("expected ValueError")
    except ValueError:
        pass
