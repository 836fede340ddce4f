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
from dataclasses import dataclass, field
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


@dataclass
class _Budget:
    """DP-AGD's zCDP budget: what is left, what was spent, the ledger of every measurement, the GradAvg count."""

    remaining: float
    ledger: accounting.Ledger = field(default_factory=accounting.Ledger)
    spent: float = 0.0
    gradavg: int = 0

    def spend_gauss(self, r: float) -> None:
        """A Gaussian measurement of the gradient sum at ``r``-zCDP."""
        self.remaining -= r
        self.spent += r
        self.ledger.add(step((ZCDPGaussianSpend(r),)))

    def spend_nmax(self, r: float) -> float:
        """A NoisyMax at ``r``-zCDP; returns its pure epsilon sqrt(2 r)."""
        self.remaining -= r
        self.spent += r
        eps = math.sqrt(2.0 * r)
        self.ledger.add(step((ExponentialSpend(eps, 1, bounded_range=False),)))
        return eps


@dataclass(frozen=True)
class _Search:
    """The fixed parameters of one iteration's step search (NoisyMax, GradAvg)."""

    clip: float
    loss_clip: float
    gamma: float
    step_candidates: int
    tiny: float
    generator: torch.Generator


def _choose_step(data: glm.LabeledCSR, w: torch.Tensor, g: torch.Tensor, g_noisy: torch.Tensor, *, r_ng: float,
                 r_nm: float, rho_ng: float, step_max: float, budget: _Budget, p: _Search
                 ) -> tuple[float, torch.Tensor | None, float]:
    """Steps 2-3 of an iteration: NoisyMax over the step candidates along g_noisy's direction, GradAvg with a
    larger budget while the zero step wins. Returns (the step, its direction, rho_ng); (0.0, None, rho_ng) when the
    budget ran out before a step > 0 won."""
    z0 = glm.logits(w, data)
    while True:
        if budget.remaining < r_nm - p.tiny:
            break
        direction = g_noisy / g_noisy.norm().clamp_min(1e-30)
        dz = glm.logits(direction, data)
        steps = torch.linspace(0.0, step_max, p.step_candidates + 1, dtype=torch.float64)
        omega = clipped_loss_sums(z0, dz, data.y, steps, p.loss_clip)
        eps_nm = budget.spend_nmax(min(r_nm, budget.remaining))
        i = noisy_max(-omega, sensitivity=p.loss_clip, epsilon=eps_nm, generator=p.generator)
        if i > 0:
            return float(steps[i]), direction, rho_ng
        # no step helps: more budget for this and later gradients, measure again and average (GradAvg)
        r_new = (1.0 + p.gamma) * r_ng
        inc = r_new - r_ng
        if budget.remaining < inc + r_nm - p.tiny:
            budget.remaining = 0.0 if budget.remaining < r_nm else budget.remaining
            break
        g_noisy = grad_avg(g_noisy, g, rho_old=r_ng, rho_new=r_new, clip=p.clip, generator=p.generator)
        budget.spend_gauss(inc)
        r_ng = r_new
        rho_ng = max(rho_ng, r_new)
        budget.gradavg += 1
    return 0.0, None, rho_ng


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
    budget = _Budget(rho)
    chosen: list[float] = []
    window: list[float] = []
    tiny = 1e-12 * rho
    search = _Search(clip=clip, loss_clip=loss_clip, gamma=gamma, step_candidates=step_candidates, tiny=tiny,
                     generator=generator)
    t = 0
    while budget.remaining > tiny and t < max_iterations:
        r_ng, r_nm = rho_ng, rho_nmax
        if budget.remaining < r_ng + r_nm:  # last iteration: spend exactly what is left, same proportion
            scale = budget.remaining / (r_ng + r_nm)
            r_ng, r_nm = r_ng * scale, r_nm * scale
        _, r, _ = clipped_residuals(w, data, x_norms, clip)
        g = glm.weighted_grad_sum(data, r)
        g_noisy = g + gaussian(g.shape, clip / math.sqrt(2.0 * r_ng), generator, dtype)
        budget.spend_gauss(r_ng)
        a, direction, rho_ng = _choose_step(data, w, g, g_noisy, r_ng=r_ng, r_nm=r_nm, rho_ng=rho_ng,
                                            step_max=step_max, budget=budget, p=search)
        if direction is not None:
            w = w - a * direction
            chosen.append(a)
            window.append(a)
        t += 1
        if len(window) >= step_window:
            step_max = (1.0 + gamma) * max(window)
            window = []
        if callback is not None and (t % log_every == 0 or budget.remaining <= tiny):
            callback(t, w, {"rho_remaining": max(budget.remaining, 0.0), "step_max": step_max,
                            "rho_ng": rho_ng, "last_step": chosen[-1] if chosen else 0.0})
    info: dict[str, Any] = {"gradavg": budget.gradavg, "iterations": t, "rho_spent": budget.spent, "rho": rho,
                            "steps_taken": len(chosen), "mean_step": sum(chosen) / len(chosen) if chosen else 0.0,
                            "final_rho_ng": rho_ng, "final_step_max": step_max}
    return ConvexResult(w, budget.ledger, t, info)
