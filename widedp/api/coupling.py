"""First-batch checks for what one backward cannot see: samples coupled by a batch statistic, and a mean-reduced loss.

``per_sample.check_independent`` catches samples that interact through the graph (a sample's loss with a gradient
path to another sample's outputs). A batch statistic that sends no gradient between samples escapes it: a dense input
standardised over the batch (``x = (x - x.mean(0)) / x.std(0)`` in ``forward``, or in ``collate_fn``), a loss divided
by a detached batch mean. A sample's gradient then depends on which other samples share its batch, so adding one
sample moves the others' clipped gradients and the step's sensitivity (S1) does not hold. ``check_batch_coupling``
recomputes the samples' gradients in sub-batches (two halves of the batch, each of >= 2 samples so that a std is
defined) and compares them with the whole batch's::

    items        [i0 i1 i2 i3 i4 i5]     one pass:   g_j in the batch of 6
    sub-batches  [i0 i1 i2] [i3 i4 i5]   two passes: g_j in a batch of 3   -> equal, or the samples are coupled

Mode: dropout modules are put in eval mode for the check (their masks differ between passes). When the gradients are
still random (functional dropout in a container's forward, say), every module the engine does not hook is put in
eval mode; when even that is random (random ops in ``collate_fn``), the check cannot run: one warning, no refusal.
Recorded calls, gradients, modes and the global RNG are restored afterwards. What no computation here can see: a
preprocessing of the whole dataset before the loader (statistics over all items), and coupling that appears only on
some batches.

``check_loss_reduction`` compares the per-sample gradients the user's own backward recorded (the hook path) with the
check's: about 1/B of them when the backward ran on ``loss.mean()`` while ``loss_reduction`` says ``sum``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from widedp.api.capture import Capture, Record, UnsupportedModelError
from widedp.api.per_sample import Layout, grads_of
from widedp.dp.rowgrads import PerSampleRows
from widedp.errors import ConfigError

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_SAME = 1e-6  # relative difference of two passes on the same sub-batch that still counts as deterministic


def check_batch_coupling(capture: Capture, layout: Layout, loss_fn: Callable[[Any], Tensor],
                         batch_of: Callable[[list[int]], Any], items: Sequence[int]) -> PerSampleRows | None:
    """Refuse a model whose samples' gradients change with the other samples of their batch.

    Args:
        loss_fn: batch -> [B] per-sample losses. batch_of: item indices -> the batch the loader would yield for them.
        items: the dataset indices to check on (>= 3; fewer: nothing to compare, returns None).

    Returns the per-sample gradients of ``batch_of(items)`` in the check's mode (the reference for
    ``check_loss_reduction``), or None when the check could not run.
    """
    items = list(items)
    if len(items) < 3:
        return None
    h = max(2, len(items) // 2)
    parts = [(0, items[:h])] + ([(h, items[h:])] if len(items) - h >= 2 else [])
    with _preserved(capture, layout):
        for all_eval in (False, True):
            with _modes(capture, all_eval=all_eval):
                sub = _pass(capture, layout, loss_fn, batch_of(parts[0][1]))
                again = _pass(capture, layout, loss_fn, batch_of(parts[0][1]))[1]
                if _max_diff(sub[1], 0, again, 0, h) <= _SAME * _scale(sub[1]) + 1e-12:
                    full = _pass(capture, layout, loss_fn, batch_of(items))
                    subs = [sub] + [_pass(capture, layout, loss_fn, batch_of(p)) for _, p in parts[1:]]
                    for (first, part), got in zip(parts, subs):
                        _compare(capture, full, got, first, len(part), dtype=layout.dtype)
                    return full[1]
    warnings.warn("make_private: could not check that samples do not interact: their gradients are random even "
                  "with dropout off (random ops in collate_fn or forward?); the check was skipped", stacklevel=3)
    return None


def check_loss_reduction(recorded: PerSampleRows, reference: PerSampleRows, *, reduction: str) -> None:
    """Refuse a hook-path step whose recorded per-sample gradients (already scaled for ``reduction``) are off by a
    factor ~B from the check's ``reference`` of the same batch: the backward ran on the other reduction. Needs
    B >= 4 (dropout in the user's pass moves the ratio by less than sqrt(B))."""
    b = reference.batch_size
    if b < 4 or recorded.batch_size != b:
        return
    mine, ref = _norms(recorded), _norms(reference)
    ok = (ref > 0) & torch.isfinite(ref) & torch.isfinite(mine)
    if not bool(ok.any()):
        return
    ratio = float((mine[ok] / ref[ok]).median())
    if ratio < b ** -0.5:
        ran, other = "loss.mean()", "'mean'"
    elif ratio > b ** 0.5:
        ran, other = "loss.sum()", "'sum'"
    else:
        return
    raise ConfigError(f"optimizer.step(): the recorded per-sample gradients are {ratio:.3g}x what "
                      f"loss_reduction={reduction!r} implies (B={b}): the backward ran on {ran}; pass "
                      f"make_private(..., loss_reduction={other}) or back-propagate the other reduction "
                      "(nothing was spent)")


def reference_rows(capture: Capture, layout: Layout, loss_fn: Callable[[Any], Tensor], batch: Any) -> PerSampleRows:
    """The per-sample gradients of ``batch`` with dropout off, the recorded calls and gradients left as they were."""
    with _preserved(capture, layout), _modes(capture, all_eval=False):
        return _pass(capture, layout, loss_fn, batch)[1]


def _pass(capture: Capture, layout: Layout, loss_fn: Callable[[Any], Tensor],
          batch: Any) -> tuple[Tensor, PerSampleRows, list[Record]]:
    with torch.enable_grad():
        return grads_of(capture, layout, loss_fn, batch)


def _compare(capture: Capture, full: tuple[Tensor, PerSampleRows, list[Record]],
             sub: tuple[Tensor, PerSampleRows, list[Record]], first: int, count: int, *, dtype: torch.dtype) -> None:
    """Samples [first, first + count) of ``full`` against samples [0, count) of ``sub``."""
    scale = _scale(full[1])
    err = _max_diff(full[1], first, sub[1], 0, count)
    if err <= max(1e-3, 8 * torch.finfo(dtype).eps) * scale + 1e-7:
        return
    rel = err / scale if scale else float("inf")
    layer = _coupled_input(capture, full[2], sub[2], first, count)
    if layer is not None:
        raise UnsupportedModelError(f"{layer}: a sample's input to this layer changes with the other samples in its "
                                    f"batch (gradients differ by {rel:.2g} of the largest in a sub-batch): a batch "
                                    "statistic (e.g. x.mean() / x.std() over the batch, in forward or collate_fn) "
                                    "couples the samples, so the step's sensitivity and ε would be wrong; compute "
                                    "it per sample or from public data")
    raise UnsupportedModelError(f"a sample's gradient changes with the other samples in its batch though no gradient "
                                f"flows between them (by {rel:.2g} of the largest in a sub-batch): a batch statistic "
                                "in the loss or after the last hooked layer (e.g. a loss divided by a detached batch "
                                "mean) couples the samples, so the step's sensitivity and ε would be wrong; compute "
                                "it per sample or from public data")


def _coupled_input(capture: Capture, full: list[Record], sub: list[Record], first: int, count: int) -> str | None:
    """The first dense layer whose batch-first input for the compared samples differs between the two passes."""
    if len(full) != len(sub):
        return None
    for rf, rs in zip(full, sub):
        if rf.module is None or rs.module is not rf.module or not rf.args or not rs.args:
            continue
        a, b = rf.args[0], rs.args[0]
        if not (isinstance(a, Tensor) and isinstance(b, Tensor) and a.dim() and a.shape[0] == rf.batch
                and b.shape[0] == count and a.shape[1:] == b.shape[1:]) or not a.is_floating_point():
            continue
        a = a[first : first + count]
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-6 * (float(a.abs().max()) if a.numel() else 0.0) + 1e-7):
            return capture.label(rf)
    return None


def _entries(g: PerSampleRows, first: int, count: int) -> tuple[Tensor, Tensor, Tensor]:
    """(sample - first, row, value) of samples [first, first + count)."""
    lo, hi = int(g.offsets[first]), int(g.offsets[first + count])
    return g.sample_ids()[lo:hi] - first, g.rows[lo:hi], g.values[lo:hi]


def _max_diff(a: PerSampleRows, fa: int, b: PerSampleRows, fb: int, count: int) -> float:
    """max_j ||a's sample fa + j - b's sample fb + j|| over j < count (sparse rows, never dense)."""
    sa, ra, va = _entries(a, fa, count)
    sb, rb, vb = _entries(b, fb, count)
    key = torch.cat([sa, sb]) * max(a.num_rows, b.num_rows) + torch.cat([ra, rb])
    uniq, inv = torch.unique(key, return_inverse=True)
    diff = va.new_zeros(uniq.numel(), va.shape[1]).index_add_(0, inv, torch.cat([va, -vb.to(va.dtype)]))
    if not diff.numel():
        return 0.0
    sample = torch.div(uniq, max(a.num_rows, b.num_rows), rounding_mode="floor")
    per = va.new_zeros(count).index_add_(0, sample, diff.nan_to_num(0.0, 0.0, 0.0).square().sum(1))
    return float(per.sqrt().max())


def _scale(g: PerSampleRows) -> float:
    """The largest finite per-sample norm of ``g`` (0 for an empty batch)."""
    return float(_norms(g).nan_to_num(0.0, 0.0, 0.0).max()) if g.batch_size else 0.0


def _norms(g: PerSampleRows) -> Tensor:
    """[B] each sample's L2 norm over all its rows."""
    return g.values.new_zeros(g.batch_size).index_add_(0, g.sample_ids(), g.values.square().sum(1)).sqrt()


@contextmanager
def _preserved(capture: Capture, layout: Layout) -> Iterator[None]:
    """Run the check without disturbing the step it precedes: recorded calls, gradients and the global RNG."""
    records, grads = list(capture.records), [(p, p.grad) for _, p in layout.dense]
    devices = sorted({p.device.index for _, p in layout.dense if p.is_cuda} |
                     {t.weight.device.index for t in layout.tables if t.weight.is_cuda})
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        capture.clear()
        capture.records.extend(records)
        for p, g in grads:
            p.grad = g


@contextmanager
def _modes(capture: Capture, *, all_eval: bool) -> Iterator[None]:
    """Dropout off (``all_eval``: every module the engine does not hook in eval mode); modes restored after."""
    saved = [(m, m.training) for m in capture.model.modules()]
    hooked = capture.hooked_modules()
    try:
        for m in capture.model.modules():
            if isinstance(m, _DROPOUT) or (all_eval and id(m) not in hooked):
                m.training = False
        yield
    finally:
        for m, mode in saved:
            m.training = mode
