"""Gaussian contribution thresholding: the exact false-positive sampler against brute force, the
selection law against its exact product law, neighbouring output laws against the Gaussian they post-process, the
V-independence at R = 10^12, the max_rows cap, the factory and the spend record."""

import itertools
import math
import time

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.stats import norm

import widedp.dp.selection.gaussian as sg
from widedp.config import GaussianThresholdSelectionConfig
from widedp.dp.rowgrads import PerSampleRows
from widedp.dp.selection import SelectionContext, make_selector
from widedp.dp.selection.gaussian import GaussianThresholdSelector, false_positives, tail_probability
from widedp.dp.selection.scores import row_counts
from widedp.dp.spend import GaussianSelectionSpend
from widedp.dp.step import dp_step
from widedp.errors import ConfigError

CTX = SelectionContext(epoch=0, num_epochs=1)


def set_pvalue(draws: list[tuple[int, ...]], law: dict[tuple[int, ...], float]) -> float:
    """χ² p-value of sets (sorted tuples) against an exact law; an impossible outcome fails."""
    counts: dict[tuple[int, ...], int] = {}
    for o in draws:
        counts[o] = counts.get(o, 0) + 1
    if any(o not in law for o in counts):
        return 0.0
    keys = sorted(law)
    obs = np.array([counts.get(o, 0) for o in keys], dtype=float)
    return float(stats.chisquare(obs, np.array([law[o] for o in keys]) * len(draws)).pvalue)


def product_law(p: np.ndarray) -> dict[tuple[int, ...], float]:
    """Law of {r : B_r = 1} for independent B_r ~ Bernoulli(p_r)."""
    law = {}
    for bits in itertools.product([0, 1], repeat=len(p)):
        b = np.array(bits)
        law[tuple(np.flatnonzero(b).tolist())] = float(np.prod(np.where(b == 1, p, 1 - p)))
    return law


def test_false_positive_sampler_matches_brute_force_and_detects_a_broken_one(monkeypatch):
    """Untouched rows above τ: binomial count + distinct uniform untouched ids == each untouched row passing
    independently (brute force over all R rows). Drawing ids among ALL rows (touched included) is detected."""
    num_rows, exclude, p = 6, torch.tensor([1, 4]), 0.3
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    ours = [tuple(sorted(false_positives(4, p, num_rows, exclude=exclude, generator=gen, device="cpu").tolist()))
            for _ in range(n)]
    law = {tuple(r for r, b in zip([0, 2, 3, 5], bits) if b): p ** sum(bits) * (1 - p) ** (4 - sum(bits))
           for bits in itertools.product([0, 1], repeat=4)}
    assert set_pvalue(ours, law) > 1e-3
    brute = torch.rand(n, num_rows, generator=gen) < p  # every row, touched ones then dropped
    brute[:, exclude] = False
    assert set_pvalue([tuple(np.flatnonzero(b).tolist()) for b in brute.numpy()], law) > 1e-3
    original = sg.sample_distinct
    monkeypatch.setattr(sg, "sample_distinct",
                        lambda k, r, *, exclude, generator, device: original(k, r, exclude=exclude[:0],
                                                                             generator=generator, device=device))
    broken = [tuple(sorted(false_positives(4, p, num_rows, exclude=exclude, generator=gen, device="cpu").tolist()))
              for _ in range(4_000)]
    assert set_pvalue(broken, law) < 1e-6


def test_selection_law_is_the_exact_product_law_and_a_wrong_std_is_detected(monkeypatch):
    """P(r selected) = P(c_r + N(0, σ²) > τ) independently over all rows, untouched (c_r = 0) included; false
    positives drawn with twice the std fail."""
    sel = GaussianThresholdSelector(sigma=0.8, threshold=1.0)
    touched, counts = torch.tensor([1, 4]), torch.tensor([1.5, 0.3], dtype=torch.float64)
    c = np.zeros(6)
    c[[1, 4]] = counts.numpy()
    law = product_law(norm.sf((1.0 - c) / 0.8))
    gen = torch.Generator().manual_seed(1)

    def draw(n):
        return [tuple(sorted(sel.select(touched, counts, selectable_rows=6, score_sensitivity=1.0, ctx=CTX,
                                        generator=gen).tolist())) for _ in range(n)]

    assert set_pvalue(draw(20_000), law) > 1e-3
    monkeypatch.setattr(sg, "tail_probability", lambda t, s: tail_probability(t, 2 * s))
    assert set_pvalue(draw(20_000), law) < 1e-6


def _exact_set_law(c: np.ndarray, sigma: float, tau: float) -> np.ndarray:
    p = norm.sf((tau - c) / sigma)
    bits = np.array(list(itertools.product([0, 1], repeat=len(c))))
    return np.prod(np.where(bits == 1, p, 1 - p), axis=1)


def _hockey(p: np.ndarray, q: np.ndarray, eps: float) -> float:
    return float(np.maximum(p - math.exp(eps) * q, 0).sum())


def _gauss_delta(eps: float, mu: float) -> float:
    return float(norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2))


def test_neighbouring_output_laws_are_dominated_by_the_gaussian():
    """Add/remove one sample: the exact laws of the selected set have a hockey-stick divergence <= that of
    N(0, σ²) vs N(1, σ²) at every ε (the selection is post-processing of a sensitivity-1 Gaussian). With
    unnormalised (raw indicator) contributions the bound fails."""
    rng = np.random.default_rng(2)
    sigma, tau, num_rows = 0.7, 1.0, 5
    eps_grid = np.linspace(0.0, 6.0, 31)
    worst = {"l2": 0.0, "raw": 0.0}
    all_rows = torch.arange(num_rows)
    for _ in range(60):
        samples = [[int(r) for r in rng.choice(num_rows, rng.integers(1, num_rows + 1), replace=False)]
                   for _ in range(int(rng.integers(1, 4)))]
        lens = [len(s) for s in samples]
        offsets = torch.tensor([0, *np.cumsum(lens)])
        rows = torch.tensor([r for s in samples for r in s])
        g = PerSampleRows(torch.zeros(rows.numel(), 1, dtype=torch.float64), rows, offsets, num_rows)
        g_rm = PerSampleRows(g.values[lens[0]:], rows[lens[0]:], offsets[1:] - lens[0], num_rows)  # sample 0 out
        for name, normalise in (("l2", True), ("raw", False)):
            c, c2 = (row_counts(x, all_rows, normalise=normalise, dtype=torch.float64).numpy() for x in (g, g_rm))
            p, q = _exact_set_law(c, sigma, tau), _exact_set_law(c2, sigma, tau)
            for e in eps_grid:
                ratio = max(_hockey(p, q, e), _hockey(q, p, e)) / _gauss_delta(e, 1 / sigma)
                worst[name] = max(worst[name], ratio)
    assert worst["l2"] <= 1 + 1e-9
    assert worst["l2"] > 0.5  # the search gets near the bound
    assert worst["raw"] > 2.0


def test_v_independent_at_a_trillion_rows():
    """R = 10^12 through dp_step: no tensor of size R (it would not fit), false positives at their expected rate."""
    num_rows = 10**12
    rows = torch.tensor([5, 10**11, num_rows - 1, 5, 7, 123_456_789_012])
    offsets = torch.tensor([0, 3, 5, 6])
    g = PerSampleRows(torch.randn(6, 3, dtype=torch.float64), rows, offsets, num_rows)
    expected_fp = 4.0
    tau = float(norm.isf(expected_fp / (num_rows - 5)))  # sigma = 1
    sel = GaussianThresholdSelector(sigma=1.0, threshold=tau)
    gen = torch.Generator().manual_seed(3)
    t0 = time.perf_counter()
    fps = []
    for _ in range(300):
        res = dp_step(g, batch_size=3.0, sampling_rate=0.01, clip1=1.0, clip2=None, noise_multiplier=1.0,
                      selector=sel, ctx=CTX, generator=gen)
        s = res.selected
        assert s.unique().numel() == s.numel() and bool(((s >= 0) & (s < num_rows)).all())
        assert res.grad.values.shape == (s.numel(), 3)
        fps.append(int((~torch.isin(s, rows)).sum()))
    assert time.perf_counter() - t0 < 30
    assert np.mean(fps) == pytest.approx(expected_fp, rel=0.15)  # a factor-2 error in p_τ fails


def test_max_rows_keeps_a_uniform_subset():
    """τ far below every count: all 5 rows pass; max_rows = 2 keeps a uniformly random pair."""
    sel = GaussianThresholdSelector(sigma=0.1, threshold=-10.0, max_rows=2)
    gen = torch.Generator().manual_seed(4)
    touched, counts = torch.tensor([0, 2]), torch.tensor([3.0, 1.0])
    draws = [tuple(sorted(sel.select(touched, counts, selectable_rows=5, score_sensitivity=1.0, ctx=CTX,
                                     generator=gen).tolist())) for _ in range(6_000)]
    law = {o: 0.1 for o in itertools.combinations(range(5), 2)}
    assert set_pvalue(draws, law) > 1e-3


def test_config_factory_and_spend():
    cfg = GaussianThresholdSelectionConfig(sigma=4.0, threshold_sigmas=2.5, max_rows=100)
    assert cfg.tau == 10.0
    sel = make_selector(cfg, num_rows=1000)
    assert (sel.sigma, sel.threshold, sel.max_rows, sel.score_kind) == (4.0, 10.0, 100, "contribution")
    s = sel.select(torch.tensor([3]), torch.tensor([30.0]), selectable_rows=1000, score_sensitivity=1.0, ctx=CTX,
                   generator=torch.Generator().manual_seed(5))
    assert sel.spend() == GaussianSelectionSpend(4.0, 1.0)
    assert 3 in s.tolist()
    assert GaussianThresholdSelectionConfig(sigma=3.0).tau == 3.0  # default τ = σ_sel
    for bad in ({"sigma": 1.0, "threshold": 1.0, "threshold_sigmas": 1.0},
                {"sigma": 0.0, "threshold": 1.0}, {"sigma": 1.0, "threshold": 1.0, "max_rows": 0}):
        with pytest.raises(ConfigError):
            GaussianThresholdSelectionConfig(**bad)
