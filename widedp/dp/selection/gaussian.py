"""Gaussian contribution thresholding (DP-AdaFEST / TF Privacy's sparsity_preserving_noise, with
ℓ2-normalised contributions) and its exact V-independent sampler of false positives.

The mechanism, on the step's batch: c = Σ_j c_j with c_j the ℓ2-normalised indicator of the rows sample j touched
(``widedp.dp.selection.scores``, ℓ2 sensitivity 1); release M = {r : c_r + Z_r > τ}, Z_r ~ N(0, σ_sel²) i.i.d. over
ALL R rows. M is post-processing of the Gaussian mechanism c + Z (sensitivity 1, noise σ_sel), so the selection is
charged ``GaussianSelectionSpend(σ_sel)``, which the accountant folds with the gradient noise of the same step:
1/σ_eff² = 1/σ² + 1/σ_sel² (``widedp.accounting.parts``).

V-independence, exactly: an untouched row has c_r = 0, so it is selected with probability p_τ = P(N(0, σ_sel²) > τ)
independently of every other row. The set of untouched rows selected is therefore a uniformly random subset of the
m = R − U untouched rows whose size is Binomial(m, p_τ): draw the size, then that many distinct uniform untouched ids
(``sample_distinct``). They need no noisy value (only selected). Cost O(U + m·p_τ), whatever R.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from widedp.dp.noise import gaussian_noise
from widedp.dp.selection.base import ScoreKind, SelectionContext, sample_distinct
from widedp.dp.selection.public import PublicHead
from widedp.dp.selection.scores import CONTRIBUTION_SENSITIVITY
from widedp.dp.spend import GaussianSelectionSpend, Spend


def tail_probability(threshold: float, std: float) -> float:
    """P(N(0, std²) > threshold) (accurate far into the tail)."""
    return 0.5 * math.erfc(threshold / (std * math.sqrt(2.0)))


def _binomial(n: int, p: float, *, generator: torch.Generator, device: torch.device) -> Tensor:
    """[1] float64 Binomial(n, p) draw on ``device`` (``n`` may exceed 2^53 only at the cost of float rounding)."""
    f64 = torch.float64
    # torch.full, not torch.tensor([...], device=): a fill kernel, where a copy from the host would make it wait
    return torch.binomial(torch.full((1,), float(n), dtype=f64, device=device),
                          torch.full((1,), min(p, 1.0), dtype=f64, device=device), generator=generator)


def false_positives(num_untouched: int, p: float, num_rows: int, *, exclude: Tensor, generator: torch.Generator,
                    device: torch.device) -> Tensor:
    """The untouched rows a threshold selects when each passes independently with probability ``p``: a uniformly
    random subset of [0, R) \\ exclude of size Binomial(R − |exclude|, p), in random order. O(|exclude| + size).

    Args:
        num_untouched: R − |exclude|.
        exclude: [U] sorted unique ids (the touched rows).
    """
    if num_untouched <= 0 or p <= 0.0:
        return torch.zeros(0, dtype=torch.long, device=device)
    count = min(int(_binomial(num_untouched, p, generator=generator, device=device).item()), num_untouched)
    return sample_distinct(count, num_rows, exclude=exclude, generator=generator, device=device)


def threshold_rows(touched: Tensor, counts: Tensor, *, num_rows: int, std: float, threshold: float,
                   generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Noisy counts > threshold over ALL rows: (touched rows selected, their noisy counts, untouched rows selected).

    The touched rows get N(0, std²) on their counts; the untouched ones (count 0) pass independently with
    probability P(N(0, std²) > τ), as in ``false_positives``. One host read (how many of each passed): the sizes of
    what is selected.
    """
    dev = touched.device
    noisy = counts + gaussian_noise(counts.shape, std=std, generator=generator, device=dev, dtype=counts.dtype)
    hit = noisy > threshold
    m, p = num_rows - touched.numel(), tail_probability(threshold, std)
    n_fp = (_binomial(m, p, generator=generator, device=dev) if m > 0 and p > 0.0
            else torch.zeros(1, dtype=torch.float64, device=dev))
    n_hit, count = (int(x) for x in torch.cat([hit.sum().reshape(1).double(), n_fp]).tolist())
    fp = sample_distinct(min(count, m), num_rows, exclude=touched, generator=generator, device=dev)
    at = torch.sort(hit.to(torch.uint8), descending=True, stable=True).indices[:n_hit]  # the hits, in order
    return touched.index_select(0, at), noisy.index_select(0, at), fp


@dataclass(frozen=True)
class GaussianThresholdSelector:
    """Rows whose contribution count plus N(0, (σ_sel·Δ)²) exceeds τ (Δ = 1, the ℓ2 sensitivity of the counts);
    charged ``GaussianSelectionSpend(σ_sel)``. ``max_rows``: when more rows pass, a uniformly random subset of
    them (data-independent given the passing set: post-processing, free). Returns touched hits, then false
    positives (the order carries no information beyond the set: false positives are random ids).

    ``head`` (``public_head: H``, ``widedp.dp.selection.public``): the first H rows of each table are selected every
    step for free (``public_rows``; ``dp_step`` leaves them out of the scores, so each unit's contribution is
    normalised over its other rows: still norm 1, sensitivity 1) and the threshold ranges over the other rows only
    (a head row is never a hit or a false positive, so ``max_rows`` caps the picks outside the head)."""

    sigma: float
    threshold: float
    max_rows: int | None = None
    head: PublicHead | None = None
    score_kind: ScoreKind = "contribution"
    score_clip: float | None = None  # contribution counts are not clipped: their ℓ2 sensitivity is 1

    @classmethod
    def from_config(cls, cfg: Any, *, num_rows: int, table_starts: Sequence[int] | None = None
                    ) -> GaussianThresholdSelector:
        """From ``GaussianThresholdSelectionConfig`` (τ in count units)."""
        head = (None if cfg.public_head is None
                else PublicHead(cfg.public_head, None if table_starts is None else tuple(table_starts)))
        return cls(sigma=cfg.sigma, threshold=cfg.tau, max_rows=cfg.max_rows, head=head)

    def spend(self) -> Spend:
        return GaussianSelectionSpend(noise_multiplier=self.sigma, sensitivity=CONTRIBUTION_SENSITIVITY)

    def public_rows(self, *, selectable_rows: int, device: torch.device | str) -> Tensor | None:
        """[P] the head (selected every step without the data), or None without ``public_head``."""
        return None if self.head is None else self.head.rows(selectable_rows=selectable_rows, device=device)

    def select(self, touched: Tensor, scores: Tensor, *, selectable_rows: int, score_sensitivity: float,
               ctx: SelectionContext, generator: torch.Generator) -> Tensor:
        head = self.public_rows(selectable_rows=selectable_rows, device=touched.device)
        if head is not None:  # head rows: "touched" with count -inf, so never a hit and never a false positive
            touched, scores = _with_head(touched, scores, head)
        hits, _, fp = threshold_rows(touched, scores, num_rows=selectable_rows, std=self.sigma * score_sensitivity,
                                     threshold=self.threshold, generator=generator)
        sel = torch.cat([hits, fp])
        if self.max_rows is not None and sel.numel() > self.max_rows:
            keep = torch.randperm(sel.numel(), generator=generator, device=sel.device)[: self.max_rows]
            sel = sel.index_select(0, keep)
        return sel if head is None else torch.cat([sel, head])


def _with_head(touched: Tensor, scores: Tensor, head: Tensor) -> tuple[Tensor, Tensor]:
    """[U'] sorted ids: ``touched`` outside ``head`` with their ``scores``, and ``head`` with score -inf."""
    out = ~torch.isin(touched, head)
    ids = torch.cat([touched[out], head])
    vals = torch.cat([scores[out], torch.full(head.shape, -math.inf, dtype=scores.dtype, device=scores.device)])
    ids, order = torch.sort(ids)
    return ids, vals.index_select(0, order)
