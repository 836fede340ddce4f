"""NumericSparse (Zhang, Mironov & Hejazinia, "Wide network learning with DP", Algorithm 1) and the DP ERM loop
that releases the averaged gradient of a group of samples through it (their Algorithm 2).

NumericSparse(u, alpha, c1) over the p coordinates of u, visited in a data-independent order:
    a0 = alpha + Lap(b_T); count = 0
    for each i:  if |u_i| + Lap(b_Q) >= a_count:  u^_i = u_i + Lap(b_R); count += 1; a_count = alpha + Lap(b_T)
                 if count >= c1: stop
The paper parameterises b_T = sigma(eps1), b_Q = 2 sigma(eps1), b_R = 2 sigma(eps2), sigma(e) = s sqrt(32 c1
log(2/delta)) / e, eps1 = 0.95 eps, eps2 = 0.05 eps. We parameterise by the per-segment epsilon e_seg of AboveThreshold
(threshold Lap(2 s / e_seg), queries Lap(4 s / e_seg): each segment ending in an above-threshold answer is
e_seg-DP for l_inf sensitivity s, Dwork & Roth Thm. 3.23) and keep the paper's ratio between release and
threshold noise: b_R = 2 b_T eps1 / eps2, i.e. each release is e_rel = s / b_R = e_seg eps2 / (4 eps1)-DP. The
accountant charges c1 segments + c1 releases per call (``SparseVectorSpend``), whatever the realised count, and
composes them (PLD) instead of the paper's advanced composition.

Sensitivity (add/remove one example): every per-example gradient x_i r_i^T is clipped to ||.||_inf <= clip
(||x_i r_i^T||_inf = ||x_i||_inf ||r_i||_inf, exact); the queries are |u_j| with u = (1/den) sum of the clipped
gradients, and | |u_j| - |u'_j| | <= |u_j - u'_j|, so the l_inf sensitivity s of u bounds every query and every
released value: s = clip / b for Poisson groups (den = b, the configured expected size: a fixed public number),
s = 2 clip / n for a full batch (den = n, the dataset's own size, which changes with the example; see
``common.mean_sensitivity``; the old clip / n was too small by up to 2x).

ERM loop (Algorithm 2): per step a group of samples is drawn, its l_inf-clipped mean gradient u (sensitivity s as
above) goes through NumericSparse, and w <- w - lr u^. The paper draws one of m FIXED groups
uniformly; that does not amplify epsilon (the selected group's other members are the same every time it is drawn,
so the mixture over groups has no component shared by neighbouring datasets), yet its Theorem 1 applies the
subsampling lemma. We draw a fresh Poisson(q = b / n) group per step, for which amplification by subsampling holds
and is what the accountant applies. The threshold is ``threshold_scale`` * b_Q (the paper's alpha, with its
constant 40 and log factors, exceeds every gradient coordinate at our sizes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from widedp import accounting
from widedp.convex.common import Callback, ConvexResult, laplace, mean_sensitivity, poisson_batch
from widedp.convex.common import step as make_step
from widedp.dp.spend import SparseVectorSpend
from widedp.models import glm


@dataclass(frozen=True)
class SparseNoise:
    """Pre-drawn noise of one NumericSparse call: thresholds [c1 + 1], queries [p], releases [c1] (all Laplace),
    and the visiting order [p] (a permutation)."""

    thresholds: np.ndarray
    queries: np.ndarray
    releases: np.ndarray
    order: np.ndarray

    @classmethod
    def draw(cls, p: int, *, cutoff: int, b_t: float, b_q: float, b_r: float, generator: torch.Generator
             ) -> SparseNoise:
        return cls(laplace((cutoff + 1,), b_t, generator).numpy(), laplace((p,), b_q, generator).numpy(),
                   laplace((cutoff,), b_r, generator).numpy(), torch.randperm(p, generator=generator).numpy())


def numeric_sparse_reference(u: np.ndarray, *, alpha: float, cutoff: int, noise: SparseNoise) -> np.ndarray:
    """Algorithm 1 line by line (the test reference): [p] -> [p] with at most ``cutoff`` nonzeros."""
    out = np.zeros_like(u, dtype=np.float64)
    count = 0
    thr = alpha + noise.thresholds[0]
    for j, i in enumerate(noise.order):
        if abs(u[i]) + noise.queries[j] >= thr:
            out[i] = u[i] + noise.releases[count]
            count += 1
            thr = alpha + noise.thresholds[count]
            if count >= cutoff:
                break
    return out


def numeric_sparse(u: np.ndarray, *, alpha: float, cutoff: int, noise: SparseNoise, block: int = 0
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The same output as ``numeric_sparse_reference`` in O(hits * (block + p / block)) numpy work.

    Returns (released indices [h], released values [h]), h <= cutoff.
    """
    p = len(u)
    a = np.abs(u[noise.order]) + noise.queries  # noisy query answers in visiting order
    block = block or max(1, int(math.sqrt(p)))
    nb = -(-p // block)
    padded = np.full(nb * block, -np.inf)
    padded[:p] = a
    bmax = padded.reshape(nb, block).max(1)
    hits: list[int] = []
    pos = 0
    while len(hits) < cutoff and pos < p:
        thr = alpha + noise.thresholds[len(hits)]
        blk = pos // block
        seg = np.flatnonzero(a[pos:min((blk + 1) * block, p)] >= thr)
        if seg.size:
            i = pos + int(seg[0])
        else:
            later = np.flatnonzero(bmax[blk + 1:] >= thr)
            if not later.size:
                break
            b2 = blk + 1 + int(later[0])
            i = b2 * block + int(np.flatnonzero(a[b2 * block:(b2 + 1) * block] >= thr)[0])
        hits.append(i)
        pos = i + 1
    idx = noise.order[np.asarray(hits, dtype=np.int64)]
    return idx, u[idx] + noise.releases[: len(hits)]


def noise_scales(*, sensitivity: float, segment_epsilon: float, release_share: float) -> tuple[float, float, float]:
    """(b_T, b_Q, b_R) for per-segment epsilon e_seg (module docstring)."""
    b_t = 2.0 * sensitivity / segment_epsilon
    return b_t, 2.0 * b_t, 2.0 * b_t * (1.0 - release_share) / release_share


def spend(*, segment_epsilon: float, cutoff: int, release_share: float) -> SparseVectorSpend:
    """The accountant record of one call: c1 segments of e_seg and c1 releases of e_seg eps2 / (4 eps1)."""
    return SparseVectorSpend(epsilon=segment_epsilon, cutoff=cutoff,
                             epsilon_release=segment_epsilon * release_share / (4.0 * (1.0 - release_share)))


def calibrate_segment_epsilon(*, iterations: int, sampling_rate: float, cutoff: int, release_share: float,
                              target_epsilon: float, delta: float, accountant: str = "pld") -> float:
    return accounting.calibrate_selection_epsilon(
        lambda e: make_step((spend(segment_epsilon=e, cutoff=cutoff, release_share=release_share),),
                            sampling_rate=sampling_rate),
        steps=iterations, delta=delta, target_epsilon=target_epsilon, accountant=accountant)  # type: ignore[arg-type]


def linf_clipped_mean(w: torch.Tensor, batch: glm.LabeledCSR, *, clip: float, denominator: float,
                      x_inf: torch.Tensor | None = None) -> np.ndarray:
    """The quantity NumericSparse sees: (1/denominator) sum_i clip_inf(grad_i), flattened [d K] (float64)."""
    x_inf = batch.row_norms(math.inf) if x_inf is None else x_inf
    _, r = glm.residuals(w, batch)
    g_inf = x_inf * r.abs().amax(1)
    r = r * torch.clamp(clip / g_inf.clamp_min(1e-30), max=1.0)[:, None]
    return (glm.weighted_grad_sum(batch, r) / denominator).reshape(-1).double().numpy()


def numeric_sparse_erm(data: glm.LabeledCSR, *, segment_epsilon: float, iterations: int, lr: float, clip: float,
                       batch_size: int, cutoff: int, threshold_scale: float, release_share: float,
                       generator: torch.Generator, callback: Callback | None = None, log_every: int = 10
                       ) -> ConvexResult:
    """Algorithm 2 with Poisson groups (module docstring). W starts at zero."""
    n, d, k = len(data), data.num_features, data.num_classes
    dtype = data.x.values().dtype
    q = min(1.0, batch_size / n)
    denom = float(batch_size) if q < 1.0 else float(n)
    sens = mean_sensitivity(clip, n=n, denominator=denom if q < 1.0 else None)
    b_t, b_q, b_r = noise_scales(sensitivity=sens, segment_epsilon=segment_epsilon, release_share=release_share)
    alpha = threshold_scale * b_q
    x_inf = data.row_norms(math.inf)
    w = torch.zeros(d, k, dtype=dtype)
    ledger = accounting.Ledger()
    record = make_step((spend(segment_epsilon=segment_epsilon, cutoff=cutoff, release_share=release_share),),
                       sampling_rate=q)
    released = 0
    for t in range(iterations):
        idx = poisson_batch(n, q, generator)
        batch = data if q >= 1.0 else data.rows(idx)
        u = linf_clipped_mean(w, batch, clip=clip, denominator=denom, x_inf=x_inf if q >= 1.0 else x_inf[idx])
        noise = SparseNoise.draw(len(u), cutoff=cutoff, b_t=b_t, b_q=b_q, b_r=b_r, generator=generator)
        hit_idx, hit_val = numeric_sparse(u, alpha=alpha, cutoff=cutoff, noise=noise)
        ledger.add(record)
        released += len(hit_idx)
        upd = torch.zeros(d * k, dtype=dtype)
        upd[torch.from_numpy(hit_idx)] = torch.from_numpy(hit_val).to(dtype)
        w = w - lr * upd.reshape(d, k)
        if callback is not None and ((t + 1) % log_every == 0 or t == iterations - 1):
            callback(t + 1, w, {"released": len(hit_idx)})
    info = {"sampling_rate": q, "sensitivity_linf": sens, "threshold": alpha, "b_threshold": b_t, "b_query": b_q,
            "b_release": b_r, "segment_epsilon": segment_epsilon, "mean_released": released / max(iterations, 1)}
    return ConvexResult(w, ledger, iterations, info)
