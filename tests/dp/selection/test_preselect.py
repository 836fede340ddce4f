"""One-shot DP pre-selection (DP-FEST): contribution totals, the exact law against brute force over all rows (with a
broken false-positive ranking detected), its spend and the prefix-aware calibration / budget, the restricted selector
in the step, and its prefix entry (``widedp.run.plan``; training runs it: tests/run/test_preselect_setup.py)."""

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats

import widedp.dp.selection.preselect as pre
from widedp import accounting
from widedp.config import AllRowsConfig, Config, DataConfig, DPConfig, TrainConfig, UniformSelectionConfig
from widedp.config.selection import PreselectConfig
from widedp.dp.rowgrads import PerSampleRows
from widedp.dp.selection import SelectionContext, make_selector
from widedp.dp.spend import GaussianSelectionSpend, GaussianSpend, StepSpend
from widedp.dp.step import dp_step
from widedp.errors import ConfigError
from widedp.run import plan

CTX = SelectionContext(0, 1)


def batch_of(samples, num_rows, dim=2):
    offsets = torch.tensor([0, *np.cumsum([len(s) for s in samples])], dtype=torch.long)
    rows = torch.tensor([r for s in samples for r in s], dtype=torch.long)
    return PerSampleRows(torch.ones(rows.numel(), dim, dtype=torch.float64), rows, offsets, num_rows)


def test_contribution_totals_over_batches():
    rng = np.random.default_rng(0)
    samples = [[int(r) for r in rng.choice(50, rng.integers(1, 6), replace=False)] for _ in range(40)]
    ref = np.zeros(50)
    for s in samples:
        ref[s] += 1 / np.sqrt(len(s))
    ids, counts = pre.contribution_totals(batch_of(samples[i:i + 7], 50) for i in range(0, 40, 7))
    assert ids.tolist() == sorted(set(r for s in samples for r in s))
    np.testing.assert_allclose(counts.numpy(), ref[ids.numpy()], atol=1e-12)
    ids2, counts2 = pre.contribution_totals([batch_of([[1, 48, 49], [49]], 50)], selectable=48)
    assert ids2.tolist() == [1] and counts2.tolist() == [1.0]  # rows >= 48 neither counted nor normalised by


def _law_pvalue(a, b):
    keys = sorted(set(a) | set(b))
    table = np.array([[a.count(k) for k in keys], [b.count(k) for k in keys]])
    return float(stats.chi2_contingency(table).pvalue)


def test_preselection_law_matches_brute_force(monkeypatch):
    """Top K of noisy counts above τ over ALL rows: V-independent sampler == dense brute force; untouched rows ranked
    with unconditioned N(0, σ²) values (a broken truncated normal) are detected."""
    cfg = PreselectConfig(rows=2, sigma=1.0, threshold=0.3)
    ids, counts = torch.tensor([1, 4]), torch.tensor([1.2, 0.5], dtype=torch.float64)
    num_rows, n = 6, 8_000
    gen = torch.Generator().manual_seed(1)
    ours = [tuple(pre.preselect_rows(ids, counts, cfg, num_rows=num_rows, generator=gen).tolist()) for _ in range(n)]
    dense = torch.zeros(num_rows, dtype=torch.float64).index_copy_(0, ids, counts)
    noisy = dense + torch.randn(n, num_rows, generator=gen, dtype=torch.float64)  # every row, every draw
    top = noisy.topk(cfg.rows, dim=1)
    brute = [tuple(sorted(i for i, v in zip(ids_, vals) if v > cfg.tau))
             for ids_, vals in zip(top.indices.tolist(), top.values.tolist())]
    assert _law_pvalue(ours, brute) > 1e-3
    monkeypatch.setattr(pre.torch.special, "ndtri", lambda x: -torch.randn(x.shape, generator=gen,
                                                                            dtype=torch.float64))
    broken = [tuple(pre.preselect_rows(ids, counts, cfg, num_rows=num_rows, generator=gen).tolist())
              for _ in range(n)]
    assert _law_pvalue(broken, brute) < 1e-6


def test_per_table_caps_match_brute_force():
    """table_rows: the K_t largest noisy counts above τ of each table (same noisy counts), against dense brute force;
    pooled top-K (ignoring the tables) is detected as a different law."""
    cfg = PreselectConfig(rows=3, sigma=1.0, threshold=0.3, table_rows=(1, 2))
    ids, counts = torch.tensor([0, 1, 4]), torch.tensor([2.0, 1.5, 0.4], dtype=torch.float64)
    num_rows, n, starts = 7, 8_000, (0, 3)
    gen = torch.Generator().manual_seed(4)
    ours = [tuple(pre.preselect_rows(ids, counts, cfg, num_rows=num_rows, generator=gen, table_starts=starts).tolist())
            for _ in range(n)]
    dense = torch.zeros(num_rows, dtype=torch.float64).index_copy_(0, ids, counts)
    noisy = dense + torch.randn(n, num_rows, generator=gen, dtype=torch.float64)

    def top(vals, lo, hi, k):
        cand = sorted(((v, i) for i, v in enumerate(vals) if lo <= i < hi and v > cfg.tau), reverse=True)
        return [i for _, i in cand[:k]]

    brute = [tuple(sorted(top(v, 0, 3, 1) + top(v, 3, 7, 2))) for v in noisy.tolist()]
    pooled = [tuple(sorted(top(v, 0, 7, 3))) for v in noisy.tolist()]
    assert _law_pvalue(ours, brute) > 1e-3 and _law_pvalue(ours, pooled) < 1e-6
    with pytest.raises(ConfigError, match="table_rows"):
        PreselectConfig(rows=4, table_rows=(1, 2))
    with pytest.raises(ConfigError, match="1 table"):
        pre.preselect_rows(ids, counts, cfg, num_rows=num_rows, generator=gen)


def test_v_independent_and_top_k():
    cfg = PreselectConfig(rows=3, sigma=1.0, threshold_sigmas=7.0)  # ~1e-12 * 1e12 = ~1 false positive
    ids = torch.tensor([10, 10**11, 10**12 - 1])
    counts = torch.tensor([100.0, 50.0, 20.0], dtype=torch.float64)
    rows = pre.preselect_rows(ids, counts, cfg, num_rows=10**12, generator=torch.Generator().manual_seed(2))
    assert rows.tolist() == sorted(rows.tolist()) and rows.numel() == 3 and 10 in rows.tolist()


def test_spend_and_prefix_aware_calibration():
    cfg = PreselectConfig(rows=10, sigma=3.0, threshold=5.0)
    step0 = pre.preselect_step(cfg)
    assert step0 == StepSpend(1.0, (GaussianSelectionSpend(3.0, 1.0),))
    one = accounting.epsilon_for_step(step0, steps=1, delta=1e-5)
    assert one == pytest.approx(accounting.epsilon_for_step(StepSpend(1.0, (GaussianSpend(3.0),)), steps=1,
                                                            delta=1e-5), rel=1e-9)
    mk = lambda s: StepSpend(0.01, (GaussianSpend(s),))  # noqa: E731
    kw = {"steps": 300, "delta": 1e-5, "target_epsilon": 2.0, "accountant": "rdp"}
    plain = accounting.calibrate_noise_multiplier(mk, **kw)
    with_pre = accounting.calibrate_noise_multiplier(mk, **kw, prefix=[(step0, 1)])
    assert with_pre > plain
    total = accounting.compose_epsilon([(step0, 1), (mk(with_pre), 300)], delta=1e-5, accountant="rdp")
    assert 0.99 * 2.0 <= total <= 2.0
    t = accounting.max_steps(mk(plain), delta=1e-5, target_epsilon=2.0, accountant="rdp", prefix=[(step0, 1)])
    assert t < accounting.max_steps(mk(plain), delta=1e-5, target_epsilon=2.0, accountant="rdp")


def test_its_prefix_entry():
    dp = DPConfig(clip1=1.0, clip2=None, noise_multiplier=1.0, selection=AllRowsConfig(), target_epsilon=3.0,
                  accountant="rdp", calibrate="noise_multiplier",
                  preselect=PreselectConfig(rows=10, sigma=3.0, threshold=5.0))
    cfg = Config(data=DataConfig(splits=(10_000, 10, 10)), train=TrainConfig(epochs=2, batch_size=100), dp=dp)
    assert plan.prefix_of(cfg).entries == (StepSpend(1.0, (GaussianSelectionSpend(3.0, 1.0),)),)
    assert plan.preselect_runs(dp) == [(StepSpend(1.0, (GaussianSelectionSpend(3.0, 1.0),)), 1)]
    assert plan.preselect_runs(replace(dp, preselect=None)) == []


def test_restricted_selector_in_the_step():
    """Only pre-selected rows are ever selected (so updated); uniform picks are uniform over them."""
    rows = torch.tensor([2, 5, 7, 11])
    sel = pre.preselected(make_selector(UniformSelectionConfig(k=2), num_rows=20), rows)
    g = batch_of([[0, 2, 5], [5, 19], [7]], 20)
    gen = torch.Generator().manual_seed(3)
    picks = []
    for _ in range(3_000):
        res = dp_step(g, batch_size=3.0, sampling_rate=0.1, clip1=1.0, clip2=None, noise_multiplier=1.0,
                      selector=sel, ctx=CTX, generator=gen)
        picks.append(tuple(sorted(res.grad.rows.tolist())))
    assert set(picks) == set(itertools.combinations(rows.tolist(), 2))
    counts = [picks.count(o) for o in sorted(set(picks))]
    assert stats.chisquare(counts).pvalue > 1e-3
    every = pre.preselected(make_selector(AllRowsConfig(), num_rows=20), rows)
    assert every.select(torch.tensor([2, 3]), torch.zeros(0), selectable_rows=20, score_sensitivity=0.0, ctx=CTX,
                        generator=gen).tolist() == rows.tolist()
    with pytest.raises(ConfigError, match="dp.selection.k"):
        pre.preselected(make_selector(UniformSelectionConfig(k=5), num_rows=20), rows)
    with pytest.raises(ConfigError, match="no row"):
        pre.preselected(make_selector(AllRowsConfig(), num_rows=20), rows[:0])
