"""Selection scores (widedp.dp.selection.scores): the sensitivities each selector relies on, by search over add/remove
neighbours, and what dp_step hands each kind of selector."""

import numpy as np
import pytest
import torch

from widedp.dp.rowgrads import PerSampleRows
from widedp.dp.selection import SelectionContext, UniformSelector
from widedp.dp.selection.scores import row_counts, selection_scores
from widedp.dp.step import dp_step


def batch_of(samples: list[list[int]], num_rows: int, dim: int = 2, seed: int = 0) -> PerSampleRows:
    """PerSampleRows with the given rows per sample (duplicates kept as given: NOT coalesced)."""
    lens = torch.tensor([len(s) for s in samples], dtype=torch.long)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.long)
    offsets[1:] = lens.cumsum(0)
    rows = torch.tensor([r for s in samples for r in s], dtype=torch.long)
    values = torch.randn(rows.numel(), dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return PerSampleRows(values, rows, offsets, num_rows)


def dense_counts(samples: list[list[int]], num_rows: int, *, normalise: bool, selectable: int) -> np.ndarray:
    """Reference: Σ_j w_j 1[r ∈ set(rows_j) ∩ [0, selectable)], w_j = 1/√|that set| or 1."""
    out = np.zeros(num_rows)
    for s in samples:
        rows = sorted({r for r in s if r < selectable})
        for r in rows:
            out[r] += 1 / np.sqrt(len(rows)) if normalise else 1.0
    return out


def random_samples(rng: np.random.Generator, num_rows: int, batch: int) -> list[list[int]]:
    out = []
    for _ in range(batch):
        n = int(rng.integers(0, 6))
        s = [int(x) for x in rng.integers(0, num_rows, n)]
        if s and rng.random() < 0.3:
            s.append(s[0])  # a duplicate row within a sample: must count once
        out.append(s)
    return out


@pytest.mark.parametrize("always", [0, 3])
def test_count_vectors_match_reference_and_sensitivities(always):
    """Contribution vector: ℓ2 distance exactly 1 between add/remove neighbours (0 when the sample touched no
    selectable row); sample counts: ℓ∞ distance 1. Unnormalised counts (the negative control) move by √r in ℓ2."""
    rng = np.random.default_rng(0)
    num_rows = 12
    sel = num_rows - always
    all_rows = torch.arange(sel)
    worst_raw = 0.0
    for _ in range(300):
        samples = random_samples(rng, num_rows, int(rng.integers(1, 7)))
        g = batch_of(samples, num_rows)
        for normalise in (True, False):
            got = row_counts(g, all_rows, normalise=normalise, dtype=torch.float64).numpy()
            ref = dense_counts(samples, num_rows, normalise=normalise, selectable=sel)[:sel]
            np.testing.assert_allclose(got, ref, atol=1e-12)
        j = int(rng.integers(len(samples)))
        nb = samples[:j] + samples[j + 1 :]  # remove sample j (add is the same pair, reversed)
        touched_sel = len({r for r in samples[j] if r < sel})
        c, c2 = (row_counts(batch_of(s, num_rows), all_rows, normalise=True, dtype=torch.float64).numpy()
                 for s in (samples, nb))
        assert np.linalg.norm(c - c2) == pytest.approx(1.0 if touched_sel else 0.0, abs=1e-12)
        n, n2 = (row_counts(batch_of(s, num_rows), all_rows, normalise=False, dtype=torch.float64).numpy()
                 for s in (samples, nb))
        assert np.abs(n - n2).max() <= 1.0
        worst_raw = max(worst_raw, float(np.linalg.norm(n - n2)))
    assert worst_raw >= 2.0  # raw counts: a sample touching 4+ rows moves them by >= 2 in ℓ2


class Recorder:
    def __init__(self, kind, score_clip=None):
        self.score_kind, self.score_clip, self.calls = kind, score_clip, []

    def spend(self):
        return UniformSelector(k=2).spend()

    def select(self, touched, scores, *, selectable_rows, score_sensitivity, ctx, generator):
        self.calls.append((touched, scores, score_sensitivity))
        return UniformSelector(k=2).select(touched, scores, selectable_rows=selectable_rows,
                                           score_sensitivity=score_sensitivity, ctx=ctx, generator=generator)


@pytest.mark.parametrize("kind,s0,sens", [("count", 2.0, 1.0), ("count", 50.0, 1.0), ("contribution", None, 1.0),
                                          ("norm", 0.05, 0.05), ("norm", 10.0, 0.25)])
def test_step_hands_each_score_kind(kind, s0, sens):
    """dp_step computes the selector's kind of score over the selectable touched rows, with its sensitivity."""
    samples = [[0, 3, 7], [3], [7, 7, 9], [3, 9]]
    num_rows = 10
    g = batch_of(samples, num_rows)
    rec = Recorder(kind, s0)
    dp_step(g, batch_size=4.0, sampling_rate=0.1, clip1=1.0, clip2=None, noise_multiplier=1.0, selector=rec,
            ctx=SelectionContext(0, 1), generator=torch.Generator().manual_seed(0))
    touched, scores, du = rec.calls[0]
    assert touched.tolist() == [0, 3, 7, 9] and du == pytest.approx(sens)
    if kind == "norm":
        return
    ref = dense_counts(samples, num_rows, normalise=kind == "contribution", selectable=num_rows)[[0, 3, 7, 9]]
    if s0 is not None:
        ref = np.minimum(ref, s0)
    np.testing.assert_allclose(scores.numpy(), ref, atol=1e-12)


def test_always_rows_are_not_counted():
    """Rows [R − A, R) are always selected: they are not in the contribution vector nor in its normaliser."""
    g = batch_of([[0, 8, 9], [1, 2]], 10)
    s, du = selection_scores("contribution", g, torch.tensor([0, 1, 2]), torch.zeros(3, 2, dtype=torch.float64),
                             score_clip=None, clip1=1.0, batch_size=2.0)
    np.testing.assert_allclose(s.numpy(), [1.0, 2**-0.5, 2**-0.5])
    assert du == 1.0
