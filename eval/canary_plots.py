"""The rank-histogram grid of the secret-sharer evaluation (the paper's Figure 2): rows n_c, columns models, and
a last column with control phrases (never inserted) — those of the row's first model.

Every panel shares one y-scale (phrases per bin), so canaries and controls, and models, compare by eye. The x-axis
is the Secret Sharer's rank (Carlini et al. 2019): a phrase's position among itself and the |R| random candidates
sorted by log-perplexity, 1 = the most likely = memorised (``position = |R| + 1 - rank`` for the paper's rank
``#{r : P(r) >= P(c)}``, high = memorised, that ``canary.json`` and the χ² test use). A model that memorised its
canaries piles them up at the left; controls stay flat on the dashed uniform line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from widedp.extras import pyplot


def position_histogram(stats: dict[str, Any], num_candidates: int, bins: int) -> tuple[np.ndarray, np.ndarray,
                                                                                          np.ndarray]:
    """(bin edges over positions 1..|R|+1, counts, counts expected under the uniform law) of one phrase set.

    From the per-phrase paper ranks (``stats["rank"]``) when present; else the stored paper-rank histogram read
    right to left (its bins then approximate the position bins)."""
    m = num_candidates + 1  # positions 1..m
    edges = 0.5 + np.linspace(0, m, bins + 1)
    width = np.bincount((np.arange(m) * bins) // m, minlength=bins)
    if stats.get("rank") is not None:
        pos0 = m - 1 - np.asarray(stats["rank"], dtype=np.int64)  # position - 1 in 0..|R|
        counts = np.bincount(pos0 * bins // m, minlength=bins)
    else:
        counts = np.asarray(stats["histogram"])[::-1]
    return edges, counts, width * (counts.sum() / m)


def plot_rank_grid(results: list[dict[str, Any]], path: Path, *, num_candidates: int, bins: int) -> Path | None:
    """One histogram of canary positions per (n_c, model) from ``evaluate_run`` results; the dashed line is
    uniform. One y-scale for every panel. None (nothing drawn) without matplotlib (the eval extra)."""
    plt = pyplot(f"the canary rank histograms ({path.name})")
    if plt is None:
        return None
    labels = list(dict.fromkeys(r["label"] for r in results))
    ncs = sorted({r["n_c"] for r in results})
    cell = {(r["n_c"], r["label"]): r for r in results}
    cols = len(labels) + 1
    fig, axes = plt.subplots(len(ncs), cols, figsize=(3.2 * cols, 2.6 * len(ncs) + 0.4), squeeze=False,
                             sharex=True, sharey=True)
    for i, nc in enumerate(ncs):
        row = [cell.get((nc, lab)) for lab in labels]
        first = next(r for r in row if r is not None)
        panels = [(r, "canaries", lab) for r, lab in zip(row, labels)]
        panels.append((first, "controls", f"control ({first['label']})"))
        for j, (r, key, title) in enumerate(panels):
            ax = axes[i][j]
            if r is None:
                ax.axis("off")
                continue
            s = r[key]
            edges, counts, expected = position_histogram(s, num_candidates, bins)
            ax.bar(edges[:-1], counts, width=np.diff(edges), align="edge", color="C0" if j < cols - 1 else "C7",
                   edgecolor="white", linewidth=0.3)
            ax.step(edges, [*expected, expected[-1]], where="post", color="k", ls="--", lw=0.8)
            p = f"p={s['p_value']:.2g}" if s["p_value"] > 0 else "p<1e-300"
            ax.set_title(f"{title}, $n_c$={nc}\n$\\chi^2/N$={s['chi2_distance']:.3g}, {p}", fontsize=8)
            ax.tick_params(labelsize=7)
            if i == len(ncs) - 1:
                ax.set_xlabel(f"rank among {num_candidates + 1:,} phrases\n(Secret Sharer: 1 = most likely)",
                              fontsize=7.5)
            if j == 0:
                ax.set_ylabel("phrases per bin", fontsize=8)
    fig.suptitle("Canary ranks (left = memorised); dashed: uniform, as for phrases never trained on", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
