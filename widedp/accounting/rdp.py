"""RDP accountant (the cross-check): per-mechanism RDP curves, joint composition inside a step, Poisson
subsampling once per step, composition over steps, conversion to (epsilon, delta).

Curves at order alpha > 1 (privacy.md §3):

- Gaussian (noise multiplier sigma relative to its sensitivity): alpha / (2 sigma^2); the gradient noise and a
  Gaussian selection (contribution thresholding) on the same batch fold into one, sigma_eff^-2 = sum sigma_i^-2.
- Exponential mechanism, per pick, bounded range (Cesar & Rogers 2021): min(eps, alpha eps^2 / 8).
- Pure eps-DP (SVT segments, Laplace releases, exponential without bounded range): min(eps, D_alpha(RR_eps)).

A step's curve is the SUM over its parts (composition on the same batch), then Poisson(q) subsampling is applied
ONCE with the general bound of Zhu & Wang 2019 (Thm. 9; integer alpha >= 2; we also take the min with the
unsubsampled curve, valid by quasi-convexity of the Renyi divergence). When the step's only cost is continuous
Gaussian noise (a Gaussian selection folded in) the exact sampled-Gaussian RDP is used (Mironov et al. 2019;
``sampled_gaussian_rdp``, a port of Opacus' ``compute_rdp`` tested against it) at Opacus' default orders. A step with
discrete Gaussian noise (``dp.noise: secure``, ``Costs.discrete``) always takes the general bound: only its
unsubsampled curve alpha / (2 sigma_eff^2) is known (Canonne, Kamath & Steinke 2020), not its subsampled RDP.
RDP -> (eps, delta): eps = min_alpha [eps(alpha) + ln((alpha-1)/alpha) - (ln delta + ln alpha)/(alpha-1)]
(Balle et al. 2020; what Opacus' ``get_privacy_spent`` computes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from scipy.special import binom, gammaln, log_ndtr, logsumexp

from widedp.accounting.base import Accountant
from widedp.accounting.parts import Costs

#: Orders for steps whose only cost is Gaussian noise (Opacus' default grid, ``RDPAccountant.DEFAULT_ALPHAS``).
OPACUS_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)])
#: Orders for everything else (the general subsampling bound needs integer alpha >= 2).
INTEGER_ORDERS: tuple[float, ...] = tuple(float(a) for a in [*range(2, 257), 512, 1024])


def gaussian_rdp(sigma: float, alpha: np.ndarray) -> np.ndarray:
    return np.asarray(alpha, float) / (2.0 * sigma**2)


def bounded_range_rdp(eps: float, alpha: np.ndarray) -> np.ndarray:
    """One eps-bounded-range mechanism (e.g. one exponential-mechanism pick): min(eps, alpha eps^2 / 8)."""
    return np.minimum(eps, np.asarray(alpha, float) * eps**2 / 8.0)


def pure_dp_rdp(eps: float, alpha: np.ndarray) -> np.ndarray:
    """One pure eps-DP mechanism: min(eps, D_alpha(RR_eps)), the randomized-response divergence (tight)."""
    a = np.asarray(alpha, float)
    lp = -np.logaddexp(0.0, -eps)  # ln p, p = e^eps / (1 + e^eps)
    l1p = -np.logaddexp(0.0, eps)  # ln (1 - p)
    d = np.logaddexp(a * lp + (1 - a) * l1p, a * l1p + (1 - a) * lp) / (a - 1)
    return np.minimum(eps, d)


def mechanism_rdp(costs: Costs, alpha: np.ndarray) -> np.ndarray:
    """RDP curve of one step BEFORE subsampling: the sum of its parts' curves."""
    a = np.asarray(alpha, float)
    out = np.zeros_like(a)
    if costs.joint_sigma is not None:  # the gradient noise and any Gaussian selection, folded (parts.py)
        out += gaussian_rdp(costs.joint_sigma, a)
    for eps, n in costs.bounded_range:
        out += n * bounded_range_rdp(eps, a)
    for eps, n in costs.pure:
        out += n * pure_dp_rdp(eps, a)
    return out


def sampled_gaussian_rdp(q: float, sigma: float, alpha: float) -> float:
    """Exact RDP of the Poisson-subsampled Gaussian (Mironov, Talwar & Zhang 2019, Sec. 3.3) at one order.

    A port of ``opacus.accountants.analysis.rdp._compute_rdp`` (same series, same stopping rule) so that the
    accountant does not import torch; tests check it against Opacus.
    """
    if q == 0:
        return 0.0
    if q == 1.0:
        return alpha / (2 * sigma**2)
    if float(alpha).is_integer():
        a = int(alpha)
        i = np.arange(a + 1)
        log_binom = gammaln(a + 1) - gammaln(i + 1) - gammaln(a - i + 1)
        log_a = logsumexp(log_binom + i * math.log(q) + (a - i) * math.log1p(-q) + (i * i - i) / (2 * sigma**2))
        return float(log_a) / (alpha - 1)
    # Fractional order: two series over the halves (-inf, z0] and [z0, inf) (Opacus' _compute_log_a_for_frac_alpha).
    log_a0, log_a1 = -math.inf, -math.inf
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    i = 0
    while True:
        coef = binom(alpha, i)
        log_coef = math.log(abs(coef))
        j = alpha - i
        log_t0 = log_coef + i * math.log(q) + j * math.log(1 - q)
        log_t1 = log_coef + j * math.log(q) + i * math.log(1 - q)
        log_e0 = log_ndtr((z0 - i) / sigma)  # = log(erfc((i - z0) / (sqrt(2) sigma)) / 2)
        log_e1 = log_ndtr((j - z0) / sigma)
        log_s0 = log_t0 + (i * i - i) / (2 * sigma**2) + log_e0
        log_s1 = log_t1 + (j * j - j) / (2 * sigma**2) + log_e1
        if coef > 0:
            log_a0, log_a1 = np.logaddexp(log_a0, log_s0), np.logaddexp(log_a1, log_s1)
        else:
            log_a0, log_a1 = _log_sub(log_a0, log_s0), _log_sub(log_a1, log_s1)
        i += 1
        if max(log_s0, log_s1) < -30:
            break
    return float(np.logaddexp(log_a0, log_a1)) / (alpha - 1)


def _log_sub(x: float, y: float) -> float:
    """log(e^x - e^y) for x >= y (-inf when equal), as Opacus' _log_sub."""
    if y == -math.inf:
        return x
    if x == y:
        return -math.inf
    try:
        return math.log(math.expm1(x - y)) + y
    except OverflowError:
        return x


def zhu_wang_subsampled_rdp(curve: np.ndarray, q: float, orders: Sequence[float]) -> np.ndarray:
    """Zhu & Wang 2019's general upper bound for Poisson(q) subsampling at integer orders.

    Args:
        curve: [L+1] with curve[l] = eps(l) of the unsubsampled mechanism for l = 0..L (entries 0, 1 unused),
            L >= max(orders).
        orders: integer orders >= 2.
    Returns: [len(orders)] subsampled RDP, min'd with the unsubsampled curve.
    """
    out = np.empty(len(orders))
    if q >= 1.0:
        for i, a in enumerate(orders):
            out[i] = curve[int(a)]
        return out
    lq, l1q = math.log(q), math.log1p(-q)
    for i, a_f in enumerate(orders):
        a = int(a_f)
        if a != a_f or a < 2:
            raise ValueError(f"Zhu-Wang bound needs integer orders >= 2, got {a_f}")
        first = (a - 1) * l1q + math.log1p((a - 1) * q)
        second = gammaln(a + 1) - gammaln(3) - gammaln(a - 1) + 2 * lq + (a - 2) * l1q + curve[2]
        terms = [first, second]
        if a >= 3:
            ls = np.arange(3, a + 1)
            rest = (
                math.log(3.0) + gammaln(a + 1) - gammaln(ls + 1) - gammaln(a - ls + 1)
                + (a - ls) * l1q + ls * lq + (ls - 1) * curve[ls]
            )
            terms.append(float(logsumexp(rest)))
        out[i] = min(float(logsumexp(terms)) / (a - 1), float(curve[a]))
    return out


@lru_cache(maxsize=256)
def step_rdp(costs: Costs, orders: tuple[float, ...]) -> np.ndarray:
    """Per-step (subsampled) RDP of ``costs`` at ``orders``. Returns [len(orders)] (read-only)."""
    if costs.is_free:
        out = np.zeros(len(orders))
    elif costs.exact_gaussian:  # exactly one subsampled continuous Gaussian (Gaussian selections folded in)
        out = np.array([sampled_gaussian_rdp(costs.q, costs.joint_sigma, a) for a in orders])
    else:
        top = int(max(orders))
        curve = mechanism_rdp(costs, np.arange(top + 1, dtype=float).clip(min=2.0))
        out = zhu_wang_subsampled_rdp(curve, costs.q, orders)
    out.setflags(write=False)
    return out


def orders_for(costs: Sequence[Costs]) -> tuple[float, ...]:
    """Opacus' grid when every step is continuous-Gaussian-only (or free), else the integer grid."""
    return OPACUS_ORDERS if all(c.exact_gaussian for c in costs) else INTEGER_ORDERS


def rdp_to_epsilon(orders: Sequence[float], rdp: np.ndarray, delta: float) -> tuple[float, float]:
    """(eps, optimal order) from a composed RDP curve (Balle et al. 2020 conversion, as in Opacus)."""
    a = np.asarray(orders, float)
    r = np.asarray(rdp, float)
    with np.errstate(invalid="ignore"):
        eps = r + np.log((a - 1) / a) - (math.log(delta) + np.log(a)) / (a - 1)
    if not np.isfinite(eps).any():
        return math.inf, math.nan
    i = int(np.nanargmin(eps))
    return max(float(eps[i]), 0.0), float(a[i])


def composed_rdp(runs: Sequence[tuple[Costs, int]]) -> tuple[tuple[float, ...], np.ndarray]:
    """(orders, total RDP) of a sequence of (costs, count) runs (composition: counts multiply)."""
    orders = orders_for([c for c, _ in runs])
    total = np.zeros(len(orders))
    for c, n in runs:
        if n:
            total = total + n * step_rdp(c, orders)
    return orders, total


def rdp_epsilon(runs: Sequence[tuple[Costs, int]], delta: float) -> tuple[float, float]:
    """(eps, optimal order) of the composition of ``runs`` at ``delta``."""
    orders, total = composed_rdp(runs)
    if not np.any(total):
        return 0.0, math.nan
    return rdp_to_epsilon(orders, total, delta)


class RDPAccountant(Accountant):
    """The cross-check: the sum of the parts' RDP curves, Zhu-Wang general subsampling once per step (the exact
    sampled Gaussian when the selection is free), Balle et al.'s conversion (``rdp_epsilon``)."""

    name = "rdp"
    method = ("sum of parts' RDP, Zhu-Wang general subsampling once per step (exact sampled Gaussian when the "
              "selection is free), Balle et al. conversion")

    def epsilon(self, runs: Sequence[tuple[Costs, int]], delta: float) -> float:
        return rdp_epsilon(runs, delta)[0]

