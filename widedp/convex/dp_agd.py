"""DP-AGD (Lee & Kifer 2018): full-batch gradient descent under a zCDP budget with adaptive per-iteration budget.

Per iteration t, with remaining budget rho:
  1. g = sum_i clip_C(grad_i) (C = ``clip``, L2 sensitivity C under add/remove); g~ = g + N(0, C^2 / (2 rho_ng) I)
     (rho_ng-zCDP); direction d = g~ / ||g~||.
  2. NoisyMax over Omega = {-sum_i min(loss_i(w - a d), C_obj) : a in Phi}, Phi = {0, a_max/M, ..., a_max}, with
     Lap(C_obj / eps_nmax) noise, eps_nmax = sqrt(2 rho_nmax) (eps-DP, hence eps^2/2 = rho_nmax-zCDP).
  3. If a step a > 0 wins: w <- w - a d. If a = 0 wins (the noisy direction does not help): rho_ng <- (1 + gamma)
     rho_ng, measure the SAME g again with the budget increment and average (GradAvg; the average has the noise of
     one rho_ng measurement), then NoisyMax again. The larger rho_ng is kept for later iterations.
  4. Every ``step_window`` (tau) iterations, a_max <- (1 + gamma) max(steps chosen in the window).
The run stops when the remaining budget cannot pay for the next measurement; a last iteration that cannot pay
the full rho_ng + rho_nmax spends exactly what is left, split in the same proportion.

Deviations from the slides (see the report in docs/results.md): GradAvg averages the UNnormalised noisy gradient
(the slides average the already-normalised g~ with a fresh unnormalised measurement, which is not the stated
estimator); the slides' "NoisyMax is eps/2-zCDP" is eps^2/2 (their Lemma 3.7); budget is never overdrawn (the
slides subtract first and test rho > 0 afterwards). NoisyMax with Lap(Delta/eps) is eps-DP here because the
candidates' clipped loss sums move in the same direction (each by [0, C_obj]) when a sample is added or removed.

Sensitivities (add/remove one example; no denominator anywhere, so the dataset's size plays no part):
- the gradient SUM g = sum_i clip_C(grad_i): D and D' differ by one term of norm <= C, so L2 sensitivity C (the
  direction g~ / ||g~|| is post-processing). Noise C / sqrt(2 rho) is rho-zCDP (Bun & Steinke Prop. 1.6).
- the NoisyMax candidates -omega_a = -sum_i min(loss_i(w - a d), C_obj): cross-entropy is >= 0, so adding z
  lowers EVERY candidate by min(loss_z, C_obj) in [0, C_obj] (removing raises every one): monotone queries of
  sensitivity C_obj, for which report-noisy-max with Lap(C_obj / eps) is eps-DP, hence eps^2/2-zCDP.

Privacy: the budgets rho_ng, rho_nmax are chosen ADAPTIVELY (GradAvg, the last iteration), so the guarantee is
a privacy filter: the run never lets the spent sum of rho's exceed the budget rho fixed in advance, so at every
order alpha the Renyi filter of Feldman & Zrnic (2021) bounds the whole run by alpha rho: rho-zCDP, i.e. (rho + 2
sqrt(rho log 1/delta), delta)-DP. That is the headline epsilon (``common.zcdp_epsilon`` of the BUDGET rho;
``rho_spent`` <= rho is data-dependent and not itself a guarantee). The ledger records every Gaussian
measurement as ``ZCDPGaussianSpend(rho)`` and every NoisyMax as ``ExponentialSpend(eps, 1, bounded_range=False)``
(pure), all full-batch; composing THOSE with the PLD/RDP accountants treats adaptively chosen budgets as fixed,
which no theorem covers for these mechanisms, so such figures are not reported as guarantees.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from widedp import accounting
from widedp.convex.common import (
    Callback,
    ConvexResult,
    ZCDPGaussianSpend,
    clipped_residuals,
    gaussian,
    laplace,
    step,
)
from widedp.dp.spend import ExponentialSpend
from widedp.models import glm


def noisy_max(values: torch.Tensor, *, sensitivity: float, epsilon: float, generator: torch.Generator,
              monotone: bool = True) -> int:
    """Report noisy max: argmax_j values_j + Lap(b), b = sensitivity / epsilon (monotone queries: all move the
    same way between neighbours) or 2 sensitivity / epsilon (general); epsilon-DP either way."""
    scale = (1.0 if monotone else 2.0) * sensitivity / epsilon
    return int(torch.argmax(values.double() + laplace(values.shape, scale, generator)))


def grad_avg(g_noisy: torch.Tensor, g: torch.Tensor, *, rho_old: float, rho_new: float, clip: float,
             generator: torch.Generator) -> torch.Tensor:
    """GradAvg: a fresh measurement of g with budget rho_new - rho_old, averaged with the rho_old one by budget
    weights; the result has noise variance clip^2 / (2 rho_new) per coordinate (as one rho_new measurement)."""
    inc = rho_new - rho_old
    g2 = g + gaussian(g.shape, clip / math.sqrt(2.0 * inc), generator, g.dtype)
    return (rho_old * g_noisy + inc * g2) / rho_new


def clipped_loss_sums(z0: torch.Tensor, dz: torch.Tensor, y: torch.Tensor, steps: torch.Tensor, loss_clip: float
                      ) -> torch.Tensor:
    """[M+1] sum_i min(loss_i(w - a d), C_obj) for each step a, from z0 = X w and dz = X d ([n, K] each)."""
    out = torch.empty(len(steps), dtype=torch.float64)
    for j, a in enumerate(steps.tolist()):
        z = z0 - a * dz
        loss = torch.logsumexp(z, 1) - z.gather(1, y[:, None])[:, 0]
        out[j] = loss.clamp(max=loss_clip).double().sum()
    return out


def dp_agd(data: glm.LabeledCSR, *, rho: float, nominal_iterations: int, clip: float, loss_clip: float,
           nmax_share: float, gamma: float, step_candidates: int, step_max: float, step_window: int,
           generator: torch.Generator, callback: Callback | None = None, log_every: int = 10,
           max_iterations: int = 100_000) -> ConvexResult:
    """Run DP-AGD on ``data`` within ``rho``-zCDP; W starts at zero. Returns weights [d, K] and the ledger."""
    d, k = data.num_features, data.num_classes
    dtype = data.x.values().dtype
    x_norms = data.row_norms(2.0)
    w = torch.zeros(d, k, dtype=dtype)
    rho_ng = (1.0 - nmax_share) * rho / nominal_iterations
    rho_nmax = nmax_share * rho / nominal_iterations
    remaining = rho
    ledger = accounting.Ledger()
    chosen: list[float] = []
    window: list[float] = []
    stats = {"gradavg": 0, "iterations": 0, "rho_spent": 0.0}
    tiny = 1e-12 * rho

    def spend_gauss(r: float) -> None:
        nonlocal remaining
        remaining -= r
        stats["rho_spent"] += r
        ledger.add(step((ZCDPGaussianSpend(r),)))

    def spend_nmax(r: float) -> float:
        nonlocal remaining
        remaining -= r
        stats["rho_spent"] += r
        eps = math.sqrt(2.0 * r)
        ledger.add(step((ExponentialSpend(eps, 1, bounded_range=False),)))
        return eps

    t = 0
    while remaining > tiny and t < max_iterations:
        r_ng, r_nm = rho_ng, rho_nmax
        if remaining < r_ng + r_nm:  # last iteration: spend exactly what is left, same proportion
            scale = remaining / (r_ng + r_nm)
            r_ng, r_nm = r_ng * scale, r_nm * scale
        _, r, _ = clipped_residuals(w, data, x_norms, clip)
        g = glm.weighted_grad_sum(data, r)
        g_noisy = g + gaussian(g.shape, clip / math.sqrt(2.0 * r_ng), generator, dtype)
        spend_gauss(r_ng)
        z0 = glm.logits(w, data)
        while True:
            if remaining < r_nm - tiny:
                break
            direction = g_noisy / g_noisy.norm().clamp_min(1e-30)
            dz = glm.logits(direction, data)
            steps = torch.linspace(0.0, step_max, step_candidates + 1, dtype=torch.float64)
            omega = clipped_loss_sums(z0, dz, data.y, steps, loss_clip)
            eps_nm = spend_nmax(min(r_nm, remaining))
            i = noisy_max(-omega, sensitivity=loss_clip, epsilon=eps_nm, generator=generator)
            if i > 0:
                a = float(steps[i])
                w = w - a * direction
                chosen.append(a)
                window.append(a)
                break
            # no step helps: more budget for this and later gradients, measure again and average (GradAvg)
            r_new = (1.0 + gamma) * r_ng
            inc = r_new - r_ng
            if remaining < inc + r_nm - tiny:
                remaining = 0.0 if remaining < r_nm else remaining
                break
            g_noisy = grad_avg(g_noisy, g, rho_old=r_ng, rho_new=r_new, clip=clip, generator=generator)
            spend_gauss(inc)
            r_ng = r_new
            rho_ng = max(rho_ng, r_new)
            stats["gradavg"] += 1
        t += 1
        if len(window) >= step_window:
            step_max = (1.0 + gamma) * max(window)
            window = []
        if callback is not None and (t % log_every == 0 or remaining <= tiny):
            callback(t, w, {"rho_remaining": max(remaining, 0.0), "step_max": step_max,
                            "rho_ng": rho_ng, "last_step": chosen[-1] if chosen else 0.0})
    stats["iterations"] = t
    info: dict[str, Any] = {**stats, "rho": rho, "steps_taken": len(chosen),
                            "mean_step": sum(chosen) / len(chosen) if chosen else 0.0, "final_rho_ng": rho_ng,
                            "final_step_max": step_max}
    return ConvexResult(w, ledger, t, info)
