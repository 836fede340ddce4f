"""Sensitivity of the selected, clipped gradient (privacy.md §4.3) and the Gaussian noise."""

import random

import pytest
import torch

from widedp.dp.clipping import aggregate, clip_l2, clip_per_sample, restrict
from widedp.dp.noise import gaussian_noise, sensitivity
from widedp.dp.rowgrads import PerSampleRows, coalesce


def test_sensitivity_values():
    assert sensitivity(clip1=15.0, clip2=1.0, batch_size=20) == pytest.approx(0.75)
    assert sensitivity(clip1=15.0, clip2=0.1, batch_size=20) == pytest.approx(0.2)  # 2·S2, not S2
    assert sensitivity(clip1=15.0, clip2=None, batch_size=20) == pytest.approx(0.75)


def test_gaussian_noise():
    gen = torch.Generator().manual_seed(0)
    x = gaussian_noise((200, 500), std=0.3, generator=gen, device="cpu", dtype=torch.float64)
    assert x.shape == (200, 500) and x.dtype == torch.float64
    assert abs(x.std().item() / 0.3 - 1) < 0.01
    assert abs(x.mean().item()) < 0.003
    y = gaussian_noise((200, 500), std=0.3, generator=torch.Generator().manual_seed(0), device="cpu",
                       dtype=torch.float64)
    assert torch.equal(x, y)


def _batch(samples: list[tuple[list[int], torch.Tensor]], num_rows: int, dim: int) -> PerSampleRows:
    if not samples:
        return PerSampleRows(torch.zeros(0, dim, dtype=torch.float64), torch.zeros(0, dtype=torch.long),
                             torch.zeros(1, dtype=torch.long), num_rows)
    rows = torch.tensor([r for rs, _ in samples for r in rs])
    values = torch.cat([v for _, v in samples])
    sample = torch.tensor([j for j, (rs, _) in enumerate(samples) for _ in rs])
    return coalesce(values, rows, sample, len(samples), num_rows)


def _delta_hat(g: PerSampleRows, selected: torch.Tensor, *, clip1: float, clip2: float | None, b: float):
    clipped, _ = clip_per_sample(g, clip1=clip1)
    touched, ghat = aggregate(clipped, batch_size=b)
    values, _ = restrict(touched, ghat, selected)
    dense_scores = torch.zeros(g.num_rows, dtype=torch.float64)
    dense_scores[touched] = ghat.norm(dim=1)
    return clip_l2(values, clip=clip2)[0], dense_scores


@pytest.mark.parametrize("clip2", [0.1, None])
def test_sensitivity_search_add_remove(clip2):
    """||Δ̂(D) − Δ̂(D')|| <= min(S1/b, 2·S2) over random neighbours, attained beyond the paper's min(S1/b, S2);
    scores min(||ĝ_r||, S0) move by at most Δu = min(S0, S1/b) per row."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    num_rows, clip1, b, s0 = 4, 1.0, 2.0, 0.3
    bound = sensitivity(clip1=clip1, clip2=clip2, batch_size=b)
    du = min(s0, clip1 / b)
    worst = worst_score = 0.0
    for _ in range(400):
        dim = rng.choice([1, 2])
        samples = []
        for _ in range(rng.randint(1, 4)):
            rows = rng.sample(range(num_rows), rng.randint(1, 3))
            mag = 3 * clip1 * rng.random()
            samples.append((rows, torch.randn(len(rows), dim, generator=gen, dtype=torch.float64) * mag))
        selected = torch.tensor(rng.sample(range(num_rows), rng.randint(1, num_rows)))
        d_full, u_full = _delta_hat(_batch(samples, num_rows, dim), selected, clip1=clip1, clip2=clip2, b=b)
        for j in range(len(samples)):
            neighbour = _batch(samples[:j] + samples[j + 1:], num_rows, dim)
            d_nb, u_nb = _delta_hat(neighbour, selected, clip1=clip1, clip2=clip2, b=b)
            worst = max(worst, (d_full - d_nb).norm().item())
            worst_score = max(worst_score, (u_full.clamp(max=s0) - u_nb.clamp(max=s0)).abs().max().item())
    assert worst <= bound + 1e-12
    assert worst_score <= du + 1e-12
    assert worst_score > 0.9 * du
    if clip2 is not None:
        assert worst > 1.5 * min(clip1 / b, clip2)  # the paper's min(S1/b, S2) is too small
    else:
        assert worst > 0.9 * bound
