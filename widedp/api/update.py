"""Applying the step's noisy ``SparseRows``: table rows through widedp's row optimizers, dense parameters through the
user's own torch optimizer.

Which row optimizer a table gets (``table_optimizer=None``: read from the user's optimizer; its learning rate is
re-read from the table's parameter group before every step, so LR schedulers on the original optimizer apply):

    torch.optim.SGD  (no momentum, no nesterov)    -> ``sgd``        w[r] -= lr·g[r] on the selected rows
    torch.optim.Adam / AdamW (no amsgrad)          -> ``lazy_adam``  Adam on the selected rows only (lr, betas, eps)
    torch.optim.SparseAdam                         -> ``lazy_adam``
    anything else                                  -> pass table_optimizer="sgd" | "lazy_adam" | "adam"

The dense parameters' noisy gradient is written to ``p.grad`` and the user's optimizer steps (any torch optimizer;
its weight decay, momentum, etc. apply to dense parameters only); every ``p.grad`` is then set to None, so the
non-private gradient the user's ``backward`` left there never reaches an update.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from widedp.api.per_sample import Layout, clear_grads
from widedp.dp.optim import make_row_optimizer
from widedp.dp.rowgrads import SparseRows
from widedp.errors import ConfigError

TABLE_OPTIMIZERS = ("sgd", "lazy_adam", "adam")


@dataclass(frozen=True)
class TableOptimizer:
    """A table's row optimizer: ``name`` with the hyper-parameters of parameter group ``group``."""

    name: str
    group: int
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


def _group_of(opt: torch.optim.Optimizer, weight: Tensor) -> int:
    for i, g in enumerate(opt.param_groups):
        if any(p is weight for p in g["params"]):
            return i
    return 0


def table_optimizer(opt: torch.optim.Optimizer, weight: Tensor, name: str | None) -> TableOptimizer:
    """The row optimizer of the table ``weight`` under the user's ``opt`` (see the module docstring)."""
    gi = _group_of(opt, weight)
    g = opt.param_groups[gi]
    betas, eps = tuple(g.get("betas", (0.9, 0.999))), float(g.get("eps", 1e-8))
    if name is not None:
        if name not in TABLE_OPTIMIZERS:
            raise ConfigError(f"table_optimizer: expected one of {', '.join(TABLE_OPTIMIZERS)}, got {name!r}")
        return TableOptimizer(name, gi, betas, eps)  # type: ignore[arg-type]
    kind = type(opt).__name__
    if isinstance(opt, torch.optim.SGD):
        if g.get("momentum", 0) or g.get("nesterov", False):
            raise ConfigError("SGD with momentum: table rows have no row-sparse momentum here; pass "
                              "table_optimizer='sgd' (plain SGD on tables, your SGD on dense layers) or use Adam")
        found = "sgd"
    elif isinstance(opt, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SparseAdam)):
        if g.get("amsgrad", False):
            raise ConfigError(f"{kind}(amsgrad=True): not available for table rows; pass table_optimizer=...")
        found = "lazy_adam"
    else:
        raise ConfigError(f"{kind}: no known table-row equivalent; pass table_optimizer='sgd', 'lazy_adam' or 'adam' "
                          "(its lr, betas and eps are read from the optimizer's parameter group)")
    if g.get("weight_decay", 0):
        warnings.warn(f"{kind}(weight_decay={g['weight_decay']}): applies to dense layers only, not to table rows",
                      stacklevel=3)
    return TableOptimizer(found, gi, betas, eps)  # type: ignore[arg-type]


class Updater:
    """Applies a noisy ``SparseRows`` over ``layout``'s rows (see the module docstring)."""

    def __init__(self, layout: Layout, optimizer: torch.optim.Optimizer, table_optimizer_name: str | None,
                 weights: list[Tensor] | None = None) -> None:
        """``weights``: what each table's row optimizer updates (default: the tables' weights)."""
        self.layout, self.optimizer = layout, optimizer
        weights = [t.weight for t in layout.tables] if weights is None else weights
        self.specs = [table_optimizer(optimizer, w, table_optimizer_name) for w in weights]
        self.rows = [make_row_optimizer(s.name, [(0, w)], lr=self._lr(s), betas=s.betas, eps=s.eps)
                     for s, w in zip(self.specs, weights)]
        bounds = [t.offset for t in layout.tables] + [layout.table_rows, layout.num_rows]
        self._bounds = torch.tensor(bounds, device=layout.tables[0].weight.device)
        known = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in layout.dense if id(p) not in known]
        if missing:
            raise ConfigError(f"the optimizer does not hold the trainable parameters {missing}: pass "
                              "model.parameters() to it, or freeze them (requires_grad_(False))")

    def _lr(self, spec: TableOptimizer) -> float:
        return float(self.optimizer.param_groups[spec.group]["lr"])

    @torch.no_grad()
    def apply(self, grad: SparseRows) -> None:
        lay = self.layout
        rows, order = torch.sort(grad.rows)
        values = grad.values.index_select(0, order)
        cuts = torch.searchsorted(rows, self._bounds).tolist()
        for i, (t, opt, spec) in enumerate(zip(lay.tables, self.rows, self.specs)):
            a, b = cuts[i], cuts[i + 1]
            opt.lr = self._lr(spec)
            local, v = rows[a:b] - t.offset, values[a:b, : t.dim]
            if t.padding_idx is not None:  # a public, data-independent mask: post-processing of the noisy rows
                keep = local != t.padding_idx  # (torch stores it non-negative)
                local, v = local[keep], v[keep]
            if local.numel():
                opt.step(SparseRows(local, v.to(t.weight.dtype), t.num_rows))
        self.apply_dense(rows[cuts[-2] : cuts[-1]], values[cuts[-2] : cuts[-1]])

    def apply_dense(self, rows: Tensor, values: Tensor) -> None:
        """The dense rows [a] (ids R_tab + i) with their values [a, D] -> ``p.grad``, the user's optimizer steps;
        then every gradient is cleared."""
        lay = self.layout
        if lay.dense:
            buf = values.new_zeros(lay.always_rows, lay.dim)
            buf.index_copy_(0, rows - lay.table_rows, values)
            flat, at = buf.reshape(-1), 0
            for _, p in lay.dense:
                p.grad = flat[at : at + p.numel()].view_as(p).to(p.dtype).clone()
                at += p.numel()
            self.optimizer.step()
        self.clear_grads()

    def clear_grads(self) -> None:
        clear_grads(self.layout)

    def state_dict(self) -> dict[str, Tensor]:
        return {f"{i}.{k}": v for i, opt in enumerate(self.rows) for k, v in opt.state_dict().items()}

    def load_state_dict(self, d: dict[str, Tensor]) -> None:
        for i, opt in enumerate(self.rows):
            opt.load_state_dict({k.split(".", 1)[1]: v for k, v in d.items() if k.split(".", 1)[0] == str(i)})


class ShardedUpdater(Updater):
    """``Updater`` for tables sharded by torchrec (``widedp.api.sharded``): each rank's row optimizers update the
    slices it holds; the released rows of every owner are all_gathered first (post-processing of released values),
    so a replicated table moves alike on every rank and a column-split row on each column slice's holder."""

    def __init__(self, layout: Layout, optimizer: torch.optim.Optimizer, table_optimizer_name: str | None,
                 tables: list[Any], group: Any = None) -> None:
        self.held = [t for t in tables if t.local is not None]
        super().__init__(layout, optimizer, table_optimizer_name, weights=[t.local.view for t in self.held])
        self.group = group

    @torch.no_grad()
    def apply(self, grad: SparseRows) -> None:
        from widedp.dp.layout import _all_gather_var

        tab = grad.rows < self.layout.table_rows
        rows, values = _all_gather_var(grad.rows[tab], self.group), _all_gather_var(grad.values[tab], self.group)
        for t, opt, spec in zip(self.held, self.rows, self.specs):
            (r0, r1), (c0, c1) = t.local.rows, t.local.cols
            at = t.table.offset + r0
            mine = ((rows >= at) & (rows < t.table.offset + r1)).nonzero().squeeze(1)
            if mine.numel():
                opt.lr = self._lr(spec)
                v = values.index_select(0, mine)[:, c0:c1]
                opt.step(SparseRows(rows.index_select(0, mine) - at, v.to(t.local.view.dtype), r1 - r0))
        self.apply_dense(grad.rows[~tab], grad.values[~tab])
