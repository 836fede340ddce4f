"""What the audit's adversaries compute from a CBOW run with canaries (``widedp.eval.audit``).

Three scores per canary, higher = "more likely included":

- ``white_box`` (the release): ⟨w_final − w_init, −g_i(w_init)⟩ / ‖g_i(w_init)‖ over the canary's own rows — did
  its rows move toward its own (clipped) descent direction. w_init is public (``train.seed`` and the audit's
  canary init).
- ``black_box``: −(the canary unit's loss under the released model).
- ``per_step`` (the accountant's adversary, optional): every step's released noisy update of the selected rows is
  seen. With μ_t the canary's clipped gradient / b at the model before step t (known to this adversary), y_t the
  released values of its own rows that were selected and s = σΔ₂ the claimed noise std, the step's likelihood ratio
  of "sampled" vs "not in the batch" is L_t = R_sel · exp(⟨y_t, μ_t⟩/s² − ‖μ_t‖²/(2s²)), where R_sel is the
  selection's ratio for the canary's rows (exponential mechanism: e^{ε″·min(‖μ_r‖, S0)/(2Δu)} per selected row;
  Gaussian thresholding: P(c_r + Z > τ)/P(Z > τ) for a selected row and the complements' ratio for an unselected
  one; data-independent selections: 1). The score is Σ_t log(1 − q + q·L_t), the log-likelihood ratio of the whole
  transcript's own-row part under Poisson sampling at rate q.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from widedp.dp.clipping import clip_per_sample
from widedp.dp.rowgrads import SparseRows
from widedp.dp.units import group_rows
from widedp.models.cbow import CBOW, CBOWBatch


def at_rows(rows: Tensor, values: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
    """Gather ``values`` [k, D] of sorted unique ``rows`` [k] at ``keys`` [...]: ([..., D] zeros where absent,
    [...] bool found)."""
    k = rows.numel()
    flat = keys.reshape(-1)
    if k == 0:
        return values.new_zeros(*keys.shape, values.shape[1]), torch.zeros(keys.shape, dtype=torch.bool,
                                                                           device=keys.device)
    pos = torch.searchsorted(rows, flat).clamp_(max=k - 1)
    found = rows.index_select(0, pos) == flat
    out = values.index_select(0, pos) * found.unsqueeze(1).to(values.dtype)
    return out.view(*keys.shape, values.shape[1]), found.view(keys.shape)


def canary_grads(model: CBOW, batch: CBOWBatch, owner: Tensor, own: Tensor, *, clip1: float | None,
                 batch_size: float) -> tuple[Tensor, Tensor]:
    """At the model's current weights: (μ [m, n, D] each canary unit's gradient clipped at S1 (whole unit, all its
    rows) divided by b, on its own rows ``own`` [m, n]; loss [m] of each unit). ``owner`` [S]: unit of each sample."""
    m, n = own.shape
    with torch.inference_mode():
        loss, g = model.per_sample_row_grads(batch)
        g = group_rows(g, owner, num_units=m)
        if clip1 is not None:
            g, _ = clip_per_sample(g, clip1=clip1)
        keys = g.sample_ids() * g.num_rows + g.rows  # sorted: rows are sorted within each unit
        want = torch.arange(m, device=own.device).unsqueeze(1) * g.num_rows + own
        mu, _ = at_rows(keys, g.values, want)
        unit_loss = loss.new_zeros(m).index_add_(0, owner, loss)
    return mu / batch_size, unit_loss


@dataclass
class SelectionRatio:
    """The per-step adversary's model of the row selection (module docstring): ``kind`` none | exponential |
    gaussian; exponential: ``epsilon`` ε″ per pick, ``score_clip`` S0, ``sensitivity`` Δu; gaussian: ``sigma``,
    ``threshold``, ``public_pool`` (the canary's negatives are public rows: its contribution spreads over its own
    rows only)."""

    kind: str = "none"
    epsilon: float = 0.0
    score_clip: float = math.inf
    sensitivity: float = 1.0
    sigma: float = 1.0
    threshold: float = 0.0
    public_pool: bool = False

    def log_ratio(self, mu: Tensor, selected: Tensor, rows_per_unit: Tensor) -> Tensor:
        """[m] Σ over own rows of log(selection ratio): ``mu`` [m, n, D], ``selected`` [m, n] bool,
        ``rows_per_unit`` [m] the rows each unit's contribution is spread over."""
        touched = mu.abs().amax(2) > 0
        if self.kind == "exponential":
            u = torch.linalg.vector_norm(mu, dim=2).clamp(max=self.score_clip)
            lr = self.epsilon * u / (2 * self.sensitivity)
            return (lr * (selected & touched)).sum(1, dtype=torch.float64)
        if self.kind == "gaussian":
            c = (1.0 / rows_per_unit.clamp(min=1).double().sqrt()).unsqueeze(1).expand(selected.shape)
            p0 = _tail(torch.full_like(c, self.threshold), self.sigma)
            p1 = _tail(self.threshold - c, self.sigma)
            lr = torch.where(selected, p1.log() - p0.log(), torch.log1p(-p1) - torch.log1p(-p0))
            return (lr * touched).sum(1)
        return torch.zeros(mu.shape[0], dtype=torch.float64, device=mu.device)


def _tail(x: Tensor, sigma: float) -> Tensor:
    return 0.5 * torch.erfc(x / (sigma * math.sqrt(2.0)))


@dataclass
class StepRecords:
    """Per step t and canary i: dot ⟨y, μ⟩, mu2 ‖μ‖² (selected own rows only), lsel (log selection ratio)."""

    dot: list[Tensor] = field(default_factory=list)
    mu2: list[Tensor] = field(default_factory=list)
    lsel: list[Tensor] = field(default_factory=list)

    def score(self, *, noise_std: float, sampling_rate: float) -> np.ndarray:
        """[m] Σ_t log(1 − q + q·L_t) (module docstring)."""
        if not self.dot:
            raise ValueError("no step was observed")
        s2 = noise_std ** 2
        llr = torch.stack(self.lsel) + torch.stack(self.dot) / s2 - torch.stack(self.mu2) / (2 * s2)  # [T, m]
        q = sampling_rate
        stay = math.log1p(-q) if q < 1 else -math.inf  # q = 1: every unit is in every batch
        per = torch.logaddexp(torch.full_like(llr, stay), math.log(q) + llr)
        return per.sum(0).numpy()


class StepObserver:
    """Wraps a run's row optimizer (``step(grad: SparseRows)``): before each update, records what the per-step
    adversary sees of every canary (``StepRecords``), at the model's weights before the step; then steps."""

    def __init__(self, inner: Any, model: CBOW, probe: dict[str, Any], ratio: SelectionRatio) -> None:
        self.inner, self.model, self.probe, self.ratio = inner, model, probe, ratio
        self.records = StepRecords()

    def step(self, grad: SparseRows) -> None:
        p = self.probe
        mu, _ = canary_grads(self.model, p["batch"], p["owner"], p["own"], clip1=p["clip1"], batch_size=p["b"])
        rows, order = grad.rows.sort()
        y, sel = at_rows(rows, grad.values.index_select(0, order), p["own"])
        mu_sel = mu * sel.unsqueeze(2).to(mu.dtype)
        self.records.dot.append((y.double() * mu_sel.double()).sum((1, 2)).cpu())
        self.records.mu2.append(mu_sel.double().square().sum((1, 2)).cpu())
        self.records.lsel.append(self.ratio.log_ratio(mu, sel, p["rows_per_unit"]).double().cpu())
        self.inner.step(grad)

    def state_dict(self) -> dict[str, Tensor]:
        return self.inner.state_dict()

    def load_state_dict(self, d: dict[str, Tensor]) -> None:
        self.inner.load_state_dict(d)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def white_box(model: CBOW, own: Tensor, init_rows: Tensor, direction: Tensor) -> np.ndarray:
    """[m] ⟨w_final − w_init, d⟩ / ‖d‖ on each canary's own rows ``own`` [m, n]; ``init_rows`` [m, n, D] the rows at
    the init, ``direction`` [m, n, D] −g_i at the init."""
    final = rows_of(model, own)
    norm = torch.linalg.vector_norm(direction.flatten(1), dim=1).clamp_min(1e-30)
    return ((final - init_rows).double() * direction.double()).sum((1, 2)).div(norm.double()).cpu().numpy()


def rows_of(model: CBOW, own: Tensor) -> Tensor:
    """[m, n, D] the model's rows at global ids ``own`` [m, n] (detached copies)."""
    out = []
    for off, w in model.row_tables():
        local = own - off
        ok = (local >= 0) & (local < w.shape[0])
        out.append(w.detach().index_select(0, local.clamp(0, w.shape[0] - 1).reshape(-1)).view(*own.shape, -1)
                   * ok.unsqueeze(2).to(w.dtype))
    return torch.stack(out).sum(0)
