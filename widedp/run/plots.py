"""Plots of a run's history (matplotlib, headless; skipped with a note without the eval extra)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from widedp.extras import pyplot


def plot_history(history: list[dict[str, Any]], path: Path, *, keys: Sequence[str], x: str = "epoch",
                 ylabel: str = "loss", title: str = "") -> None:
    """One line per ``keys`` entry of ``history`` records against record[``x``], into a PNG."""
    plt = pyplot("the loss and accuracy curves (*.png)")
    if not history or plt is None:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=100)
    xs = [h[x] for h in history]
    for key, style in zip(keys, ("-o", "-s", "-^", "-v", "-d")):
        ax.plot(xs, [h.get(key) for h in history], style, ms=3, label=key.replace("_", " "))
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_losses(history: list[dict[str, Any]], path: Path, *, title: str = "") -> None:
    """Train / valid / test loss per epoch (epoch 0 = before training) into a PNG."""
    plot_history(history, path, keys=("train_loss", "valid_loss", "test_loss"), title=title)
