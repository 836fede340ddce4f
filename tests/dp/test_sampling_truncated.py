"""Truncated Poisson sampling (``dp.max_batch_size``): the batch-size law min(Binomial(N, q), B), uniform
membership given the size, plain Poisson's batches where nothing overflows, and the overflow tail and δ_B against
brute force."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from scipy import stats

from widedp.dp import sampling
from widedp.dp.sampling import PoissonSampler
from widedp.dp.units import UnitPoissonSampler, group_units

N, Q, B, STEPS = 60, 0.3, 20, 30_000  # mean 18, P[size > 20] ~ 0.27


@pytest.fixture(scope="module")
def drawn():
    """[STEPS] sizes and the truncated batches of a bounded sampler, and the plain sampler's batches (same seed)."""
    bounded = PoissonSampler(N, sampling_rate=Q, seed=7, max_batch_size=B)
    plain = PoissonSampler(N, sampling_rate=Q, seed=7)
    return [(bounded.batch(t), bounded.truncated(t), plain.batch(t)) for t in range(STEPS)]


def _chi2_p(observed: np.ndarray, expected_p: np.ndarray) -> float:
    """Pearson χ² p-value of the counts ``observed`` against the probabilities ``expected_p`` (cells with an
    expected count below 5 merged into their neighbour)."""
    exp = expected_p * observed.sum()
    obs, e = [], []
    co, ce = 0.0, 0.0
    for o, x in zip(observed, exp):
        co, ce = co + o, ce + x
        if ce >= 5:
            obs.append(co)
            e.append(ce)
            co = ce = 0.0
    obs[-1] += co
    e[-1] += ce
    return float(stats.chisquare(obs, e).pvalue)


def _truncated_pmf(n: int, q: float, bound: int) -> np.ndarray:
    """[bound + 1] the law of min(Binomial(n, q), bound)."""
    pmf = stats.binom.pmf(np.arange(bound + 1), n, q)
    pmf[bound] = stats.binom.sf(bound - 1, n, q)
    return pmf


def test_batch_size_is_min_of_binomial_and_bound(drawn):
    sizes = np.array([b.numel() for b, _, _ in drawn])
    counts = np.bincount(sizes, minlength=B + 1)
    assert sizes.max() == B and len(counts) == B + 1
    assert _chi2_p(counts, _truncated_pmf(N, Q, B)) > 1e-3
    # a factor-2 error in the overflow mass (or q 10% off) fails the same check
    half = _truncated_pmf(N, Q, B)
    half[B] /= 2
    assert _chi2_p(counts, half / half.sum()) < 1e-6
    assert _chi2_p(counts, _truncated_pmf(N, 1.1 * Q, B)) < 1e-6
    # the exact mass at the bound: P[Binomial(N, q) >= B], within 5 standard errors
    p_at = stats.binom.sf(B - 1, N, Q)
    assert abs(counts[B] / STEPS - p_at) < 5 * math.sqrt(p_at * (1 - p_at) / STEPS)


def _membership(batches: list[torch.Tensor]) -> np.ndarray:
    return np.bincount(torch.cat(batches).numpy(), minlength=N)


def test_each_unit_is_kept_equally_often_given_truncation(drawn):
    cut = [(b, p) for b, t, p in drawn if t]
    assert len(cut) > 5000
    kept = _membership([b for b, _ in cut])
    mean = len(cut) * B / N  # each unit in a uniformly random B-subset with probability B/N
    sd = math.sqrt(len(cut) * (B / N) * (1 - B / N))
    assert np.abs(kept - mean).max() < 5 * sd
    # the first member (the batch's order) is uniform too
    first = np.bincount(np.array([int(b[0]) for b, _ in cut]), minlength=N)
    assert _chi2_p(first, np.full(N, 1 / N)) > 1e-3
    # negative control: keeping the B smallest ids (a biased cut) fails the same check
    biased = _membership([torch.sort(p).values[:B] for _, p in cut])
    assert np.abs(biased - mean).max() > 5 * sd


def test_non_overflowing_steps_are_plain_poisson_batches(drawn):
    for bounded, truncated, plain in drawn:
        assert truncated == (plain.numel() > B)
        assert torch.equal(bounded, plain[:B])  # the whole plain batch when it fits


def test_unbounded_batches_are_the_ones_drawn_before_the_bound_existed():
    import hashlib

    for kw in ({}, {"max_batch_size": None}):
        s, h = PoissonSampler(1000, sampling_rate=0.05, seed=11, **kw), hashlib.sha256()
        for t in [*range(0, 2100, 7), 5000]:
            h.update(s.batch(t).numpy().tobytes())
        assert h.hexdigest()[:16] == "a0c6e80d9ecd2e17"  # the sampler's digest before dp.max_batch_size


def test_a_step_is_a_pure_function_of_seed_and_step():
    a = PoissonSampler(500, sampling_rate=0.1, seed=3, max_batch_size=50)
    b = PoissonSampler(500, sampling_rate=0.1, seed=3, max_batch_size=50)
    for t in (0, 1500, 3):  # b asks for them out of order, as a resumed run does
        assert torch.equal(a.batch(t), b.batch(t)) and a.truncated(t) == b.truncated(t)
    with pytest.raises(ValueError, match="max_batch_size"):
        PoissonSampler(10, sampling_rate=0.5, seed=0, max_batch_size=0)


def test_unit_sampler_bounds_units_not_samples():
    unit_of = np.repeat(np.arange(40), 3)  # 40 units of 3 samples
    units = group_units(unit_of, np.arange(len(unit_of)), cap=3)
    bounded = UnitPoissonSampler(units, sampling_rate=0.5, seed=1, max_batch_size=12)
    plain = UnitPoissonSampler(units, sampling_rate=0.5, seed=1)
    cut = 0
    for t in range(200):
        x, y = bounded.draw(t), plain.draw(t)
        assert x.num_units == min(y.num_units, 12) and x.samples.numel() == 3 * x.num_units
        assert torch.equal(x.samples, y.samples[: 3 * x.num_units])
        cut += bounded.truncated(t)
    assert cut > 50


def _brute_tail(n: int, q: Fraction, bound: int) -> Fraction:
    return sum((math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(bound + 1, n + 1)), Fraction(0))


@pytest.mark.parametrize(("n", "q", "bound"), [(10, Fraction(3, 10), 5), (40, Fraction(1, 20), 2),
                                               (200, Fraction(1, 20), 60), (120, Fraction(1, 2), 110)])
def test_overflow_tail_matches_brute_force(n, q, bound):
    exact = _brute_tail(n, q, bound)
    assert exact > 0
    got = sampling.log_overflow(n, float(q), bound)
    assert abs(got - math.log(exact)) < 1e-8 * max(1.0, abs(math.log(exact)))  # relative, far into the tail
    assert sampling.log_overflow(n, float(q), n) == -math.inf


def test_overflow_tail_below_float_range_is_an_upper_bound():
    n, q, bound = 2000, Fraction(1, 100), 400  # P ~ 1e-500: scipy's sf underflows
    exact_log = math.log(_brute_tail(n, q, bound).numerator) - math.log(_brute_tail(n, q, bound).denominator)
    got = sampling.log_overflow(n, float(q), bound)
    assert exact_log < -700 and exact_log <= got < exact_log + 0.1  # an upper bound, and a tight one


def test_truncation_delta_formula_and_smallest_bound():
    n, q, steps, bar = 300, 0.1, 50, 2.0
    tail = float(_brute_tail(n + 1, Fraction(1, 10), 45))  # a neighbour has N + 1 units
    d = sampling.truncation_delta(steps=steps, n=n, q=q, bound=45, epsilon_bar=bar)
    assert d == pytest.approx((1 + math.exp(bar)) * steps * tail, rel=1e-9)
    assert sampling.truncation_delta(steps=steps, n=n, q=q, bound=n + 1, epsilon_bar=bar) == 0.0
    assert sampling.truncation_delta(steps=1, n=10**6, q=0.5, bound=10, epsilon_bar=800.0) == math.inf
    for target in (1e-3, 1e-9, 1e-30):
        b = sampling.smallest_bound(steps=steps, n=n, q=q, epsilon_bar=bar, delta_b=target)
        assert sampling.truncation_delta(steps=steps, n=n, q=q, bound=b, epsilon_bar=bar) <= target
        assert sampling.truncation_delta(steps=steps, n=n, q=q, bound=b - 1, epsilon_bar=bar) > target
