"""Row selection: output laws against exact/brute-force references, with negative controls (privacy.md §4)."""

import itertools
import math
import random

import numpy as np
import pytest
import torch
from laws import ordered_law
from scipy import stats

import widedp.dp.selection.base as selection_base
import widedp.dp.selection.exponential as selection_exponential
from widedp.dp.noise import laplace
from widedp.dp.selection import (
    AllRowsSelector,
    ExponentialSelector,
    RandomSparsificationSelector,
    SelectionContext,
    SparseVectorSelector,
    UniformSelector,
    gumbel_topk,
    gumbel_topk_sparse,
    sample_distinct,
)
from widedp.dp.spend import FreeSpend

CTX = SelectionContext(epoch=0, num_epochs=1)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _dense_factor(monkeypatch, value: int) -> None:
    """Set ``_DENSE_FACTOR`` where ``sample_distinct`` and the exponential selector read it."""
    monkeypatch.setattr(selection_base, "_DENSE_FACTOR", value)
    monkeypatch.setattr(selection_exponential, "_DENSE_FACTOR", value)


def law_pvalue(draws, law: dict[tuple[int, ...], float]) -> float:
    """χ² p-value of ordered outcomes (rows of ``draws``) against an exact law; impossible outcomes fail."""
    counts: dict[tuple[int, ...], int] = {}
    for o in map(tuple, np.asarray(draws).tolist()):
        counts[o] = counts.get(o, 0) + 1
    if any(o not in law for o in counts):
        return 0.0
    n = sum(counts.values())
    keys = sorted(law)
    obs = np.array([counts.get(o, 0) for o in keys], dtype=np.float64)
    exp = np.array([law[o] for o in keys]) * n
    return float(stats.chisquare(obs, exp).pvalue)


def two_sample_pvalue(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> float:
    """χ² homogeneity test of two samples of outcomes."""
    keys = sorted(set(a) | set(b))
    ca = {o: 0 for o in keys}
    cb = dict(ca)
    for o in a:
        ca[o] += 1
    for o in b:
        cb[o] += 1
    table = np.array([[ca[o] for o in keys], [cb[o] for o in keys]])
    return float(stats.chi2_contingency(table).pvalue)


# ---------------------------------------------------------------------------------------- exponential mechanism


def test_gumbel_topk_matches_sequential_picks():
    """§4.1: Gumbel top-k of ε''u/(2Δu) + Gumbel == k sequential picks; dropping the factor 2 is detected."""
    sel = ExponentialSelector(k=2, epsilon=2.0, score_clip=1.0)
    scores = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
    logits = scores * sel.key_scale(1.0)
    law = ordered_law(logits.numpy(), 2)
    gen = torch.Generator().manual_seed(0)
    n = 400_000
    assert law_pvalue(gumbel_topk(logits.expand(n, 5), 2, generator=gen), law) > 1e-3
    wrong = scores * (sel.epsilon / 1.0)  # ε''u/Δu
    assert law_pvalue(gumbel_topk(wrong.expand(n, 5), 2, generator=gen), law) < 1e-6


def test_exact_law_on_neighbours_is_k_epsilon_dp():
    """§4.2: max |log P(o) − log P'(o)| <= k·ε'' over neighbouring scores (|u_r − u'_r| <= Δu); ε without /2 breaks
    it."""
    rng = np.random.default_rng(0)
    num_rows, k, eps, s0 = 5, 2, 1.0, 0.3
    du = s0
    sel = ExponentialSelector(k=k, epsilon=eps, score_clip=s0)
    worst = {"right": 0.0, "broken": 0.0}
    for t in range(1500):
        if t % 2:
            u = rng.uniform(0, s0, num_rows)
            u2 = np.clip(u + rng.uniform(-du, du, num_rows), 0, s0)
        else:  # corners, where the bound is nearly attained
            u = rng.choice([0.0, s0], num_rows)
            u2 = np.clip(u + rng.choice([-du, du], num_rows), 0, s0)
        assert np.abs(u - u2).max() <= du + 1e-12
        for name, scale in (("right", sel.key_scale(du)), ("broken", eps / du)):
            p, q = ordered_law(u * scale, k), ordered_law(u2 * scale, k)
            worst[name] = max(worst[name], max(abs(math.log(p[o] / q[o])) for o in p))
    assert worst["right"] <= k * eps + 1e-9
    assert worst["right"] > 0.6 * k * eps  # the search gets near the bound
    assert worst["broken"] > k * eps


def _draw(fn, n: int) -> np.ndarray:
    return np.stack([fn().numpy() for _ in range(n)])


@pytest.mark.parametrize("dense_factor", [4, 0])  # 0: force the rejection sampler for the untouched ids
def test_sparse_gumbel_topk_matches_brute_force(monkeypatch, dense_factor):
    """§4.6: the V-independent sampler (order statistics on random untouched ids) has the law of brute-force
    Gumbel top-k over all rows."""
    _dense_factor(monkeypatch, dense_factor)
    num_rows, k = 6, 2
    touched = torch.tensor([1, 4])
    logits = torch.tensor([1.2, 0.4], dtype=torch.float64)
    dense = torch.zeros(num_rows, dtype=torch.float64).index_copy_(0, touched, logits)
    law = ordered_law(dense.numpy(), k)
    gen = torch.Generator().manual_seed(1)
    fast = _draw(lambda: gumbel_topk_sparse(touched, logits, num_rows=num_rows, k=k, generator=gen), 8_000)
    assert law_pvalue(fast, law) > 1e-3
    assert law_pvalue(gumbel_topk(dense.expand(200_000, num_rows), k, generator=gen), law) > 1e-3


def test_sorted_untouched_ids_are_detected(monkeypatch):
    """Negative control of §4.6: order statistics attached to untouched ids in sorted order is biased."""
    original = selection_exponential.sample_distinct
    monkeypatch.setattr(selection_exponential, "sample_distinct", lambda *a, **kw: original(*a, **kw).sort().values)
    touched = torch.tensor([1, 4])
    logits = torch.tensor([1.2, 0.4], dtype=torch.float64)
    dense = torch.zeros(6, dtype=torch.float64).index_copy_(0, touched, logits)
    gen = torch.Generator().manual_seed(1)
    draws = _draw(lambda: gumbel_topk_sparse(touched, logits, num_rows=6, k=2, generator=gen), 5_000)
    assert law_pvalue(draws, ordered_law(dense.numpy(), 2)) < 1e-6


def test_sparse_gumbel_topk_marginals_at_moderate_size():
    """R = 50, 5 touched, k = 3 (the rejection path without forcing): first- and second-pick marginals exact."""
    num_rows, k = 50, 3
    touched = torch.tensor([3, 17, 18, 30, 49])
    logits = torch.tensor([2.0, 1.5, 0.2, 3.0, 0.7], dtype=torch.float64)
    w = np.exp(torch.zeros(num_rows, dtype=torch.float64).index_copy_(0, touched, logits).numpy())
    first = w / w.sum()
    second = np.array([sum(first[i] * w[j] / (w.sum() - w[i]) for i in range(num_rows) if i != j)
                       for j in range(num_rows)])
    gen = torch.Generator().manual_seed(2)
    draws = _draw(lambda: gumbel_topk_sparse(touched, logits, num_rows=num_rows, k=k, generator=gen), 8_000)
    assert all(len(set(d)) == k for d in draws.tolist())
    for col, p in ((0, first), (1, second)):
        obs = np.bincount(draws[:, col], minlength=num_rows)
        assert stats.chisquare(obs, p * len(draws)).pvalue > 1e-3


@pytest.mark.parametrize("dense_factor", [4, 0])
def test_sample_distinct_is_a_uniform_ordered_sample(monkeypatch, dense_factor):
    _dense_factor(monkeypatch, dense_factor)
    gen = torch.Generator().manual_seed(3)
    exclude = torch.tensor([1, 4])
    draws = _draw(lambda: sample_distinct(2, 6, exclude=exclude, generator=gen, device="cpu"), 12_000)
    law = {o: 1 / 12 for o in itertools.permutations([0, 2, 3, 5], 2)}
    assert law_pvalue(draws, law) > 1e-3


@pytest.mark.parametrize("method", ["sparse", "brute"])
def test_untouched_rows_stay_candidates(monkeypatch, method):
    """All scores 0 (touched or not): every row, untouched included, is picked with probability 1/R."""
    _dense_factor(monkeypatch, 0)  # the rejection id sampler even at R = 10
    sel = ExponentialSelector(k=1, epsilon=1.0, score_clip=0.1, method=method)
    touched = torch.tensor([2, 5, 7])
    scores = torch.zeros(3)
    gen = torch.Generator().manual_seed(4)
    picks = [int(sel.select(touched, scores, selectable_rows=10, score_sensitivity=0.1, ctx=CTX, generator=gen))
             for _ in range(5_000)]
    obs = np.bincount(picks, minlength=10)
    assert stats.chisquare(obs).pvalue > 1e-3
    assert obs[[0, 1, 3, 4, 6, 8, 9]].sum() > 0.65 * 5_000  # ~7/10 untouched, not 0


def test_method_names_say_which_sampler_runs(monkeypatch):
    """auto: brute force on a small row space, the O(U + k) sampler on a large one; sparse and brute: always."""
    calls = []
    for f in ("gumbel_topk", "gumbel_topk_sparse"):
        original = getattr(selection_exponential, f)
        monkeypatch.setattr(selection_exponential, f, lambda *a, f=f, o=original, **kw: calls.append(f) or o(*a, **kw))
    touched, scores = torch.tensor([1, 3]), torch.tensor([0.1, 0.0])
    for method, rows, used in [("auto", 100, "gumbel_topk"), ("auto", 10**6, "gumbel_topk_sparse"),
                               ("sparse", 100, "gumbel_topk_sparse"), ("brute", 10**5, "gumbel_topk")]:
        calls.clear()
        sel = ExponentialSelector(k=2, epsilon=1.0, score_clip=0.1, method=method)
        sel.select(touched, scores, selectable_rows=rows, score_sensitivity=0.1, ctx=CTX,
                   generator=torch.Generator().manual_seed(0))
        assert calls == [used], (method, rows)
    with pytest.raises(ValueError, match="method"):
        ExponentialSelector(k=2, epsilon=1.0, score_clip=0.1, method="fast")


# --------------------------------------------------------------------------------------------- sparse vector


def svt_reference(scores, *, eps, threshold, cutoff, frac, du, rng, renoise=True, touched=None, query_factor=2.0):
    """Plain-loop AboveThreshold with cutoff (and knobs for broken variants)."""
    eps1, eps2 = frac * eps, (1 - frac) * eps

    def lap(b):
        return b * (rng.expovariate(1.0) - rng.expovariate(1.0))

    order = list(range(len(scores)))
    rng.shuffle(order)
    if touched is not None:  # broken: visits only touched rows
        order = [r for r in order if r in touched]
    noisy_threshold = threshold + lap(du / eps1)
    out = []
    for r in order:
        if scores[r] + lap(query_factor * du / eps2) >= noisy_threshold:
            out.append(r)
            if len(out) == cutoff:
                break
            if renoise:
                noisy_threshold = threshold + lap(du / eps1)
    return tuple(out)


def test_sparse_vector_matches_reference_and_detects_broken_variants():
    """§4.7: same law as a plain-loop reference; not re-noising the threshold, visiting only touched rows and a
    query noise half as wide are all detected."""
    eps, threshold, cutoff, frac, du = 8.0, 0.8, 2, 0.2, 1.0  # wide threshold noise: re-noising matters
    sel = SparseVectorSelector(epsilon=eps, threshold=threshold, cutoff=cutoff, threshold_fraction=frac,
                               score_clip=1.0)
    touched = torch.tensor([0, 2])
    scores = torch.tensor([1.0, 0.6])
    dense = [1.0, 0.0, 0.6, 0.0]
    gen = torch.Generator().manual_seed(5)
    ours = [tuple(sel.select(touched, scores, selectable_rows=4, score_sensitivity=du, ctx=CTX, generator=gen).tolist())
            for _ in range(8_000)]
    rng = random.Random(0)
    kw = {"eps": eps, "threshold": threshold, "cutoff": cutoff, "frac": frac, "du": du, "rng": rng}
    reference = [svt_reference(dense, **kw) for _ in range(30_000)]
    assert two_sample_pvalue(ours, reference) > 1e-3
    for broken in ({"renoise": False}, {"touched": {0, 2}}, {"query_factor": 1.0}):
        bad = [svt_reference(dense, **kw, **broken) for _ in range(30_000)]
        assert two_sample_pvalue(ours, bad) < 1e-6, broken


def test_sparse_vector_zero_scores_pick_any_row():
    sel = SparseVectorSelector(epsilon=2.0, threshold=0.0, cutoff=1, threshold_fraction=0.5, score_clip=1.0)
    gen = torch.Generator().manual_seed(6)
    touched = torch.tensor([1, 2])
    picks = []
    for _ in range(3_000):
        s = sel.select(touched, torch.zeros(2), selectable_rows=8, score_sensitivity=1.0, ctx=CTX, generator=gen)
        picks += s.tolist()
    obs = np.bincount(picks, minlength=8)
    assert len(picks) > 2_000 and stats.chisquare(obs).pvalue > 1e-3


def test_laplace_scale():
    gen = torch.Generator().manual_seed(7)
    x = laplace((20_000,), scale=0.7, generator=gen, device="cpu", dtype=torch.float64).numpy()
    assert stats.kstest(x, stats.laplace(scale=0.7).cdf).pvalue > 0.01
    assert stats.kstest(x, stats.laplace(scale=1.4).cdf).pvalue < 1e-6


# ------------------------------------------------------------------------------------------ data-independent


def test_uniform_law():
    gen = torch.Generator().manual_seed(8)
    sel = UniformSelector(k=2)
    empty = torch.zeros(0, dtype=torch.long)
    draws = _draw(lambda: sel.select(empty, torch.zeros(0), selectable_rows=5, score_sensitivity=0.0, ctx=CTX,
                                     generator=gen), 10_000)
    assert law_pvalue(draws, {o: 1 / 20 for o in itertools.permutations(range(5), 2)}) > 1e-3
    sel = UniformSelector(k=3)  # rejection path
    draws = _draw(lambda: sel.select(empty, torch.zeros(0), selectable_rows=1000, score_sensitivity=0.0, ctx=CTX,
                                     generator=gen), 10_000)
    assert all(len(set(d)) == 3 for d in draws.tolist())
    assert stats.chisquare(np.bincount(draws.ravel(), minlength=1000)).pvalue > 1e-3


def test_random_sparsification_mask_per_epoch():
    num_rows, epochs = 1000, 5
    sel = RandomSparsificationSelector(final_rate=0.8)
    gen = torch.Generator().manual_seed(9)
    empty = torch.zeros(0, dtype=torch.long)
    masks = []
    for e in range(epochs):
        ctx = SelectionContext(epoch=e, num_epochs=epochs)
        m = sel.select(empty, torch.zeros(0), selectable_rows=num_rows, score_sensitivity=0.0, ctx=ctx, generator=gen)
        again = sel.select(torch.tensor([3]), torch.zeros(1), selectable_rows=num_rows, score_sensitivity=0.0, ctx=ctx,
                           generator=gen)
        assert torch.equal(m, again)  # constant within the epoch
        assert m.numel() == round((1 - 0.8 * e / (epochs - 1)) * num_rows)  # keep-rate 1, .8, .6, .4, .2
        assert m.unique().numel() == m.numel() and sel.spend() == FreeSpend("random_sparsification")
        masks.append(m)
    assert not torch.equal(masks[1], masks[2][: masks[1].numel()])
    assert torch.equal(masks[0], torch.arange(num_rows))
    # without cooling the final rate applies from the first epoch
    flat = RandomSparsificationSelector(final_rate=0.8, gradual_cooling=False)
    m = flat.select(empty, torch.zeros(0), selectable_rows=num_rows, score_sensitivity=0.0,
                    ctx=SelectionContext(0, epochs), generator=gen)
    assert m.numel() == 200
    m2 = flat.select(empty, torch.zeros(0), selectable_rows=num_rows, score_sensitivity=0.0,
                     ctx=SelectionContext(1, epochs), generator=gen)
    assert m2.numel() == 200 and not torch.equal(m, m2)


def test_all_rows():
    sel = AllRowsSelector()
    s = sel.select(torch.tensor([1]), torch.zeros(1), selectable_rows=7, score_sensitivity=0.0, ctx=CTX,
                   generator=torch.Generator())
    assert torch.equal(s, torch.arange(7)) and sel.spend() == FreeSpend("all")


# ------------------------------------------------------------------------------------------ factory, records


def test_exponential_k_equals_all_rows():
    sel = ExponentialSelector(k=9, epsilon=1.0, score_clip=1.0, method="sparse")
    for _ in range(3):
        s = sel.select(torch.tensor([0, 4]), torch.tensor([0.5, 0.2]), selectable_rows=9, score_sensitivity=1.0,
                       ctx=CTX, generator=torch.Generator().manual_seed(11))
        assert sorted(s.tolist()) == list(range(9))


def test_random_sparsification_mask_survives_a_resume():
    # a resumed run has a fresh selector and a generator in another state: the epoch's mask must not change
    from widedp.dp.selection import RandomSparsificationSelector, SelectionContext

    ctx = SelectionContext(epoch=3, num_epochs=10)
    empty = torch.zeros(0, dtype=torch.long)
    g1 = torch.Generator().manual_seed(5)
    first = RandomSparsificationSelector(final_rate=0.5).select(
        empty, empty.float(), selectable_rows=50, score_sensitivity=0.0, ctx=ctx, generator=g1)
    g2 = torch.Generator().manual_seed(5)
    torch.rand(1000, generator=g2)  # the resumed generator has advanced
    again = RandomSparsificationSelector(final_rate=0.5).select(
        empty, empty.float(), selectable_rows=50, score_sensitivity=0.0, ctx=ctx, generator=g2)
    assert torch.equal(first, again)
    other = RandomSparsificationSelector(final_rate=0.5).select(
        empty, empty.float(), selectable_rows=50, score_sensitivity=0.0, ctx=SelectionContext(epoch=4, num_epochs=10),
        generator=g2)
    assert not torch.equal(first, other)
