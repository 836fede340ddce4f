"""Recorded calls -> ``PerSampleRows``: each sample's gradient over the engine's row space, never B x V x D.

Row space (R = R_tab + A rows of width D = the widest table)::

    [ table 0 rows | table 1 rows | ... | A dense rows ]
      global row = table offset + id       every trainable non-table parameter, flattened in
                                           model.named_parameters() order, zero-padded to A·D, cut into rows

A narrower table's rows are zero-padded to D (the pad is noised by the step and dropped by the update). The dense
rows are ``dp_step``'s always rows: selected every step at no selection cost, clipped with the sample's table rows
(one S1 clip over everything a sample touched) and noised like them.

Per-sample gradients: table entries ``go[src] * scale`` summed per (sample, row) (``widedp.dp.rowgrads.coalesce``);
``nn.Linear`` in closed form (go^T x per sample, inputs [B, ..., in]); any other layer by ``torch.func``
(vmap over the batch of the gradient of <layer(x_j), go_j>): both need the per-sample loss to be a sum over
samples with each sample's loss depending on its own inputs only. ``losses_and_rows`` checks that once
(``check_independent``: a second backward with per-sample weights v must give v_j times each output row's gradient
of sample j); ``widedp.api.coupling`` adds what sends no gradient between samples (batch statistics).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from widedp.api.capture import Capture, Record, Table, UnsupportedModelError
from widedp.dp.rowgrads import PerSampleRows, PerSampleRowsWithDense, coalesce


@dataclass(frozen=True)
class Layout:
    """The row space of a model: ``tables`` (global offsets in order), ``dense`` [(name, parameter)], row width
    ``dim`` (D) and the dtype of the per-sample values."""

    tables: tuple[Table, ...]
    dense: tuple[tuple[str, nn.Parameter], ...]
    dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, tables: list[Table], dense: list[tuple[str, nn.Parameter]]) -> Layout:
        dtype = tables[0].weight.dtype
        for w in [t.weight for t in tables] + [p for _, p in dense]:
            dtype = torch.promote_types(dtype, w.dtype)
        return cls(tuple(tables), tuple(dense), max(t.dim for t in tables), dtype)

    @property
    def table_rows(self) -> int:
        """R_tab: the rows a selection mechanism ranges over."""
        return self.tables[-1].offset + self.tables[-1].num_rows

    @property
    def dense_numel(self) -> int:
        return sum(p.numel() for _, p in self.dense)

    @property
    def always_rows(self) -> int:
        """A = ceil(P / D) dense rows."""
        return math.ceil(self.dense_numel / self.dim)

    @property
    def num_rows(self) -> int:
        return self.table_rows + self.always_rows


def clear_grads(layout: Layout) -> None:
    """Drop every gradient a backward left on the layout's parameters (they never reach an update)."""
    for _, p in layout.dense:
        p.grad = None
    for t in layout.tables:
        t.weight.grad = None


def collect(capture: Capture, layout: Layout, *, batch: int, scale: float = 1.0,
            reduce: Callable[[Tensor], Tensor] | None = None) -> PerSampleRows:
    """``per_sample_rows`` of what ``capture`` recorded since its last ``clear()`` (then cleared)."""
    capture.check_tables_untouched()
    capture.enabled = False  # torch.func re-runs layers: record nothing meanwhile
    try:
        return per_sample_rows(capture.records, layout, batch=batch, scale=scale, reduce=reduce)
    finally:
        capture.enabled = True
        capture.clear()


def losses_and_rows(capture: Capture, layout: Layout, loss_fn: Any, batch: Any, *,
                    reduce: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, PerSampleRows]:
    """([B] losses, each sample's gradient over ``layout``'s rows) from one forward and one backward of
    ``loss_fn(batch)`` ([B] per-sample losses), without stepping; no gradient is left on the model."""
    loss, g, _ = grads_of(capture, layout, loss_fn, batch, reduce=reduce)
    return loss, g


def grads_of(capture: Capture, layout: Layout, loss_fn: Any, batch: Any, *,
             reduce: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, PerSampleRows, list[Record]]:
    """``losses_and_rows`` and the calls it recorded (their inputs and output gradients), for the coupling check."""
    capture.clear()
    clear_grads(layout)
    loss = loss_fn(batch)
    if not isinstance(loss, Tensor) or loss.dim() != 1:
        raise ValueError(f"loss_fn must return the [B] per-sample losses (reduction='none'), got "
                         f"{getattr(loss, 'shape', type(loss))}")
    weighted = None
    if not capture.independence_checked and loss.shape[0] >= 2 and loss.requires_grad:
        weighted = _weighted_grads(capture, layout, loss)
    loss.sum().backward()
    if weighted is not None:
        check_independent(capture, *weighted, torch.isfinite(loss.detach()))
    records = list(capture.records)
    g = collect(capture, layout, batch=loss.shape[0], reduce=reduce)
    clear_grads(layout)  # the non-private summed gradient backward left on dense parameters
    return loss.detach(), g, records


def _weighted_grads(capture: Capture, layout: Layout, loss: Tensor) -> tuple[Tensor, list[Tensor | None]]:
    """(v, each record's d(Σ_j v_j ℓ_j)/d(output)) for fixed random weights v [B] in [0.5, 1.5): a backward through
    the records' own hooks (so an output modified in place is seen at the version the lookup returned) that keeps
    the graph for the main one; it leaves no gradient behind."""
    gen = torch.Generator().manual_seed(0)  # any fixed weights: the check needs no secret
    v = (torch.rand(loss.shape[0], generator=gen, dtype=torch.float64) + 0.5).to(loss.device, loss.dtype)
    loss.backward(v, retain_graph=True)
    weighted = [r.go for r in capture.records]
    for r in capture.records:
        r.go = None
    clear_grads(layout)
    return v, weighted


def check_independent(capture: Capture, v: Tensor, weighted: list[Tensor | None], finite: Tensor, *,
                      rtol: float = 1e-4) -> None:
    """Refuse samples that interact. When sample j's loss depends on sample j's inputs only, the gradient of
    Σ_j v_j ℓ_j at each output row of sample j is v_j times that of Σ_j ℓ_j (``go``); a batch statistic, in-batch
    negatives, a batch-level loss term or a lookup that is not batch first (one row per sample) breaks it, and the
    per-sample gradients of one backward would be wrong. Samples with a non-finite loss (``finite`` [B] False) and
    non-finite entries are left out: the step gives such a sample no weight (``widedp.dp.clipping``)."""
    for r, gv in zip(capture.records, weighted):
        if gv is None or r.go is None or r.batch != v.shape[0]:  # (another batch size: refused by ``collect``)
            continue
        if r.table is not None:  # output rows -> their sample (rows no kept entry reads stay -1: not checked)
            d = r.table.dim
            gv, go = gv.reshape(-1, d), r.go.reshape(-1, d)
            owner = torch.full((go.shape[0],), -1, dtype=torch.long, device=go.device)
            owner[r.src] = r.sample
            keep = (owner >= 0) & finite[owner.clamp_min(0)]
            gv, want = gv[keep], v[owner[keep]].unsqueeze(1) * go[keep]
        else:
            gv, want = gv[finite], (v.reshape(-1, *([1] * (r.go.dim() - 1))) * r.go)[finite]
        ok = torch.isfinite(gv) & torch.isfinite(want)
        gv, want = gv[ok], want[ok]
        if not want.numel():
            continue
        tol = max(rtol, 8 * torch.finfo(gv.dtype).eps, 8 * torch.finfo(r.go.dtype).eps)  # bf16 tables: 8 eps(bf16)
        err = float((gv - want).abs().max())
        if not err <= tol * float(want.abs().max()) + 1e-7:
            raise UnsupportedModelError(f"{capture.label(r)}: a sample's loss depends on other samples' outputs of "
                                        f"this layer (max error {err:.3g}): samples interact (batch statistics, "
                                        "in-batch negatives, a batch-level loss term, or a lookup that is not one row "
                                        "per sample), so per-sample gradients would be wrong")
    capture.independence_checked = True


def empty_rows(layout: Layout, device: torch.device) -> PerSampleRows:
    """The per-sample rows of an empty batch (B = 0), for the step of an empty Poisson batch."""
    empty = PerSampleRows(values=torch.zeros(0, layout.dim, dtype=layout.dtype, device=device),
                          rows=torch.zeros(0, dtype=torch.long, device=device),
                          offsets=torch.zeros(1, dtype=torch.long, device=device), num_rows=layout.table_rows)
    dense = torch.zeros(0, layout.always_rows, layout.dim, dtype=layout.dtype, device=device)
    return with_always_rows(empty, dense, num_rows=layout.num_rows)


def batch_size_of(records: list[Record]) -> int:
    """B from the records the backward reached (all must agree); ValueError when there are none."""
    sizes = {r.batch for r in records if r.go is not None and r.batch >= 0}
    if len(sizes) > 1:
        raise UnsupportedModelError(f"recorded calls see different batch sizes {sorted(sizes)}: every lookup and "
                                    "dense layer must take the batch first (one bag / one row per sample)")
    if not sizes:
        raise RuntimeError("no per-sample gradient was recorded: run the model's forward in training mode and "
                           "loss.sum().backward() on the [B] per-sample losses before optimizer.step()")
    return sizes.pop()


def per_sample_rows(records: list[Record], layout: Layout, *, batch: int, scale: float = 1.0,
                    reduce: Callable[[Tensor], Tensor] | None = None) -> PerSampleRows:
    """Each of ``batch`` samples' gradient over ``layout``'s R rows; dense rows last within each sample.

    ``scale`` multiplies every gradient (``batch`` for a loss that was the mean over the batch). ``reduce``: what
    the backward leaves in a dense ``.grad`` from the sum of this process's per-sample gradients [A·D] (None: that
    sum; with DDP: the mean over processes, ``widedp.api.sharded.dense_total``).
    """
    for r in records:
        if r.go is not None and r.batch >= 0 and r.batch != batch:
            where = r.table.name if r.table is not None else type(r.module).__name__
            raise UnsupportedModelError(f"{where}: saw {r.batch} samples (bags / rows), the loss has {batch}: every "
                                        "lookup and dense layer must take the batch first")
    device = layout.tables[0].weight.device
    values, rows, sample = _table_entries(records, layout, device)
    if sample.numel() and int(sample.max()) >= batch:
        raise UnsupportedModelError(f"a lookup's entries belong to {int(sample.max()) + 1} samples, the loss has "
                                    f"{batch} (is the KJT's stride the batch size?)")
    if scale != 1.0:
        values = values * scale
    tab = coalesce(values, rows, sample, batch, layout.table_rows)
    dense = _dense_rows(records, layout, batch, device)
    check_dense_sums(dense, layout, reduce=reduce)
    if scale != 1.0:
        dense = dense.mul_(scale)
    return with_always_rows(tab, dense.view(batch, layout.always_rows, layout.dim), num_rows=layout.num_rows)


def check_dense_sums(dense: Tensor, layout: Layout, *, rtol: float = 1e-3,
                     reduce: Callable[[Tensor], Tensor] | None = None) -> None:
    """Each dense parameter's per-sample gradients ``dense`` [B, A·D] must add up to the gradient the backward left in
    ``p.grad`` (when it left one): otherwise the parameter was read outside its module's forward or the loss has a
    term that is not a sum over samples, and the per-sample gradients would be wrong. (Samples that interact can
    still add up: ``check_independent`` is the check for them.)"""
    total, at = dense.sum(0), 0
    if reduce is not None:
        total = reduce(total)
    for name, p in layout.dense:
        mine, at = total[at : at + p.numel()], at + p.numel()
        if p.grad is None:
            continue
        ref = p.grad.reshape(-1).to(mine.dtype)
        if not bool(torch.isfinite(ref).all() & torch.isfinite(mine).all()):
            continue  # a non-finite sample (the step gives it no weight) leaves nothing to compare
        err = float((mine - ref).abs().max()) if ref.numel() else 0.0
        if err > rtol * float(ref.abs().max()) + 1e-6:
            raise UnsupportedModelError(f"{name}: its per-sample gradients do not add up to its gradient (max error "
                                        f"{err:.3g}): it is read outside its module's forward, or the loss has a term "
                                        "that is not a sum of per-sample losses")


def _table_entries(records: list[Record], layout: Layout, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """values [N, D], global rows [N], sample [N] of every looked-up entry the backward reached."""
    parts: list[tuple[Tensor, Tensor, Tensor]] = []
    for r in records:
        if r.table is None or r.go is None:
            continue
        v = r.go.reshape(-1, r.table.dim).index_select(0, r.src).to(layout.dtype)
        if r.scale is not None:
            v = v * r.scale.to(layout.dtype).unsqueeze(1)
        if r.table.dim < layout.dim:
            v = F.pad(v, (0, layout.dim - r.table.dim))
        parts.append((v, r.rows, r.sample))
    if not parts:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return torch.zeros(0, layout.dim, dtype=layout.dtype, device=device), empty, empty
    return tuple(torch.cat(p) for p in zip(*parts))  # type: ignore[return-value]


def _dense_rows(records: list[Record], layout: Layout, batch: int, device: torch.device) -> Tensor:
    """[B, A·D] per-sample gradients of the dense parameters, flattened in order and zero-padded (zeros for a
    parameter no recorded call reached); each call's gradients are added straight into their slice."""
    out = torch.zeros(batch, layout.always_rows * layout.dim, dtype=layout.dtype, device=device)
    if batch == 0:  # (a process's empty share of a batch on several processes)
        return out
    at, where = 0, {}
    for _, p in layout.dense:
        where[id(p)] = out[:, at : at + p.numel()]
        at += p.numel()
    for r in records:
        if r.module is not None and r.go is not None:
            grads = _linear(r.module, r.args[0], r.go) if _plain_linear(r.module) else _functional(r, batch)
            for key, g in grads.items():
                where[key].add_(g.reshape(batch, -1))
    return out


def _plain_linear(m: nn.Module) -> bool:
    """An ``nn.Linear`` whose weight and bias are its own parameters (not computed, e.g. by ``weight_norm``)."""
    return type(m) is nn.Linear and m._parameters.get("weight") is m.weight and (
        m.bias is None or m._parameters.get("bias") is m.bias)


def _linear(m: nn.Linear, x: Tensor, go: Tensor) -> dict[int, Tensor]:
    """Per-sample grads of y = x W^T + c, x [B, ..., in], go [B, ..., out]: W_j = Σ_t go_jt^T x_jt, c_j = Σ_t go_jt."""
    b = go.shape[0]
    x3, g3 = x.reshape(b, -1, x.shape[-1]), go.reshape(b, -1, go.shape[-1])
    out = {}
    if m.weight.requires_grad:
        out[id(m.weight)] = torch.bmm(g3.transpose(1, 2), x3.to(g3.dtype))
    if m.bias is not None and m.bias.requires_grad:
        out[id(m.bias)] = g3.sum(1)
    return out


def _functional(r: Record, batch: int) -> dict[int, Tensor]:
    """Per-sample grads of any layer: vmap over samples of grad_θ <layer_θ(x_j), go_j>. Tensor arguments whose first
    dimension is B are per sample; other arguments are shared."""
    m = r.module
    assert m is not None and r.go is not None
    params = {n: p.detach() for n, p in m.named_parameters(recurse=False) if p.requires_grad}
    dims = tuple(0 if isinstance(a, Tensor) and a.dim() and a.shape[0] == batch else None for a in r.args)

    def inner(p: dict[str, Tensor], args: tuple[object, ...], go: Tensor) -> Tensor:
        one = tuple(a.unsqueeze(0) if d == 0 else a for a, d in zip(args, dims))  # type: ignore[union-attr]
        return (functional_call(m, p, one) * go.unsqueeze(0)).sum()

    try:
        grads = vmap(grad(inner), in_dims=(None, dims, 0))(params, r.args, r.go)
    except RuntimeError as e:  # random ops, data-dependent control flow, in-place buffer updates, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedModelError(f"{type(m).__name__}: torch.func cannot compute its per-sample gradients ({first}"
                                    "); a layer with parameters must be a deterministic function of its own "
                                    "inputs (move dropout and data-dependent branches outside it)") from None
    return {id(m._parameters[n]): g for n, g in grads.items()}


def with_always_rows(tab: PerSampleRows, dense: Tensor, *, num_rows: int) -> PerSampleRowsWithDense:
    """Each sample's table rows, then its A dense rows [R_tab, R_tab + A) with values ``dense`` [B, A, D]
    (``always_rows`` = A: ``dp_step`` selects them every step)."""
    b, a, d = dense.shape
    counts = tab.lengths() + a
    offsets = torch.zeros(b + 1, dtype=torch.long, device=dense.device)
    offsets[1:] = torch.cumsum(counts, 0)
    slots = ((offsets[1:] - a).unsqueeze(1) + torch.arange(a, device=dense.device)).reshape(-1)  # [B·A]
    is_dense = torch.zeros(int(offsets[-1]), dtype=torch.bool, device=dense.device).index_fill_(0, slots, True)
    table_slots = (~is_dense).nonzero().squeeze(1)
    values = tab.values.new_empty(is_dense.numel(), d)
    values.index_copy_(0, table_slots, tab.values).index_copy_(0, slots, dense.reshape(-1, d))
    rows = tab.rows.new_empty(is_dense.numel())
    dense_ids = torch.arange(tab.num_rows, tab.num_rows + a, device=dense.device).repeat(b)
    rows.index_copy_(0, table_slots, tab.rows).index_copy_(0, slots, dense_ids)
    return PerSampleRowsWithDense(values=values, rows=rows, offsets=offsets, num_rows=num_rows, always_rows=a)
