"""Per-sample clipping, aggregation, restriction and whole-tensor clipping against dense references."""

import pytest
import torch

from widedp.dp.clipping import (
    SampleNorms,
    aggregate,
    clip_l2,
    clip_per_sample,
    restrict,
    sample_norms,
    sample_scale,
    sample_sumsq,
)
from widedp.dp.rowgrads import PerSampleRows, coalesce


def random_batch(gen: torch.Generator, *, batch: int, num_rows: int, dim: int, max_len: int = 4) -> PerSampleRows:
    """Jagged batch with duplicate rows inside samples (coalesced) and some empty samples."""
    lens = torch.randint(0, max_len + 1, (batch,), generator=gen)
    n = int(lens.sum())
    rows = torch.randint(num_rows, (n,), generator=gen)
    sample = torch.repeat_interleave(torch.arange(batch), lens)
    scale = torch.rand(batch, generator=gen).mul(4.0)[sample].unsqueeze(1)  # per-sample norms from 0 to ~8
    values = torch.randn(n, dim, generator=gen, dtype=torch.float64) * scale
    return coalesce(values, rows, sample, batch, num_rows)


def dense_clip(dense: torch.Tensor, clip1: float) -> tuple[torch.Tensor, torch.Tensor]:
    norms = dense.flatten(1).norm(dim=1)
    factor = torch.where(norms > clip1, clip1 / norms, torch.ones_like(norms))
    return dense * factor[:, None, None], norms > clip1


@pytest.mark.parametrize("clip1", [2.0, 15.0, 0.7])
def test_clip_per_sample_matches_dense(clip1):
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        g = random_batch(gen, batch=7, num_rows=9, dim=3)
        g = PerSampleRows(g.values * clip1 / 2, g.rows, g.offsets, g.num_rows)
        clipped, info = clip_per_sample(g, clip1=clip1)
        was = info.clipped
        assert not info.nonfinite.any()
        ref, ref_was = dense_clip(g.to_dense(), clip1)
        torch.testing.assert_close(clipped.to_dense(), ref, rtol=1e-12, atol=1e-12)
        assert torch.equal(was, ref_was), trial
        assert torch.equal(clipped.rows, g.rows) and torch.equal(clipped.offsets, g.offsets)
    # every sample's norm is at most clip1 and unclipped samples are bit-identical
    norms = clipped.to_dense().flatten(1).norm(dim=1)
    assert (norms <= clip1 * (1 + 1e-12)).all()
    keep = ~was
    assert torch.equal(clipped.to_dense()[keep], g.to_dense()[keep])


def test_clip_norm_is_over_the_whole_sample_not_per_row():
    # one sample, two rows of norm 1 each: whole norm sqrt(2) > 1.2 -> both rows scaled by 1.2 / sqrt(2)
    values = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    g = PerSampleRows(values, torch.tensor([0, 3]), torch.tensor([0, 2]), num_rows=4)
    clipped, info = clip_per_sample(g, clip1=1.2)
    torch.testing.assert_close(clipped.values, values * (1.2 / 2**0.5))
    assert info.clipped.tolist() == [True]


def test_sample_norms_are_a_power_of_two_times_a_root():
    gen = torch.Generator().manual_seed(3)
    g = random_batch(gen, batch=40, num_rows=9, dim=3)
    dense = g.to_dense().flatten(1)
    top, ref = dense.abs().amax(1), dense.norm(dim=1)
    n = sample_norms(g)
    assert (n.scale.frexp().mantissa == 0.5).all()  # powers of two
    nz = top > 0
    assert (~nz).any() and ((n.scale <= top) & (top < 2 * n.scale))[nz].all()
    torch.testing.assert_close(n.scale * n.sumsq.sqrt(), ref, rtol=1e-14, atol=0)


def test_clip_with_the_norms_of_a_split_sample():
    """The row-block clip of widedp.dp.layout.RowBlocks: each part clipped with the whole samples' norms (the larger
    scale, the sum of sumsq) is the whole clip, part by part; a NaN in one part zeroes the sample in both."""
    gen = torch.Generator().manual_seed(4)
    g = random_batch(gen, batch=9, num_rows=12, dim=3)
    g.values[int(g.offsets[3]):int(g.offsets[4])][-1, 0] = float("nan")  # sample 3 (lengths >= 1 for this seed)
    sample = g.sample_ids()
    parts = [coalesce(g.values[m], g.rows[m], sample[m], 9, 12) for m in (g.rows < 6, g.rows >= 6)]
    scale = torch.maximum(*(sample_scale(p) for p in parts))
    norms = SampleNorms(scale, sum(sample_sumsq(p, scale) for p in parts))
    whole, info = clip_per_sample(g, clip1=1.5)
    assert info.nonfinite.tolist() == [j == 3 for j in range(9)] and info.clipped.any()
    assert not whole.to_dense()[3].any() and torch.isfinite(whole.values).all()
    split = [clip_per_sample(p, clip1=1.5, norms=norms) for p in parts]
    torch.testing.assert_close(split[0][0].to_dense() + split[1][0].to_dense(), whole.to_dense(), rtol=1e-12,
                               atol=1e-12)
    for _, part_info in split:
        assert torch.equal(part_info.clipped, info.clipped) and torch.equal(part_info.nonfinite, info.nonfinite)


@pytest.mark.parametrize("num_rows", [11, 200])  # fewer rows than pairs (dense buffer path) and more (sort path)
def test_aggregate_matches_dense(num_rows):
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        g = random_batch(gen, batch=6, num_rows=num_rows, dim=4)
        touched, ghat = aggregate(g, batch_size=5.0)
        assert torch.equal(touched, torch.unique(g.rows))
        assert (touched[1:] > touched[:-1]).all()
        dense = g.to_dense().sum(0) / 5.0
        full = torch.zeros_like(dense)
        full[touched] = ghat
        torch.testing.assert_close(full, dense, rtol=1e-12, atol=1e-12)


def test_restrict_gives_zeros_for_untouched_selected_rows():
    touched = torch.tensor([1, 4, 6])
    ghat = torch.arange(6.0).reshape(3, 2) + 1
    selected = torch.tensor([6, 0, 4, 9])
    values, hit = restrict(touched, ghat, selected)
    assert hit.tolist() == [True, False, True, False]
    torch.testing.assert_close(values, torch.tensor([[5.0, 6.0], [0, 0], [3.0, 4.0], [0, 0]]))
    empty_values, empty_hit = restrict(touched[:0], ghat[:0], selected)
    assert empty_values.shape == (4, 2) and not empty_values.any() and not empty_hit.any()


def test_clip_l2():
    x = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=torch.float64)  # norm 5
    y, c = clip_l2(x, clip=2.5)
    torch.testing.assert_close(y, x / 2)
    assert bool(c) and c.dim() == 0
    y, c = clip_l2(x, clip=5.0)
    assert torch.equal(y, x) and not bool(c)
    z = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))
    for clip in (15.0, 0.7 * float(z.norm()) + 1e-3, float(z.norm()) * 1.0001):
        y, c = clip_l2(z * 0.7, clip=clip)
        assert torch.equal(y, z * 0.7) and not bool(c)  # bit-identical when not clipped
    y, c = clip_l2(x, clip=None)
    assert y is x and not bool(c)
    y, c = clip_l2(x[:0], clip=1.0)
    assert y.shape == (0, 2) and not bool(c)


def test_empty_batch():
    g = PerSampleRows(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long), 10)
    clipped, info = clip_per_sample(g, clip1=1.0)
    assert clipped.values.shape == (0, 3) and info.clipped.shape == (0,) and info.nonfinite.shape == (0,)
    touched, ghat = aggregate(clipped, batch_size=4.0)
    assert touched.shape == (0,) and ghat.shape == (0, 3)
