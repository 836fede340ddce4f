"""Output perturbation with l_inf projection (Ghazi, Guzman, Kamath, Kumar & Manurangsi, poster "DP optimization
with sparse gradients"), and the regularised ERM solver shared with the non-private baseline.

    x*_lambda = argmin_{x in X} (1/N) sum_i f(x; z_i) + (lambda/2) ||x||_2^2,     X = {||x||_2 <= R}
    x~ = x*_lambda + xi,     x^ = argmin_{x in X} ||x - x~||_inf

Noise (f L-Lipschitz and H-smooth in L2, gradients s-sparse):
- ``gaussian``: N(0, sigma^2 I). The poster's sigma^2 = 8 L^2 ln(1.25/delta) / (lambda n eps)^2 is the classical
  Gaussian mechanism (valid for eps <= 1) on the replace-one L2 sensitivity 2L/(lambda n). We use the add/remove
  sensitivity L/(lambda N) (N public) and calibrate the noise multiplier with the accountant (any eps).
- ``laplace`` (pure eps-DP): Lap(b)^d with the poster's b = 2 sqrt(2 s) L / (lambda n eps) (2H/lambda + 1).

The l_inf projection onto the L2 ball is soft-thresholding: x^ = sign(x~) max(|x~| - t, 0) with the smallest t
>= 0 that brings ||x^||_2 <= R (every point within l_inf distance t of x~ has norm >= that of the soft-threshold,
so this t is the l_inf distance from x~ to X and x^ attains it).

Sensitivity needs the exact minimiser: the solver is accelerated projected gradient descent for the
(lambda + H)-smooth, lambda-strongly convex objective, run until the gradient-mapping norm is below ``tol``; the
leftover optimisation error (<= tol / lambda in L2) is reported in the result's info.
"""

from __future__ import annotations

import math

import torch

from widedp import accounting
from widedp.convex.common import ConvexResult, GaussianSpend, LaplaceSpend, gaussian, laplace, step
from widedp.models import glm


def project_l2(w: torch.Tensor, radius: float) -> torch.Tensor:
    nrm = float(w.norm())
    return w if nrm <= radius else w * (radius / nrm)


def solve_regularized(data: glm.SparseRows, *, l2_reg: float, radius: float = math.inf, iterations: int = 1000,
                      tol: float = 1e-7, smooth: float = glm.SMOOTH_L2) -> tuple[torch.Tensor, dict[str, float]]:
    """argmin over ||W|| <= radius of mean loss + (l2_reg/2)||W||^2: W [d, K] (float64 internally), and
    {"iterations", "grad_mapping_norm"}."""
    n = len(data)
    x64 = glm.SparseRows(data.x.to(torch.float64), data.xt.to(torch.float64), data.y, data.num_classes)
    lip = smooth + l2_reg
    kappa = lip / l2_reg
    beta = (math.sqrt(kappa) - 1.0) / (math.sqrt(kappa) + 1.0)
    w = torch.zeros(data.num_features, data.num_classes, dtype=torch.float64)
    y_pt = w
    gm = math.inf
    it = 0
    while it < iterations:
        it += 1
        _, r = glm.residuals(y_pt, x64)
        g = glm.weighted_grad_sum(x64, r) / n + l2_reg * y_pt
        w_new = project_l2(y_pt - g / lip, radius)
        gm = float((y_pt - w_new).norm()) * lip
        y_pt = w_new + beta * (w_new - w)
        w = w_new
        if gm < tol:
            break
    return w, {"iterations": it, "grad_mapping_norm": gm}


def linf_project_l2_ball(x: torch.Tensor, radius: float, *, iters: int = 100) -> torch.Tensor:
    """argmin_{||z||_2 <= radius} ||z - x||_inf (the soft-threshold of the module docstring), by bisection on t."""
    if float(x.norm()) <= radius:
        return x.clone()
    a = x.abs()
    lo, hi = 0.0, float(a.max())
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if float(torch.clamp(a - mid, min=0).norm()) > radius:
            lo = mid
        else:
            hi = mid
    return torch.sign(x) * torch.clamp(a - hi, min=0)


def poster_gaussian_sigma(*, lipschitz: float, l2_reg: float, n: int, epsilon: float, delta: float) -> float:
    """The poster's sigma = sqrt(8 L^2 ln(1.25/delta)) / (lambda n eps)."""
    return math.sqrt(8.0 * lipschitz**2 * math.log(1.25 / delta)) / (l2_reg * n * epsilon)


def poster_laplace_scale(*, lipschitz: float, smooth: float, sparsity: int, l2_reg: float, n: int,
                         epsilon: float) -> float:
    """The poster's b = 2 sqrt(2 s) L / (lambda n eps) * (2 H / lambda + 1)."""
    return 2.0 * math.sqrt(2.0 * sparsity) * lipschitz / (l2_reg * n * epsilon) * (2.0 * smooth / l2_reg + 1.0)


def output_perturbation(data: glm.SparseRows, *, epsilon: float, delta: float, l2_reg: float, mechanism: str,
                        sparsity: int, radius: float, generator: torch.Generator, solver_iterations: int = 1000,
                        accountant: str = "pld", lipschitz: float = glm.LIPSCHITZ_L2,
                        smooth: float = glm.SMOOTH_L2) -> ConvexResult:
    """Solve, perturb, project. ``radius`` <= 0: R = L / lambda (the smallest ball sure to hold x*_lambda)."""
    n = len(data)
    if radius <= 0:
        radius = lipschitz / l2_reg
    w_star, solve_info = solve_regularized(data, l2_reg=l2_reg, radius=radius, iterations=solver_iterations,
                                           smooth=smooth)
    ledger = accounting.Ledger()
    if mechanism == "gaussian":
        sens = lipschitz / (l2_reg * n)
        sigma_mult = accounting.calibrate_noise_multiplier(
            lambda s: step((GaussianSpend(s),)), steps=1, delta=delta, target_epsilon=epsilon,
            accountant=accountant)  # type: ignore[arg-type]
        std = sigma_mult * sens
        noisy = w_star + gaussian(w_star.shape, std, generator, torch.float64)
        ledger.add(step((GaussianSpend(sigma_mult, sens),)))
        extra = {"noise_multiplier": sigma_mult, "sensitivity_l2": sens, "noise_std": std,
                 "poster_sigma": poster_gaussian_sigma(lipschitz=lipschitz, l2_reg=l2_reg, n=n, epsilon=epsilon,
                                                       delta=delta)}
    else:
        b = poster_laplace_scale(lipschitz=lipschitz, smooth=smooth, sparsity=sparsity, l2_reg=l2_reg, n=n,
                                 epsilon=epsilon)
        noisy = w_star + laplace(w_star.shape, b, generator)
        ledger.add(step((LaplaceSpend(epsilon),)))
        extra = {"laplace_scale": b, "noise_std": b * math.sqrt(2.0), "sparsity": sparsity}
    w = linf_project_l2_ball(noisy, radius)
    info = {**solve_info, **extra, "radius": radius, "nonzero_share": float((w != 0).double().mean()),
            "optimisation_error_bound": solve_info["grad_mapping_norm"] / l2_reg,
            "w_star_norm": float(w_star.norm()), "noise_norm": float((noisy - w_star).norm())}
    return ConvexResult(w.to(data.x.values().dtype), ledger, solve_info["iterations"], info)
