"""Issue 16 §2: a sample whose per-sample gradient holds NaN / +inf / -inf contributes zero, for every selector and
model, and is counted; huge finite gradients are clipped to S1, not zeroed.

The law is checked exactly: a step on the poisoned batch and a step on the same batch with that sample's gradient
replaced by zeros, with the same generator seed, select the same rows and release bit-identical values.
"""

from __future__ import annotations

import pytest
import torch

from widedp.config import (
    AllRowsConfig,
    ExponentialSelectionConfig,
    RandomSparsificationConfig,
    SparseVectorSelectionConfig,
    UniformSelectionConfig,
)
from widedp.config.recsys import RecsysDataConfig
from widedp.data_prep.interactions import RecsysSplit, prepare_interactions
from widedp.dp.clipping import clip_per_sample
from widedp.dp.rowgrads import PerSampleRows, coalesce
from widedp.dp.selection import ExponentialSelector, SelectionContext, make_selector
from widedp.dp.step import dp_step
from widedp.models.cbow import CBOW, CBOWBatch
from widedp.models.recsys import RecsysModel

CTX = SelectionContext(epoch=1, num_epochs=3)  # random sparsification keeps 3/4 of the rows at epoch 1
BAD = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}
R, B, D, POISONED = 60, 12, 4, 5  # sample POISONED alone touches rows 0, 1, 2
SELECTIONS = {
    "exponential": ExponentialSelectionConfig(k=3, epsilon=1.0, score_clip=0.05),
    "exponential_brute": ExponentialSelectionConfig(k=3, epsilon=1.0, score_clip=0.05, method="brute"),
    # threshold far below every score: each visited row is picked until the cutoff (half the rows)
    "sparse_vector": SparseVectorSelectionConfig(epsilon=1.0, threshold=-1.0, cutoff=R // 2, score_clip=0.05),
    "uniform": UniformSelectionConfig(k=R // 2),
    "random_sparsification": RandomSparsificationConfig(final_rate=0.5),
    "all": AllRowsConfig(),
}


def selector(name: str, num_rows: int = R):
    if name == "exponential":  # the O(U + k) path (method auto perturbs all rows below 4096 rows)
        return ExponentialSelector(k=3, epsilon=1.0, score_clip=0.05, method="sparse")
    return make_selector(SELECTIONS[name], num_rows=num_rows)


def step(g, sel, seed, **kw):
    args = dict(batch_size=float(B), sampling_rate=0.05, clip1=1.0, clip2=0.5, noise_multiplier=0.8, selector=sel,
                ctx=CTX, generator=torch.Generator().manual_seed(seed))
    return dp_step(g, **{**args, **kw})


def batch(seed: int, dtype=torch.float64) -> PerSampleRows:
    """B samples of 3 to 5 rows in [3, R); sample POISONED has rows 0, 1, 2 (no other sample touches them)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 6, (B,), generator=gen)
    rows = torch.randint(3, R, (int(lens.sum()),), generator=gen)
    sample = torch.repeat_interleave(torch.arange(B), lens)
    rows[sample == POISONED] = torch.arange(int(lens[POISONED])).clamp(max=2)
    values = torch.randn(rows.numel(), D, generator=gen, dtype=dtype)
    return coalesce(values, rows, sample, B, R)


def with_sample(g: PerSampleRows, j: int, fill) -> PerSampleRows:
    """``g`` with sample j's values replaced: ``fill(values)`` of its slice (rows and offsets unchanged)."""
    lo, hi = int(g.offsets[j]), int(g.offsets[j + 1])
    values = g.values.clone()
    values[lo:hi] = fill(values[lo:hi].clone())
    return type(g)(**{**g.__dict__, "values": values})


def poisoned(g: PerSampleRows, j: int, bad: float) -> PerSampleRows:
    def fill(v):
        v[-1, 1] = bad  # one bad entry among ordinary ones
        return v
    return with_sample(g, j, fill)


def zeroed(g: PerSampleRows, *samples: int) -> PerSampleRows:
    for j in samples:
        g = with_sample(g, j, torch.zeros_like)
    return g


def assert_same_release(res_p, res_z, *, exact: bool = True) -> None:
    assert torch.isfinite(res_p.grad.values).all()  # (a)
    assert torch.equal(res_p.selected, res_z.selected)  # (b) the law of the zeroed batch
    if exact:
        assert torch.equal(res_p.grad.values, res_z.grad.values)
    else:
        torch.testing.assert_close(res_p.grad.values, res_z.grad.values, rtol=1e-6, atol=1e-9)
    assert res_p.spend == res_z.spend


# ------------------------------------------------------------------------------------------ every selector


@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("name", SELECTIONS)
def test_poisoned_sample_has_the_law_of_a_zero_sample(name, bad):
    for seed in range(6):
        g = batch(seed)
        sel = selector(name)
        res_p = step(poisoned(g, POISONED, BAD[bad]), sel, seed)
        res_z = step(zeroed(g, POISONED), sel, seed)
        assert_same_release(res_p, res_z)
        assert int(res_p.stats.nonfinite) == 1 and int(res_z.stats.nonfinite) == 0  # (c)
        assert res_p.stats.nonfinite.dim() == 0
        assert torch.equal(res_p.stats.clipped1, res_z.stats.clipped1)


def test_every_sample_non_finite():
    g = batch(0, dtype=torch.float32)
    g = PerSampleRows(torch.full_like(g.values, float("nan")), g.rows, g.offsets, g.num_rows)
    for name in SELECTIONS:
        res = step(g, selector(name), 1)
        assert torch.isfinite(res.grad.values).all() and int(res.stats.nonfinite) == B
        assert float(res.stats.clipped1) == 0 and float(res.stats.touched_share) >= 0


def test_exponential_does_not_favour_the_poisoned_rows():
    """(d) Over 400 steps the poisoned sample's rows are picked no more often than with the sample zeroed (the
    old step picked all 3 of them every step: 1200 picks; a zero sample's rows: about 400·3·3/R ≈ 60)."""
    sel = selector("exponential")
    g = batch(7)
    for bad in BAD.values():
        gp, gz = poisoned(g, POISONED, bad), zeroed(g, POISONED)
        hits_p = sum(int((step(gp, sel, s).selected < 3).sum()) for s in range(400))
        hits_z = sum(int((step(gz, sel, 10_000 + s).selected < 3).sum()) for s in range(400))
        assert hits_p <= hits_z + 4 * hits_z**0.5 + 10, (bad, hits_p, hits_z)


# ------------------------------------------------------------------------------------------ huge finite values


@pytest.mark.parametrize("dtype,huge", [(torch.float32, 1e30), (torch.float32, 3e38), (torch.float64, 1e200)])
def test_huge_finite_gradient_is_clipped_to_s1(dtype, huge):
    """Squares overflow (1e30² in float32): the sample is still scaled to norm S1 in its own direction."""
    values = torch.tensor([[1.0, -1.0, 0.5], [0.25, 1e-3, -1.0], [0.3, 0.1, 0.2]], dtype=torch.float64)
    direction = values[:2] / values[:2].norm()
    g = PerSampleRows((values * torch.tensor([[huge], [huge], [1.0]], dtype=torch.float64)).to(dtype),
                      torch.tensor([1, 4, 2]), torch.tensor([0, 2, 3]), num_rows=6)
    assert torch.isfinite(g.values).all()
    clipped, info = clip_per_sample(g, clip1=1.5)
    assert info.clipped.tolist() == [True, False] and info.nonfinite.tolist() == [False, False]
    out = clipped.values[:2].double()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.norm(), torch.tensor(1.5, dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(out / 1.5, direction, rtol=1e-5, atol=1e-7)
    assert torch.equal(clipped.values[2], g.values[2])  # the unclipped sample is untouched
    # through the whole step: the update is the clipped sample (tiny noise), finite
    res = step(g, selector("all", 6), 0, batch_size=2.0, clip1=1.5, clip2=None, noise_multiplier=1e-9)
    assert torch.isfinite(res.grad.values).all() and float(res.stats.clipped1) == 0.5
    ref = torch.zeros(6, 3, dtype=torch.float64)
    ref[1], ref[4], ref[2] = 1.5 * direction[0], 1.5 * direction[1], values[2]
    torch.testing.assert_close(res.grad.to_dense().double(), ref / 2.0, rtol=1e-5, atol=1e-6)


def test_tiny_values_are_not_clipped_and_untouched():
    """Squares that underflow (1e-30² in float32) are no reason to change anything."""
    v = torch.tensor([[1e-30, -2e-30], [3e-31, 0.0]], dtype=torch.float32)
    g = PerSampleRows(v, torch.tensor([0, 1]), torch.tensor([0, 2]), num_rows=2)
    clipped, info = clip_per_sample(g, clip1=1e-3)
    assert not info.clipped.any() and torch.equal(clipped.values, v)


# ------------------------------------------------------------------------------------------ the models


def recsys_setup():
    data = prepare_interactions(RecsysDataConfig(num_users=11, num_items=13, num_interactions=300, num_tags=5,
                                                 tags_per_item=3, context_cardinality=4, cache_dir=""))
    model = RecsysModel(data.cardinality, dim=4, hidden=(6,), init_scale=0.3,
                        generator=torch.Generator().manual_seed(0))
    return model, RecsysSplit(data.train, "cpu").batch(torch.arange(B))


@pytest.mark.parametrize("where", ["embedding", "mlp"])
@pytest.mark.parametrize("bad", BAD, ids=str)
@pytest.mark.parametrize("name", ["exponential_brute", "uniform", "all"])
def test_recsys_poisoned_gradient(name, bad, where):
    """Per-sample row gradients of the recommender, the always-selected MLP rows included."""
    model, b = recsys_setup()
    with torch.inference_mode():
        _, g = model.per_sample_row_grads(b)
    A = g.always_rows
    assert A > 0
    lo, hi = int(g.offsets[POISONED]), int(g.offsets[POISONED + 1])
    values = g.values.clone()
    values[lo if where == "embedding" else hi - 1, 0] = BAD[bad]  # its first embedding row or its last MLP row
    gp = type(g)(**{**g.__dict__, "values": values})
    sel = make_selector(SELECTIONS[name], num_rows=model.num_rows)
    for seed in range(3):
        res_p, res_z = step(gp, sel, seed), step(zeroed(g, POISONED), sel, seed)
        assert_same_release(res_p, res_z)
        assert int(res_p.stats.nonfinite) == 1
        assert torch.equal(res_p.selected[-A:], torch.arange(model.num_rows, model.total_rows))


def test_recsys_nan_embedding_row_through_the_forward():
    """A NaN in one item row: every sample that looks it up has a NaN loss and NaN gradients; those samples are
    zeroed, the others are untouched, and the step releases finite values."""
    model, b = recsys_setup()
    with torch.inference_mode():
        loss0, g0 = model.per_sample_row_grads(b)
    items = b.kjt.to_dict()["item"].values()
    item = int(items[POISONED])
    hit = (items == item).nonzero().squeeze(1).tolist()  # the samples that look the item up
    with torch.no_grad():
        model.tables()[1][item] = float("nan")
    with torch.inference_mode():
        loss, g = model.per_sample_row_grads(b)
    assert torch.isfinite(loss0).all() and 0 < len(hit) < B
    assert torch.equal(loss.isnan(), torch.isin(torch.arange(B), torch.tensor(hit)))  # the loss is NaN for them
    for name in ("exponential_brute", "sparse_vector", "all"):
        sel = make_selector(SELECTIONS[name], num_rows=model.num_rows)
        res, ref = step(g, sel, 3), step(zeroed(g0, *hit), sel, 3)
        assert_same_release(res, ref, exact=False)
        assert int(res.stats.nonfinite) == len(hit)


@pytest.mark.parametrize("tied", [True, False])
def test_cbow_nan_row_through_the_forward(tied):
    """A NaN in one CBOW row (tied: context, target and negative row; untied: context row only): exactly the
    samples that use it get NaN gradients, are zeroed and counted; every selector releases finite values."""
    V, C, K = 30, 3, 4
    gen = torch.Generator().manual_seed(0)
    model = CBOW(V, D, tied=tied, sparse=False, generator=gen).double()
    ctx = torch.randint(V, (B, C), generator=gen)
    ctx[ctx == 7] = 8
    ctx[:, 0][torch.arange(B) % 4 == 1] = 7  # a few samples have word 7 in their context
    ctx[2, 1] = -1  # padding
    bt = CBOWBatch(torch.randint(V, (B,), generator=gen), ctx, torch.randint(V, (B, K), generator=gen))
    with torch.inference_mode():
        loss0, g0 = model.per_sample_row_grads(bt)
    with torch.no_grad():
        model.input.weight[7] = float("nan")
    with torch.inference_mode():
        loss, g = model.per_sample_row_grads(bt)
    uses = (ctx == 7).any(1)
    if tied:
        uses |= (bt.target == 7) | (bt.negatives == 7).any(1)
    hit = uses.nonzero().squeeze(1).tolist()
    assert 0 < len(hit) < B and torch.equal(loss.isnan(), uses)
    assert torch.equal(loss[~uses], loss0[~uses])
    for name in SELECTIONS:
        sel = selector(name, model.num_rows)
        res, ref = step(g, sel, 5), step(zeroed(g0, *hit), sel, 5)
        assert_same_release(res, ref)
        assert int(res.stats.nonfinite) == len(hit)
