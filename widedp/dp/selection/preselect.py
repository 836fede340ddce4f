"""One-shot DP pre-selection of rows (DP-FEST): a private partition selection of the most-contributed
rows of the WHOLE training set, run once before the first step; afterwards every selector ranges over those rows only
(the others stay frozen).

Mechanism (``dp.preselect: {rows: K, sigma, threshold | threshold_sigmas}``): c = Σ_{all training samples} c_j with
c_j the ℓ2-normalised indicator of the rows sample j touches (``widedp.dp.selection.scores``: ||c_j|| = 1), noisy
counts c_r + N(0, σ²) for EVERY row, keep the K largest noisy counts above τ. The output is post-processing of the
Gaussian mechanism c + Z (ℓ2 sensitivity 1 under add/remove of one sample, noise σ), so it is charged once as
``PRESELECT_STEP(σ)`` = StepSpend(1.0, (GaussianSelectionSpend(σ),)) — sampling rate 1: every sample takes part.

Exact and V-independent: an untouched row (c_r = 0) passes τ with probability p_τ = P(N(0, σ²) > τ), independently,
so the untouched rows above τ are a uniform random subset of size Binomial(R − U, p_τ)
(``widedp.dp.selection.gaussian.false_positives``), and given that they passed their noisy values are i.i.d.
N(0, σ²) conditioned on > τ: σ·Φ̄⁻¹(V·p_τ), V ~ U(0, 1] — needed here (unlike per-step thresholding) to rank them
against the touched rows for the top K.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from widedp.config.selection import PreselectConfig
from widedp.dp.rowgrads import PerSampleRows
from widedp.dp.selection.base import ScoreKind, SelectionContext, Selector
from widedp.dp.selection.gaussian import tail_probability, threshold_rows
from widedp.dp.selection.scores import row_counts
from widedp.dp.spend import GaussianSelectionSpend, Spend, StepSpend
from widedp.errors import ConfigError


def preselect_step(cfg: PreselectConfig) -> StepSpend:
    """What the pre-selection spends: one Gaussian mechanism (sensitivity 1, noise ``cfg.sigma``) on all samples."""
    return StepSpend(1.0, (GaussianSelectionSpend(noise_multiplier=cfg.sigma, sensitivity=1.0),))


def contribution_totals(batches: Iterable[PerSampleRows], *, selectable: int | None = None,
                        dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Σ over every sample of every batch of its ℓ2-normalised row indicator: ([U] sorted row ids, [U] counts).

    ``selectable``: only rows [0, selectable) count (and normalise), e.g. R − A when the last A rows are always
    selected. Memory O(rows touched by the whole set); the batches' ``values`` are not read (rows and offsets only).
    Privacy units: pass each unit's merged rows as one sample, so that each unit's vector has norm 1.
    """
    ids: Tensor | None = None
    counts: Tensor | None = None
    for g in batches:
        touched = torch.unique(g.rows)
        if selectable is not None:
            touched = touched[touched < selectable]
        c = row_counts(g, touched, normalise=True, dtype=dtype)
        if ids is None:
            ids, counts = touched, c
            continue
        ids, inv = torch.unique(torch.cat([ids, touched]), return_inverse=True)
        counts = torch.zeros(ids.numel(), dtype=dtype, device=ids.device).index_add_(0, inv, torch.cat([counts, c]))
    if ids is None:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=dtype)
    return ids, counts


def preselect_rows(ids: Tensor, counts: Tensor, cfg: PreselectConfig, *, num_rows: int,
                   generator: torch.Generator, table_starts: Sequence[int] = (0,)) -> Tensor:
    """The pre-selected rows: [<= K] sorted ids, the ``cfg.rows`` largest noisy counts above τ over ALL rows (with
    ``cfg.table_rows``: the K_t largest of each table t = [table_starts[t], table_starts[t + 1] or num_rows))."""
    hits, noisy, fp = threshold_rows(ids, counts, num_rows=num_rows, std=cfg.sigma, threshold=cfg.tau,
                                     generator=generator)
    p = tail_probability(cfg.tau, cfg.sigma)
    v = 1.0 - torch.rand(fp.shape, generator=generator, device=fp.device, dtype=torch.float64)  # (0, 1]
    fp_noisy = torch.special.ndtri(v * p).neg_().mul_(cfg.sigma)  # N(0, σ²) given > τ: Φ̄⁻¹(V p_τ) σ
    rows = torch.cat([hits, fp])
    keys = torch.cat([noisy.to(torch.float64), fp_noisy])
    if cfg.table_rows is None:
        return _top(rows, keys, cfg.rows).sort().values
    if len(cfg.table_rows) != len(table_starts):
        raise ConfigError(f"dp.preselect.table_rows: {len(cfg.table_rows)} caps for a model with "
                          f"{len(table_starts)} table(s)")
    ends = [*table_starts[1:], num_rows]
    parts = [_top(rows[(rows >= a) & (rows < e)], keys[(rows >= a) & (rows < e)], k)
             for a, e, k in zip(table_starts, ends, cfg.table_rows)]
    return torch.cat(parts).sort().values


def _top(rows: Tensor, keys: Tensor, k: int) -> Tensor:
    return rows if rows.numel() <= k else rows.index_select(0, keys.topk(k).indices)


@dataclass(frozen=True)
class PreselectedSelector:
    """``base`` run over the pre-selected rows only: ``rows`` [K] sorted global ids are its row space [0, K); the
    touched rows outside it are dropped (the data-independent, already-released preselection is public to the
    steps), and the picks map back to global ids. Same spend as ``base`` (on the batch; the preselection is charged
    once, separately). Rows outside ``rows`` are never selected, so never updated."""

    base: Selector
    rows: Tensor

    @property
    def score_kind(self) -> ScoreKind:
        return self.base.score_kind

    @property
    def score_clip(self) -> float | None:
        return self.base.score_clip

    def spend(self) -> Spend:
        return self.base.spend()

    def select(self, touched: Tensor, scores: Tensor, *, selectable_rows: int, score_sensitivity: float,
               ctx: SelectionContext, generator: torch.Generator) -> Tensor:
        rows = self.rows.to(touched.device)
        k = rows.numel()
        pos = torch.searchsorted(rows, touched).clamp_(max=k - 1)
        inside = rows.index_select(0, pos) == touched
        local_scores = scores[inside] if scores.numel() else scores
        sel = self.base.select(pos[inside], local_scores, selectable_rows=k, score_sensitivity=score_sensitivity,
                               ctx=ctx, generator=generator)
        return rows.index_select(0, sel)


def preselected(base: Selector, rows: Tensor) -> PreselectedSelector:
    """``base`` restricted to the pre-selected ``rows`` (sorted ids); refuses an empty set or k > K picks."""
    if getattr(base, "head", None) is not None:
        raise ConfigError("dp.preselect: not with a public head (dp.selection public_top or public_head): the head "
                          "would be selected outside the pre-selected rows")
    if rows.numel() == 0:
        raise ConfigError("dp.preselect: no row passed the threshold (lower dp.preselect.threshold or sigma)")
    k = getattr(base, "k", None)
    if k is not None and k > rows.numel():
        raise ConfigError(f"dp.selection.k: {k} rows asked for but the pre-selection kept {rows.numel()}")
    return PreselectedSelector(base, rows)
