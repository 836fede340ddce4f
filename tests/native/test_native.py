"""The fused native kernels (widedp.native) against the PyTorch reference: clip + aggregate, lazy Adam, dp_step.

Bit for bit where the reference's rounding can be followed (touched ids, ClipInfo, samples that are not clipped,
the Adam moments and step counts); to 1e-6 relative elsewhere (a clipped sample's norm is summed in another order;
ATen's vectorised sqrt is not always correctly rounded).
"""

from __future__ import annotations

import os
import shutil
import warnings

import numpy as np
import pytest
import torch

from widedp import native
from widedp.config import ExponentialSelectionConfig, GaussianThresholdSelectionConfig
from widedp.dp.clipping import aggregate, clip_aggregate, clip_per_sample
from widedp.dp.optim import LazyAdam
from widedp.dp.rowgrads import PerSampleRows, SparseRows
from widedp.dp.selection import SelectionContext, make_selector
from widedp.dp.step import dp_step
from widedp.models.cbow import CBOW, CBOWBatch

if os.environ.get("WIDEDP_NATIVE") == "0" or shutil.which(os.environ.get("CXX", "c++")) is None:
    pytest.skip("native kernels switched off (WIDEDP_NATIVE=0) or no C++ compiler", allow_module_level=True)


def jagged(gen: torch.Generator, *, B: int, R: int, D: int, max_len: int, dtype=torch.float32) -> PerSampleRows:
    """B samples of 0..max_len distinct rows each (some empty), norms spread around 1."""
    lens = torch.randint(0, min(max_len, R) + 1, (B,), generator=gen)
    rows = [torch.randperm(R, generator=gen)[: int(n)] for n in lens]
    offsets = torch.zeros(B + 1, dtype=torch.long)
    offsets[1:] = lens.cumsum(0)
    scale = torch.exp(torch.randn(B, generator=gen, dtype=dtype)).repeat_interleave(lens)
    values = torch.randn(int(lens.sum()), D, generator=gen, dtype=dtype) * scale.unsqueeze(1) / max(D, 1) ** 0.5
    return PerSampleRows(values, torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long), offsets, R)


def reference(g: PerSampleRows, *, clip1: float, b: float):
    clipped, info = clip_per_sample(g, clip1=clip1)
    return *aggregate(clipped, batch_size=b), info


def assert_matches(g: PerSampleRows, *, clip1: float, b: float) -> None:
    touched, ghat, info = reference(g, clip1=clip1, b=b)
    t2, gh2, info2 = clip_aggregate(g, clip1=clip1, batch_size=b, fused=True)
    assert torch.equal(t2, touched) and gh2.dtype == ghat.dtype and gh2.shape == ghat.shape
    assert torch.equal(info2.clipped, info.clipped) and torch.equal(info2.nonfinite, info.nonfinite)
    # error bound of a sum: relative to the summed magnitudes, not to a cancelled result
    mag = aggregate(PerSampleRows(clip_per_sample(g, clip1=clip1)[0].values.abs(), g.rows, g.offsets, g.num_rows),
                    batch_size=b)[1]
    assert torch.all((gh2 - ghat).abs() <= 1e-6 * mag), (gh2 - ghat).abs().max()
    if not info.clipped.any():
        assert torch.equal(gh2, ghat)  # nothing clipped: the same sums in the same order, bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("B", "R", "D", "max_len"), [(20, 2000, 100, 12), (64, 30, 7, 10), (300, 20_000, 128, 40),
                                                      (5, 1, 3, 1), (9, 5000, 1, 3)])
def test_clip_aggregate_equals_reference_on_random_jagged_batches(dtype, B, R, D, max_len):
    gen = torch.Generator().manual_seed(B * 7 + D)
    for clip1 in (0.3, 1.0, 3.0, 1e9):  # most clipped .. none clipped
        g = jagged(gen, B=B, R=R, D=D, max_len=max_len, dtype=dtype)
        assert_matches(g, clip1=clip1, b=float(B))


def test_threads_do_not_change_the_result():
    g = jagged(torch.Generator().manual_seed(5), B=300, R=5000, D=33, max_len=20)
    tables = [(0, torch.randn(3000, 33)), (3000, torch.randn(2000, 33))]
    grad = SparseRows(torch.randperm(5000)[:700], torch.randn(700, 33), 5000)
    out = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            copy = [(off, w.clone()) for off, w in tables]
            LazyAdam(copy, lr=0.1, betas=(0.9, 0.999), eps=1e-8, fused=True).step(grad)
            out.append((*clip_aggregate(g, clip1=0.7, batch_size=300.0, fused=True)[:2], *(w for _, w in copy)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*out))


def test_empty_batch_and_empty_samples():
    for B in (0, 4):
        g = PerSampleRows(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), torch.zeros(B + 1, dtype=torch.long), 9)
        touched, ghat, info = clip_aggregate(g, clip1=1.0, batch_size=3.0, fused=True)
        assert touched.shape == (0,) and ghat.shape == (0, 5) and info.clipped.shape == info.nonfinite.shape == (B,)
        assert not info.clipped.any() and not info.nonfinite.any()


def test_nonfinite_samples_contribute_zero_and_are_counted():
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        g = jagged(gen, B=40, R=60, D=6, max_len=5, dtype=dtype)
        v = g.values.clone()
        nonempty = (g.offsets.diff() > 0).nonzero().squeeze(1)
        bad = nonempty[:6]
        for j, x in zip(bad.tolist(), [float("nan"), float("inf"), -float("inf")] * 2):
            v[g.offsets[j] + (j % 2) * (g.offsets[j + 1] - g.offsets[j] - 1), j % 6] = x
        g = PerSampleRows(v, g.rows, g.offsets, g.num_rows)
        assert_matches(g, clip1=0.5, b=40.0)
        touched, ghat, info = clip_aggregate(g, clip1=0.5, batch_size=40.0, fused=True)
        assert info.nonfinite.nonzero().squeeze(1).tolist() == bad.tolist() and torch.isfinite(ghat).all()
        assert not info.clipped[bad].any()
        # a batch of only the bad samples: their rows are touched (ghat exactly 0), nothing else
        keep = torch.zeros(40, dtype=torch.bool)
        keep[bad] = True
        sample = torch.repeat_interleave(torch.arange(40), g.offsets.diff())
        pairs = keep[sample]
        offsets = torch.zeros(41, dtype=torch.long)
        offsets[1:] = (g.offsets.diff() * keep).cumsum(0)
        only = PerSampleRows(v[pairs], g.rows[pairs], offsets, g.num_rows)
        touched, ghat, info = clip_aggregate(only, clip1=0.5, batch_size=40.0, fused=True)
        assert torch.equal(touched, g.rows[pairs].unique()) and torch.equal(ghat, torch.zeros_like(ghat))


def test_huge_and_tiny_finite_entries():
    """1e30 (float32) / 1e300 (float64) entries square to inf: such samples are clipped to S1 all the same; tiny
    (subnormal) samples are kept unchanged."""
    for dtype, huge, tiny in ((torch.float32, 1e30, 1e-40), (torch.float64, 1e300, 1e-310)):
        values = torch.tensor([[huge, -huge, 3.0], [huge, 0.0, 0.0], [tiny, -tiny, 0.0], [1.0, 2.0, 2.0]],
                              dtype=dtype)
        rows = torch.tensor([0, 1, 0, 2])
        g = PerSampleRows(values, rows, torch.tensor([0, 2, 3, 4]), 4)
        assert_matches(g, clip1=1.5, b=1.0)
        touched, ghat, info = clip_aggregate(g, clip1=1.5, batch_size=1.0, fused=True)
        assert info.clipped.tolist() == [True, False, True] and not info.nonfinite.any()
        sample0 = torch.stack([ghat[0] - tiny * torch.tensor([1.0, -1.0, 0.0], dtype=dtype), ghat[1]])
        torch.testing.assert_close(torch.linalg.vector_norm(sample0), torch.tensor(1.5, dtype=dtype))
        torch.testing.assert_close(ghat[2], torch.tensor([1.0, 2.0, 2.0], dtype=dtype) * 0.5)
        single = PerSampleRows(values[2:3], rows[2:3], torch.tensor([0, 1]), 4)
        assert torch.equal(clip_aggregate(single, clip1=1.5, batch_size=1.0, fused=True)[1], values[2:3])


def test_bad_inputs_raise():
    v, r = torch.zeros(3, 2), torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match="offsets"):
        native.clip_aggregate(v, r, torch.tensor([0, 2]), num_rows=3, clip1=1.0, batch_size=1.0)
    with pytest.raises(RuntimeError, match="num_rows"):
        native.clip_aggregate(v, r, torch.tensor([0, 3]), num_rows=2, clip1=1.0, batch_size=1.0)


# ----------------------------------------------------------------------------------------------------- lazy Adam


def lazy_adam_pair(dtype, make, *, betas=(0.9, 0.999), steps: int = 25):
    """The reference ``LazyAdam`` and ``make(tables)`` (another implementation) driven with the same sparse
    gradients on two tables (ids 70..74 lie outside every table: ignored; 60..69 are never given).

    Returns:
        (ref, other, ref tables, other tables, weights before [70, 16], ids never updated).
    """
    gen = torch.Generator().manual_seed(11)
    tables = [(0, torch.randn(30, 16, generator=gen, dtype=dtype)), (30, torch.randn(40, 16, generator=gen,
                                                                                     dtype=dtype))]
    copy = [(off, w.clone()) for off, w in tables]
    before = torch.cat([w for _, w in tables])
    ref, other = LazyAdam(tables, lr=0.01, betas=betas, eps=1e-8, fused=False), make(copy)
    given = set()
    for _ in range(steps):
        rows = torch.randperm(75, generator=gen)[:12]
        rows = rows[(rows < 60) | (rows >= 70)]
        scale = 10.0 ** torch.randint(-4, 2, (rows.numel(), 1), generator=gen)
        grad = SparseRows(rows, torch.randn(rows.numel(), 16, generator=gen, dtype=dtype) * scale, 75)
        ref.step(grad)
        other.step(grad)
        given.update(r for r in rows.tolist() if r < 70)
    return ref, other, tables, copy, before, sorted(set(range(70)) - given)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.6), (0.9, 1 - 1e-8)])  # bias table; lerp's other branch;
def test_lazy_adam_fused_equals_reference(dtype, betas):  # pow fallback (table too long)
    ref, fused, tables, copy, before, untouched = lazy_adam_pair(
        dtype, lambda t: LazyAdam(t, lr=0.01, betas=betas, eps=1e-8, fused=True), betas=betas)
    assert fused.fused and not ref.fused and (ref._table is None) == (betas[1] == 1 - 1e-8)
    for a, b in zip(ref.state_dict().items(), fused.state_dict().items()):
        assert a[0] == b[0] and torch.equal(a[1], b[1])  # moments and per-row step counts bit for bit
    for (_, w), (_, w2) in zip(tables, copy):
        torch.testing.assert_close(w2, w, rtol=1e-6 if dtype == torch.float32 else 1e-13, atol=0)
    assert untouched and torch.equal(torch.cat([w for _, w in copy])[untouched], before[untouched])


# ------------------------------------------------------------------------------------------------ whole step


def _same_result(a, b) -> None:
    assert torch.equal(a.selected, b.selected) and torch.equal(a.grad.rows, b.grad.rows)
    # a float32 sum over many clipped samples rounds differently: error relative to the gradient's scale
    torch.testing.assert_close(b.grad.values, a.grad.values, rtol=1e-6, atol=1e-6 * float(a.grad.values.abs().max()))
    assert a.spend == b.spend and a.stats.rows_selected == b.stats.rows_selected
    for k in ("touched_share", "clipped1", "clipped2", "nonfinite"):
        assert torch.equal(getattr(a.stats, k), getattr(b.stats, k)), k


@pytest.mark.parametrize("sel", [ExponentialSelectionConfig(k=40, epsilon=1.0, score_clip=0.05),
                                 GaussianThresholdSelectionConfig(sigma=0.5, threshold=1.0)])
def test_dp_step_and_training_fused_equal_reference_on_cbow(sel):
    """Five CBOW steps with lazy Adam, fused and not, from the same seeds: same selections, noise and tables."""
    V, D, B = 300, 16, 32
    runs = []
    for fused in (False, True):
        model = CBOW(V, D, tied=False, generator=torch.Generator().manual_seed(0))
        opt = LazyAdam(model.row_tables(), lr=0.05, betas=(0.9, 0.999), eps=1e-8, fused=fused)
        selector = make_selector(sel, num_rows=model.num_rows)
        data, gen, results = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2), []
        for _ in range(5):
            batch = CBOWBatch(torch.randint(V, (B,), generator=data), torch.randint(V, (B, 4), generator=data),
                              torch.randint(V, (B, 5), generator=data))
            with torch.inference_mode():
                _, g = model.per_sample_row_grads(batch)
                results.append(dp_step(g, batch_size=B, sampling_rate=0.01, clip1=0.043, clip2=0.05,
                                       noise_multiplier=0.5, selector=selector, ctx=SelectionContext(epoch=0,
                                       num_epochs=1), generator=gen, fused=fused))
                opt.step(results[-1].grad)
        runs.append((results, [w.detach().clone() for _, w in model.row_tables()]))
    (ref, ref_w), (got, got_w) = runs
    assert 0 < float(ref[0].stats.clipped1) < 1  # some samples clipped, some not
    for a, b in zip(ref, got):
        _same_result(a, b)
    for a, b in zip(ref_w, got_w):  # Adam rescales a gradient entry near 0 (1e-9 here): 1e-10 apart moves w by ~lr/20
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-3 * 0.05)


def test_dp_step_fused_equals_reference_on_recsys():
    from widedp.config.recsys import RecsysDataConfig
    from widedp.data_prep.interactions import RecsysSplit, prepare_interactions
    from widedp.models.recsys import RecsysModel

    data = prepare_interactions(RecsysDataConfig(num_users=20, num_items=50, num_interactions=400, num_tags=6,
                                                 tags_per_item=3, context_cardinality=4, cache_dir=""))
    model = RecsysModel(data.cardinality, dim=4, hidden=(6,), init_scale=0.5,
                        generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        _, g = model.per_sample_row_grads(RecsysSplit(data.train, "cpu").batch(torch.arange(64)))
    assert g.always_rows > 0
    selector = make_selector(ExponentialSelectionConfig(k=10, epsilon=1.0, score_clip=0.1),
                             num_rows=model.total_rows - g.always_rows)
    res = [dp_step(g, batch_size=64, sampling_rate=0.1, clip1=0.65, clip2=0.5, noise_multiplier=0.7, selector=selector,
                   ctx=SelectionContext(epoch=0, num_epochs=1), generator=torch.Generator().manual_seed(5),
                   fused=fused) for fused in (False, True)]
    assert 0 < float(res[0].stats.clipped1) < 1
    _same_result(*res)


# ----------------------------------------------------------------------------------------------------- fallback


def test_unavailable_kernels_warn_once_and_fall_back(monkeypatch):
    def broken(**_):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "build", broken)
    g = jagged(torch.Generator().manual_seed(0), B=6, R=20, D=3, max_len=4)
    with pytest.warns(RuntimeWarning, match="unavailable.*no compiler.*PyTorch path"):
        assert not native.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        touched, ghat, _ = clip_aggregate(g, clip1=1.0, batch_size=6.0)  # fused=None: the reference, silently
        assert not LazyAdam([(0, torch.zeros(20, 3))], lr=0.1, betas=(0.9, 0.99), eps=1e-8).fused
    assert torch.equal(ghat, reference(g, clip1=1.0, b=6.0)[1])
    with pytest.raises(RuntimeError, match="fused=True.*no compiler"):
        clip_aggregate(g, clip1=1.0, batch_size=6.0, fused=True)
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("WIDEDP_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not native.use(None, g.values)  # switched off: no warning


def test_build_is_cached_and_named_by_source():
    path = native.build(quiet=True)
    assert path.exists() and path == native.library_path() and path.parent == native.build_dir()
    assert native.build(quiet=True) == path  # second call: no compile


def _cbow_case(gen: torch.Generator, *, tied: bool, C: int, dtype: torch.dtype, V: int = 40, B: int = 96):
    model = CBOW(V, 12, tied=tied, generator=gen).to(dtype)
    if not tied:
        model.output.weight.data.normal_(generator=gen)
    ctx = torch.randint(V, (B, C), generator=gen)
    if C > 1:
        ctx[torch.rand(B, C, generator=gen) < 0.3] = -1  # padding, some samples fully padded
        ctx[:3] = -1
    # a small V: repeated negatives, negatives equal to the context (tied), duplicate context ids
    return model, CBOWBatch(torch.randint(V, (B,), generator=gen), ctx, torch.randint(V, (B, 8), generator=gen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("C", [1, 4])
def test_cbow_row_grads_equal_the_reference(dtype, tied, C):
    """The native CBOW per-sample gradients: the same rows and offsets, values and losses within 1e-6 of the
    magnitudes involved (dot products accumulate in double there, in float in the reference's bmm)."""
    gen = torch.Generator().manual_seed(7)
    model, batch = _cbow_case(gen, tied=tied, C=C, dtype=dtype)
    with torch.inference_mode():
        loss, ref = model.per_sample_row_grads(batch, fused=False)
        loss2, got = model.per_sample_row_grads(batch, fused=True)
    assert torch.equal(got.rows, ref.rows) and torch.equal(got.offsets, ref.offsets) and got.num_rows == ref.num_rows
    assert got.values.dtype == dtype and loss2.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.values, ref.values, atol=tol * ref.values.abs().max().item(), rtol=0)
    torch.testing.assert_close(loss2, loss, atol=tol * loss.abs().max().item(), rtol=0)


def test_cbow_row_grads_keep_nonfinite_rows_in_their_samples():
    """A NaN or inf in a row a sample uses stays in that sample (as the reference): the same samples are
    non-finite, the others equal."""
    gen = torch.Generator().manual_seed(8)
    model, batch = _cbow_case(gen, tied=False, C=1, dtype=torch.float32)
    model.output.weight.data[3, 0] = float("nan")
    model.input.weight.data[5, 1] = float("inf")
    with torch.inference_mode():
        loss, ref = model.per_sample_row_grads(batch, fused=False)
        loss2, got = model.per_sample_row_grads(batch, fused=True)
    bad = ~torch.isfinite(ref.values).all(1)
    assert torch.equal(bad, ~torch.isfinite(got.values).all(1)) and bad.any()
    torch.testing.assert_close(got.values[~bad], ref.values[~bad], atol=1e-6, rtol=0)
    assert torch.equal(torch.isfinite(loss), torch.isfinite(loss2))


@pytest.mark.parametrize("seed", range(4))
def test_svt_scan_equals_the_reference(seed):
    """The native sparse-vector scan returns ``svt.scan``'s picks exactly, over random instances: none, few, thousands
    (many 64-row blocks) or all rows touched, tied scores, thresholds below and above the scores, and thresholds
    700-760 query scales up, where an untouched row's pass probability is subnormal or 0 (its geometric skip
    overflows to inf)."""
    from widedp.dp.selection import svt

    assert native.available()
    rng = np.random.default_rng(seed)
    subnormal = 0
    for case in range(300):
        num_rows = int(rng.choice([1, 7, 60, 10_000, 10**12]))
        tpos = np.unique(rng.integers(0, num_rows, size=int(rng.integers(0, 200 if case % 2 else 5000))))
        if case % 10 == 0:
            tpos = np.arange(min(num_rows, 50))  # every row touched (up to 50 rows): no untouched answer
        u, c = tpos.size, int(rng.integers(0, 40))
        tnoisy = rng.normal(rng.choice([-1.0, 0.0, 1.0]), 1.0, u).round(int(rng.choice([1, 8])))  # ties
        tid = rng.integers(0, 2**40, u)
        scale = float(rng.choice([1e-3, 0.1, 1.0]))
        thr = rng.normal(float(rng.choice([-1.0, 0.5, 2.0])), 1.0, c)
        if case % 3 == 0:
            thr = rng.uniform(700, 760, c) * scale
        subnormal += int(np.sum((thr / scale > 709) & (thr / scale < 745)))
        unif = 1.0 - rng.random(c)
        args = (tpos.astype(np.int64), tnoisy, tid.astype(np.int64), thr, unif)
        ref = svt.scan(*args, num_rows=num_rows, query_scale=scale)
        got = native.svt_scan(*map(torch.from_numpy, args), num_rows=num_rows, query_scale=scale).tolist()
        assert got == ref, (case, num_rows, u, c)
    assert subnormal > 100
