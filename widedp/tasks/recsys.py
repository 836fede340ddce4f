"""The ``recsys`` task's builder for ``widedp.run.train`` (registered in ``widedp.run.train.TASK_BUILDERS``).

    widedp train configs/recsys_synthetic_sparse_exp.yaml --out runs/recsys
    widedp epsilon configs/recsys_synthetic_sparse_exp.yaml

The training loop, the DP step (``widedp.dp.step.dp_step``), the accountant and the row optimizers are the ones CBOW
uses: this module only prepares the interaction splits and the model. Non-private training: autograd and
``train.optimizer`` sgd (dense or, with ``model.sparse: true``, sparse table gradients) or adam (``model.sparse:
false``); ``sparse_adam`` is not available because the MLP is dense. DP: ``sgd`` | ``lazy_adam`` | ``adam`` row
optimizers over the tables and the dense rows.

A run directory also holds ``features.json`` (table sizes, positive rate) and ``ids.json`` (the raw id of every
table row, what ``widedp export --format torch`` releases beside the weights). ``add_eval_metrics`` adds AUC and
normalised entropy of the final model (valid and test) to ``summary.json`` and ``metrics.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from widedp.config import Config
from widedp.config.recsys import RecsysModelConfig
from widedp.data_prep.interactions import InteractionData, RecsysSplit, prepare_interactions
from widedp.errors import ConfigError
from widedp.models.recsys import RecsysModel
from widedp.run.checkpoint import load_checkpoint, read_json, write_json


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
    if data.ids is not None:
        write_json(out / IDS_FILE, ids_document(data), indent=None)
    return splits, build_model(data.cardinality, cfg.model, seed=cfg.train.seed, device=device)


IDS_FILE = "ids.json"
IDS_FORMAT = "widedp.ids/1"


def ids_document(data: InteractionData) -> dict[str, Any]:
    """``ids.json``: for every table (feature, in table order) the raw id of each row."""
    return {"format": IDS_FORMAT, "features": list(data.cardinality),
            "ids": {f: data.ids[f] for f in data.cardinality},
            "note": "row r of table t_<feature> in model.pt is raw id ids[feature][r]"}


def add_eval_metrics(cfg: Config, run_dir: Path) -> dict[str, float]:
    """AUC, normalised entropy and BCE of the run's final model on its valid and test splits (the first
    ``train.eval_max_samples`` of each, as the losses), added to ``summary.json`` (``valid_auc``, ``test_ne``, ...)
    and ``metrics.jsonl`` (a ``kind: eval`` record); returns them."""
    data = prepare_interactions(cfg.data)
    model = build_model(data.cardinality, cfg.model, seed=cfg.train.seed)
    try:
        model.load_state_dict(load_checkpoint(run_dir)["model"])
    except (KeyError, RuntimeError) as e:
        raise ConfigError(f"{run_dir}: checkpoint does not hold this recommender ({type(e).__name__})") from None
    model.eval()
    tc = cfg.train
    out: dict[str, float] = {}
    for split in ("valid", "test"):
        m = model.eval_metrics(RecsysSplit(getattr(data, split), "cpu"), batch_size=tc.eval_batch_size,
                               max_samples=tc.eval_max_samples)
        out.update({f"{split}_{k}": v for k, v in m.items() if k != "bce"})
    summary_path = run_dir / "summary.json"
    summary = read_json(summary_path)
    summary.update(out)
    write_json(summary_path, summary)
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"kind": "eval", "step": summary.get("steps"), **out}) + "\n")
    return out
