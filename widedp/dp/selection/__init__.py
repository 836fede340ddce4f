"""Row selection of the DP step (paper Alg. 3, step 3) — swappable mechanisms over ALL R rows (privacy.md §2).

Every selector sees the rows the batch touched and their scores (``Selector.score_kind``: gradient norms
u_r = min(||ĝ_r||, S0), sample counts, or ℓ2-normalised contribution counts; ``widedp.dp.selection.scores``); rows the
batch did not touch have score 0 and stay candidates (selecting only among touched rows would publish which rows
were touched). Each selector states once what a step of it spends (``Selector.spend()``); ``select`` draws the
rows among the ``selectable_rows`` it is handed (the model's R rows less those selected every step).

- ``ExponentialSelector`` (``widedp.dp.selection.exponential``): k exponential-mechanism picks = Gumbel top-k of
  ε''·u/(2Δu) + Gumbel(0,1); ``sparse`` is O(U + k) (order statistics for the untouched rows), ``brute`` O(R),
  ``auto`` brute force on small row spaces.
- ``SparseVectorSelector`` (``widedp.dp.selection.svt``): AboveThreshold with cutoff c over all rows in a fresh random
  order; ``sparse`` is O(U + c) (geometric skips over the untouched rows), ``brute`` O(R).
- ``GaussianThresholdSelector`` (``widedp.dp.selection.gaussian``): contribution counts + N(0, σ_sel²) > τ over all
  rows, false positives drawn exactly in O(expected count); a Gaussian mechanism folded into the step's noise.
- ``UniformSelector``, ``RandomSparsificationSelector``, ``AllRowsSelector`` (``widedp.dp.selection.free``):
  data-independent, free.

This module is the factory (``make_selector``) and re-exports the public names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from widedp.config import (
    AllRowsConfig,
    ExponentialSelectionConfig,
    GaussianThresholdSelectionConfig,
    RandomSparsificationConfig,
    SelectionConfig,
    SparseVectorSelectionConfig,
    UniformSelectionConfig,
)
from widedp.dp.selection.base import ScoreKind, SelectionContext, Selector, member, sample_distinct
from widedp.dp.selection.exponential import ExponentialSelector, gumbel_topk, gumbel_topk_sparse
from widedp.dp.selection.free import AllRowsSelector, RandomSparsificationSelector, UniformSelector
from widedp.dp.selection.gaussian import GaussianThresholdSelector
from widedp.dp.selection.svt import SparseVectorSelector
from widedp.errors import ConfigError

__all__ = [
    "AllRowsSelector",
    "ExponentialSelector",
    "GaussianThresholdSelector",
    "RandomSparsificationSelector",
    "ScoreKind",
    "SelectionContext",
    "Selector",
    "SparseVectorSelector",
    "UniformSelector",
    "gumbel_topk",
    "gumbel_topk_sparse",
    "make_selector",
    "member",
    "sample_distinct",
]


def _num_picks(cfg: ExponentialSelectionConfig | UniformSelectionConfig, num_rows: int) -> int:
    k = cfg.k if cfg.k is not None else max(1, round(cfg.gamma * num_rows))
    if k > num_rows:
        raise ConfigError(f"dp.selection.k: {k} exceeds the number of rows R={num_rows}")
    return k


def _exponential(cfg: ExponentialSelectionConfig, num_rows: int) -> ExponentialSelector:
    return ExponentialSelector(
        k=_num_picks(cfg, num_rows), epsilon=cfg.epsilon, score_clip=cfg.score_clip, method=cfg.method,
        score_kind=cfg.score,
    )


def _sparse_vector(cfg: SparseVectorSelectionConfig, num_rows: int) -> SparseVectorSelector:
    return SparseVectorSelector(
        epsilon=cfg.epsilon, threshold=cfg.threshold, cutoff=cfg.cutoff, threshold_fraction=cfg.threshold_fraction,
        score_clip=cfg.score_clip, release_values=cfg.release_values, epsilon_release=cfg.epsilon_release,
        method=cfg.method, score_kind=cfg.score,
    )


def _uniform(cfg: UniformSelectionConfig, num_rows: int) -> UniformSelector:
    return UniformSelector(k=_num_picks(cfg, num_rows))


def _random_sparsification(cfg: RandomSparsificationConfig, num_rows: int) -> RandomSparsificationSelector:
    return RandomSparsificationSelector(final_rate=cfg.final_rate, gradual_cooling=cfg.gradual_cooling)


def _all(cfg: AllRowsConfig, num_rows: int) -> AllRowsSelector:
    return AllRowsSelector()


def _gaussian_threshold(cfg: GaussianThresholdSelectionConfig, num_rows: int) -> GaussianThresholdSelector:
    return GaussianThresholdSelector(sigma=cfg.sigma, threshold=cfg.tau, max_rows=cfg.max_rows)


_FACTORIES: dict[str, Callable[[Any, int], Selector]] = {
    "exponential": _exponential,
    "sparse_vector": _sparse_vector,
    "uniform": _uniform,
    "random_sparsification": _random_sparsification,
    "all": _all,
    "gaussian_threshold": _gaussian_threshold,
}


def make_selector(cfg: SelectionConfig, *, num_rows: int) -> Selector:
    """The selector a ``dp.selection`` config describes; ``num_rows`` is the R that ``gamma`` is a fraction of and
    that ``k`` may not exceed."""
    if cfg.name not in _FACTORIES:
        raise ConfigError(f"dp.selection.name: unknown selection {cfg.name!r}")
    return _FACTORIES[cfg.name](cfg, num_rows)
