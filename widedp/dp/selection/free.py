"""The data-independent selectors (privacy.md §2): uniform k rows, Zhu & Blaschko's random sparsification, and
every row (DP-SGD). They read no scores and spend nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from widedp.dp import rng
from widedp.dp.selection.base import ScoreKind, SelectionContext, num_picks, sample_distinct
from widedp.dp.spend import FreeSpend, Spend


@dataclass(frozen=True)
class UniformSelector:
    """k distinct rows uniformly at random (data-independent, free)."""

    k: int
    score_clip: float | None = None  # no scores used
    score_kind: ScoreKind = "none"

    @classmethod
    def from_config(cls, cfg: Any, *, num_rows: int) -> UniformSelector:
        return cls(k=num_picks(cfg, num_rows))

    def spend(self) -> Spend:
        return FreeSpend("uniform")

    def select(self, touched: Tensor, scores: Tensor, *, selectable_rows: int, score_sensitivity: float,
               ctx: SelectionContext, generator: torch.Generator) -> Tensor:
        empty = touched.new_zeros(0)
        return sample_distinct(self.k, selectable_rows, exclude=empty, generator=generator, device=touched.device)


@dataclass(eq=False)
class RandomSparsificationSelector:
    """Zhu & Blaschko's random sparsification: one uniformly random mask per epoch keeping round((1 − r(e))·R)
    rows (at least 1), r(e) = final_rate·e/(E−1) with gradual cooling (final_rate when E = 1), final_rate
    without. The mask is a function of (the step generator's seed, epoch), cached for the epoch.
    """

    final_rate: float
    gradual_cooling: bool = True
    score_clip: float | None = None  # no scores used
    score_kind: ScoreKind = "none"
    _epoch: int | None = field(default=None, init=False, repr=False)
    _mask: Tensor | None = field(default=None, init=False, repr=False)

    def rate(self, ctx: SelectionContext) -> float:
        if not self.gradual_cooling or ctx.num_epochs <= 1:
            return self.final_rate
        return self.final_rate * ctx.epoch / (ctx.num_epochs - 1)

    @classmethod
    def from_config(cls, cfg: Any, *, num_rows: int) -> RandomSparsificationSelector:
        return cls(final_rate=cfg.final_rate, gradual_cooling=cfg.gradual_cooling)

    def spend(self) -> Spend:
        return FreeSpend("random_sparsification")

    def select(self, touched: Tensor, scores: Tensor, *, selectable_rows: int, score_sensitivity: float,
               ctx: SelectionContext, generator: torch.Generator) -> Tensor:
        mask = self._mask
        if self._epoch != ctx.epoch or mask is None or mask.device != touched.device:
            # the epoch's mask comes from its own stream (seeded by the step generator's seed and the epoch), so a
            # run resumed mid-epoch redraws the same mask and leaves the step generator's draws untouched
            epoch_gen = rng.generator(rng.derived_seed(generator.initial_seed(), f"random-sparsification:{ctx.epoch}"))
            kept = max(1, round((1.0 - self.rate(ctx)) * selectable_rows))
            mask = torch.randperm(selectable_rows, generator=epoch_gen)[:kept].sort().values.to(touched.device)
            self._epoch, self._mask = ctx.epoch, mask
        return mask


@dataclass(eq=False)
class AllRowsSelector:
    """Every row (DP-SGD)."""

    score_clip: float | None = None  # no scores used
    score_kind: ScoreKind = "none"
    _all: Tensor | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_config(cls, cfg: Any, *, num_rows: int) -> AllRowsSelector:
        return cls()

    def spend(self) -> Spend:
        return FreeSpend("all")

    def select(self, touched: Tensor, scores: Tensor, *, selectable_rows: int, score_sensitivity: float,
               ctx: SelectionContext, generator: torch.Generator) -> Tensor:
        rows = self._all
        if rows is None or rows.numel() != selectable_rows or rows.device != touched.device:
            rows = self._all = torch.arange(selectable_rows, device=touched.device)
        return rows
