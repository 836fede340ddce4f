"""Clipping and aggregation of jagged per-sample row gradients (paper Alg. 3, steps 1 and 4).

Everything here is a few vectorised ops (segment sums over ``offsets``; no Python loop over samples) and never
syncs with the host except to learn how many rows the batch touched in ``aggregate`` (``torch.unique``).

Non-finite gradients: a sample with any NaN or ±inf entry contributes zero, as if its gradient were all
zeros, so no non-finite value reaches the scores, the selection or the noise; samples are counted (``ClipInfo``).
Norms are taken in units of a power of two near each sample's largest entry, so huge finite entries (1e30 in
float32, whose squares overflow) are clipped to S1 like any others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from widedp import native
from widedp.dp.rowgrads import PerSampleRows
from widedp.native import gpu


@dataclass(frozen=True)
class SampleNorms:
    """Each sample's L2 norm as ``scale · sqrt(sumsq)``: nothing overflows or underflows on the way.

    scale: [B] the power of two with scale <= max |entry| < 2·scale (any power of two for a zero or empty
    sample); +inf when an entry is not finite (NaN, ±inf). sumsq: [B] Σ (entry / scale)², exact scaling,
    in [1, 4·n·D) (0 for a zero, empty or non-finite sample).
    """

    scale: Tensor
    sumsq: Tensor


@dataclass(frozen=True)
class ClipInfo:
    """clipped: [B] bool, the sample's norm was > S1. nonfinite: [B] bool, it had a non-finite entry (zeroed)."""

    clipped: Tensor
    nonfinite: Tensor


def sample_scale(g: PerSampleRows) -> Tensor:
    """[B] ``SampleNorms.scale`` of each sample of ``g``."""
    top = torch.maximum(g.values.amax(1), g.values.amin(1).neg_())  # [nnz] max |entry|; NaN propagates
    top = torch.segment_reduce(top.masked_fill_(top.isnan(), math.inf), "max", offsets=g.offsets, initial=0)
    mantissa, _ = top.frexp()  # top = mantissa · 2^e, mantissa in [0.5, 1); top / (2·mantissa) = 2^(e-1) exactly
    return torch.where(top > 0, top / (mantissa + mantissa), 1.0).masked_fill_(top.isinf(), math.inf)


def sample_sumsq(g: PerSampleRows, scale: Tensor) -> Tensor:
    """[B] ``SampleNorms.sumsq`` for ``scale`` (``sample_scale(g)``, or larger: a row-sharded sample's)."""
    return _sumsq(g, _unit(g, scale))


def sample_norms(g: PerSampleRows) -> SampleNorms:
    scale = sample_scale(g)
    return SampleNorms(scale, sample_sumsq(g, scale))


def clip_per_sample(
    g: PerSampleRows, *, clip1: float, norms: SampleNorms | None = None
) -> tuple[PerSampleRows, ClipInfo]:
    """Scale each sample's whole gradient (all its rows) to L2 norm at most ``clip1``. A sample with a non-finite
    entry (NaN, ±inf) becomes all zeros: a function of that sample alone, so the sensitivity is unchanged.

    ``norms`` (default: ``g``'s own) may describe samples larger than ``g`` (a row-sharded sample: scale and sumsq
    combined over every shard), so that the clip sees each sample's whole gradient.

    Returns:
        The clipped ``PerSampleRows`` (same rows/offsets; unclipped finite samples bit-identical, bar entries
        below 2^-126 (float32) of the sample's largest) and ``ClipInfo``.
    """
    scale = sample_scale(g) if norms is None else norms.scale
    unit = _unit(g, scale)  # [nnz, D] entry / scale: |.| < 2 for finite samples; 0 or NaN for non-finite ones
    sumsq = _sumsq(g, unit) if norms is None else norms.sumsq
    root = sumsq.sqrt()
    nonfinite = scale.isinf()
    clipped = ~nonfinite & (scale * root > clip1)  # the product may overflow to inf: clipped all the same
    # clipped: unit · S1 / sqrt(sumsq); kept: unit · scale (exact); non-finite: unit · inf, NaN -> 0
    factor = torch.where(clipped, clip1 / root, scale)
    values = unit.mul_(_per_pair(factor, g).unsqueeze(1)).nan_to_num_(nan=0.0)  # finite samples have no NaN
    return PerSampleRows(values, g.rows, g.offsets, g.num_rows), ClipInfo(clipped, nonfinite)


def _unit(g: PerSampleRows, scale: Tensor) -> Tensor:
    return g.values / _per_pair(scale, g).unsqueeze(1)


def _sumsq(g: PerSampleRows, unit: Tensor) -> Tensor:
    sq = torch.linalg.vector_norm(unit, dim=1).nan_to_num_(nan=0.0).square_()  # non-finite samples: 0, not NaN
    return torch.segment_reduce(sq, "sum", offsets=g.offsets)


def _per_pair(x: Tensor, g: PerSampleRows) -> Tensor:
    """[B] -> [nnz]: each (sample, row) pair gets its sample's value."""
    return torch.repeat_interleave(x, g.offsets.diff(), output_size=g.values.shape[0])


def aggregate(g: PerSampleRows, *, batch_size: float, always_from: int | None = None) -> tuple[Tensor, Tensor]:
    """ĝ = (1/b) Σ_j g_j over the rows the batch touched; b is the fixed (expected) batch size.

    ``always_from`` A0: the rows [A0, R) count as touched whether or not they were (ĝ = 0 on those that were not), so
    that the touched rows below A0 are the first U − (R − A0) without a look at the data.

    Returns:
        touched [U] int64 sorted unique row ids, ghat [U, D].
    """
    rows, values = g.rows, g.values
    if always_from is not None and always_from < g.num_rows:
        rows = torch.cat([rows, torch.arange(always_from, g.num_rows, device=rows.device)])
        values = torch.cat([values, values.new_zeros(g.num_rows - always_from, values.shape[1])])
    if g.num_rows <= rows.numel():
        # more (sample, row) pairs than rows (e.g. dense MLP rows every sample touches): an [R, D] buffer is
        # cheaper than sorting the pairs, and gives the same touched set and sums
        buf = values.new_zeros(g.num_rows, values.shape[1]).index_add_(0, rows, values, alpha=1.0 / batch_size)
        present = torch.zeros(g.num_rows, dtype=torch.bool, device=rows.device).index_fill_(0, rows, True)
        touched = present.nonzero().squeeze(1)
        return touched, buf.index_select(0, touched)
    touched, inv = torch.unique(rows, sorted=True, return_inverse=True)
    ghat = values.new_zeros(touched.numel(), values.shape[1])
    ghat.index_add_(0, inv, values, alpha=1.0 / batch_size)
    return touched, ghat


def clip_aggregate(g: PerSampleRows, *, clip1: float, batch_size: float, fused: bool | None = None,
                   always_from: int | None = None) -> tuple[Tensor, Tensor, ClipInfo]:
    """``clip_per_sample`` then ``aggregate``: touched [U], ghat [U, D] and ``ClipInfo``. ``fused``: one native
    pass (``widedp.native`` on the CPU, its Triton kernel on CUDA; None: when available; False: these PyTorch
    functions). ``always_from``: as ``aggregate``'s."""
    if gpu.use(fused, g.values) and (out := gpu.clip_aggregate(
            g.values, g.rows, g.offsets, num_rows=g.num_rows, clip1=clip1, batch_size=batch_size,
            always_from=always_from, strict=fused is True)) is not None:
        return out[0], out[1], ClipInfo(out[2], out[3])
    if native.use(fused, g.values):
        touched, ghat, clipped, nonfinite = native.clip_aggregate(
            g.values, g.rows, g.offsets, num_rows=g.num_rows, clip1=clip1, batch_size=batch_size)
        if always_from is not None and always_from < g.num_rows:  # (on the CPU: these reads cost nothing)
            extra = torch.arange(always_from, g.num_rows)
            extra = extra[~torch.isin(extra, touched)]
            touched, order = torch.cat([touched, extra]).sort()
            ghat = torch.cat([ghat, ghat.new_zeros(extra.numel(), ghat.shape[1])]).index_select(0, order)
        return touched, ghat, ClipInfo(clipped, nonfinite)
    clipped_g, info = clip_per_sample(g, clip1=clip1)
    return *aggregate(clipped_g, batch_size=batch_size, always_from=always_from), info


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
