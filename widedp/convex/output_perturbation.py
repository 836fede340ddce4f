"""Output perturbation with l_inf projection (Ghazi, Guzman, Kamath, Kumar & Manurangsi, poster "DP optimization
with sparse gradients"), and the regularised ERM solver shared with the non-private baseline.

    x*(D) = argmin_{x in X} F_D(x),  F_D = (1/n) sum_{i in D} f(x; z_i) + (lambda/2) ||x||_2^2,  X = {||x||_2 <= R}
    x~ = x^(D) + xi,     x_out = argmin_{x in X} ||x - x~||_inf          (x^(D): the solver's x*(D), see below)

Sensitivity (add/remove one example; n = |D| is the dataset's own size, so the denominator changes too; f is
L-Lipschitz in L2: L = sqrt(2) for rows with ||x||_2 <= 1, checked by ``glm.check_row_norms``). Adding z to D
(n -> n + 1): (n + 1) F_D' = n F_D + g with g = f(.; z) + (lambda/2)||.||^2, and (n + 1) F_D' is
(n + 1) lambda-strongly convex; with the optimality of x*(D) for n F_D over X and of x*(D') for (n + 1) F_D',
    (n + 1) lambda ||x*(D) - x*(D')||^2 <= <grad g(x*(D)), x*(D) - x*(D')>,
so ||x*(D) - x*(D')|| <= (L + lambda ||x*(D)||) / ((n + 1) lambda); removing z from D gives the same with n for
n + 1. ||x*|| <= R' = min(R, L / lambda) (the unconstrained minimiser has lambda x* = -mean grad f), hence
    Delta_exact = (L + lambda R') / (lambda n)      (the old L / (lambda n) is short by the factor 1 + lambda R' / L:
                                                     up to 2x with R = L / lambda; 1.035x for lambda 0.01, R = 5).
Solver residual: accelerated projected gradient (V-FISTA, Beck 2017 Thm. 10.42) on the (H + lambda)-smooth,
lambda-strongly convex F, stopped at the first iterate whose gradient mapping G (at the extrapolated point y,
x^ = P_X(y - grad F(y) / (H + lambda)), G = (H + lambda)(y - x^)) has ||G|| <= tol, or after k* iterations.
Either way ||x^ - x*|| <= e = 2 tol / lambda: from the projection's and x*'s optimality conditions,
lambda ||x^ - x*||^2 <= <G + grad F(x^) - grad F(y), x^ - x*> <= 2 ||G|| ||x^ - x*||; and k* is the
data-independent count with ||x_k - x*||^2 <= (2 / lambda)(1 - 1/sqrt(kappa))^k (L R' + lambda R'^2 / 2) <= e^2
(F(0) - F* <= ||grad F(0)|| ||x*|| <= L R'). So the released x^ has L2 sensitivity
    Delta = Delta_exact + 2 e,   with tol = 1e-3 lambda Delta_exact / 4 (the residual adds 0.1%)
(floating-point error of the float64 solver, ~1e-14, is neglected).

Noise:
- ``gaussian``: N(0, (sigma Delta)^2 I), sigma calibrated with the accountant (any eps). (The poster's
  sigma^2 = 8 L^2 ln(1.25/delta) / (lambda n eps)^2 is the classical Gaussian mechanism, eps <= 1, on the
  replace-one 2L / (lambda n).)
- ``laplace`` (pure eps-DP): Lap(b)^p, p = d K coordinates, b = sqrt(p) Delta / eps from the certified l1
  sensitivity ||.||_1 <= sqrt(p) ||.||_2. The poster's b = 2 sqrt(2 s) L / (lambda n eps) (2H/lambda + 1) rests on
  an l1 bound for x* we could not verify (x*(D) - x*(D') is not sparse); it is reported as ``poster_laplace_scale``
  only (at our sizes it is larger than the certified scale anyway).

The l_inf projection onto the L2 ball is soft-thresholding: x_out = sign(x~) max(|x~| - t, 0) with the smallest
t >= 0 that brings ||x_out||_2 <= R (every point within l_inf distance t of x~ has norm >= that of the
soft-threshold, so this t is the l_inf distance from x~ to X and x_out attains it); post-processing.
"""

from __future__ import annotations

import math

import torch

from widedp import accounting
from widedp.convex.common import ConvexResult, GaussianSpend, gaussian, laplace, step
from widedp.dp.spend import ExponentialSpend
from widedp.models import glm


def project_l2(w: torch.Tensor, radius: float) -> torch.Tensor:
    nrm = float(w.norm())
    return w if nrm <= radius else w * (radius / nrm)


def solve_regularized(data: glm.LabeledCSR, *, l2_reg: float, radius: float = math.inf, iterations: int = 1000,
                      tol: float = 1e-7, smooth: float = glm.SMOOTH_L2) -> tuple[torch.Tensor, dict[str, float]]:
    """argmin over ||W|| <= radius of mean loss + (l2_reg/2)||W||^2 by V-FISTA: W [d, K] (float64 internally), and
    {"iterations", "grad_mapping_norm"}; stops when the gradient mapping norm is <= tol or after ``iterations``."""
    n = len(data)
    x64 = glm.LabeledCSR(data.x.to(torch.float64), data.xt.to(torch.float64), data.y, data.num_classes)
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
        if gm <= tol:
            break
    return w, {"iterations": it, "grad_mapping_norm": gm}


def exact_sensitivity(*, lipschitz: float, l2_reg: float, n: int, radius: float) -> float:
    """(L + lambda R') / (lambda n), R' = min(R, L / lambda): add/remove L2 sensitivity of the exact x*."""
    return (lipschitz + l2_reg * min(radius, lipschitz / l2_reg)) / (l2_reg * n)


def guaranteed_iterations(*, tol: float, lipschitz: float, smooth: float, l2_reg: float, radius: float) -> int:
    """k*: V-FISTA iterations after which ||x_k - x*|| <= 2 tol / lambda whatever the data (module docstring)."""
    r_eff = min(radius, lipschitz / l2_reg)
    b0 = lipschitz * r_eff + 0.5 * l2_reg * r_eff**2
    rate = 1.0 - 1.0 / math.sqrt((smooth + l2_reg) / l2_reg)
    target = 2.0 * tol**2 / (l2_reg * b0)
    return 0 if target >= 1.0 else math.ceil(math.log(target) / math.log(rate))


def solve_private(data: glm.LabeledCSR, *, l2_reg: float, radius: float, lipschitz: float, smooth: float,
                  iterations: int) -> tuple[torch.Tensor, float, dict[str, float]]:
    """The solver as output perturbation runs it: (x^, the charged L2 sensitivity Delta, info); Delta covers
    x^(D) vs x^(D') for D' = D +- one example, the solver residual included (module docstring)."""
    glm.check_row_norms(data, p=2.0)
    n = len(data)
    exact = exact_sensitivity(lipschitz=lipschitz, l2_reg=l2_reg, n=n, radius=radius)
    tol = 1e-3 * l2_reg * exact / 4.0
    k_star = guaranteed_iterations(tol=tol, lipschitz=lipschitz, smooth=smooth, l2_reg=l2_reg, radius=radius)
    w, info = solve_regularized(data, l2_reg=l2_reg, radius=radius, iterations=max(iterations, k_star), tol=tol,
                                smooth=smooth)
    residual = 2.0 * tol / l2_reg
    return w, exact + 2.0 * residual, {**info, "tol": tol, "guaranteed_iterations": k_star,
                                       "sensitivity_exact": exact, "residual_bound": residual}


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
    """The poster's b = 2 sqrt(2 s) L / (lambda n eps) * (2 H / lambda + 1) (reference only: not verified)."""
    return 2.0 * math.sqrt(2.0 * sparsity) * lipschitz / (l2_reg * n * epsilon) * (2.0 * smooth / l2_reg + 1.0)


def output_perturbation(data: glm.LabeledCSR, *, epsilon: float, delta: float, l2_reg: float, mechanism: str,
                        sparsity: int, radius: float, generator: torch.Generator, solver_iterations: int = 1000,
                        accountant: str = "pld", lipschitz: float = glm.LIPSCHITZ_L2,
                        smooth: float = glm.SMOOTH_L2) -> ConvexResult:
    """Solve, perturb, project. ``radius`` <= 0: R = L / lambda (the smallest ball sure to hold x*_lambda)."""
    n = len(data)
    if radius <= 0:
        radius = lipschitz / l2_reg
    w_star, sens, solve_info = solve_private(data, l2_reg=l2_reg, radius=radius, lipschitz=lipschitz,
                                             smooth=smooth, iterations=solver_iterations)
    ledger = accounting.Ledger()
    if mechanism == "gaussian":
        sigma_mult = accounting.calibrate_noise_multiplier(
            lambda s: step((GaussianSpend(s),)), steps=1, delta=delta, target_epsilon=epsilon,
            accountant=accountant)  # type: ignore[arg-type]
        std = sigma_mult * sens
        noisy = w_star + gaussian(w_star.shape, std, generator, torch.float64)
        ledger.add(step((GaussianSpend(sigma_mult, sens),)))
        extra = {"noise_multiplier": sigma_mult, "noise_std": std,
                 "poster_sigma": poster_gaussian_sigma(lipschitz=lipschitz, l2_reg=l2_reg, n=n, epsilon=epsilon,
                                                       delta=delta)}
    else:
        sens_l1 = math.sqrt(w_star.numel()) * sens
        b = sens_l1 / epsilon
        noisy = w_star + laplace(w_star.shape, b, generator)
        ledger.add(step((ExponentialSpend(epsilon, 1, bounded_range=False),)))
        extra = {"laplace_scale": b, "noise_std": b * math.sqrt(2.0), "sensitivity_l1": sens_l1,
                 "poster_laplace_scale": poster_laplace_scale(lipschitz=lipschitz, smooth=smooth, sparsity=sparsity,
                                                              l2_reg=l2_reg, n=n, epsilon=epsilon),
                 "sparsity": sparsity}
    w = linf_project_l2_ball(noisy, radius)
    info = {**solve_info, **extra, "sensitivity_l2": sens, "radius": radius,
            "nonzero_share": float((w != 0).double().mean())}
    return ConvexResult(w.to(data.x.values().dtype), ledger, solve_info["iterations"], info)
