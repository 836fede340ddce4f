"""The O(U + c) sparse-vector selector (geometric skips over untouched rows) has the output law of the O(R)
brute-force one (privacy.md §4.7); broken skips are detected; R = 10^12 runs."""

import time

import pytest
import torch
from test_selection import two_sample_pvalue

import widedp.dp.selection.base as selection_base
import widedp.dp.selection.svt as svt
from widedp.config import SparseVectorSelectionConfig
from widedp.dp.selection import SelectionContext, SparseVectorSelector, make_selector

CTX = SelectionContext(epoch=0, num_epochs=1)



def draws(sel, touched, scores, num_rows, n, seed, du=1.0):
    gen = torch.Generator().manual_seed(seed)
    return [tuple(sel.select(touched, scores, selectable_rows=num_rows, score_sensitivity=du, ctx=CTX,
                             generator=gen).tolist()) for _ in range(n)]


def selectors(**kw):
    return (SparseVectorSelector(method="sparse", score_clip=1.0, **kw),
            SparseVectorSelector(method="brute", score_clip=1.0, **kw))


KW = {"epsilon": 4.0, "threshold": 0.5, "cutoff": 2, "threshold_fraction": 0.3}
TOUCHED, SCORES = torch.tensor([1, 4]), torch.tensor([1.0, 0.4])


@pytest.fixture(scope="module")
def reference():
    return draws(selectors(**KW)[1], TOUCHED, SCORES, 6, 20_000, 1)


@pytest.mark.parametrize("scan", ["native", "python"])
@pytest.mark.parametrize("dense_factor", [4, 0])  # 0: positions by the rejection sampler
def test_sparse_matches_brute_force(monkeypatch, reference, dense_factor, scan):
    """Ordered outcomes on R = 6 (2 touched), c = 2: the same law as the O(R) reference, with either host scan."""
    monkeypatch.setattr(selection_base, "_DENSE_FACTOR", dense_factor)
    if scan == "python":
        monkeypatch.setattr(svt.native, "available", lambda: False)
    a = draws(selectors(**KW)[0], TOUCHED, SCORES, 6, 10_000, 0)
    assert two_sample_pvalue(a, reference) > 1e-3
    assert any(len(o) == 2 and all(r not in (1, 4) for r in o) for o in a)  # untouched rows are picked


@pytest.mark.parametrize("broken", ["tail_scale", "off_by_one"])
def test_broken_skips_are_detected(monkeypatch, reference, broken):
    # the breakage is put into the Python scan (the native one returns its picks exactly: tests/native)
    monkeypatch.setattr(svt.native, "available", lambda: False)
    if broken == "tail_scale":  # untouched pass probability with half the query noise scale
        original = svt.laplace_tail
        monkeypatch.setattr(svt, "laplace_tail", lambda t, s: original(t, s / 2))
    else:  # skip one untouched row too many
        original = svt.geometric_failures
        monkeypatch.setattr(svt, "geometric_failures", lambda v, p: original(v, p) + 1)
    a = draws(selectors(**KW)[0], TOUCHED, SCORES, 6, 10_000, 0)
    assert two_sample_pvalue(a, reference) < 1e-6


def test_sparse_matches_brute_force_at_moderate_size():
    """R = 60, 6 touched, c = 3, low threshold (many untouched answers): first pick, second pick and the number of
    picks have the reference's laws."""
    kw = {"epsilon": 2.0, "threshold": 0.8, "cutoff": 3, "threshold_fraction": 0.5}
    touched = torch.tensor([3, 17, 18, 30, 44, 59])
    scores = torch.tensor([2.0, 1.5, 0.2, 3.0, 0.7, 1.0])
    sparse, brute = selectors(**kw)
    a = draws(sparse, touched, scores, 60, 8_000, 2)
    b = draws(brute, touched, scores, 60, 8_000, 3)
    assert two_sample_pvalue([len(o) for o in a], [len(o) for o in b]) > 1e-3
    for i in (0, 1):
        assert two_sample_pvalue([o[i] for o in a if len(o) > i], [o[i] for o in b if len(o) > i]) > 1e-3
    assert all(len(set(o)) == len(o) for o in a)


def test_trillion_rows_and_factory():
    sel = make_selector(SparseVectorSelectionConfig(epsilon=5.0, threshold=0.01, cutoff=50, score_clip=0.05),
                        num_rows=10**12)
    assert sel.method == "sparse" and sel.score_kind == "norm"
    gen = torch.Generator().manual_seed(4)
    t0 = time.perf_counter()
    s = sel.select(torch.tensor([1, 5, 10**11]), torch.tensor([0.05, 0.02, 0.0]), selectable_rows=10**12,
                   score_sensitivity=0.05, ctx=CTX, generator=gen)
    assert time.perf_counter() - t0 < 5
    assert s.numel() == 50 and s.unique().numel() == 50 and sel.spend().cutoff == 50
    assert make_selector(SparseVectorSelectionConfig(method="brute"), num_rows=10).method == "brute"
