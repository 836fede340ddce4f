"""Tasks: what a run trains (its data, its model, the facts its privacy statement needs), behind one protocol.

    TASKS = {"cbow": ..., "recsys": ..., "glm": ..., "module": ...}   name -> a function returning the task
    task = get_task(cfg.task)

The functions import their task's module when called (recsys pulls in torchrec): nothing registers itself at import
time. A ``Task`` is trained by the one loop (``widedp.run.loop``) with any engine (``widedp.run.engines``); an
``AlgorithmTask`` (glm: convex DP algorithms, not the DP-sparse step) runs its own ``train``.

What a ``Task.build`` returns (``Built``): splits ``train`` / ``valid`` / ``test``, each with ``len()`` and
``batch(idx [B] int64) -> batch``, and a model with ``forward(batch) -> [B]`` per-sample losses,
``per_sample_row_grads(batch) -> ([B] losses, PerSampleRows)`` (under ``torch.inference_mode``) and ``num_rows`` (the
rows a selection ranges over). ``tasks.base.LoopTask`` holds the defaults a task may keep.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from widedp.errors import ConfigError


@dataclass
class Built:
    """A run's splits and model (module docstring); ``notes``: facts for summary.json's ``units`` (the DP
    vocabulary's mechanism, ...)."""

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


@dataclass(frozen=True)
class UnitFacts:
    """What a run's epsilon protects (``unit``), what it does not cover, what it includes besides the steps."""

    unit: str
    not_covered: tuple[str, ...] = ()
    includes: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpacusParts:
    """What the Opacus baseline engine trains: ``module`` (``module(*items) -> [B]`` losses, Opacus-hookable layers
    only), the train split as a map-style ``dataset`` whose ``__getitems__`` returns a tuple of tensors, and
    ``sync(module)``: the task's model with the module's weights (for evaluation)."""

    module: torch.nn.Module
    dataset: Any
    sync: Callable[[torch.nn.Module], Any]


class Task(Protocol):
    """A task the one loop trains (module docstring; defaults in ``widedp.tasks.base.LoopTask``)."""

    name: str
    #: summary keys ``widedp train`` prints besides the losses (e.g. AUC)
    summary_keys: tuple[str, ...]

    def check(self, cfg: Any, *, private: bool) -> None:
        """ConfigError for what this task cannot train (before anything is written)."""

    def build(self, cfg: Any, out: Path, *, device: torch.device, data: Any = None, noise_seed: int | None = None
              ) -> Built:
        """Splits and model on ``device``; files the run directory needs (vocab.json, ...). ``data``: prepared
        data to use (canaries, a sweep's shared corpus); ``noise_seed``: the run's secret seed for what is released
        before the first step (``RunBudget.prefix``), None when nothing is."""

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

    def opacus(self, cfg: Any, built: Built) -> OpacusParts:
        """The Opacus baseline's module and dataset (``dp.engine: opacus``), or a ConfigError."""

    def warn(self, cfg: Any) -> None:
        """Warnings on stderr, once the run is set up (a config error stays one line)."""

    def finish(self, cfg: Any, out: Path, built: Built) -> dict[str, Any]:
        """Metrics of the final model added to summary.json (``built.model`` holds the final weights)."""

    def shared_data(self, cfg: Any) -> Any:
        """Data several runs of a sweep may share (``widedp compare``), or None (each run prepares its own)."""


@runtime_checkable
class AlgorithmTask(Protocol):
    """A task with its own algorithms (not the DP-sparse step): it trains and reports itself."""

    name: str
    summary_keys: tuple[str, ...]

    def train(self, cfg: Any, out: Path, *, resume: bool, progress: bool) -> dict[str, Any]: ...

    def epsilon_report(self, cfg: Any) -> dict[str, Any]: ...


def _cbow() -> Task:
    from widedp.tasks.cbow import TASK

    return TASK


def _recsys() -> Task:
    from widedp.tasks.recsys import TASK

    return TASK


def _glm() -> AlgorithmTask:
    from widedp.tasks.glm import TASK

    return TASK


def _module() -> Task:
    from widedp.tasks.module import TASK

    return TASK


#: task name (the config's ``task:``) -> the function that returns it
TASKS: dict[str, Callable[[], Task | AlgorithmTask]] = {"cbow": _cbow, "recsys": _recsys, "glm": _glm,
                                                          "module": _module}


def get_task(name: str) -> Task | AlgorithmTask:
    if name not in TASKS:
        raise ConfigError(f"task: expected one of {', '.join(TASKS)}, got {name!r}")
    return TASKS[name]()


def loop_task(name: str) -> Task:
    """The task ``name``, which must be one the loop trains (not an ``AlgorithmTask``)."""
    task = get_task(name)
    if isinstance(task, AlgorithmTask):
        raise ConfigError(f"task: {name} runs its own algorithms (`widedp train CONFIG`), not the DP-sparse loop")
    return task
