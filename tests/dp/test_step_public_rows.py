"""``dp_step``'s ``public_rows`` (``data.negatives_pool``): selected for free, invisible to the scores."""

import torch
from test_step import CTX, dense_ghat, random_batch

from widedp.config import ExponentialSelectionConfig, GaussianThresholdSelectionConfig
from widedp.dp.rowgrads import PerSampleRows, coalesce
from widedp.dp.selection import make_selector
from widedp.dp.selection.scores import row_counts
from widedp.dp.step import dp_step

R = 400


def without_rows(g: PerSampleRows, rows: torch.Tensor) -> PerSampleRows:
    """``g`` with every (sample, row) pair on ``rows`` removed (the public rows' pairs)."""
    keep = ~torch.isin(g.rows, rows)
    sample = g.sample_ids()
    return coalesce(g.values[keep], g.rows[keep], sample[keep], g.batch_size, g.num_rows)


def step(g, selector, seed, public=None, *, sigma=1.0, clip2=1.0):
    return dp_step(g, batch_size=float(g.batch_size), sampling_rate=0.01, clip1=1.0, clip2=clip2,
                   noise_multiplier=sigma, selector=selector, ctx=CTX, generator=torch.Generator().manual_seed(seed),
                   public_rows=public)


def test_public_rows_are_selected_and_the_selection_ignores_them():
    """Gaussian thresholding on contribution counts: with public rows P, the picks outside P are exactly those of
    the same step on the batch with P's pairs removed (same generator): the scores never see P."""
    gen = torch.Generator().manual_seed(0)
    selector = make_selector(GaussianThresholdSelectionConfig(sigma=0.5), num_rows=R)
    picked = 0
    for seed in range(20):
        g = random_batch(gen, batch=40, num_rows=R, dim=3, max_len=8)
        public = torch.randperm(R, generator=gen)[:60].sort().values
        got = step(g, selector, seed, public).selected
        ref = step(without_rows(g, public), selector, seed).selected
        assert torch.isin(public, got).all() and got.unique().numel() == got.numel()
        mine = set(got.tolist()) - set(public.tolist())
        assert mine == set(ref.tolist()) - set(public.tolist())
        picked += len(mine)
    assert picked > 100


def test_contribution_is_normalised_over_the_private_rows_only():
    """ℓ2 sensitivity 1 of the counts the selection sees: a sample's weight is 1/√|its non-public rows|."""
    gen = torch.Generator().manual_seed(1)
    g = random_batch(gen, batch=30, num_rows=R, dim=2, max_len=10)
    public = torch.arange(0, R, 3)
    private_rows = torch.tensor([r for r in range(R) if r % 3])
    got = row_counts(g, private_rows, normalise=True, dtype=torch.float64)
    ref = torch.zeros(R, dtype=torch.float64)
    for j in range(g.batch_size):
        rows = [r for r in g.rows[g.offsets[j]:g.offsets[j + 1]].tolist() if r not in set(public.tolist())]
        for r in rows:
            ref[r] += 1 / len(rows) ** 0.5
    torch.testing.assert_close(got, ref[private_rows])


def test_public_rows_get_the_clipped_gradient_and_noise():
    """σ → 0, no S2 clip: every selected row, public ones included, carries ĝ (clipped per sample at S1)."""
    gen = torch.Generator().manual_seed(2)
    selector = make_selector(ExponentialSelectionConfig(k=20, epsilon=1.0), num_rows=R)
    g = random_batch(gen, batch=25, num_rows=R, dim=3)
    public = torch.unique(g.rows)[::2]  # touched ones: their ĝ is not zero
    res = step(g, selector, 3, public, sigma=1e-12, clip2=None)
    ghat, _ = dense_ghat(g, clip1=1.0, b=25.0)
    torch.testing.assert_close(res.grad.values, ghat[res.selected], atol=1e-9, rtol=0)
    assert torch.isin(public, res.selected).all()
