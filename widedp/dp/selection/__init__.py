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
- ``PublicTopSelector`` (``widedp.dp.selection.public``): the first H rows of each table (a public vocabulary's
  most frequent words) every step, data-independent, free; ``gaussian_threshold``'s ``public_head`` adds the same
  head to its picks. Both hand the head to ``dp_step`` as public rows (left out of the scores).

This module is the factory (``make_selector``: the config class names its selector, whose ``from_config`` builds it)
and re-exports the public names.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from widedp.config import SelectionConfig
from widedp.dp.selection.base import ScoreKind, SelectionContext, Selector, member, sample_distinct
from widedp.dp.selection.exponential import ExponentialSelector, gumbel_topk, gumbel_topk_sparse
from widedp.dp.selection.free import AllRowsSelector, RandomSparsificationSelector, UniformSelector
from widedp.dp.selection.gaussian import GaussianThresholdSelector
from widedp.dp.selection.public import PublicTopSelector, head_rows
from widedp.dp.selection.svt import SparseVectorSelector
from widedp.errors import ConfigError

__all__ = [
    "AllRowsSelector",
    "ExponentialSelector",
    "GaussianThresholdSelector",
    "PublicTopSelector",
    "RandomSparsificationSelector",
    "ScoreKind",
    "SelectionContext",
    "Selector",
    "SparseVectorSelector",
    "UniformSelector",
    "gumbel_topk",
    "gumbel_topk_sparse",
    "head_rows",
    "make_selector",
    "member",
    "sample_distinct",
]


def make_selector(cfg: SelectionConfig, *, num_rows: int, table_starts: Sequence[int] | None = None) -> Selector:
    """The selector a ``dp.selection`` config describes; ``num_rows`` is the R that ``gamma`` is a fraction of and
    that ``k`` may not exceed; ``table_starts``: the model's tables' first global rows (``model.row_tables()``),
    for the selectors that read them (``uses_tables``: a public head); without them such a selector spends as
    usual but refuses to select."""
    path = getattr(cfg, "selector", None)
    if not isinstance(path, str) or ":" not in path:
        raise ConfigError(f"dp.selection.name: unknown selection {getattr(cfg, 'name', cfg)!r}")
    module, name = path.split(":")
    extra = {"table_starts": table_starts} if getattr(cfg, "uses_tables", False) else {}
    selector: Selector = getattr(importlib.import_module(module), name).from_config(cfg, num_rows=num_rows, **extra)
    return selector
