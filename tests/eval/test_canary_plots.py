"""The canary figure: one y-scale, the Secret Sharer's rank on the x-axis."""

import numpy as np

from widedp.eval.canary import rank_histogram, uniformity
from widedp.eval.canary_plots import plot_rank_grid, position_histogram


def _stats(ranks, num_candidates, bins):
    return {**uniformity(np.asarray(ranks), num_candidates, bins), "rank": list(ranks)}


def test_positions_are_the_paper_ranks_mirrored():
    R, bins = 99, 10  # |R| + 1 = 100 positions, 10 per bin
    rng = np.random.default_rng(0)
    ranks = rng.integers(0, R + 1, 500)
    edges, counts, expected = position_histogram(_stats(ranks, R, bins), R, bins)
    paper, paper_expected = rank_histogram(ranks, R, bins)
    assert counts.tolist() == paper[::-1].tolist() and np.allclose(expected, paper_expected[::-1])
    assert edges[0] == 0.5 and edges[-1] == R + 1.5
    # a memorised canary (paper rank |R|: every candidate is less likely) is at position 1, the first bin
    _, counts, _ = position_histogram(_stats([R, R, R - 1], R, bins), R, bins)
    assert counts[0] == 3 and counts.sum() == 3
    # without per-phrase ranks: the stored histogram read right to left
    st = uniformity(ranks, R, bins)
    assert position_histogram(st, R, bins)[1].tolist() == paper[::-1].tolist()


def test_grid_shares_one_y_scale(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    R, bins = 999, 20
    rng = np.random.default_rng(1)
    results = []
    for label, ranks in (("dp", rng.integers(0, R + 1, 200)), ("plain", np.full(200, R))):
        results.append({"label": label, "n_c": 3, "canaries": _stats(ranks, R, bins),
                        "controls": _stats(rng.integers(0, R + 1, 200), R, bins)})
    seen = {}
    orig = plt.Figure.savefig

    def spy(fig, *a, **k):
        seen["ylims"] = {ax.get_ylim() for ax in fig.axes if ax.get_visible()}
        seen["xlabel"] = fig.axes[0].get_xlabel()
        return orig(fig, *a, **k)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    path = plot_rank_grid(results, tmp_path / "g.png", num_candidates=R, bins=bins)
    assert path.stat().st_size > 5000
    assert len(seen["ylims"]) == 1 and next(iter(seen["ylims"]))[1] >= 200  # the memorised pile sets the scale
    assert "1 = most likely" in seen["xlabel"]
