"""The ``recsys`` task's builder for ``widedp.train`` (registered in ``widedp.train.TASK_BUILDERS``).

    widedp train configs/recsys_synthetic_sparse_exp.yaml --out runs/recsys
    widedp epsilon configs/recsys_synthetic_sparse_exp.yaml

The training loop, the DP step (``widedp.step.dp_step``), the accountant and the row optimizers are the ones CBOW
uses: this module only prepares the interaction splits and the model. Non-private training: autograd and
``train.optimizer`` sgd (dense or, with ``model.sparse: true``, sparse table gradients) or adam (``model.sparse:
false``); ``sparse_adam`` is not available because the MLP is dense. DP: ``sgd`` | ``lazy_adam`` | ``adam`` row
optimizers over the tables and the dense rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from widedp.config import Config
from widedp.data_prep.interactions import InteractionData, RecsysSplit, prepare_interactions
from widedp.errors import ConfigError
from widedp.models.recsys import RecsysModel
from widedp.recsys_config import RecsysModelConfig


def build_model(cardinality: dict[str, int], cfg: RecsysModelConfig, *, seed: int,
                device: torch.device | str = "cpu") -> RecsysModel:
    """The model for tables of ``cardinality``; initialised on the CPU from ``seed`` (same weights on any
    device), then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    model = RecsysModel(cardinality, dim=cfg.dim, hidden=cfg.hidden, pooling=cfg.pooling,
                        interaction=cfg.interaction, sparse=cfg.sparse, init_scale=cfg.init_scale, generator=gen)
    return model.to(device)


def build_recsys(cfg: Config, out: Path, *, device: torch.device, data: InteractionData | None = None
                 ) -> tuple[dict[str, RecsysSplit], RecsysModel]:
    """Recsys task: splits (tensors on ``device``) and the model; writes ``out/features.json``."""
    if cfg.dp is None and cfg.train.optimizer == "sparse_adam":
        raise ConfigError("train.optimizer: sparse_adam is not available for recsys (its MLP is dense); use adam "
                          "with model.sparse: false, or sgd")
    data = data if data is not None else prepare_interactions(cfg.data)
    splits = {k: RecsysSplit(getattr(data, k), device) for k in ("train", "valid", "test")}
    (out / "features.json").write_text(json.dumps({"cardinality": data.cardinality,
                                                   "positive_rate": data.positive_rate}))
    return splits, build_model(data.cardinality, cfg.model, seed=cfg.train.seed, device=device)
