"""Row-update optimizers: apply a ``SparseRows`` gradient (global row ids) to a model's ``row_tables()``.

``sgd``        w[r] -= lr g[r] on the given rows only.
``lazy_adam``  Adam on the given rows only: their moments and their own step counters advance, bias correction
               uses each row's count (a row given for the first time at step 1000 takes a full first Adam step).
               Other rows (weights, moments, counters) are untouched bit for bit. Update formula as
               ``torch.optim.Adam``: w -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
               Differs from ``torch.optim.SparseAdam`` in two ways: SparseAdam counts steps per tensor (one
               global t, so a row first given late gets a nearly uncorrected first step m = (1 - b1) g), and it
               adds eps before the bias correction (eps * sqrt(1 - b2^t) in Adam's terms). With eps -> 0 and the
               same rows given every step the two agree (tested).
``adam``       dense Adam (the paper's): the gradient is zero on rows not given; every row's moments decay and
               every row moves; one global step counter. Equals ``torch.optim.Adam`` on the dense gradient
               (it runs the same fused kernel as ``Adam(fused=True)``).

Tables must be adjacent in the row space and in offset order (as ``CBOW.row_tables()``). Build the optimizer after
the model is on its device; it keeps detached views of the tables and updates them in place (so the model's
``load_state_dict``, which copies in place, is fine; ``assign=True`` is not). Works on any device; uses
index_select / index_add_ / index_copy_ (faster than advanced indexing).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

from widedp import native
from widedp.dp.rowgrads import SparseRows
from widedp.errors import ConfigError
from widedp.native import gpu

Tables = list[tuple[int, Tensor]]


class RowOptimizer(Protocol):
    lr: float

    def step(self, grad: SparseRows) -> None: ...

    def state_dict(self) -> dict[str, Tensor]: ...

    def state_tensors(self) -> dict[str, Tensor]: ...

    def load_state_dict(self, d: dict[str, Tensor]) -> None: ...


def make_row_optimizer(
    name: str, tables: Tables, *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
) -> RowOptimizer:
    """``sgd`` | ``lazy_adam`` | ``adam`` over ``tables`` = [(global row offset, weight [n, D])]."""
    if not lr > 0:
        raise ConfigError(f"train.lr: must be > 0, got {lr}")
    if name == "sgd":
        return RowSGD(tables, lr=lr)
    if name in ("lazy_adam", "adam"):
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ConfigError(f"train.betas: must be in [0, 1), got {list(betas)}")
        if eps < 0:
            raise ConfigError(f"train.eps: must be >= 0, got {eps}")
        cls = LazyAdam if name == "lazy_adam" else DenseAdam
        return cls(tables, lr=lr, betas=betas, eps=eps)
    raise ConfigError(f"train.optimizer: expected sgd, lazy_adam or adam for a row optimizer, got {name!r}")


def _split(tables: list[tuple[int, Tensor]], bounds: Tensor, grad: SparseRows) -> list[tuple[int, Tensor, Tensor]]:
    """[(table index, local rows [k_t], values [k_t, D])] for the tables that have given rows.

    ``bounds`` [T + 1]: table t owns global rows [bounds[t], bounds[t + 1]). Rows outside every table are ignored.
    """
    if len(tables) == 1:
        off, w = tables[0]
        return [(0, grad.rows - off if off else grad.rows, grad.values)]
    rows, order = torch.sort(grad.rows)  # 5 ops and one sync for any number of tables
    cuts = torch.searchsorted(rows, bounds).tolist()
    values = grad.values.index_select(0, order)
    return [
        (i, rows[a:b] - off, values[a:b])
        for i, ((off, _), a, b) in enumerate(zip(tables, cuts[:-1], cuts[1:]))
        if b > a
    ]


class _Base:
    def __init__(self, tables: Tables, *, lr: float) -> None:
        self.lr = lr
        self.tables = [(off, w.detach()) for off, w in tables]
        ends = [off + w.shape[0] for off, w in self.tables]
        if not tables or any(off != end for (off, _), end in zip(self.tables[1:], ends)):
            raise ValueError(f"row tables must be adjacent and in offset order, got offsets {[o for o, _ in tables]}")
        self.num_rows = ends[-1]
        self._bounds = torch.tensor([off for off, _ in self.tables] + ends[-1:], device=self.tables[0][1].device)

    def _state(self) -> dict[str, Tensor]:
        return {}

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors only (loads with torch.load(weights_only=True)); cloned."""
        return {k: v.detach().clone() for k, v in self._state().items()}

    def state_tensors(self) -> dict[str, Tensor]:
        """``state_dict()``'s tensors themselves, not cloned: what a checkpoint writes, or loads into, in place."""
        return self._state()

    def load_state_dict(self, d: dict[str, Tensor]) -> None:
        mine = self._state()
        if set(d) != set(mine):
            raise ConfigError(f"optimizer state: keys {sorted(d)} do not match {sorted(mine)} (other optimizer?)")
        for k, t in mine.items():
            if tuple(d[k].shape) != tuple(t.shape):
                raise ConfigError(f"optimizer state: {k} has shape {tuple(d[k].shape)}, expected {tuple(t.shape)}")
            t.copy_(d[k])


class RowSGD(_Base):
    """w[r] -= lr g[r] for the given rows."""

    @torch.no_grad()
    def step(self, grad: SparseRows) -> None:
        for i, rows, vals in _split(self.tables, self._bounds, grad):
            self.tables[i][1].index_add_(0, rows, vals, alpha=-self.lr)


class LazyAdam(_Base):
    """Adam on the given rows only, with per-row step counters (see the module docstring).

    ``fused``: update every table in one native call (``widedp.native`` on the CPU, its Triton kernel on CUDA;
    None: when available and the tables are contiguous; False: the op-by-op PyTorch update, the reference).
    """

    #: Longest bias-correction table (rows); beyond its last entry both corrections are exactly 1 in float64.
    MAX_TABLE = 1 << 20

    def __init__(self, tables: Tables, *, lr: float, betas: tuple[float, float], eps: float,
                 fused: bool | None = None) -> None:
        super().__init__(tables, lr=lr)
        self.b1, self.b2 = betas
        self.eps = eps
        weights = [w for _, w in self.tables]
        if fused is None and not all(w.is_contiguous() for w in weights):
            fused = False
        self.gpu = gpu.use(fused, *weights)  # Triton on CUDA; else the C++ kernel on the CPU
        self.fused = not self.gpu and native.use(fused, *weights)
        self._bound_list = self._bounds.tolist()
        # m and v of a table stacked as [n, 2, D]: one gather and one scatter per step instead of two each
        self.moments = [w.new_zeros(w.shape[0], 2, w.shape[1]) for _, w in self.tables]
        self.steps = [torch.zeros(w.shape[0], dtype=torch.long, device=w.device) for _, w in self.tables]
        # (1 / (1 - b1^t), 1 / sqrt(1 - b2^t)) looked up by t: one gather instead of ~10 small ops per step
        tiny = 2.0**-54  # b^t below this: 1 - b^t == 1 in float64
        longest = max(1 + math.ceil(math.log(tiny) / math.log(b)) if b > 0 else 1 for b in betas)
        self._table: Tensor | None = None
        if longest + 1 <= self.MAX_TABLE:
            t = torch.arange(longest + 1, dtype=torch.float64).clamp_min(1)
            coef = torch.stack([1 / (1 - self.b1**t), 1 / (1 - self.b2**t).sqrt()], 1)
            w0 = self.tables[0][1]
            self._table = coef.to(dtype=w0.dtype, device=w0.device)
        elif self.gpu and fused:
            raise ValueError(f"fused=True: the Triton lazy Adam needs betas whose bias corrections reach 1 within "
                             f"{self.MAX_TABLE} steps, got {betas}")
        self.gpu = self.gpu and self._table is not None
        self._strict = fused is True

    def _state(self) -> dict[str, Tensor]:
        d = {f"moments.{i}": m for i, m in enumerate(self.moments)}
        d.update({f"steps.{i}": s for i, s in enumerate(self.steps)})
        return d

    def _coef(self, t: Tensor, like: Tensor) -> Tensor:
        """[k, 2] (1 / (1 - b1^t), 1 / sqrt(1 - b2^t)) for step counts t [k] (bias corrections in float64)."""
        if self._table is not None:
            return self._table.index_select(0, t.clamp_max(self._table.shape[0] - 1))
        tf = t.to(torch.float64).unsqueeze(1)
        return torch.cat([1 / (1 - torch.pow(self.b1, tf)), (1 - torch.pow(self.b2, tf)).rsqrt()], 1).to(like.dtype)

    @torch.no_grad()
    def step(self, grad: SparseRows) -> None:
        if self.gpu:
            if gpu.lazy_adam_([w for _, w in self.tables], self.moments, self.steps, self._bound_list, grad.rows,
                              grad.values, self._table, lr=self.lr, betas=(self.b1, self.b2), eps=self.eps,
                              strict=self._strict):
                return
            self.gpu = False  # the kernel could not run (warned once): the PyTorch update from now on
        if self.fused:
            native.lazy_adam_([w for _, w in self.tables], self.moments, self.steps, self._bound_list, grad.rows,
                              grad.values, self._table, lr=self.lr, betas=(self.b1, self.b2), eps=self.eps)
            return
        for i, rows, g in _split(self.tables, self._bounds, grad):
            w, mom, cnt = self.tables[i][1], self.moments[i], self.steps[i]
            t = cnt.index_select(0, rows).add_(1)
            cnt.index_copy_(0, rows, t)
            mv = mom.index_select(0, rows)  # [k, 2, D]
            m, v = mv[:, 0], mv[:, 1]
            m.lerp_(g, 1 - self.b1)  # as torch.optim.Adam
            v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            mom.index_copy_(0, rows, mv)
            coef = self._coef(t, w)
            # torch.optim.Adam: w -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
            denom = v.sqrt().mul_(coef[:, 1:]).add_(self.eps)
            w.index_add_(0, rows, m.mul(coef[:, :1]).div_(denom), alpha=-self.lr)


class DenseAdam(_Base):
    """Dense Adam with a gradient that is zero off the given rows (see the module docstring).

    Runs torch's fused Adam kernel (the one behind ``torch.optim.Adam(fused=True)``, ~3x faster than the
    op-by-op update on CPU) on a dense gradient buffer that is non-zero only on the rows of the step.
    """

    def __init__(self, tables: Tables, *, lr: float, betas: tuple[float, float], eps: float) -> None:
        super().__init__(tables, lr=lr)
        self.b1, self.b2 = betas
        self.eps = eps
        self.exp_avg = [torch.zeros_like(w) for _, w in self.tables]
        self.exp_avg_sq = [torch.zeros_like(w) for _, w in self.tables]
        self.t = [torch.zeros((), dtype=torch.float32, device=w.device) for _, w in self.tables]
        self._grad = [torch.zeros_like(w) for _, w in self.tables]  # all zero between steps

    def _state(self) -> dict[str, Tensor]:
        d = {f"exp_avg.{i}": m for i, m in enumerate(self.exp_avg)}
        d.update({f"exp_avg_sq.{i}": v for i, v in enumerate(self.exp_avg_sq)})
        d.update({f"step.{i}": t for i, t in enumerate(self.t)})
        return d

    @torch.no_grad()
    def step(self, grad: SparseRows) -> None:
        given = _split(self.tables, self._bounds, grad)
        for i, rows, g in given:
            self._grad[i].index_copy_(0, rows, g)
        for t in self.t:
            t.add_(1)
        torch._fused_adam_(
            [w for _, w in self.tables], self._grad, self.exp_avg, self.exp_avg_sq, [], self.t,
            amsgrad=False, lr=self.lr, beta1=self.b1, beta2=self.b2, weight_decay=0.0, eps=self.eps, maximize=False,
        )
        for i, rows, _ in given:
            self._grad[i].index_fill_(0, rows, 0)
