"""Plots of a run's losses (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_losses(history: list[dict[str, Any]], path: Path, *, title: str = "") -> None:
    """Train / valid / test loss per epoch (epoch 0 = before training) into a PNG."""
    if not history:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=100)
    epochs = [h["epoch"] for h in history]
    for key, style in (("train_loss", "-o"), ("valid_loss", "-s"), ("test_loss", "-^")):
        ax.plot(epochs, [h.get(key) for h in history], style, ms=3, label=key.replace("_", " "))
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
