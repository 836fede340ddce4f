"""The whole DP step against a dense reference (privacy.md §1, §4.4)."""


import numpy as np
import pytest
import torch
from scipy import stats

from widedp.config import (
    AllRowsConfig,
    ExponentialSelectionConfig,
    GaussianThresholdSelectionConfig,
    RandomSparsificationConfig,
    SparseVectorSelectionConfig,
    UniformSelectionConfig,
)
from widedp.dp.rowgrads import PerSampleRows, coalesce
from widedp.dp.selection import (
    AllRowsSelector,
    ExponentialSelector,
    SelectionContext,
    UniformSelector,
    make_selector,
)
from widedp.dp.spend import ExponentialSpend, GaussianSelectionSpend, GaussianSpend, StepSpend
from widedp.dp.step import dp_step

CTX = SelectionContext(epoch=0, num_epochs=3)


def random_batch(gen: torch.Generator, *, batch: int, num_rows: int, dim: int, max_len: int = 5) -> PerSampleRows:
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    n = int(lens.sum())
    rows = torch.randint(num_rows, (n,), generator=gen)
    sample = torch.repeat_interleave(torch.arange(batch), lens)
    scale = torch.rand(batch, generator=gen).mul(3.0)[sample].unsqueeze(1)
    values = torch.randn(n, dim, generator=gen, dtype=torch.float64) * scale
    return coalesce(values, rows, sample, batch, num_rows)


def dense_ghat(g: PerSampleRows, *, clip1: float, b: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, D] (1/b) Σ_j clip_S1(g_j) from the dense copy, and [B] was-clipped."""
    dense = g.to_dense()
    norms = dense.flatten(1).norm(dim=1)
    factor = torch.where(norms > clip1, clip1 / norms, torch.ones_like(norms))
    return (dense * factor[:, None, None]).sum(0) / b, norms > clip1


def dense_delta(g: PerSampleRows, selected: torch.Tensor, *, clip1: float, clip2: float | None, b: float):
    ghat, _ = dense_ghat(g, clip1=clip1, b=b)
    delta = ghat[selected]
    if clip2 is not None and delta.norm() > clip2:
        delta = delta * (clip2 / delta.norm())
    return delta


def step(g, selector, gen, *, b=30.0, clip1=1.0, clip2=0.01, sigma=0.7, q=0.01):
    return dp_step(g, batch_size=b, sampling_rate=q, clip1=clip1, clip2=clip2, noise_multiplier=sigma,
                   selector=selector, ctx=CTX, generator=gen)


def test_update_touches_only_selected_rows_and_noise_is_calibrated():
    """§4.4: unselected rows bit-identical after the update; (value − Δ̂)/(σΔ₂) ~ N(0, 1) with Δ₂ = 2·S2 here;
    the paper's Δ₂ = min(S1/b, S2) and a doubled std both fail the KS test."""
    num_rows, dim, b, clip1, clip2, sigma = 200, 8, 30.0, 1.0, 0.01, 0.7
    d2 = min(clip1 / b, 2 * clip2)
    assert d2 == 2 * clip2
    gen = torch.Generator().manual_seed(0)
    sel = ExponentialSelector(k=100, epsilon=1.0, score_clip=0.05)
    z = []
    for _ in range(5):
        g = random_batch(gen, batch=30, num_rows=num_rows, dim=dim)
        res = step(g, sel, gen, b=b, clip1=clip1, clip2=clip2, sigma=sigma)
        weights = torch.randn(num_rows, dim, generator=gen, dtype=torch.float64)
        updated = weights.clone().index_add_(0, res.grad.rows, res.grad.values, alpha=-0.1)
        unselected = torch.ones(num_rows, dtype=torch.bool)
        unselected[res.selected] = False
        assert unselected.sum() == num_rows - 100
        assert torch.equal(updated[unselected], weights[unselected])
        assert not torch.equal(updated[~unselected], weights[~unselected])
        assert torch.equal(res.grad.rows, res.selected)
        ref = dense_delta(g, res.selected, clip1=clip1, clip2=clip2, b=b)
        z.append(((res.grad.values - ref) / (sigma * d2)).flatten())
    z = torch.cat(z).numpy()
    assert z.size == 4000
    assert stats.kstest(z, "norm").pvalue > 0.01
    assert stats.kstest(z * d2 / min(clip1 / b, clip2), "norm").pvalue < 1e-6  # the paper's sensitivity
    assert stats.kstest(z / 2, "norm").pvalue < 1e-6  # std off by 2


@pytest.mark.parametrize("clip2", [None, 0.05])
def test_tiny_noise_all_rows_gives_clipped_ghat(clip2):
    num_rows, dim, b = 40, 3, 10.0
    gen = torch.Generator().manual_seed(1)
    g = random_batch(gen, batch=12, num_rows=num_rows, dim=dim)
    ghat, _ = dense_ghat(g, clip1=1.0, b=b)
    if clip2 is not None:
        assert ghat.norm() > clip2
        ghat = ghat * (clip2 / ghat.norm())
    for sel in (ExponentialSelector(k=num_rows, epsilon=1.0, score_clip=0.1), AllRowsSelector()):
        res = step(g, sel, gen, b=b, clip1=1.0, clip2=clip2, sigma=1e-12)
        torch.testing.assert_close(res.grad.to_dense(), ghat, rtol=0, atol=1e-10)
        assert bool(res.stats.clipped2) == (clip2 is not None)


class RecordingSelector:
    """Uniform selection that records what the step handed it."""

    def __init__(self, score_clip):
        self.score_clip = score_clip
        self.score_kind = "none" if score_clip is None else "norm"
        self.calls = []

    def spend(self):
        return UniformSelector(k=5).spend()

    def select(self, touched, scores, *, selectable_rows, score_sensitivity, ctx, generator):
        self.calls.append((touched, scores, selectable_rows, score_sensitivity))
        return UniformSelector(k=5).select(touched, scores, selectable_rows=selectable_rows,
                                           score_sensitivity=score_sensitivity, ctx=ctx, generator=generator)


def test_step_hands_scores_and_score_sensitivity_to_the_selector():
    gen = torch.Generator().manual_seed(2)
    g = random_batch(gen, batch=8, num_rows=30, dim=4)
    ghat, _ = dense_ghat(g, clip1=1.0, b=4.0)
    for s0, expected_du in ((0.05, 0.05), (10.0, 0.25)):  # Δu = min(S0, S1/b)
        sel = RecordingSelector(s0)
        step(g, sel, gen, b=4.0, clip1=1.0)
        touched, scores, selectable, du = sel.calls[0]
        assert torch.equal(touched, torch.unique(g.rows)) and selectable == 30
        assert du == pytest.approx(expected_du)
        torch.testing.assert_close(scores, ghat[touched].norm(dim=1).clamp(max=s0))
    sel = RecordingSelector(None)  # a selector without scores: none computed
    step(g, sel, gen)
    assert sel.calls[0][1].numel() == 0


def test_spend_stats_and_reproducibility():
    num_rows, b, clip1, clip2, sigma, q = 50, 6.0, 0.5, 0.02, 0.9, 0.003
    gen = torch.Generator().manual_seed(3)
    g = random_batch(gen, batch=7, num_rows=num_rows, dim=4)
    sel = ExponentialSelector(k=4, epsilon=0.7, score_clip=0.1)
    res = step(g, sel, torch.Generator().manual_seed(9), b=b, clip1=clip1, clip2=clip2, sigma=sigma, q=q)
    d2 = min(clip1 / b, 2 * clip2)
    assert res.spend == StepSpend(q, (GaussianSpend(sigma, d2), ExponentialSpend(epsilon=0.7, picks=4)))
    st = res.stats
    assert st.rows_selected == 4
    assert all(isinstance(x, torch.Tensor) and x.dim() == 0 for x in (st.touched_share, st.clipped1, st.clipped2,
                                                                      st.nonfinite))
    assert not hasattr(st, "noise_norm")  # with one released value it tells membership apart
    _, was = dense_ghat(g, clip1=clip1, b=b)
    touched = set(g.rows.tolist())
    f = st.as_floats()
    assert f["clipped1"] == pytest.approx(was.double().mean().item())
    assert f["touched_share"] == pytest.approx(sum(r in touched for r in res.selected.tolist()) / 4)
    assert f["nonfinite"] == 0 and set(f) == {"rows_selected", "touched_share", "clipped1", "clipped2", "nonfinite"}
    assert all(isinstance(v, float) for v in f.values())
    again = step(g, sel, torch.Generator().manual_seed(9), b=b, clip1=clip1, clip2=clip2, sigma=sigma, q=q)
    assert torch.equal(again.grad.values, res.grad.values) and torch.equal(again.selected, res.selected)


@pytest.mark.parametrize(
    "cfg",
    [ExponentialSelectionConfig(k=3), ExponentialSelectionConfig(k=3, method="brute"),
     SparseVectorSelectionConfig(threshold=0.0, cutoff=2), UniformSelectionConfig(k=3),
     RandomSparsificationConfig(final_rate=0.5), AllRowsConfig(),
     GaussianThresholdSelectionConfig(sigma=1.0, threshold=-3.0),
     SparseVectorSelectionConfig(threshold=0.0, cutoff=2, method="brute")],
    ids=lambda c: c.name + getattr(c, "method", ""),
)
def test_empty_batch(cfg):
    """Poisson sampling can give B = 0: selection still runs over all rows and noise is still added."""
    dim = 5
    g = PerSampleRows(torch.zeros(0, dim), torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long), 50)
    sel = make_selector(cfg, num_rows=50)
    gen = torch.Generator().manual_seed(4)
    res = step(g, sel, gen, b=20.0, clip1=1.0, clip2=0.5, sigma=1.0)
    k = res.selected.numel()
    assert res.grad.values.shape == (k, dim) and res.grad.num_rows == 50
    assert k > 0 and (res.grad.values != 0).all()
    f = res.stats.as_floats()
    assert f["touched_share"] == 0 and f["clipped1"] == 0 and f["clipped2"] == 0
    assert np.isfinite(list(f.values())).all()
    # the noise std is σΔ₂ = min(1/20, 1.0)
    if k * dim >= 100:
        assert abs(res.grad.values.std().item() / 0.05 - 1) < 0.3


def test_sparse_vector_selecting_nothing():
    """SVT may find no row above the threshold: an empty (but well-formed) gradient, charged all the same."""
    gen = torch.Generator().manual_seed(5)
    g = random_batch(gen, batch=4, num_rows=20, dim=3)
    sel = make_selector(SparseVectorSelectionConfig(threshold=1e6, cutoff=3), num_rows=20)
    res = step(g, sel, gen)
    assert res.selected.numel() == 0 and res.grad.values.shape == (0, 3)
    assert res.spend.parts[1].cutoff == 3
    assert np.isfinite(list(res.stats.as_floats().values())).all()


def test_gaussian_threshold_step_spends_the_folded_record():
    """The step's spend names both Gaussians (the accountant folds them) and equals plan.step_spend's record."""
    from widedp.config import DPConfig
    from widedp.run.plan import step_spend

    gen = torch.Generator().manual_seed(6)
    g = random_batch(gen, batch=10, num_rows=40, dim=3)
    cfg = GaussianThresholdSelectionConfig(sigma=2.0, threshold_sigmas=1.0)
    res = step(g, make_selector(cfg, num_rows=40), gen, b=10.0, clip1=1.0, clip2=0.05, sigma=0.8, q=0.01)
    dp = DPConfig(clip1=1.0, clip2=0.05, noise_multiplier=0.8, selection=cfg)
    assert res.spend == step_spend(dp, num_rows=40, batch_size=10, n=1000)
    assert res.spend.parts[1] == GaussianSelectionSpend(2.0, 1.0)
    assert res.grad.values.shape == (res.selected.numel(), 3)
