"""Multinomial logistic regression on sparse bag-of-words rows: a convex GLM with per-sample gradients as sparse as
its inputs.

Parameters W: [d, K] (d features, the last may be a constant bias feature; K classes). For a sample (x, y) with
logits z = W^T x and p = softmax(z):

    loss(W; x, y) = logsumexp(z) - z_y,          grad_W = x (p - e_y)^T   ([d, K], nonzero only on x's support).

Constants (x normalised to ||x||_2 = 1 by the data builder, or ||x||_1 = 1 which implies ||x||_2 <= 1):
    ||grad||_2 = ||x||_2 ||p - e_y||_2 <= sqrt(2) ||x||_2              (L2-Lipschitz L = sqrt(2))
    ||grad||_inf <= ||x||_inf ||p - e_y||_inf <= ||x||_inf <= 1          (Lipschitz w.r.t. ||.||_1 of W: L0 = 1)
    Hessian = (x x^T) kron (diag p - p p^T), ||.||_op <= ||x||_2^2 / 2  (L2-smoothness H = 1/2)
    ||grad(W) - grad(W')||_inf <= ||x||_inf^2 ||W - W'||_1 / 4 ... <= ||W - W'||_1 / 4   (ell_1-smoothness L1 = 1/4)
(the last: the softmax Jacobian's entries are at most 1/4 in absolute value).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

#: Bounds for unit-norm rows (see the module docstring).
LIPSCHITZ_L2 = math.sqrt(2.0)
LIPSCHITZ_LINF = 1.0
SMOOTH_L2 = 0.5
SMOOTH_L1 = 0.25


@dataclass(frozen=True)
class LabeledCSR:
    """A CSR design matrix and labels, on one device (samples, not gradients: a gradient that is non-zero on a few
    rows is ``widedp.dp.rowgrads.SparseRows``).

    Attributes:
        x: [n, d] sparse CSR (float). xt: [d, n] sparse CSR, its transpose (for X^T M products).
        y: [n] int64 class ids. num_classes: K.
    """

    x: torch.Tensor
    xt: torch.Tensor
    y: torch.Tensor
    num_classes: int

    @classmethod
    def from_csr(cls, indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, y: torch.Tensor, *,
                 num_features: int, num_classes: int, dtype: torch.dtype = torch.float32) -> LabeledCSR:
        n = len(indptr) - 1
        with warnings.catch_warnings():  # "sparse CSR support is in beta"
            warnings.simplefilter("ignore", UserWarning)
            x = torch.sparse_csr_tensor(indptr.long(), indices.long(), values.to(dtype), size=(n, num_features),
                                        check_invariants=False)
            xt = x.to_sparse_coo().t().coalesce().to_sparse_csr()
        return cls(x, xt, y.long(), num_classes)

    def __len__(self) -> int:
        return self.x.shape[0]

    @property
    def num_features(self) -> int:
        return self.x.shape[1]

    def rows(self, idx: torch.Tensor) -> LabeledCSR:
        """The sub-matrix of rows ``idx`` ([m] int64)."""
        crow, col, val = self.x.crow_indices(), self.x.col_indices(), self.x.values()
        starts, ends = crow[idx], crow[idx + 1]
        lens = ends - starts
        new_crow = torch.zeros(len(idx) + 1, dtype=torch.long)
        new_crow[1:] = torch.cumsum(lens, 0)
        total = int(new_crow[-1])
        rep = torch.repeat_interleave(torch.arange(len(idx)), lens)
        pos = starts[rep] + (torch.arange(total) - new_crow[:-1][rep])
        return LabeledCSR.from_csr(new_crow, col[pos], val[pos], self.y[idx], num_features=self.num_features,
                                   num_classes=self.num_classes, dtype=val.dtype)

    def row_norms(self, p: float = 2.0) -> torch.Tensor:
        """[n] the p-norm of each row."""
        crow, val = self.x.crow_indices(), self.x.values().abs()
        seg = torch.repeat_interleave(torch.arange(len(self)), crow[1:] - crow[:-1])
        out = torch.zeros(len(self), dtype=val.dtype)
        if p == math.inf:
            return out.scatter_reduce(0, seg, val, "amax", include_self=True)
        return out.index_add(0, seg, val**p) ** (1.0 / p)


#: Relative slack for float rounding of rows normalised to norm 1 (``check_row_norms``).
ROW_NORM_SLACK = 1e-5


def check_row_norms(data: LabeledCSR, *, p: float = 2.0, bound: float = 1.0) -> None:
    """Raise ValueError unless every row has p-norm <= bound (the Lipschitz and smoothness constants above assume
    unit rows; the data builder normalises each example by its own norm, so any example satisfies it)."""
    if len(data) and float(data.row_norms(p).max()) > bound * (1.0 + ROW_NORM_SLACK):
        raise ValueError(f"rows must have {p}-norm <= {bound} (the GLM's Lipschitz constants assume it); got "
                         f"{float(data.row_norms(p).max()):.6g}")


def logits(w: torch.Tensor, data: LabeledCSR) -> torch.Tensor:
    """[n, K] = X W."""
    return torch.sparse.mm(data.x, w.to(data.x.dtype))


def losses(w: torch.Tensor, data: LabeledCSR) -> torch.Tensor:
    """[n] per-sample cross-entropy."""
    z = logits(w, data)
    return torch.logsumexp(z, 1) - z.gather(1, data.y[:, None])[:, 0]


def residuals(w: torch.Tensor, data: LabeledCSR) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample loss [n] and residual R = softmax(XW) - onehot(y): [n, K] (grad_i = x_i R_i^T)."""
    z = logits(w, data)
    lse = torch.logsumexp(z, 1)
    loss = lse - z.gather(1, data.y[:, None])[:, 0]
    r = torch.exp(z - lse[:, None])
    r[torch.arange(len(data)), data.y] -= 1.0
    return loss, r


def weighted_grad_sum(data: LabeledCSR, coef: torch.Tensor) -> torch.Tensor:
    """sum_i x_i coef_i^T = X^T coef: [d, K] for coef [n, K] (e.g. clipped residuals)."""
    return torch.sparse.mm(data.xt, coef)


def grad_norms(data: LabeledCSR, r: torch.Tensor, x_norms: torch.Tensor) -> torch.Tensor:
    """[n] per-sample gradient L2 norms ||x_i||_2 ||r_i||_2 (the gradient is a rank-one outer product)."""
    return x_norms * r.norm(dim=1)


def accuracy(w: torch.Tensor, data: LabeledCSR) -> float:
    if len(data) == 0:
        return float("nan")
    return float((logits(w, data).argmax(1) == data.y).double().mean())


def mean_loss(w: torch.Tensor, data: LabeledCSR) -> float:
    if len(data) == 0:
        return float("nan")
    return float(losses(w, data).double().mean())
