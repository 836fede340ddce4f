"""The trainer protocol (``Trainer``) and what trainers return; ``widedp.run.trainers`` describes the trainers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from widedp.accounting.statement import PrivacyStatement
from widedp.config import DPConfig
from widedp.tasks.protocol import Built, Task


@dataclass(frozen=True)
class Drawn:
    """One step's batch: ``batch`` (what the trainer steps on), ``samples`` (how many samples it holds, units
    counted by their samples), ``units`` (``widedp.dp.units.UnitBatch`` when the privacy unit groups samples) and
    ``public_rows`` (rows the step noises whatever the data: ``data.negatives_pool``'s pool)."""

    batch: Any
    samples: int
    units: Any = None
    public_rows: Any = None


@dataclass(frozen=True)
class StepOutput:
    """loss_sum: the batch's summed per-sample loss, 0-dim (a DP trainer counts a non-finite one as 0)."""

    loss_sum: Tensor


@dataclass(frozen=True)
class Report:
    """What a finished run states: the privacy statement, summary.json's ``dp`` section (None: non-private), and
    the title of loss.png."""

    statement: PrivacyStatement
    dp: dict[str, Any] | None
    title: str


class Trainer(Protocol):
    """See the module docstring. ``module``: what trains (its ``state_dict`` is the checkpoint's ``model``)."""

    module: torch.nn.Module
    dp: DPConfig | None  # calibrated
    prefix_seed: int | None  # the secret seed of what the task's build releases before the first step; None: nothing
    per_epoch: int
    total: int
    unit_info: dict[str, Any] | None  # summary.json's "units"
    is_writer: bool  # this process writes the run's files (a distributed run's rank 0; ``widedp.distributed.ranks``)

    def setup(self, built: Built, task: Task) -> None: ...

    def start(self) -> dict[str, Any]:
        """A new run's first moment (the prefix's journal entry); returns the start record's extra keys."""

    def sample(self, step: int) -> Drawn: ...

    def step(self, drawn: Drawn, epoch: int) -> StepOutput: ...

    def interval_stats(self, steps: int, step: int) -> dict[str, Any]:
        """The diagnostics of the last ``steps`` steps (then reset) for metrics.jsonl."""

    def eval_model(self) -> Any:
        """The task's model holding the trained weights (for evaluation)."""

    def epsilons(self) -> dict[str, Any]: ...

    def exhausted(self) -> bool: ...

    def reserve(self, steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, ckpt: dict[str, Any]) -> None: ...

    def save_private(self, step: int, *, best: dict[str, Any] | None = None) -> None:
        """What this process alone holds at checkpoint ``step`` (generator states; a sharded run's part of the
        checkpoint), written before checkpoint.pt; ``best``: ``train.keep_best``'s epoch, valid loss and weights
        (``module.state_dict()``), which a trainer whose weights are not in checkpoint.pt saves too."""

    def prune_private(self, step: int) -> None: ...

    def close(self) -> None: ...

    def report(self, *, stopped: bool) -> Report: ...


