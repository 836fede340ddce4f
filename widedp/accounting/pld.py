"""PLD accountant (the headline): one dominating pair per step, Poisson-subsampled once, FFT self-composition.

Per step the worst-case pair is P = N(1, sigma^2) x P_sel vs Q = N(0, sigma^2) x Q_sel (adaptive composition of
the selection and the noise on the same batch is dominated by the product of their dominating pairs, Zhu, Dong &
Wang 2022, Thm. 10; a Gaussian selection, i.e. contribution thresholding, folds into the N(1, sigma^2) factor,
sigma^-2 = sum sigma_i^-2, see parts.py), and Poisson(q) subsampling of the whole step is dominated by
(qP + (1-q)Q, Q) for remove and (Q, qP + (1-q)Q) for add (ibid., Thm. 11). We report the max of the two
adjacencies.

Selection pairs (all symmetric: swapping P and Q gives the same pair up to relabelling):

- pure eps-DP mechanism (SVT segment, Laplace release, exponential without bounded range): randomized response
  RR_eps, a dominating pair for every pure eps-DP mechanism.
- one eps-bounded-range pick (exponential mechanism, Durfee & Rogers 2019): any BR pair has its likelihood ratio in
  [e^(t-eps), e^t] for some t in [0, eps], so it is a garbling of the two-point pair B_t with exactly those ratios.
  t is data dependent, so we use the envelope E_eps whose hockey-stick curve is sup_t of B_t's:
      delta_E(x) = (1 - e^((x-eps)/2))^2 / (1 - e^-eps)    for 0 <= x < eps (optimum t = (x+eps)/2),
      delta_E(x) = 1 - e^x + e^x delta_E(-x)               for x < 0,   0 for x >= eps.
  (A sup of hockey-stick curves is one: convex, 1 at gamma=0, above (1-gamma)_+.) E_eps dominates every
  eps-BR mechanism; it is sound but not tight (its RDP at alpha=2 is ~1.3x the zCDP eps^2/8 bound; RR_eps is 4x).
  k picks (Gumbel top-k = k adaptive picks) are E_eps^(x k).

What comes from dp_accounting 0.6.0 (``dp_accounting.pld``): the RR PLD (``from_privacy_parameters(eps, 0)``),
the PMF classes with their composition and FFT self-composition (``PLDPmf.compose/self_compose``,
``PrivacyLossDistribution(remove, add)``), the connect-the-dots discretisation (``pld_pmf``'s fixed-gap formula,
Doroshenko et al. 2022; we vectorise it, tested equal) and eps(delta) (vectorised, tested equal). Where we went
beyond it: dp_accounting 0.6.0 has no exponential-mechanism event (its development head has one, but its RDP
accountant ignores ``count`` for it) and subsamples only Gaussian/Laplace at construction, so
- the BR envelope pair above is ours;
- the joint step is ours: we compose the unsubsampled pair (Gaussian x selection) with dp_accounting, read its
  hockey-stick curve H(x) = H_{e^x}(P||Q) exactly from the pessimistic PMF (x >= 0; x < 0 by the pair's symmetry
  H(x) = 1 - e^x + e^x H(-x)), map it through the exact subsampling identities
    remove: delta(e) = q H(ln c),                                    c  = (e^e - (1 - q)) / q   (c >= 1),
            delta(e) = 1 - e^e + (e^e - 1 + q) H(ln 1/c)                                         (0 < c < 1),
    add:    delta(e) = a H(ln(q e^e / a)),                            a  = 1 - e^e (1 - q)        (a > 0),
  and discretise the subsampled pair pessimistically by connect-the-dots;
- the Gaussian pair uses its closed-form hockey-stick curve (instead of ``from_gaussian_mechanism``, whose per-point
  Python loops took ~4 s at sigma = 0.5); a step whose only cost is Gaussian noise goes through the same
  subsampling identities with the exact curve. Tests check it against ``from_gaussian_mechanism(sampling_prob=q)``.
Every stage over-estimates the hockey-stick curve, so the result is an upper bound (up to float rounding); per-step
tails below 1e-20 go to +infinity. Discretisation interval 1e-4 (moving it to 5e-5 changes the paper-setting eps
in the 5th digit).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pldm
from scipy import fft
from scipy.special import log_ndtr, ndtr

from widedp.accounting.base import Accountant
from widedp.accounting.parts import Costs
from widedp.dp.spend import DISCRETE_PLD_REFUSED
from widedp.errors import ConfigError

DEFAULT_DISCRETIZATION = 1e-4
_GAUSS_TAIL_SD = 10.0  # Gaussian losses beyond mean +- 10 sd (mass < 1e-23) are lumped pessimistically
_MAX_GRID = 5_000_000  # largest per-step privacy-loss grid (points) we build
#: largest composed privacy-loss grid (points): its FFT holds a few complex arrays of this length (~0.5 GB in all);
#: a wider one (an epsilon of hundreds or thousands) is refused before it is allocated
_MAX_COMPOSED_GRID = 2**23
_TAIL = 1e-20  # per-step hockey-stick mass below which the subsampled pair's upper tail is sent to +infinity
_COMPOSE_TAIL = 1e-15  # dp_accounting's default tail truncation in compositions (pessimistic: goes to +infinity)

PLD = pldm.PrivacyLossDistribution


class PLDRangeError(ConfigError):
    """The privacy-loss range is too wide for a PLD grid (tiny sigma or huge selection epsilon)."""


#: Why a step with discrete Gaussian noise (``dp.noise: secure``) has no PLD here (also the config's error).
DISCRETE_REFUSED = DISCRETE_PLD_REFUSED


class PLDNotApplicable(ConfigError):
    """The ledger holds a step whose privacy-loss distribution this accountant does not model (discrete noise)."""


# ---------------------------------------------------------------------------------------------------- helpers


def ctd_pmf(d: float, lo: int, deltas: np.ndarray) -> pld_pmf.DensePLDPmf:
    """Pessimistic connect-the-dots PMF on the grid (lo .. lo+m-1) * d from exact hockey-stick values deltas: [m].

    The fixed-gap formula of dp_accounting's ``create_pmf_pessimistic_connect_dots_fixed_gap`` (Doroshenko et al.
    2022, Alg. 1), vectorised into a ``DensePLDPmf`` (the dp_accounting version builds a dict per grid point). A
    running max from the right first makes the curve non-increasing by only raising values (pessimistic).
    """
    deltas = np.maximum.accumulate(np.clip(np.asarray(deltas, float), 0.0, 1.0)[::-1])[::-1]
    if len(deltas) < 2:
        raise ValueError("connect-the-dots needs at least two grid points")
    em1 = math.expm1(d)
    diffs = np.diff(deltas)
    probs = np.empty_like(deltas)
    probs[0] = 1.0 - deltas[0] + diffs[0] / em1
    probs[1:-1] = (diffs[1:] - diffs[:-1] * math.exp(d)) / em1
    probs[-1] = diffs[-1] / math.expm1(-d)
    return pld_pmf.DensePLDPmf(d, int(lo), np.maximum(probs, 0.0), float(deltas[-1]), True)


def gaussian_delta(sigma: float, x: np.ndarray) -> np.ndarray:
    """Exact hockey-stick curve of N(1, sigma^2) vs N(0, sigma^2) at e^x, any real x: [m] -> [m]."""
    x = np.asarray(x, float)
    a = 0.5 / sigma
    with np.errstate(over="ignore"):
        out = ndtr(a - x * sigma) - np.exp(x + log_ndtr(-a - x * sigma))
    return np.clip(out, 0.0, 1.0)


def gaussian_pmf(sigma: float, d: float) -> pld_pmf.DensePLDPmf:
    """Pessimistic connect-the-dots PMF of the (unsubsampled) Gaussian pair; losses ~ N(mu^2/2, mu^2), mu = 1/sigma."""
    mu = 1.0 / sigma
    lo = math.floor((mu * mu / 2 - _GAUSS_TAIL_SD * mu) / d)
    hi = math.ceil((mu * mu / 2 + _GAUSS_TAIL_SD * mu) / d)
    _check_grid(hi - lo, sigma)
    return ctd_pmf(d, lo, gaussian_delta(sigma, np.arange(lo, hi + 1) * d))


def _check_grid(n: int, sigma: float | None) -> None:
    if n > _MAX_GRID:
        what = f"noise multiplier {sigma:g} is too small" if sigma is not None else "the selection is too costly"
        raise PLDRangeError(
            f"pld accountant: {what} for a {n}-point privacy-loss grid (limit {_MAX_GRID}); use accountant rdp"
        )


def _check_mass(pld: PLD, tol: float, what: str) -> PLD:
    """``pld`` if each PMF's total mass (with +infinity) is finite and <= 1 + ``tol``; else a ``PLDRangeError``.

    A step's pessimistic PMF can come out heavier than 1 when its hockey-stick curve is not convex on the grid
    (connect-the-dots masses below 0 are clipped): composed over many steps the excess grows geometrically, and
    at ~1.4 per step the FFT overflows and the epsilon read off is garbage (0.0 was seen: an under-report). Such
    ledgers are refused, not reported. Normal steps carry an excess of ~1e-7 (the add side's grid)."""
    for pmf in (pld._pmf_remove, pld._pmf_add):
        dense = pmf.to_dense_pmf()
        probs = np.asarray(dense._probs, float)
        mass = float(probs.sum()) + float(dense._infinity_mass)
        if not (np.isfinite(probs).all() and mass <= 1.0 + tol):
            raise PLDRangeError(f"pld accountant: numerically unstable for {what} (its privacy-loss distribution "
                                f"has mass {mass:.6g} > 1); use accountant rdp")
    return pld


# ------------------------------------------------------------------------------------------------ selection pairs


def bounded_range_envelope_delta(eps: float, x: np.ndarray) -> np.ndarray:
    """Hockey-stick curve delta_E(x) of the envelope pair of all eps-bounded-range pairs, x: [m] -> [m]."""
    x = np.asarray(x, float)
    denom = -math.expm1(-eps)

    def nonneg(y: np.ndarray) -> np.ndarray:
        y = np.minimum(y, eps)
        return np.expm1((y - eps) / 2.0) ** 2 / denom

    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = nonneg(x[pos])
    xn = x[~pos]
    out[~pos] = -np.expm1(xn) + np.exp(xn) * nonneg(-xn)
    return out


def bounded_range_pmf(eps: float, d: float) -> pld_pmf.PLDPmf:
    """Pessimistic (connect-the-dots) PLD PMF of the envelope pair E_eps."""
    lo, hi = math.floor(-eps / d), math.ceil(eps / d)
    return ctd_pmf(d, lo, bounded_range_envelope_delta(eps, np.arange(lo, hi + 1) * d))


def pure_dp_pmf(eps: float, d: float) -> pld_pmf.PLDPmf:
    """Pessimistic PLD PMF of randomized response RR_eps (dominates any pure eps-DP mechanism)."""
    # _pmf_remove: dp_accounting exposes no public accessor for the PMF of a PrivacyLossDistribution.
    return pldm.from_privacy_parameters(pld_common.DifferentialPrivacyParameters(eps, 0.0), d)._pmf_remove


@lru_cache(maxsize=8)
def _power(kind: str, eps: float, count: int, d: float) -> pld_pmf.PLDPmf:
    base = bounded_range_pmf(eps, d) if kind == "br" else pure_dp_pmf(eps, d)
    return base if count == 1 else base.self_compose(count, _COMPOSE_TAIL)


def product_pmf(costs: Costs, d: float) -> pld_pmf.PLDPmf:
    """PMF of the unsubsampled step pair (Gaussian x selection pairs), pessimistic, symmetric."""
    pmfs = []
    if costs.joint_sigma is not None:  # the gradient noise and any Gaussian selection, folded (parts.py)
        pmfs.append(gaussian_pmf(costs.joint_sigma, d))
    _check_grid(int(2 * sum(e * n for e, n in costs.bounded_range + costs.pure) / d), None)
    pmfs += [_power("br", e, n, d) for e, n in costs.bounded_range]
    pmfs += [_power("pure", e, n, d) for e, n in costs.pure]
    out = pmfs[0]
    for p in pmfs[1:]:
        out = pld_pmf.compose_pmfs(out, p, _COMPOSE_TAIL)
    return out


# ---------------------------------------------------------------------------------------------- subsampling


class HockeyStick:
    """x -> H(x) = sum_o [P(o) - e^x Q(o)]_+ of a symmetric pair, from its pessimistic discrete PLD (vectorised)."""

    def __init__(self, pmf: pld_pmf.PLDPmf) -> None:
        dense = pmf.to_dense_pmf()
        # Private fields: DensePLDPmf keeps its grid as (lower index, probs, infinity mass) with no accessor.
        self.d = dense._discretization
        self.lo = int(dense._lower_loss)
        probs = np.maximum(np.asarray(dense._probs, float), 0.0)  # FFT round-off can leave -1e-20s
        self.inf = float(dense._infinity_mass)
        self.losses = (self.lo + np.arange(len(probs))) * self.d
        # Suffix sums: sp[i] = sum_{j>=i} p_j, log_sq[i] = log sum_{j>=i} p_j e^-l_j.
        self.sp = np.append(np.cumsum(probs[::-1])[::-1], 0.0)
        with np.errstate(divide="ignore"):
            self.log_sq = _log_suffix_sum(np.log(probs) - self.losses)
        self.max_loss = float(self.losses[-1]) if len(probs) else 0.0

    def _nonneg(self, x: np.ndarray) -> np.ndarray:
        i = np.floor(x / self.d).astype(np.int64) - self.lo + 1  # first index with loss > x
        i = np.clip(i, 0, len(self.losses))
        return np.maximum(self.inf + self.sp[i] - np.exp(x + self.log_sq[i]), 0.0)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, float)
        out = np.empty_like(x)
        pos = x >= 0
        out[pos] = self._nonneg(x[pos])
        xn = x[~pos]
        out[~pos] = -np.expm1(xn) + np.exp(xn) * self._nonneg(-xn)
        return np.clip(out, 0.0, 1.0)


class GaussianHockeyStick:
    """The exact hockey-stick curve of N(1, sigma^2) vs N(0, sigma^2) (symmetric pair), same interface."""

    def __init__(self, sigma: float) -> None:
        self.sigma = sigma
        mu = 1.0 / sigma
        self.max_loss = mu * mu / 2 + _GAUSS_TAIL_SD * mu  # H(max_loss) < 1e-23

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return gaussian_delta(self.sigma, x)


def _remove_delta(h: HockeyStick | GaussianHockeyStick, q: float, e: np.ndarray) -> np.ndarray:
    em1 = np.expm1(e)
    c = (em1 + q) / q
    out = -em1  # c <= 0: every outcome counts, delta = 1 - e^e
    big, small = c >= 1, (c > 0) & (c < 1)
    out[big] = q * h(np.log(c[big]))
    out[small] = -em1[small] + (em1[small] + q) * h(-np.log(c[small]))
    return out


def _add_delta(h: HockeyStick | GaussianHockeyStick, q: float, e: np.ndarray) -> np.ndarray:
    a = -np.expm1(e + math.log1p(-q))
    out = np.zeros_like(e)
    m = a > 0
    out[m] = a[m] * h(math.log(q) + e[m] - np.log(a[m]))
    return out


def subsampled_pld(h: HockeyStick | GaussianHockeyStick, q: float, d: float) -> PLD:
    """PLD (remove, add) of the Poisson(q)-subsampled pair whose unsubsampled hockey-stick curve is ``h``."""
    top = float(np.logaddexp(math.log1p(-q), math.log(q) + h.max_loss))  # largest finite subsampled loss
    lo_r = math.floor(math.log1p(-q) / d)
    hi = max(math.ceil(top / d), 1)
    # Smallest grid index whose remove-delta is <= _TAIL (bisection; delta is non-increasing).
    a, b = 0, hi
    if _remove_delta(h, q, np.array([b * d]))[0] <= _TAIL:
        while b - a > 1:
            mid = (a + b) // 2
            if _remove_delta(h, q, np.array([mid * d]))[0] <= _TAIL:
                b = mid
            else:
                a = mid
    hi_r = b
    _check_grid(hi_r - lo_r, getattr(h, "sigma", None))
    pmf_remove = ctd_pmf(d, lo_r, _remove_delta(h, q, np.arange(lo_r, hi_r + 1) * d))
    # Add: its losses lie in (-inf, -ln(1-q)]; below -hi_r the excess over 1 - e^e is e^e delta_remove(-e) <= tail.
    lo_a, hi_a = -hi_r, math.ceil(-math.log1p(-q) / d)
    pmf_add = ctd_pmf(d, lo_a, _add_delta(h, q, np.arange(lo_a, hi_a + 1) * d))
    return PLD(pmf_remove, pmf_add)


# ------------------------------------------------------------------------------------------------ accountant


@lru_cache(maxsize=8)
def step_pld(costs: Costs, d: float = DEFAULT_DISCRETIZATION) -> PLD:
    """The pessimistic PLD of one step (both adjacencies)."""
    if costs.is_free:
        return pldm.identity(d)
    if costs.q >= 1.0:
        return PLD(product_pmf(costs, d))
    if costs.discrete:
        raise PLDNotApplicable(DISCRETE_REFUSED)
    if costs.is_gaussian:  # exactly one subsampled Gaussian (Gaussian selections folded in)
        return _check_mass(subsampled_pld(GaussianHockeyStick(costs.joint_sigma), costs.q, d), 1e-6, "this step")
    return _check_mass(subsampled_pld(HockeyStick(product_pmf(costs, d)), costs.q, d), 1e-6, "this step")


def compose_pld(runs: Sequence[tuple[Costs, int]], d: float = DEFAULT_DISCRETIZATION) -> PLD:
    """Composition of ``count`` steps of each run, run after run (self-composition by FFT)."""
    if any(costs.discrete and n > 0 for costs, n in runs):
        raise PLDNotApplicable(DISCRETE_REFUSED)
    out = None
    for costs, n in runs:
        if n <= 0 or costs.is_free:
            continue
        p = step_pld(costs, d)
        p = _self_compose(p, n) if n > 1 else p
        out = p if out is None else out.compose(p)
    # a composition's excess is count x a step's (1e-7 x 1e5 steps = 1e-2); what must never pass is an overflow
    return pldm.identity(d) if out is None else _check_mass(out, 0.5, "this ledger")


def _self_compose(pld: PLD, n: int) -> PLD:
    """``pld`` composed with itself ``n`` times: dp_accounting's ``self_compose`` (the same Chernoff truncation
    at ``_COMPOSE_TAIL`` and FFT), with the composed grid's size checked before the FFT allocates it."""
    remove = _self_compose_pmf(pld._pmf_remove, n)
    return PLD(remove) if pld._symmetric else PLD(remove, _self_compose_pmf(pld._pmf_add, n))


def _self_compose_pmf(pmf: pld_pmf.PLDPmf, n: int) -> pld_pmf.PLDPmf:
    """``DensePLDPmf.self_compose(n, _COMPOSE_TAIL)`` step by step (private fields: no accessor in dp_accounting
    0.6.0); a ``PLDRangeError`` when its grid would exceed ``_MAX_COMPOSED_GRID`` points."""
    if not isinstance(pmf, pld_pmf.DensePLDPmf):
        return pmf.self_compose(n, _COMPOSE_TAIL)
    probs = pmf._probs
    lo, hi = pld_common.compute_self_convolve_bounds(probs, n, _COMPOSE_TAIL)
    size = hi - lo + 1
    if size > _MAX_COMPOSED_GRID:
        raise PLDRangeError(f"pld accountant: {n} composed steps need a {size}-point privacy-loss grid (limit "
                            f"{_MAX_COMPOSED_GRID}): epsilon in the hundreds or more; use accountant rdp")
    spectrum = fft.fft(probs, fft.next_fast_len(max(size, len(probs))))
    out = np.array(np.roll(np.real(fft.ifft(spectrum**n)), -lo)[:size])
    inf = _COMPOSE_TAIL - math.expm1(n * math.log1p(-pmf._infinity_mass))
    return pld_pmf.DensePLDPmf(pmf._discretization, pmf._lower_loss * n + lo, out, inf, pmf._pessimistic_estimate)


def _log_suffix_sum(log_terms: np.ndarray) -> np.ndarray:
    """[m] -> [m+1]: log sum_{j>=i} exp(log_terms[j]), with -inf appended (empty sum)."""
    return np.append(np.logaddexp.accumulate(log_terms[::-1])[::-1], -np.inf)


def epsilon_for_delta(pmf: pld_pmf.PLDPmf, delta: float) -> float:
    """Smallest eps >= 0 with hockey-stick(eps) <= delta for a discrete PLD (vectorised form of dp_accounting's
    ``PLDPmf.get_epsilon_for_delta``: on (l_{i-1}, l_i] delta(eps) = inf + A_i - e^eps B_i with suffix sums
    A_i = sum_{j>=i} p_j, B_i = sum_{j>=i} p_j e^-l_j; B is kept in log space)."""
    dense = pmf.to_dense_pmf()
    inf = float(dense._infinity_mass)
    if inf > delta:
        return math.inf
    probs = np.maximum(np.asarray(dense._probs, float), 0.0)  # FFT round-off can leave -1e-20s
    losses = (dense._lower_loss + np.arange(len(probs))) * dense._discretization
    a = np.append(np.cumsum(probs[::-1])[::-1], 0.0)
    with np.errstate(divide="ignore"):
        log_b = _log_suffix_sum(np.log(probs) - losses)
    at_losses = inf + a[1:] - np.exp(losses + log_b[1:])  # delta(l_i)
    above = np.nonzero(at_losses > delta)[0]
    i = above[-1] + 1 if len(above) else 0  # eps lies in (l_{i-1}, l_i]
    if not np.isfinite(log_b[i]) or inf + a[i] <= delta:
        return max(float(losses[i - 1]) if i > 0 else 0.0, 0.0)
    return max(math.log(inf + a[i] - delta) - float(log_b[i]), 0.0)


@lru_cache(maxsize=256)
def _pld_epsilon(runs: tuple[tuple[Costs, int], ...], delta: float, d: float) -> float:
    pld = compose_pld(runs, d)
    # _pmf_remove/_pmf_add: the two adjacencies' PMFs (no public accessor in dp_accounting 0.6.0).
    return max(epsilon_for_delta(pld._pmf_remove, delta), epsilon_for_delta(pld._pmf_add, delta))


def pld_epsilon(runs: Sequence[tuple[Costs, int]], delta: float, d: float = DEFAULT_DISCRETIZATION) -> float:
    """eps at ``delta`` of the composition of ``runs`` (max over add and remove adjacency)."""
    return _pld_epsilon(tuple(runs), float(delta), float(d))


def pld_delta(runs: Sequence[tuple[Costs, int]], epsilon: float, d: float = DEFAULT_DISCRETIZATION) -> float:
    """delta at ``epsilon`` of the composition of ``runs`` (max over add and remove adjacency)."""
    return float(compose_pld(runs, d).get_delta_for_epsilon(epsilon))


class PLDAccountant(Accountant):
    """The headline: each step's dominating pair, Poisson-subsampled once, pessimistically discretised, composed by
    FFT (``pld_epsilon``); no PLD of the discrete Gaussian (``DISCRETE_REFUSED``)."""

    name = "pld"
    discrete_noise = False
    start_from = "rdp"
    #: a target of ε = 100 (already a vacuous bound) composes grids of up to ~10^6 - 10^7 points; far above it they
    #: exceed ``_MAX_COMPOSED_GRID`` and the search could only report what it cannot resolve
    max_epsilon = 100.0
    method = ("dominating pair per step: N(1,s^2) x selection pair (bounded-range envelope per exponential pick, "
              "randomized response per pure-DP mechanism), Poisson-subsampled once, pessimistic connect-the-dots "
              f"(interval {DEFAULT_DISCRETIZATION:g}), FFT self-composition, max over add/remove")

    def refusal(self, costs: Costs) -> str | None:
        return DISCRETE_REFUSED if costs.discrete else None

    def epsilon(self, runs: Sequence[tuple[Costs, int]], delta: float) -> float:
        return pld_epsilon(runs, delta)

