"""The task protocol (``Task``, ``AlgorithmTask``) and what tasks return; the tasks themselves are in
``widedp.tasks.TASKS``.

What a ``Task.build`` returns (``Built``): splits ``train`` / ``valid`` / ``test``, each with ``len()`` and
``batch(idx [B] int64) -> batch``, and a model with ``model(batch) -> [B]`` per-sample losses,
``per_sample_row_grads(batch) -> ([B] losses, PerSampleRows)`` (called under ``torch.inference_mode``), ``num_rows``
(the rows a selection ranges over), ``state_dict`` / ``load_state_dict`` / ``parameters`` / ``train`` / ``eval``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from widedp.accounting.statement import UnitFacts


@dataclass
class Built:
    """A run's splits and model (the module docstring says what they provide); ``notes``: facts for summary.json's
    ``units`` (the DP vocabulary's mechanism, ...)."""

    splits: dict[str, Any]
    model: Any
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Shape:
    """What ``widedp epsilon`` needs without training: n samples, the selectable rows, the train split when privacy
    units must be counted (else None), notes for the report."""

    n: int
    num_rows: int
    train: Any = None
    notes: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    """A task the one loop trains (module docstring; defaults in ``widedp.tasks.base.LoopTask``)."""

    name: str
    #: summary keys ``widedp train`` prints besides the losses (e.g. AUC)
    summary_keys: tuple[str, ...]

    def check(self, cfg: Any, *, private: bool) -> None:
        """ConfigError for what this task cannot train (before anything is written)."""

    def build(self, cfg: Any, out: Path, *, device: torch.device, data: Any = None, noise_seed: int | None = None,
              resumed: bool = False) -> Built:
        """Splits and model on ``device``; files the run directory needs (vocab.json, ...). ``data``: prepared
        data to use (canaries, a sweep's shared corpus); ``noise_seed``: the run's secret seed for what the build
        releases before the first step (the DP vocabulary: ``RunBudget.vocabulary``), None when it releases nothing;
        ``resumed``: the run directory holds a checkpoint, so what the build releases must be there already (a second
        draw would be a second, uncharged release)."""

    def shape(self, cfg: Any) -> Shape:
        """n, rows (and the train split for units) without training."""

    def units(self, cfg: Any, split: Any, *, device: torch.device | str) -> Any:
        """The train split's privacy units (``widedp.dp.units.Units``), None when a sample is the unit."""

    def privacy(self, cfg: Any) -> UnitFacts:
        """The unit and the gaps of this config's guarantee (``widedp.accounting.statement.for_run``)."""

    def optimizer(self, cfg: Any, model: Any) -> torch.optim.Optimizer:
        """The non-private optimizer (``train.optimizer``)."""

    def row_optimizer(self, cfg: Any, model: Any) -> Any:
        """The DP update: ``step(SparseRows)``, ``state_dict()``, ``load_state_dict()``."""

    def warn(self, cfg: Any) -> None:
        """Warnings on stderr, once the run is set up (a config error stays one line)."""

    def finish(self, cfg: Any, out: Path, built: Built) -> dict[str, Any]:
        """Metrics of the final model added to summary.json (``built.model`` holds the final weights)."""

    def metrics_model(self, cfg: Any) -> str | None:
        """Which model the run's losses and metrics score (e.g. the full model, of which the release leaves a table
        out), for a notice line at the head of metrics.jsonl; None: the release is the trained model."""

    def shared_data(self, cfg: Any) -> Any:
        """Data several runs of a sweep may share (``widedp compare``), or None (each run prepares its own)."""


@runtime_checkable
class AlgorithmTask(Protocol):
    """A task with its own algorithms (not the DP-sparse step): it trains and reports itself."""

    name: str
    summary_keys: tuple[str, ...]

    def train(self, cfg: Any, out: Path, *, resume: bool, progress: bool) -> dict[str, Any]: ...

    def epsilon_report(self, cfg: Any) -> dict[str, Any]: ...


