"""The row scores a selector reads (``Selector.score_kind``) and how far one sample can move them.

- ``norm``: u_r = min(||ĝ_r||₂, S0) with ĝ = (1/b) Σ_j clip_S1(g_j); one sample moves each u_r by <= min(S0, S1/b).
- ``count``: u_r = min(n_r, S0), n_r = the number of samples that touched row r; one sample moves each u_r by
  <= min(S0, 1) (scale-free: no gradient norm, no 1/b).
- ``contribution``: c_r = Σ_j 1[r ∈ rows_j] / √|rows_j|: each sample's indicator of the rows it touched,
  normalised to ℓ2 norm 1 (not ℓ1 as TF Privacy's sparsity_preserving_noise: √r more signal per row when a sample
  touches r rows); adding or removing one sample moves the whole vector (c_r)_r by exactly 1 in ℓ2 (0 when it
  touched no selectable row): the sensitivity of the Gaussian thresholding mechanism.

Only rows in the selectable range (the ``touched`` ids handed in) count, so ``|rows_j|`` is the number of distinct
selectable rows sample j touched; a row listed twice in one sample counts once (the sensitivity does not rely on
the ``PerSampleRows`` contract). Rows are what a sample touched, not its gradient values: a sample whose gradient
is not finite still counts (a function of that sample alone: the sensitivity is unchanged). O(nnz log nnz).
"""

from __future__ import annotations

import torch
from torch import Tensor

from widedp.dp.rowgrads import PerSampleRows

#: How far one sample moves the contribution counts, in ℓ2 (each sample's indicator has norm 1, or 0).
CONTRIBUTION_SENSITIVITY = 1.0


def _pairs(g: PerSampleRows, touched: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The (sample, row) pairs of ``g`` against ``touched`` (non-empty), in some order: ([nnz] sample, [nnz] index
    into ``touched``, [nnz] bool keep). Kept: the first of each distinct (sample, row) pair on a row of ``touched``
    (pairs on other rows, e.g. always-selected ones, drop out). ``PerSampleRows`` already holds distinct rows per
    sample; deduplicating again keeps the sensitivity whatever a caller built. Fixed sizes: no host sync."""
    u = touched.numel()
    pos = torch.searchsorted(touched, g.rows).clamp_(max=u - 1)
    sample = g.sample_ids()
    key = torch.where(touched.index_select(0, pos) == g.rows, sample * u + pos, -1)
    key, order = torch.sort(key)
    keep = key >= 0
    keep[1:] &= key[1:] != key[:-1]
    return sample.index_select(0, order), pos.index_select(0, order), keep


def sample_row_counts(g: PerSampleRows, touched: Tensor) -> Tensor:
    """[B] |rows_j|: the number of distinct rows of ``touched`` each sample touched (a shard's part, to all_reduce)."""
    out = torch.zeros(g.batch_size, dtype=torch.long, device=touched.device)
    if touched.numel() == 0 or g.rows.numel() == 0:
        return out
    sample, _, keep = _pairs(g, touched)
    return out.index_add_(0, sample, keep.long())


def row_counts(g: PerSampleRows, touched: Tensor, *, normalise: bool, dtype: torch.dtype,
               sample_rows: Tensor | None = None) -> Tensor:
    """[U] Σ_j w_j 1[touched_i ∈ rows_j]: w_j = 1 (``normalise=False``: n_r) or 1/√|rows_j| (c_r).

    Args:
        touched: [U] sorted unique ids of the selectable rows the batch touched (pairs on other rows are ignored).
        sample_rows: [B] |rows_j| to normalise by (default: counted here) — a row-sharded sample's total over every
            shard.
    """
    out = torch.zeros(touched.numel(), dtype=dtype, device=touched.device)
    if touched.numel() == 0 or g.rows.numel() == 0:
        return out
    sample, pos, keep = _pairs(g, touched)
    w = keep.to(dtype)
    if normalise:
        if sample_rows is None:
            sample_rows = torch.zeros(g.batch_size, dtype=torch.long, device=out.device).index_add_(0, sample,
                                                                                                   keep.long())
        # a sample with no kept pair has |rows_j| = 0: its weight is never used (masked, not 0 · inf)
        w = torch.where(keep, sample_rows.to(dtype).rsqrt().index_select(0, sample), 0.0)
    return out.index_add_(0, pos, w)


def selection_scores(kind: str, g: PerSampleRows, touched: Tensor, ghat: Tensor, *, score_clip: float | None,
                     clip1: float, batch_size: float, sample_rows: Tensor | None = None) -> tuple[Tensor, float]:
    """(scores [U] on ``touched``, their sensitivity) for a selector of ``score_kind`` ``kind`` (module docstring).

    Args:
        touched, ghat: [U], [U, D] the selectable touched rows and ĝ on them.
        sample_rows: ``contribution`` only: [B] each sample's number of distinct selectable rows when ``g`` holds
            part of them (a row shard); default: counted from ``g``.
    """
    if kind == "none":
        return ghat.new_zeros(0), 0.0
    if kind == "norm":
        assert score_clip is not None
        return torch.linalg.vector_norm(ghat, dim=1).clamp_(max=score_clip), min(score_clip, clip1 / batch_size)
    if kind == "count":
        assert score_clip is not None
        return row_counts(g, touched, normalise=False, dtype=ghat.dtype).clamp_(max=score_clip), min(score_clip, 1.0)
    if kind == "contribution":
        return (row_counts(g, touched, normalise=True, dtype=ghat.dtype, sample_rows=sample_rows),
                CONTRIBUTION_SENSITIVITY)
    raise ValueError(f"unknown score kind {kind!r}")
