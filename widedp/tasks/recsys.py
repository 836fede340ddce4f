"""The ``recsys`` task (``widedp.tasks.TASKS["recsys"]``): a DLRM-style recommender on interaction data.

    widedp train configs/recsys_synthetic_sparse_exp.yaml --out runs/recsys
    widedp epsilon configs/recsys_synthetic_sparse_exp.yaml

The training loop, the DP step (``widedp.dp.step.dp_step``), the accountant and the row optimizers are the ones CBOW
uses: this module only prepares the interaction splits and the model. Non-private training: autograd and
``train.optimizer`` sgd (dense or, with ``model.sparse: true``, sparse table gradients) or adam (``model.sparse:
false``); ``sparse_adam`` is not available because the MLP is dense. DP: ``sgd`` | ``lazy_adam`` | ``adam`` row
optimizers over the tables and the dense rows.

A run directory also holds ``features.json`` (table sizes, positive rate) and ``ids.json`` (the raw id of every
table row). ``widedp export --format torch`` releases the weights and ids.json (``release_parts``), except with
``data.privacy_unit: user`` when the user table's rows are the data's raw user ids (``withheld_features``): the user
table and the user ids then stay with the data holder, since together they would list who is in the data. At the end
of a run AUC and normalised entropy of the final model (valid and test) are added to ``summary.json`` and
``metrics.jsonl`` (``finish``), with ``metrics_model`` saying which model they score: the released one, or the full
model the data holder keeps (and then ``release_*``: the released parts alone, the user embedding zero).
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
from widedp.models.rowinit import Deferred
from widedp.resources import check_tables_fit
from widedp.run.checkpoint import write_json
from widedp.tasks import placement
from widedp.tasks.base import LoopTask
from widedp.tasks.protocol import Built

#: The gap of a release that lists the data's raw ids (``data.privacy_unit: interaction``, ids not hashed).
IDS_NOT_COVERED = ("the release lists every raw id present: ids.json names each user and item id of the data (all "
                   "splits) with its table row, so the table sizes are the numbers of distinct users and items "
                   "(data.id_buckets hashes ids into fixed tables instead)")
#: The gap with ``data.privacy_unit: user`` (ids not hashed): the release leaves the user table out
#: (``withheld_features``); what its item side still tells.
USER_UNIT_IDS_NOT_COVERED = (
    "the release leaves the user table and every user id out, but lists every raw item id present (ids.json: each "
    "item of the data, all splits, with its table row; the item table's size is their number), so an item that only "
    "one user rated is listed only when that user is in the data; and the number of distinct users set the size of "
    "the row space the selection ranged over (data.id_buckets hashes ids into fixed tables instead)")
#: The gap with ``data.privacy_unit: user`` and no user table (``data.user_feature: false``).
NO_USER_TABLE_IDS_NOT_COVERED = (
    "the model has no user table (data.user_feature: false) and the release no user id, but it lists every raw item "
    "id present (ids.json: each item of the data, all splits, with its table row; the item table's size is their "
    "number), so an item that only one user rated is listed only when that user is in the data (data.id_buckets "
    "hashes ids into fixed tables instead)")
#: The gap with ``data.privacy_unit: interaction`` and no user table.
NO_USER_TABLE_ITEM_IDS_NOT_COVERED = (
    "the release lists every raw item id present (no user table, data.user_feature: false, so no user id): ids.json "
    "names each item of the data (all splits) with its table row, so the item table's size is the number of distinct "
    "items (data.id_buckets hashes ids into fixed tables instead)")
COUNTED_SPLITS_NOT_COVERED = ("data.splits given as counts: each split's rate n/N uses the number of "
                              "interactions N (fractions do not)")


def build_model(cardinality: dict[str, int], cfg: RecsysModelConfig, *, seed: int,
                device: torch.device | str = "cpu", meta: bool = False) -> RecsysModel:
    """The model for tables of ``cardinality``; initialised on the CPU from ``seed`` (same weights on any
    device), then moved to ``device``. ``meta``: on the meta device (no storage; several processes:
    ``widedp.tasks.placement``), its init deferred to each rank's ``ShardedRecsys``, which draws its own rows of the
    weights built here otherwise."""
    check_tables_fit(sum(cardinality.values()), cfg.dim, device=device,
                     what=f"{len(cardinality)} tables of {sum(cardinality.values()):,} rows")
    shape = dict(dim=cfg.dim, hidden=cfg.hidden, pooling=cfg.pooling, interaction=cfg.interaction, sparse=cfg.sparse,
                 init_scale=cfg.init_scale)
    if meta:
        model = RecsysModel(cardinality, **shape, device="meta")
        model.deferred = Deferred(seed, torch.device(device))
        return model
    model = RecsysModel(cardinality, **shape, generator=torch.Generator().manual_seed(seed))
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


def withheld_features(privacy_unit: str, id_buckets: int, source: str, *, user_feature: bool = True
                      ) -> tuple[str, ...]:
    """The tables a release leaves out: ``("user",)`` when ε protects a user and the user table's rows are the data's
    raw user ids (not hashed into ``data.id_buckets`` fixed buckets, not the synthetic source's public range 0..U-1):
    its ids and its size would tell who is in the data. Else none (also when ``data.user_feature`` is false: the
    model has no user table)."""
    withhold = privacy_unit == "user" and not id_buckets and source != "synthetic" and user_feature
    return ("user",) if withhold else ()


def cfg_withheld(cfg: Config) -> tuple[str, ...]:
    """``withheld_features`` of a run's config."""
    d = cfg.data
    return withheld_features(d.privacy_unit, d.id_buckets, d.source, user_feature=d.user_feature)


def table_key(feature: str) -> str:
    """The state-dict key of ``feature``'s embedding table (``RecsysModel``)."""
    return f"ebc.embedding_bags.t_{feature}.weight"


WITHHELD_NOTE = (" Tables named in withheld are not in model.pt and have no ids here (data.privacy_unit: user: their "
                 "rows are the data's users): a user fits their own row against the released tables on their side, "
                 "or leaves it at zero (the run's release_* metrics).")


def release_parts(data: dict[str, Any], state: dict[str, torch.Tensor], ids: dict[str, Any]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The weights and the ids document a release may hold: ``state`` and ``ids`` (the run's ids.json) without the
    tables ``withheld_features`` names for ``data`` (the run's resolved ``data:`` section, as config.yaml holds it).

    Raises:
        ConfigError: a table to leave out is not in the weights (not a recommender's state dict).
    """
    gone = withheld_features(str(data.get("privacy_unit", "interaction")), int(data.get("id_buckets") or 0),
                             str(data.get("source", "")), user_feature=bool(data.get("user_feature", True)))
    if not gone:
        return state, ids
    missing = [f for f in gone if table_key(f) not in state]
    if missing:
        raise ConfigError(f"the weights have no {table_key(missing[0])} to leave out of the release")
    state = {k: v for k, v in state.items() if k not in {table_key(f) for f in gone}}
    doc = {**ids, "ids": {f: v for f, v in ids.get("ids", {}).items() if f not in gone}, "withheld": list(gone),
           "note": str(ids.get("note", "")) + WITHHELD_NOTE}
    return state, doc


#: ``metrics_model`` of a run whose release is the whole model.
RELEASED_MODEL = "the released model (every table)"


class RecsysTask(LoopTask):
    name = "recsys"
    summary_keys = ("valid_auc", "test_auc", "valid_ne", "test_ne", "metrics_model", "release_test_auc",
                    "release_test_ne")

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
        return Built(splits, build_model(data.cardinality, cfg.model, seed=cfg.train.seed, device=device,
                                         meta=placement.tables_on_meta(cfg, resumed=resumed)))

    def units(self, cfg: Config, split: Any, *, device: torch.device | str) -> units.Units | None:
        """User units: the raw user of each interaction (the ``user`` feature's row, or with hashed ids, where
        raw users share rows, the raw id itself), each user's interactions keyed by their index in the split."""
        if units.is_per_sample(cfg):
            return None
        if split.user is None and "user" not in split.names:
            raise ConfigError("data.privacy_unit: user needs a 'user' feature in the data")
        user = split.user if split.user is not None else split.features[split.names.index("user")][:, 0].cpu().numpy()
        return units.group_units(user, np.arange(len(user)), cap=cfg.data.max_samples_per_unit, device=device)

    def privacy(self, cfg: Config) -> UnitFacts:
        unit = ("interaction (one user-item example)" if units.is_per_sample(cfg)
                else units.unit_name(cfg, "interactions"))
        d = cfg.data
        if units.is_per_sample(cfg):
            ids = IDS_NOT_COVERED if d.user_feature else NO_USER_TABLE_ITEM_IDS_NOT_COVERED
        else:
            ids = USER_UNIT_IDS_NOT_COVERED if d.user_feature else NO_USER_TABLE_IDS_NOT_COVERED
        ids_gap = () if d.source == "synthetic" or d.id_buckets else (ids,)
        gaps = ids_gap + (
            (COUNTED_SPLITS_NOT_COVERED,) if counted(d.splits) else ()) + (
            (f"data.max_interactions: {d.max_interactions}: the source is cut to its first {d.max_interactions} "
             "rows by position",) if d.max_interactions else ())
        return UnitFacts(unit, gaps)

    def metrics_model(self, cfg: Config) -> str:
        """Which model the run's losses and metrics score: the released one, or (a table withheld from the release)
        the full model the data holder keeps, with ``release_*`` metrics for the released parts alone."""
        gone = cfg_withheld(cfg)
        if not gone:
            return RELEASED_MODEL
        return (f"the full model the data holder keeps ({', '.join(gone)} rows included; the release leaves the "
                f"{', '.join(gone)} table out): losses, AUC and NE; release_* metrics score the released parts alone "
                f"(item side: the {', '.join(gone)} embedding zero)")

    def finish(self, cfg: Config, out: Path, built: Built) -> dict[str, Any]:
        """AUC, normalised entropy (and BCE) of the final model on the valid and test splits (the first
        ``train.eval_max_samples`` of each, as the losses), ``metrics_model``, and with a table withheld from the
        release the same metrics of the released parts alone (``release_*``)."""
        model, tc = built.model, cfg.train
        gone = cfg_withheld(cfg)
        model.eval()
        res: dict[str, Any] = {"metrics_model": self.metrics_model(cfg)}
        for prefix, zero in (("", ()), *((("release_", gone),) if gone else ())):
            for split in ("valid", "test"):
                m = model.eval_metrics(built.splits[split], batch_size=tc.eval_batch_size,
                                       max_samples=tc.eval_max_samples, zero_features=zero)
                res.update({f"{prefix}{split}_{k}": v for k, v in m.items() if k != "bce"})
        model.train()
        return res


TASK = RecsysTask()
