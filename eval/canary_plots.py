"""The rank-histogram grid of the secret-sharer evaluation (the paper's Figure 2): rows n_c, columns models, and
a last column with control phrases (never inserted) — those of the row's first model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def plot_rank_grid(results: list[dict[str, Any]], path: Path, *, num_candidates: int, bins: int) -> Path:
    """One histogram of canary ranks per (n_c, model) from ``evaluate_run`` results; the dashed line is uniform."""
    labels = list(dict.fromkeys(r["label"] for r in results))
    ncs = sorted({r["n_c"] for r in results})
    cell = {(r["n_c"], r["label"]): r for r in results}
    cols = len(labels) + 1
    fig, axes = plt.subplots(len(ncs), cols, figsize=(3.2 * cols, 2.6 * len(ncs)), squeeze=False, sharex=True)
    edges = np.linspace(0, num_candidates + 1, bins + 1)
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
            ax.bar(edges[:-1], s["histogram"], width=np.diff(edges), align="edge", color="C0" if j < cols - 1
                   else "C7", edgecolor="white", linewidth=0.3)
            ax.step(edges, [*s["expected"], s["expected"][-1]], where="post", color="k", ls="--", lw=0.8)
            p = f"p={s['p_value']:.2g}" if s["p_value"] > 0 else "p<1e-300"
            ax.set_title(f"{title}, $n_c$={nc}\n$\\chi^2/N$={s['chi2_distance']:.3g}, {p}", fontsize=8)
            ax.tick_params(labelsize=7)
            if i == len(ncs) - 1:
                ax.set_xlabel("rank", fontsize=8)
            if j == 0:
                ax.set_ylabel("phrases", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
