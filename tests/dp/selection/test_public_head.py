"""A public head (``widedp.dp.selection.public``): ``public_top`` (the first H rows of each table, free) and
``gaussian_threshold``'s ``public_head`` (the head for free, thresholding over the other rows with contributions
normalised over them) — the head rows per table, data independence and the free spend, the noise on head rows, the
exact law of the picks outside the head (a wrong normalisation or a doubled σ_sel fails), the sensitivity of the
counts the selection sees, the factory and the refusals."""

import itertools

import numpy as np
import pytest
import torch
from scipy import stats
from scipy.stats import norm
from test_selection_gaussian import product_law, set_pvalue

from widedp import accounting
from widedp.config import SELECTIONS, GaussianThresholdSelectionConfig
from widedp.config.selection import PublicTopSelectionConfig
from widedp.dp.rowgrads import PerSampleRows, coalesce
from widedp.dp.selection import SelectionContext, head_rows, make_selector
from widedp.dp.selection.gaussian import GaussianThresholdSelector
from widedp.dp.selection.preselect import preselected
from widedp.dp.selection.public import PublicHead
from widedp.dp.spend import FreeSpend, GaussianSpend, StepSpend
from widedp.dp.step import dp_step, dp_step_spend
from widedp.errors import ConfigError

CTX = SelectionContext(epoch=0, num_epochs=1)


def batch(samples: list[list[int]], num_rows: int, *, dim: int = 2, seed: int = 0) -> PerSampleRows:
    """Per-sample rows (each sample's rows distinct) with random values."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.tensor([r for s in samples for r in s], dtype=torch.long)
    sample = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor([len(s) for s in samples]))
    values = torch.randn(rows.numel(), dim, generator=gen, dtype=torch.float64)
    return coalesce(values, rows, sample, len(samples), num_rows)


def step(g, selector, gen, *, sigma=1.0, clip2=None, public=None):
    return dp_step(g, batch_size=float(max(g.batch_size, 1)), sampling_rate=0.01, clip1=1.0, clip2=clip2,
                   noise_multiplier=sigma, selector=selector, ctx=CTX, generator=gen, public_rows=public)


def test_head_rows_per_table():
    assert head_rows([0, 10], per_table=3, selectable_rows=20).tolist() == [0, 1, 2, 10, 11, 12]
    assert head_rows([0, 4], per_table=6, selectable_rows=10).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    # a table starting at or beyond the selectable rows (always-selected dense rows) is left out
    assert head_rows([0, 5, 9], per_table=2, selectable_rows=9).tolist() == [0, 1, 5, 6]
    assert head_rows([10, 0], per_table=1, selectable_rows=20).tolist() == [0, 10]


def test_public_top_selects_the_head_whatever_the_batch_and_spends_nothing():
    """Neighbouring batches (one sample removed, or none at all) select the same rows: the head, and the pool's
    public rows beside it; the step's spend is DP-SGD's Gaussian alone."""
    sel = make_selector(PublicTopSelectionConfig(rows_per_table=3), num_rows=20, table_starts=[0, 10])
    head = [0, 1, 2, 10, 11, 12]
    g = batch([[0, 5, 15], [7, 11, 19], [3, 4]], 20)
    g_rm = batch([[7, 11, 19], [3, 4]], 20)
    empty = PerSampleRows(torch.zeros(0, 2, dtype=torch.float64), torch.zeros(0, dtype=torch.long),
                          torch.zeros(1, dtype=torch.long), 20)
    for x in (g, g_rm, empty):
        res = step(x, sel, torch.Generator().manual_seed(1))
        assert sorted(res.selected.tolist()) == head
        pooled = step(x, sel, torch.Generator().manual_seed(1), public=torch.tensor([2, 6, 17]))
        assert sorted(pooled.selected.tolist()) == sorted({*head, 6, 17})
    assert sel.spend() == FreeSpend("public_top")
    spend = dp_step_spend(sel, sampling_rate=0.01, noise_multiplier=0.9, clip1=1.0, clip2=None, batch_size=3.0)
    alone = StepSpend(0.01, (GaussianSpend(0.9, 1.0 / 3.0),))
    eps = [accounting.compose_epsilon([(s, 500)], delta=1e-5, accountant="pld") for s in (spend, alone)]
    assert eps[0] == pytest.approx(eps[1], rel=1e-9)


def test_head_rows_get_the_clipped_gradient_and_calibrated_noise():
    """σ → 0: each head row carries ĝ (0 where untouched), no other row is released; σ = 0.7: the released values
    of untouched head rows standardised by σΔ₂ are N(0, 1) (KS), and by 2σΔ₂ they are not."""
    sel = make_selector(PublicTopSelectionConfig(rows_per_table=40), num_rows=200, table_starts=[0, 100])
    g = batch([[0, 1, 150], [2, 101, 199], [60]], 200, dim=3)
    res = step(g, sel, torch.Generator().manual_seed(2), sigma=1e-12)
    dense = g.to_dense()
    norms = dense.flatten(1).norm(dim=1).clamp(min=1.0)
    ghat = (dense / norms[:, None, None]).sum(0) / 3.0
    assert set(res.selected.tolist()) == set(range(40)) | set(range(100, 140))
    torch.testing.assert_close(res.grad.values, ghat[res.grad.rows], atol=1e-9, rtol=0)
    noise = []
    gen = torch.Generator().manual_seed(3)
    untouched = torch.tensor([r for r in list(range(40)) + list(range(100, 140)) if r not in (0, 1, 2, 101)])
    for _ in range(30):
        res = step(g, sel, gen, sigma=0.7)
        dense = torch.zeros(200, 3, dtype=res.grad.values.dtype).index_copy_(0, res.grad.rows, res.grad.values)
        noise.append(dense[untouched].flatten())
    z = torch.cat(noise).numpy() / (0.7 / 3.0)
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert stats.kstest(z / 2, "norm").pvalue < 1e-6


#: 2 tables of 3 rows, head = the first row of each: {0, 3}; the threshold ranges over {1, 2, 4, 5}
TAIL = [1, 2, 4, 5]
SAMPLES = [[0, 3, 1], [0, 2, 5], [3, 4]]


def tail_counts(samples, head, *, over_all=False):
    """c_r on every row: each sample adds 1/sqrt(n) to each of its rows outside ``head`` (n: its rows outside the
    head; ``over_all``: all its rows — the wrong normalisation)."""
    c = np.zeros(6)
    for s in samples:
        tail = [r for r in s if r not in head]
        for r in tail:
            c[r] += 1 / np.sqrt(len(s) if over_all else len(tail))
    return c


def test_picks_outside_the_head_follow_the_exact_law_normalised_over_the_tail(monkeypatch):
    """Through dp_step: the head every step, and the set of other rows selected is the product law of
    P(c_r + N(0, σ_sel²) > τ) with c normalised over each sample's non-head rows; normalising over all the sample's
    rows, or twice σ_sel, is rejected."""
    sigma, tau = 0.5, 0.8
    cfg = GaussianThresholdSelectionConfig(sigma=sigma, threshold=tau, public_head=1)
    sel = make_selector(cfg, num_rows=6, table_starts=[0, 3])
    g = batch(SAMPLES, 6)
    gen = torch.Generator().manual_seed(4)
    draws = []
    for _ in range(6_000):
        s = step(g, sel, gen).selected.tolist()
        assert 0 in s and 3 in s and len(s) == len(set(s))
        draws.append(tuple(r for r in TAIL if r in s))

    def law(c, sd):
        return {tuple(TAIL[i] for i in k): v for k, v in product_law(norm.sf((tau - c[TAIL]) / sd)).items()}

    assert set_pvalue(draws, law(tail_counts(SAMPLES, {0, 3}), sigma)) > 1e-3
    assert set_pvalue(draws, law(tail_counts(SAMPLES, {0, 3}, over_all=True), sigma)) < 1e-6
    assert set_pvalue(draws, law(tail_counts(SAMPLES, {0, 3}), 2 * sigma)) < 1e-6


class Spy(GaussianThresholdSelector):
    """Records the scores the step hands to the selection."""

    seen: list = []

    def select(self, touched, scores, **kw):
        dense = torch.zeros(kw["selectable_rows"], dtype=torch.float64)
        Spy.seen.append(dense.index_copy_(0, touched, scores.double()))
        return super().select(touched, scores, **kw)


def test_counts_the_selection_sees_move_by_exactly_one_per_sample():
    """Add/remove one sample: the contribution counts outside the head move by exactly 1 in ℓ2 (0 for a sample with
    head rows only), so the Gaussian's sensitivity 1 holds with the head left out."""
    rng = np.random.default_rng(5)
    spy = Spy(sigma=1.0, threshold=1.0, head=PublicHead(4, (0, 15)))
    head = set(range(4)) | set(range(15, 19))
    for _ in range(40):
        samples = [sorted(rng.choice(30, rng.integers(1, 7), replace=False).tolist()) for _ in range(4)]
        Spy.seen = []
        step(batch(samples, 30), spy, torch.Generator().manual_seed(0))
        step(batch(samples[1:], 30), spy, torch.Generator().manual_seed(0))
        moved = float((Spy.seen[0] - Spy.seen[1]).norm())
        assert moved == pytest.approx(0.0 if set(samples[0]) <= head else 1.0, abs=1e-12)
        assert all(float(c[sorted(head)].abs().max()) == 0.0 for c in Spy.seen)


def test_head_is_never_a_false_positive_and_max_rows_caps_the_picks_outside_it():
    """τ far below every count: every non-head row passes; max_rows = 2 keeps 2 of the 4 (uniformly), plus the
    head."""
    sel = GaussianThresholdSelector(sigma=0.1, threshold=-10.0, max_rows=2, head=PublicHead(1, (0, 3)))
    gen = torch.Generator().manual_seed(6)
    touched, counts = torch.tensor([0, 2, 3]), torch.tensor([5.0, 1.0, 5.0])  # a caller that left the head in
    outs = []
    for _ in range(3_000):
        s = sel.select(touched, counts, selectable_rows=6, score_sensitivity=1.0, ctx=CTX, generator=gen).tolist()
        assert len(s) == 4 and s[-2:] == [0, 3]
        outs.append(tuple(sorted(s[:2])))
    assert set_pvalue(outs, {o: 1 / 6 for o in itertools.combinations(TAIL, 2)}) > 1e-3


def test_factory_config_and_refusals():
    assert SELECTIONS["public_top"] is PublicTopSelectionConfig
    for bad in ({"rows_per_table": 0},):
        with pytest.raises(ConfigError, match="rows_per_table"):
            PublicTopSelectionConfig(**bad)
    with pytest.raises(ConfigError, match="public_head"):
        GaussianThresholdSelectionConfig(sigma=1.0, public_head=0)
    plain = make_selector(GaussianThresholdSelectionConfig(sigma=1.0), num_rows=10, table_starts=[0, 5])
    assert plain.public_rows(selectable_rows=10, device="cpu") is None
    # without the model's tables: the spend is known (the privacy plan), selecting is refused in one line
    no_tables = make_selector(PublicTopSelectionConfig(rows_per_table=2), num_rows=10)
    assert no_tables.spend() == FreeSpend("public_top")
    with pytest.raises(ConfigError, match="needs the model's tables"):
        step(batch([[1]], 10), no_tables, torch.Generator())
    headed = make_selector(GaussianThresholdSelectionConfig(sigma=1.0, public_head=2), num_rows=10,
                           table_starts=[0, 5])
    for s in (headed, make_selector(PublicTopSelectionConfig(rows_per_table=2), num_rows=10, table_starts=[0, 5])):
        with pytest.raises(ConfigError, match="dp.preselect"):
            preselected(s, torch.tensor([1, 2, 3]))
