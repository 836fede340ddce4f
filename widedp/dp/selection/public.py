"""Rows chosen by a public ranking: the first H rows of each table, selected every step whatever the batch holds.

With a public vocabulary ordered by a public frequency (``data.vocabulary: wordfreq``: row id = the word's rank in
wordfreq's list; ``file:PATH``: the list's order), the first H rows of each CBOW table are the H publicly most
frequent words. At a privacy unit of many rows (a sentence touches ~13 rows at V = 10K), a per-step data-dependent
selection cannot see the tail: each unit's ℓ2-normalised contribution gives each of its rows ~1/√13 while the
selection noise is σ_sel ≳ 1, and most rows are touched by less than one unit per batch. The public head is the
part of the rows a selection would find anyway, found for free.

- ``PublicTopSelector`` (``dp.selection: {name: public_top, rows_per_table: H}``): exactly the head, every step.
  Its output is a function of the public row numbering only (the same for every batch, so for every pair of
  neighbouring datasets): data-independent, it spends nothing (``FreeSpend``); the step is DP-SGD on the head rows
  (noise N(0, (σΔ₂)²) on each of them, Δ₂ = min(S1/b, 2·S2) unchanged: the clipped, summed gradient restricted to
  a fixed set of rows is a 1-Lipschitz function of the unrestricted one), and the other rows are never updated.
- ``GaussianThresholdSelector(public_head=H)`` (``widedp.dp.selection.gaussian``): the head every step for free,
  plus Gaussian thresholding over the other rows, whose contribution counts are normalised over each unit's non-head
  rows only (sensitivity 1, ``widedp.dp.selection.scores``).

Both hand the head to ``dp_step`` through ``public_rows`` (``with_selector_rows``), where it joins any
per-step public rows (``data.negatives_pool``'s pool): selected, clipped and noised like every selected row, and
left out of the scores. The table layout (``table_starts``) comes from the model (``make_selector``'s
``table_starts``); a selector built without it refuses to select.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from widedp.dp.selection.base import ScoreKind, SelectionContext
from widedp.dp.spend import FreeSpend, Spend
from widedp.errors import ConfigError


def head_rows(table_starts: Sequence[int], *, per_table: int, selectable_rows: int,
              device: torch.device | str = "cpu") -> Tensor:
    """[P] sorted ids: the first ``per_table`` rows of each table t = [table_starts[t], table_starts[t + 1] or
    ``selectable_rows``) (all of a smaller table); tables starting at or beyond ``selectable_rows`` (e.g. a
    recommender's always-selected dense rows) are left out."""
    starts = sorted(s for s in table_starts if s < selectable_rows)
    ends = [*starts[1:], selectable_rows]
    parts = [torch.arange(a, min(a + per_table, e), device=device) for a, e in zip(starts, ends)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


@dataclass(eq=False)
class PublicHead:
    """The head of a model's tables (``head_rows``), cached per (selectable rows, device)."""

    per_table: int
    table_starts: tuple[int, ...] | None
    _cached: tuple[int, torch.device, Tensor] | None = field(default=None, init=False, repr=False)

    def rows(self, *, selectable_rows: int, device: torch.device | str) -> Tensor:
        if self.table_starts is None:
            raise ConfigError("dp.selection: a public head (public_top, public_head) needs the model's tables; "
                              "widedp train gives them, make_private does not")
        dev = torch.device(device)
        if self._cached is None or self._cached[:2] != (selectable_rows, dev):
            rows = head_rows(self.table_starts, per_table=self.per_table, selectable_rows=selectable_rows, device=dev)
            self._cached = (selectable_rows, dev, rows)
        return self._cached[2]


@dataclass(eq=False)
class PublicTopSelector:
    """The first ``rows_per_table`` rows of every table, every step (module docstring): free."""

    head: PublicHead
    score_kind: ScoreKind = "none"
    score_clip: float | None = None  # no scores used

    @classmethod
    def from_config(cls, cfg: Any, *, num_rows: int, table_starts: Sequence[int] | None = None
                    ) -> PublicTopSelector:
        return cls(PublicHead(cfg.rows_per_table, None if table_starts is None else tuple(table_starts)))

    def spend(self) -> Spend:
        return FreeSpend("public_top")

    def public_rows(self, *, selectable_rows: int, device: torch.device | str) -> Tensor:
        """[P] the rows selected every step without the data (``dp_step`` adds them to its ``public_rows``)."""
        return self.head.rows(selectable_rows=selectable_rows, device=device)

    def select(self, touched: Tensor, scores: Tensor, *, selectable_rows: int, score_sensitivity: float,
               ctx: SelectionContext, generator: torch.Generator) -> Tensor:
        return self.public_rows(selectable_rows=selectable_rows, device=touched.device)


def table_starts(model: Any) -> list[int] | None:
    """The first global row of each of ``model``'s tables (``model.row_tables()``), or None for a model without."""
    tables = getattr(model, "row_tables", None)
    return None if tables is None else [int(off) for off, _ in tables()]


def with_selector_rows(selector: Any, public_rows: Tensor | None, *, selectable_rows: int,
                       device: torch.device | str) -> Tensor | None:
    """``public_rows`` ([P] sorted unique, or None) joined with the rows ``selector`` takes every step without the
    data (its ``public_rows``, when it has them): [P'] sorted unique, or None when neither has any."""
    own = getattr(selector, "public_rows", None)
    head = None if own is None else own(selectable_rows=selectable_rows, device=device)
    if head is None or head.numel() == 0:
        return public_rows
    return head if public_rows is None or public_rows.numel() == 0 else torch.cat([public_rows, head]).unique()
