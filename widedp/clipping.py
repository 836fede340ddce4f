"""Clipping and aggregation of jagged per-sample row gradients (paper Alg. 3, steps 1 and 4).

Everything here is a few vectorised ops (segment sums over ``offsets``; no Python loop over samples) and never
syncs with the host except ``torch.unique`` in ``aggregate``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from widedp.rowgrads import PerSampleRows


def clip_per_sample(g: PerSampleRows, *, clip1: float) -> tuple[PerSampleRows, Tensor]:
    """Scale each sample's whole gradient (all its rows) to L2 norm at most ``clip1``.

    Returns:
        The clipped ``PerSampleRows`` (same rows/offsets) and [B] bool: was the sample's norm > clip1.
    """
    sq = torch.linalg.vector_norm(g.values, dim=1).square_()  # [nnz]
    sq_norms = torch.segment_reduce(sq, "sum", offsets=g.offsets)  # [B]; an empty sample -> 0
    ratio = sq_norms / (clip1 * clip1)
    was_clipped = ratio > 1
    factor = ratio.clamp_(min=1.0).rsqrt_()  # min(1, clip1 / norm); exactly 1 for unclipped samples
    per_pair = torch.repeat_interleave(factor, g.offsets.diff(), output_size=g.values.shape[0])
    values = g.values * per_pair.unsqueeze(1)
    return PerSampleRows(values=values, rows=g.rows, offsets=g.offsets, num_rows=g.num_rows), was_clipped


def aggregate(g: PerSampleRows, *, batch_size: float) -> tuple[Tensor, Tensor]:
    """ĝ = (1/b) Σ_j g_j over the rows the batch touched; b is the fixed (expected) batch size.

    Returns:
        touched [U] int64 sorted unique row ids, ghat [U, D].
    """
    if g.num_rows <= g.rows.numel():
        # more (sample, row) pairs than rows (e.g. dense MLP rows every sample touches): an [R, D] buffer is
        # cheaper than sorting the pairs, and gives the same touched set and sums
        buf = g.values.new_zeros(g.num_rows, g.values.shape[1]).index_add_(0, g.rows, g.values, alpha=1.0 / batch_size)
        present = torch.zeros(g.num_rows, dtype=torch.bool, device=g.rows.device).index_fill_(0, g.rows, True)
        touched = present.nonzero().squeeze(1)
        return touched, buf.index_select(0, touched)
    touched, inv = torch.unique(g.rows, sorted=True, return_inverse=True)
    ghat = g.values.new_zeros(touched.numel(), g.values.shape[1])
    ghat.index_add_(0, inv, g.values, alpha=1.0 / batch_size)
    return touched, ghat


def restrict(touched: Tensor, ghat: Tensor, selected: Tensor) -> tuple[Tensor, Tensor]:
    """ĝ restricted to ``selected`` rows (M ⊙ ĝ, kept as rows): zeros for selected rows the batch did not touch.

    Args:
        touched: [U] sorted unique ids; ghat: [U, D]; selected: [k] distinct ids (any order).

    Returns:
        values [k, D] in the order of ``selected``, and hit [k] bool: was the row touched.
    """
    k, d = selected.numel(), ghat.shape[1]
    if touched.numel() == 0:
        return ghat.new_zeros(k, d), torch.zeros(k, dtype=torch.bool, device=selected.device)
    pos = torch.searchsorted(touched, selected).clamp_(max=touched.numel() - 1)
    hit = touched.index_select(0, pos) == selected
    values = ghat.index_select(0, pos).mul_(hit.unsqueeze(1))
    return values, hit


def clip_l2(values: Tensor, *, clip: float | None) -> tuple[Tensor, Tensor]:
    """Scale the whole tensor to L2 norm at most ``clip`` (``None``: no clipping).

    Returns:
        (values, bool 0-dim tensor: was it clipped).
    """
    if clip is None:
        return values, torch.zeros((), dtype=torch.bool, device=values.device)
    ratio = torch.linalg.vector_norm(values) / clip
    clipped = ratio > 1
    return values * ratio.clamp_(min=1.0).reciprocal_(), clipped  # exactly 1 when not clipped
