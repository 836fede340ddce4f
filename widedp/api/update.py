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

    def __init__(self, layout: Layout, optimizer: torch.optim.Optimizer, table_optimizer_name: str | None) -> None:
        self.layout, self.optimizer = layout, optimizer
        self.specs = [table_optimizer(optimizer, t.weight, table_optimizer_name) for t in layout.tables]
        self.rows = [make_row_optimizer(s.name, [(0, t.weight)], lr=self._lr(s), betas=s.betas, eps=s.eps)
                     for s, t in zip(self.specs, layout.tables)]
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
        if lay.dense:
            buf = values.new_zeros(lay.always_rows, lay.dim)
            a, b = cuts[-2], cuts[-1]
            buf.index_copy_(0, rows[a:b] - lay.table_rows, values[a:b])
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
