"""Privacy units: grouping and the cap, Poisson sampling over units, per-unit clipping and its
sensitivity (widedp.dp.units)."""

import dataclasses

import numpy as np
import pytest
import torch
from scipy import stats

from widedp.dp.rowgrads import coalesce
from widedp.dp.selection import AllRowsSelector, SelectionContext
from widedp.dp.step import dp_step
from widedp.dp.units import UnitPoissonSampler, group_rows, group_units
from widedp.errors import ConfigError

CTX = SelectionContext(epoch=0, num_epochs=1)


def _units_of(grouped):
    """unit -> list of sample ids, from a Units."""
    s, o = grouped.samples.tolist(), grouped.offsets.tolist()
    return [s[o[u]:o[u + 1]] for u in range(grouped.num_units)]


def test_cap_keeps_the_first_m_samples_in_key_order_deterministically():
    rng = np.random.default_rng(0)
    unit_of = np.repeat([7, 3, 9], [10, 2, 6])
    key = rng.permutation(18) * 10  # corpus order, shuffled into the split
    perm = rng.permutation(18)  # the split's own order must not matter
    a = group_units(unit_of[perm], key[perm], cap=4)
    b = group_units(unit_of, key, cap=4)
    kept_a = [sorted(key[perm][s]) for s in _units_of(a)]
    kept_b = [sorted(key[s]) for s in _units_of(b)]
    assert kept_a == kept_b
    for u, kept in zip((3, 7, 9), kept_a):  # units numbered by increasing id
        assert kept == sorted(key[unit_of == u])[:4]  # the 4 smallest keys: the first 4 in corpus order
    assert a.dropped == 6 + 2 and a.lengths().tolist() == [2, 4, 4]
    # in each unit the kept samples are in key order
    for s in _units_of(a):
        assert list(key[perm][s]) == sorted(key[perm][s])
    # removing a whole other unit does not change what a unit keeps (a per-unit rule)
    keep = unit_of[perm] != 9
    c = group_units(unit_of[perm][keep], key[perm][keep], cap=4)
    assert [sorted(key[perm][keep][s]) for s in _units_of(c)] == kept_a[:2]
    with pytest.raises(ConfigError):
        group_units(unit_of, key, cap=0)


def test_poisson_over_units_law_and_whole_units():
    rng = np.random.default_rng(1)
    n_units, q, steps = 400, 0.05, 2000
    sizes = rng.integers(1, 9, n_units)
    unit_of = rng.permutation(np.repeat(np.arange(n_units) * 3 + 11, sizes))
    grouped = group_units(unit_of, np.arange(len(unit_of)), cap=5)
    members = {u: set(s) for u, s in enumerate(_units_of(grouped))}
    owner = {s: u for u, ss in members.items() for s in ss}
    sampler = UnitPoissonSampler(grouped, sampling_rate=q, seed=5)
    n_drawn, hits = [], np.zeros(n_units)
    for t in range(steps):
        b = sampler.draw(t)
        seg = b.segment.tolist()
        assert seg == sorted(seg) and (not seg or seg[-1] == b.num_units - 1)
        drawn = {owner[s] for s in b.samples.tolist()}
        assert len(drawn) == b.num_units
        for u in drawn:  # every sample of a drawn unit, each once
            assert members[u] <= set(b.samples.tolist())
        assert len(b.samples) == sum(len(members[u]) for u in drawn)
        n_drawn.append(b.num_units)
        hits[list(drawn)] += 1
    # units per batch ~ Binomial(N, q): KS at the 0.1% level; a fixed-size or a per-sample sampler fails it
    sizes_b = np.array(n_drawn)
    grid = np.arange(sizes_b.min(), sizes_b.max() + 1)
    ecdf = np.searchsorted(np.sort(sizes_b), grid, side="right") / steps
    assert np.abs(ecdf - stats.binom.cdf(grid, n_units, q)).max() < 1.95 / np.sqrt(steps)
    assert np.abs(ecdf - stats.binom.cdf(grid, n_units, 2 * q)).max() > 1.95 / np.sqrt(steps)  # factor 2 caught
    # each unit's inclusion frequency ~ q (chi-square over units)
    chi2 = ((hits - steps * q) ** 2 / (steps * q * (1 - q))).sum()
    assert stats.chi2.sf(chi2, n_units) > 1e-3
    # stateless per step: step t's batch again after other steps
    again = UnitPoissonSampler(grouped, sampling_rate=q, seed=5).draw(steps - 1)
    assert torch.equal(again.samples, sampler.draw(steps - 1).samples)


def _pairs(gen, *, samples, num_rows, dim, scale):
    lens = torch.randint(1, 4, (samples,), generator=gen)
    rows = torch.randint(num_rows, (int(lens.sum()),), generator=gen)
    sample = torch.repeat_interleave(torch.arange(samples), lens)
    vals = torch.randn(len(rows), dim, generator=gen, dtype=torch.float64) * scale
    return coalesce(vals, rows, sample, samples, num_rows)


def test_group_rows_sums_each_units_samples():
    gen = torch.Generator().manual_seed(2)
    g = _pairs(gen, samples=9, num_rows=12, dim=3, scale=1.0)
    segment = torch.tensor([0, 0, 0, 1, 2, 2, 3, 3, 3])
    u = group_rows(g, segment, num_units=4)
    dense = g.to_dense()
    want = torch.stack([dense[segment == k].sum(0) for k in range(4)])
    torch.testing.assert_close(u.to_dense(), want)
    assert type(u) is type(g) and u.batch_size == 4


def test_group_rows_keeps_dense_rows_last():
    from widedp.models.recsys import PerSampleRowsWithDense

    gen = torch.Generator().manual_seed(3)
    g = _pairs(gen, samples=6, num_rows=10, dim=2, scale=1.0)
    g = PerSampleRowsWithDense(g.values, g.rows, g.offsets, 12, always_rows=2)  # rows 10, 11 never touched here
    dense_vals = torch.randn(6 * 2, 2, generator=gen, dtype=torch.float64)
    rows = torch.cat([g.rows, torch.tensor([10, 11] * 6)])
    sample = torch.cat([g.sample_ids(), torch.arange(6).repeat_interleave(2)])
    c = coalesce(torch.cat([g.values, dense_vals]), rows, sample, 6, 12)
    g = PerSampleRowsWithDense(c.values, c.rows, c.offsets, 12, always_rows=2)
    u = group_rows(g, torch.tensor([0, 0, 1, 1, 1, 2]), num_units=3)
    assert isinstance(u, PerSampleRowsWithDense) and u.always_rows == 2
    for k in range(3):
        r = u.rows[u.offsets[k]:u.offsets[k + 1]].tolist()
        assert r[-2:] == [10, 11] and r == sorted(r)


def _delta_hat(units_g, *, b, clip1, clip2):
    """Δ̂ of a DP step with every row selected and no noise (σ tiny): [R, D]."""
    res = dp_step(units_g, batch_size=b, sampling_rate=0.1, clip1=clip1, clip2=clip2, noise_multiplier=1e-30,
                  selector=AllRowsSelector(), ctx=CTX, generator=torch.Generator().manual_seed(0))
    return res.grad.to_dense(), res.spend.parts[0].sensitivity


@pytest.mark.parametrize("clip2", [None, 0.02])
def test_per_unit_sensitivity_search(clip2):
    """Adding/removing one whole unit (up to m samples, adversarially aligned) moves Δ̂ by at most the charged
    sensitivity min(S1/b, 2·S2); per-SAMPLE clipping of the same batch moves it up to m times more."""
    num_rows, dim, b, clip1, m = 15, 3, 4.0, 1.0, 6
    gen = torch.Generator().manual_seed(4)
    worst_unit, worst_sample, charged = 0.0, 0.0, None
    for trial in range(60):
        base = _pairs(gen, samples=10, num_rows=num_rows, dim=dim, scale=float(torch.rand(1, generator=gen)) * 3)
        seg_base = torch.sort(torch.randint(5, (10,), generator=gen)).values
        # the extra unit: m samples, random or all equal (aligned, the worst case for per-sample clipping)
        extra = _pairs(gen, samples=1 if trial % 2 else m, num_rows=num_rows, dim=dim, scale=5.0)
        if trial % 2:
            extra = coalesce(extra.values.repeat(m, 1), extra.rows.repeat(m),
                             torch.arange(m).repeat_interleave(extra.rows.numel()), m, num_rows)
        both = coalesce(torch.cat([base.values, extra.values]), torch.cat([base.rows, extra.rows]),
                        torch.cat([base.sample_ids(), extra.sample_ids() + 10]), 10 + m, num_rows)
        seg_both = torch.cat([seg_base, torch.full((m,), 5)])
        d_with, charged = _delta_hat(group_rows(both, seg_both, num_units=6), b=b, clip1=clip1, clip2=clip2)
        d_without, _ = _delta_hat(group_rows(base, seg_base, num_units=5), b=b, clip1=clip1, clip2=clip2)
        worst_unit = max(worst_unit, float((d_with - d_without).norm()))
        s_with, _ = _delta_hat(both, b=b, clip1=clip1, clip2=clip2)  # negative control: samples clipped alone
        s_without, _ = _delta_hat(base, b=b, clip1=clip1, clip2=clip2)
        worst_sample = max(worst_sample, float((s_with - s_without).norm()))
    assert charged == pytest.approx(min(clip1 / b, 2 * clip2) if clip2 is not None else clip1 / b)
    assert worst_unit <= charged * (1 + 1e-9)
    assert worst_unit > 0.9 * min(clip1 / b, clip2 or np.inf)  # the search gets near the bound
    if clip2 is None:
        assert worst_sample > 2 * charged  # per-sample clipping of a unit's samples: not the charged sensitivity


def test_units_replace_keeps_cap_fields():
    g = group_units(np.array([1, 1, 2]), np.array([0, 1, 2]), cap=1)
    assert dataclasses.replace(g).cap == 1 and g.num_units == 2 and g.dropped == 1


def _model_delta_search(per_sample, unit_of, *, b, clip1, clip2):
    """max over units u of ||Δ̂(all units) - Δ̂(all but u)|| for a model's per-sample rows ``per_sample(idx)``."""
    n = len(unit_of)
    everyone = torch.arange(n)
    worst = 0.0
    for u in np.unique(unit_of):
        _, seg_all = np.unique(unit_of, return_inverse=True)
        g_all = group_rows(per_sample(everyone), torch.as_tensor(seg_all), num_units=int(seg_all.max()) + 1)
        keep = torch.as_tensor(np.flatnonzero(unit_of != u))
        _, seg = np.unique(unit_of[keep.numpy()], return_inverse=True)
        g_less = group_rows(per_sample(keep), torch.as_tensor(seg), num_units=int(seg.max()) + 1)
        d_all, charged = _delta_hat(g_all, b=b, clip1=clip1, clip2=clip2)
        d_less, _ = _delta_hat(g_less, b=b, clip1=clip1, clip2=clip2)
        worst = max(worst, float((d_all - d_less).norm()))
    return worst, charged


def test_per_unit_sensitivity_with_the_cbow_model():
    from widedp.models.cbow import CBOW, CBOWBatch

    gen = torch.Generator().manual_seed(6)
    model = CBOW(20, 4, tied=False, init_scale=40.0, generator=gen).double()  # large rows: clipping binds
    with torch.no_grad():
        model.output.weight.normal_(0, 3.0, generator=gen)
    n = 40
    target, context = torch.randint(20, (n,), generator=gen), torch.randint(20, (n, 1), generator=gen)
    negatives = torch.randint(20, (n, 3), generator=gen)
    unit_of = np.sort(np.random.default_rng(0).integers(0, 8, n))  # 8 sentences of ~5 pairs

    def per_sample(idx):
        with torch.inference_mode():
            return model.per_sample_row_grads(CBOWBatch(target[idx], context[idx], negatives[idx]))[1]

    worst, charged = _model_delta_search(per_sample, unit_of, b=5.0, clip1=1.0, clip2=None)
    assert charged == pytest.approx(1.0 / 5.0) and 0.5 * charged < worst <= charged * (1 + 1e-9)


def test_per_user_sensitivity_with_the_recommender(tmp_path):
    from widedp.config.recsys import RecsysDataConfig, RecsysModelConfig
    from widedp.data_prep.interactions import RecsysSplit, prepare_interactions
    from widedp.tasks.recsys import build_model

    data = prepare_interactions(RecsysDataConfig(num_users=8, num_items=30, num_interactions=120, cache_dir=""))
    model = build_model(data.cardinality, RecsysModelConfig(dim=4, hidden=(6,), init_scale=1.0), seed=0)
    split = RecsysSplit(data.train, "cpu")
    users = data.train.features["user"][:, 0]

    def per_sample(idx):
        with torch.inference_mode():
            return model.per_sample_row_grads(split.batch(idx))[1]

    worst, charged = _model_delta_search(per_sample, users, b=4.0, clip1=0.05, clip2=None)
    assert charged == pytest.approx(0.05 / 4.0) and 0.5 * charged < worst <= charged * (1 + 1e-6)
