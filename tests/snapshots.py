"""A crash at a checkpoint, for the resume tests: a run, and a copy of its directory taken right after one
checkpoint was written."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import widedp.run.loop as loop_mod
from widedp.run.train import train


def train_with_snapshot(cfg: Any, run: Path, snap: Path, *, step: int, monkeypatch: Any) -> dict[str, Any]:
    """Train ``cfg`` into ``run`` (uninterrupted); ``snap`` gets the run directory as it was right after its
    checkpoint at ``step`` (what a kill -9 then leaves). Returns the uninterrupted run's summary."""
    orig = loop_mod.save_checkpoint

    def snapshot(out: Path, state: dict[str, Any]) -> None:
        orig(out, state)
        if state["step"] == step and not snap.exists():
            shutil.copytree(out, snap)

    monkeypatch.setattr(loop_mod, "save_checkpoint", snapshot)
    try:
        return train(cfg, run, progress=False)
    finally:
        monkeypatch.setattr(loop_mod, "save_checkpoint", orig)
