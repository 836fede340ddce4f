"""Sparse vector selection (AboveThreshold with cutoff c) over ALL R rows in a fresh random order (privacy.md §2).

Each segment (ended by an above-threshold answer) is ε-DP: threshold noise Lap(Δu/ε1), query noise Lap(2Δu/ε2),
ε1 = f·ε, ε2 = (1−f)·ε; charged c segments whatever happens (``SparseVectorSpend``).

``brute`` (the reference) perturbs all R rows: O(R). ``sparse`` has the same output law in O(U log U + c·U) ops
(O(U log U + c·log U) with the native scan, ``widedp.native.svt_scan``, which returns ``scan``'s picks exactly) and
O(U + c) memory, whatever R (U = rows touched):
1. a uniformly random visiting order puts the U touched rows at a uniformly random ordered set of U distinct
   positions of [0, R) (``sample_distinct``); the untouched rows fill the other positions;
2. within a segment of threshold t, from position p on, the answer is the earlier of
   - the first touched row at a position >= p whose noisy score u + Lap(2Δu/ε2) is >= t (each row is visited once,
     so its query noise can be drawn up front, as ``brute`` does), and
   - the first untouched row at a position >= p that passes: untouched rows have score 0 and pass independently
     with probability p0(t) = P(Lap(2Δu/ε2) >= t), so the number of untouched rows skipped before the first pass
     is Geometric(p0(t)) — one draw per segment; the rows after the segment's answer are visited afresh by the
     next segment (new threshold, their noise not yet drawn), so the draw's overshoot is simply discarded;
3. an untouched row's identity is independent of whether it passes, so the untouched answers are attached, in
   order, to uniformly random distinct untouched ids (``sample_distinct``) at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from widedp import native
from widedp.dp.noise import laplace
from widedp.dp.selection.base import ScoreKind, SelectionContext, dense_scores, sample_distinct
from widedp.dp.spend import SparseVectorSpend, Spend
from widedp.dp.syncs import to_device


def laplace_tail(t: float, scale: float) -> float:
    """P(Lap(0, scale) >= t)."""
    return 0.5 * math.exp(-t / scale) if t >= 0 else 1.0 - 0.5 * math.exp(t / scale)


def geometric_failures(v: float, p: float) -> float:
    """Failures before the first success of Bernoulli(p) trials, from v uniform on (0, 1] (inversion); inf when p is
    so small (subnormal) that the quotient overflows."""
    if p >= 1.0:
        return 0.0
    x = math.log(v) / math.log1p(-p)
    return x if math.isinf(x) else math.floor(x)


def svt_brute(touched: Tensor, scores: Tensor, thresholds: Tensor, *, num_rows: int, query_scale: float,
              generator: torch.Generator) -> Tensor:
    """The reference: every row of a fresh random order perturbed; returns the picks in visiting order. O(R)."""
    dev, dt = touched.device, scores.dtype
    order = torch.randperm(num_rows, generator=generator, device=dev)
    # each row is visited at most once and each segment has its own threshold, so drawing every query noise
    # and every threshold up front is the same law as drawing them as the loop goes
    noisy = dense_scores(touched, scores, num_rows).index_select(0, order)
    noisy += laplace((num_rows,), scale=query_scale, generator=generator, device=dev, dtype=dt)
    picks: list[int] = []
    start = 0
    for t in thresholds.tolist():
        if start >= num_rows:
            break
        above = (noisy[start:] >= t).to(torch.uint8)
        i = int(above.argmax())  # first above-threshold answer of this segment
        if not above[i]:
            break
        picks.append(start + i)
        start += i + 1
    return order[torch.tensor(picks, dtype=torch.long, device=dev)]


def scan(tpos: np.ndarray, tnoisy: np.ndarray, tid: np.ndarray, thr: np.ndarray, unif: np.ndarray, *, num_rows: int,
         query_scale: float) -> list[int]:
    """``svt_sparse``'s host scan (steps 2-3 of the module docstring), the reference of ``widedp.native.svt_scan``.

    Args:
        tpos [U] int64 ascending: the touched rows' positions in the visiting order; tnoisy [U] their noisy scores;
        tid [U] their ids; thr [c], unif [c] float64: each segment's threshold and a (0, 1] uniform.

    Returns:
        at most c answers: a touched id, or -1 for an untouched answer (its id is drawn afterwards).
    """
    u, m = tpos.size, num_rows - tpos.size  # m: untouched rows
    skipped = tpos - np.arange(u)  # untouched positions before each touched one (non-decreasing)
    picks: list[int] = []
    p, i = 0, 0  # next position to visit; first touched row (in visiting order) at a position >= p
    for t, v in zip(thr.tolist(), unif.tolist()):
        above = np.flatnonzero(tnoisy[i:] >= t)
        x_touched = int(tpos[i + above[0]]) if above.size else num_rows
        x_untouched = num_rows
        p0 = laplace_tail(t, query_scale)
        if m and p0 > 0:
            # untouched rank (0-based) of the first passing untouched row at a position >= p
            k = (p - i) + geometric_failures(v, p0)
            if k < m:
                k = int(k)
                x_untouched = k + int(np.searchsorted(skipped, k, side="right"))  # its position
        if x_touched == num_rows and x_untouched == num_rows:
            break  # the scan reached the end of the order: no further segment can answer
        if x_touched < x_untouched:
            picks.append(int(tid[i + above[0]]))
            p = x_touched + 1
        else:
            picks.append(-1)
            p = x_untouched + 1
        i = int(np.searchsorted(tpos, p, side="left"))
    return picks


def svt_sparse(touched: Tensor, scores: Tensor, thresholds: Tensor, *, num_rows: int, query_scale: float,
             generator: torch.Generator) -> Tensor:
    """Same law as ``svt_brute`` without visiting the untouched rows one by one (module docstring)."""
    dev, u, c = touched.device, touched.numel(), thresholds.numel()
    pos = sample_distinct(u, num_rows, exclude=touched[:0], generator=generator, device=dev)  # touched i at pos[i]
    noisy = scores + laplace((u,), scale=query_scale, generator=generator, device=dev, dtype=scores.dtype)
    unif = 1.0 - torch.rand((c,), generator=generator, device=dev, dtype=torch.float64)  # (0, 1]: geometric draws
    by_pos = pos.argsort()
    # the scan runs on the host: ONE copy of everything it reads (ids and positions < 2^53 are exact in float64)
    host = torch.cat([pos.index_select(0, by_pos).double(), noisy.index_select(0, by_pos).double(),
                      touched.index_select(0, by_pos).double(), thresholds.double(), unif]).cpu()
    tpos, tnoisy, tid = host[:u].long(), host[u:2 * u], host[2 * u:3 * u].long()
    thr, unif_h = host[3 * u:3 * u + c], host[3 * u + c:]
    if native.available():  # the same picks, in O(U + c·log U) instead of O(c·U)
        picks = native.svt_scan(tpos, tnoisy, tid, thr, unif_h, num_rows=num_rows, query_scale=query_scale).numpy()
    else:
        picks = np.asarray(scan(tpos.numpy(), tnoisy.numpy(), tid.numpy(), thr.numpy(), unif_h.numpy(),
                                num_rows=num_rows, query_scale=query_scale), dtype=np.int64)
    untouched = np.flatnonzero(picks < 0)
    both = to_device(torch.from_numpy(np.concatenate([picks, untouched])), dev)  # one copy back, without a wait
    out, at = both[:picks.size], both[picks.size:]
    if untouched.size:
        ids = sample_distinct(untouched.size, num_rows, exclude=touched, generator=generator, device=dev)
        out.index_copy_(0, at, ids)
    return out


@dataclass(frozen=True)
class SparseVectorSelector:
    """AboveThreshold with cutoff c over all rows in a fresh random order (module docstring); returns the (at most
    c) rows found above, in visiting order. ``sparse``: O(U + c) memory, independent of R; ``brute``: O(R)."""

    epsilon: float
    threshold: float
    cutoff: int
    threshold_fraction: float
    score_clip: float
    release_values: bool = False
    epsilon_release: float = 0.0
    method: str = "sparse"
    score_kind: ScoreKind = "norm"

    def __post_init__(self) -> None:
        if self.method not in ("sparse", "brute"):
            raise ValueError(f"method: expected sparse or brute, got {self.method!r}")

    @classmethod
    def from_config(cls, cfg: Any, *, num_rows: int) -> SparseVectorSelector:
        """From ``SparseVectorSelectionConfig`` (R does not enter)."""
        return cls(epsilon=cfg.epsilon, threshold=cfg.threshold, cutoff=cfg.cutoff,
                   threshold_fraction=cfg.threshold_fraction, score_clip=cfg.score_clip,
                   release_values=cfg.release_values, epsilon_release=cfg.epsilon_release, method=cfg.method,
                   score_kind=cfg.score)

    def spend(self) -> Spend:
        return SparseVectorSpend(epsilon=self.epsilon, cutoff=self.cutoff,
                                 epsilon_release=self.epsilon_release if self.release_values else 0.0)

    def select(self, touched: Tensor, scores: Tensor, *, selectable_rows: int, score_sensitivity: float,
               ctx: SelectionContext, generator: torch.Generator) -> Tensor:
        eps1 = self.threshold_fraction * self.epsilon
        eps2 = self.epsilon - eps1
        thresholds = laplace(
            (self.cutoff,), scale=score_sensitivity / eps1, generator=generator, device=touched.device,
            dtype=scores.dtype,
        ).add_(self.threshold)
        run = svt_brute if self.method == "brute" else svt_sparse
        return run(touched, scores, thresholds, num_rows=selectable_rows, query_scale=2 * score_sensitivity / eps2,
                   generator=generator)
