"""The ``recsys`` task (``widedp.tasks.TASKS["recsys"]``): a DLRM-style recommender on interaction data.

    widedp train configs/recsys_synthetic_sparse_exp.yaml --out runs/recsys
    widedp epsilon configs/recsys_synthetic_sparse_exp.yaml

The training loop, the DP step (``widedp.dp.step.dp_step``), the accountant and the row optimizers are the ones CBOW
uses: this module only prepares the interaction splits and the model. Non-private training: autograd and
``train.optimizer`` sgd (dense or, with ``model.sparse: true``, sparse table gradients) or adam (``model.sparse:
false``); ``sparse_adam`` is not available because the MLP is dense. DP: ``sgd`` | ``lazy_adam`` | ``adam`` row
optimizers over the tables and the dense rows.

A run directory also holds ``features.json`` (table sizes, positive rate) and ``ids.json`` (the raw id of every
table row, what ``widedp export --format torch`` releases beside the weights). At the end of a run AUC and normalised
entropy of the final model (valid and test) are added to ``summary.json`` and ``metrics.jsonl`` (``finish``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from widedp.accounting.statement import UnitFacts
from widedp.config import Config
from widedp.config.recsys import RecsysModelConfig
from widedp.data_prep.interactions import InteractionData, RecsysSplit, prepare_interactions
from widedp.data_prep.splits import counted
from widedp.dp import units
from widedp.errors import ConfigError
from widedp.models.recsys import RecsysModel
from widedp.run.checkpoint import write_json
from widedp.tasks.base import LoopTask
from widedp.tasks.protocol import Built

IDS_NOT_COVERED = ("the embedding-table sizes and id -> row numbering (computed from the data's distinct ids; "
                   "data.id_buckets hashes ids into fixed tables instead)")
COUNTED_SPLITS_NOT_COVERED = ("data.splits given as counts: each split's rate n/N uses the number of "
                              "interactions N (fractions do not)")


def build_model(cardinality: dict[str, int], cfg: RecsysModelConfig, *, seed: int,
                device: torch.device | str = "cpu") -> RecsysModel:
    """The model for tables of ``cardinality``; initialised on the CPU from ``seed`` (same weights on any
    device), then moved to ``device``."""
    gen = torch.Generator().manual_seed(seed)
    model = RecsysModel(cardinality, dim=cfg.dim, hidden=cfg.hidden, pooling=cfg.pooling,
                        interaction=cfg.interaction, sparse=cfg.sparse, init_scale=cfg.init_scale, generator=gen)
    return model.to(device)


IDS_FILE = "ids.json"
IDS_FORMAT = "widedp.ids/1"


def ids_document(data: InteractionData) -> dict[str, Any]:
    """``ids.json``: for every table (feature, in table order) the raw id of each row, or ``{"hashed": B}`` for a
    hashed table (``data.id_buckets``)."""
    return {"format": IDS_FORMAT, "features": list(data.cardinality),
            "ids": {f: data.ids[f] for f in data.cardinality},
            "note": "row r of table t_<feature> in model.pt is raw id ids[feature][r]; a table given as {hashed: B} "
                    "holds raw id x in row int.from_bytes(blake2b(str(x).encode(), digest_size=8).digest(), "
                    "'little') % B (an integral float id x written as int)"}


class RecsysTask(LoopTask):
    name = "recsys"
    summary_keys = ("valid_auc", "test_auc", "valid_ne", "test_ne")

    def check(self, cfg: Config, *, private: bool) -> None:
        if not private and cfg.train.optimizer == "sparse_adam":
            raise ConfigError("train.optimizer: sparse_adam is not available for recsys (its MLP is dense); use adam "
                              "with model.sparse: false, or sgd")

    def build(self, cfg: Config, out: Path, *, device: torch.device, data: Any = None, noise_seed: int | None = None,
              resumed: bool = False) -> Built:
        """Splits (tensors on ``device``) and the model; writes ``out/features.json`` and ``out/ids.json``."""
        data = data if data is not None else prepare_interactions(cfg.data)
        splits = {k: RecsysSplit(getattr(data, k), device) for k in ("train", "valid", "test")}
        (out / "features.json").write_text(json.dumps({"cardinality": data.cardinality,
                                                       "positive_rate": data.positive_rate}))
        if data.ids is not None:
            write_json(out / IDS_FILE, ids_document(data), indent=None)
        return Built(splits, build_model(data.cardinality, cfg.model, seed=cfg.train.seed, device=device))

    def units(self, cfg: Config, split: Any, *, device: torch.device | str) -> units.Units | None:
        """User units: the raw user of each interaction (the ``user`` feature's row, or with hashed ids, where
        raw users share rows, the raw id itself), each user's interactions keyed by their index in the split."""
        if units.is_per_sample(cfg):
            return None
        if "user" not in split.names:
            raise ConfigError("data.privacy_unit: user needs a 'user' feature in the data")
        user = split.user if split.user is not None else split.features[split.names.index("user")][:, 0].cpu().numpy()
        return units.group_units(user, np.arange(len(user)), cap=cfg.data.max_samples_per_unit, device=device)

    def privacy(self, cfg: Config) -> UnitFacts:
        unit = ("interaction (one user-item example)" if units.is_per_sample(cfg)
                else units.unit_name(cfg, "interactions"))
        d = cfg.data
        gaps = (() if d.source == "synthetic" or d.id_buckets else (IDS_NOT_COVERED,)) + (
            (COUNTED_SPLITS_NOT_COVERED,) if counted(d.splits) else ()) + (
            (f"data.max_interactions: {d.max_interactions}: the source is cut to its first {d.max_interactions} "
             "rows by position",) if d.max_interactions else ())
        return UnitFacts(unit, gaps)

    def shard(self, model: RecsysModel, rank: int, world: int) -> Any:
        """``ShardedRecsys``: rank ``rank`` of ``world``'s row block of every table, the MLP rows replicated."""
        from widedp.dp.distributed import ShardedRecsys, shard_of

        try:
            return ShardedRecsys(model, shard_of(model, rank, world))
        except ValueError as e:
            raise ConfigError(f"data: {e}") from None

    def finish(self, cfg: Config, out: Path, built: Built) -> dict[str, Any]:
        """AUC, normalised entropy (and BCE) of the final model on the valid and test splits (the first
        ``train.eval_max_samples`` of each, as the losses)."""
        model, tc = built.model, cfg.train
        model.eval()
        res: dict[str, Any] = {}
        for split in ("valid", "test"):
            m = model.eval_metrics(built.splits[split], batch_size=tc.eval_batch_size,
                                   max_samples=tc.eval_max_samples)
            res.update({f"{split}_{k}": v for k, v in m.items() if k != "bce"})
        model.train()
        return res


TASK = RecsysTask()
