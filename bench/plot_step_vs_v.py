"""Plot the DP step's time against V from a ``bench_step.py --device cuda`` JSON (docs/step_vs_v_h200.png).

    .venv/bin/python bench/plot_step_vs_v.py docs/bench_step_cuda_h200.json --png docs/step_vs_v_h200.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

LABELS = {
    "nonprivate_sparse_adam": "non-private SparseAdam",
    "dp_sparse_lazy_adam": "DP-sparse, exponential, lazy Adam",
    "dp_gaussian_threshold_lazy_adam": "DP, Gaussian thresholding, lazy Adam",
    "dpsgd_dense_lazy_adam": "dense DP-SGD (every row noised)",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--png", type=Path, required=True)
    args = ap.parse_args()
    data = json.loads(args.json.read_text())
    batches = sorted({r["batch"] for r in data["rows"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 3.8), sharey=True, squeeze=False)
    for ax, b in zip(axes[0], batches):
        for method, label in LABELS.items():
            pts = sorted((r["vocab"], r["step_ms"]) for r in data["rows"] if r["batch"] == b and r["method"] == method)
            if pts:
                ax.plot([v for v, _ in pts], [t for _, t in pts], marker="o", label=label,
                        color="black" if method.startswith("dpsgd") else None)
        ax.set(xscale="log", yscale="log", xlabel="V (rows per table)", title=f"b = {b}, D = 128, k = 1024")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("ms per step")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"Step time against V on {data['device'].split(' (')[0]} ({args.json.name})", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
