"""``LoopTask``: the defaults of the ``widedp.tasks.Task`` protocol; a task overrides what it does differently."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from widedp.accounting.statement import UnitFacts
from widedp.dp import units
from widedp.dp.optim import make_row_optimizer
from widedp.errors import ConfigError
from widedp.tasks.protocol import Built, Shape


class LoopTask:
    """Defaults: samples are the unit; epsilon protects one training example; non-private ``sgd`` / ``adam`` /
    ``sparse_adam`` over ``model.parameters()``; DP row optimizers over ``model.row_tables()``; no Opacus model."""

    name = ""
    summary_keys: tuple[str, ...] = ()

    def check(self, cfg: Any, *, private: bool) -> None:
        pass

    def build(self, cfg: Any, out: Path, *, device: torch.device, data: Any = None, noise_seed: int | None = None,
              resumed: bool = False) -> Built:
        raise NotImplementedError

    def shape(self, cfg: Any) -> Shape:
        """Build the data and the model once (on the CPU, in a scratch directory) to learn n and the rows."""
        with tempfile.TemporaryDirectory() as tmp:
            built = self.build(cfg, Path(tmp), device=torch.device("cpu"))
        train = built.splits["train"]
        return Shape(len(train), built.model.num_rows, train)

    def units(self, cfg: Any, split: Any, *, device: torch.device | str) -> Any:
        if units.is_per_sample(cfg):
            return None
        raise ConfigError(f"data.privacy_unit: {units.privacy_unit(cfg)} is not available for task {self.name}")

    def privacy(self, cfg: Any) -> UnitFacts:
        return UnitFacts("training example")

    def optimizer(self, cfg: Any, model: Any) -> torch.optim.Optimizer:
        tc = cfg.train
        if tc.optimizer == "sgd":
            return torch.optim.SGD(model.parameters(), lr=tc.lr)
        if tc.optimizer == "sparse_adam":
            return torch.optim.SparseAdam(list(model.parameters()), lr=tc.lr, betas=tc.betas, eps=tc.eps)
        if getattr(cfg.model, "sparse", False):
            raise ConfigError("train.optimizer: adam (dense) needs model.sparse: false; use sparse_adam for sparse "
                              "embeddings")
        return torch.optim.Adam(model.parameters(), lr=tc.lr, betas=tc.betas, eps=tc.eps)

    def row_optimizer(self, cfg: Any, model: Any) -> Any:
        tc = cfg.train
        return make_row_optimizer(tc.optimizer, model.row_tables(), lr=tc.lr, betas=tc.betas, eps=tc.eps)

    def warn(self, cfg: Any) -> None:
        pass

    def finish(self, cfg: Any, out: Path, built: Built) -> dict[str, Any]:
        return {}

    def metrics_model(self, cfg: Any) -> str | None:
        return None

    def shared_data(self, cfg: Any) -> Any:
        return None
