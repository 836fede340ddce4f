"""Sparse DP mean estimation (Ghazi et al. poster) and the noisy-gradient-descent loop that uses it to aggregate
clipped per-sample gradients (``sparse_mean_gd``; with ``estimator: gaussian`` the loop is plain DP-SGD / DP-GD).

Estimators of a mean of s-sparse vectors with ||z||_2 <= L (so the mean lies in the l1 ball of radius L sqrt(s)):
- projection mechanism (Nikolov, Talwar & Zhang): z^ = argmin{||z - (mean + xi)||_2 : ||z||_1 <= L sqrt(s)}, xi
  Laplace (poster: b = 2 L sqrt(s) / (n eps)) or Gaussian (poster: sigma^2 = 8 L^2 ln(1.25/delta) / (n eps)^2).
  Sensitivity of the mean (add/remove, the mean over the dataset's own n): (z - mean) / (n + 1), so <= 2 L sqrt(s)
  / n in l1 and 2 L / n in l2 -- the poster's replace-one figures, which thus also cover add/remove; the projection
  is post-processing. (The Gaussian formula is the classical one: valid for eps <= 1 only.)
- Gaussian l1 recovery (compressed sensing): A ~ N(0, 1/m)^{m x d}, m = n eps sqrt(s ln(d/s) / ln(1/delta)),
  b = A mean + N(0, sigma^2 I), sigma^2 = 18 L^2 ln(2.5/delta) / (n eps)^2; z~ = argmin{||z||_1 : A z = b}, an LP
  solved with scipy.optimize.linprog(method="highs") on z = u - v, u, v >= 0.
  The poster's sigma relies on A acting as a near-isometry on s-sparse vectors (RIP, which holds w.h.p. over A and
  cannot be certified for a given A). In the GD loop we instead use the certified sensitivity ||A||_op Delta
  (A data-independent and block-diagonal, ||A||_op = max over blocks of the largest singular value, computed).
These two functions take the noise scale from the caller; ``poster_*`` give the poster's (reference only).

In the GD loop (per step, per-example L2 clip C, adjacency add/remove of one example):
    g^ = (1/den) sum_{i in batch} clip_C(grad_i)
    gaussian:    g~ = g^ + N(0, (sigma Delta)^2)
    projection:  g~ = Proj_{l1 ball of radius l1_radius}(g^ + N(0, (sigma Delta)^2))       (post-processing)
    l1_recovery: blocks of ``block_size`` coordinates, m_b = ceil(ratio * block_size) rows each,
                 g~ = argmin ||z||_1 s.t. A z = A g^ + N(0, (sigma ||A||_op Delta)^2)
- Poisson(q = b / n) batches (batch_size b > 0): den = b, a fixed public number; D and D' = D +- z differ by z's
  term in the batch (when z is sampled), so Delta = C / b.
- Full batch (batch_size 0, or b >= n): den = n, the dataset's own size, which changes with z: Delta = 2 C / n
  (``common.mean_sensitivity``; the old C / n was exceeded by up to 1.96x on signed features, i.e. the "eps = 1"
  full-batch runs were eps ~ 2.1).
sigma is calibrated by the accountant for the target eps over T steps (StepSpend(q, Gaussian(sigma))).
"""

from __future__ import annotations

import math

import numpy as np
import scipy.optimize
import torch

from widedp import accounting
from widedp.convex.common import (
    Callback,
    ConvexResult,
    GaussianSpend,
    clipped_residuals,
    gaussian,
    mean_sensitivity,
    poisson_batch,
)
from widedp.convex.common import step as make_step
from widedp.models import glm

# ---------------------------------------------------------------------------------------------------- estimators


def project_l1_ball(v: torch.Tensor, radius: float) -> torch.Tensor:
    """Euclidean projection of ``v`` (any shape) onto {||z||_1 <= radius} (Duchi et al. 2008, sort-based)."""
    flat = v.reshape(-1)
    if float(flat.abs().sum()) <= radius:
        return v.clone()
    if radius <= 0:
        return torch.zeros_like(v)
    u = torch.sort(flat.abs(), descending=True).values
    css = torch.cumsum(u, 0)
    j = torch.arange(1, len(u) + 1, dtype=u.dtype)
    cond = u - (css - radius) / j > 0
    k = int(torch.nonzero(cond)[-1]) + 1
    theta = (css[k - 1] - radius) / k
    return (torch.sign(flat) * torch.clamp(flat.abs() - theta, min=0)).reshape(v.shape)


def poster_projection_noise(*, lipschitz: float, sparsity: int, n: int, epsilon: float, delta: float) -> float:
    """The poster's noise of the projection mechanism: Laplace scale (delta = 0) or Gaussian std (delta > 0)."""
    if delta == 0:
        return 2.0 * lipschitz * math.sqrt(sparsity) / (n * epsilon)
    return math.sqrt(8.0 * lipschitz**2 * math.log(1.25 / delta)) / (n * epsilon)


def poster_recovery_parameters(*, lipschitz: float, sparsity: int, dim: int, n: int, epsilon: float, delta: float
                               ) -> tuple[int, float]:
    """The poster's (m, sigma) of Gaussian l1 recovery."""
    m = n * epsilon * math.sqrt(sparsity * math.log(dim / sparsity) / math.log(1.0 / delta))
    sigma = math.sqrt(18.0 * lipschitz**2 * math.log(2.5 / delta)) / (n * epsilon)
    return max(1, math.ceil(m)), sigma


def projection_mechanism(mean: torch.Tensor, *, radius: float, noise_std: float, generator: torch.Generator,
                         laplace_noise: bool = False) -> torch.Tensor:
    """Proj_{l1 ball(radius)}(mean + xi); xi Gaussian with std ``noise_std`` or Laplace with that scale."""
    from widedp.convex.common import laplace

    xi = (laplace(mean.shape, noise_std, generator, mean.dtype) if laplace_noise
          else gaussian(mean.shape, noise_std, generator, mean.dtype))
    return project_l1_ball(mean + xi, radius)


def l1_recovery(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||z||_1 s.t. A z = b (A: [m, d], b: [m]) by linprog(method="highs") on z = u - v, u, v >= 0."""
    m, d = a.shape
    res = scipy.optimize.linprog(np.ones(2 * d), A_eq=np.hstack([a, -a]), b_eq=b, bounds=(0, None), method="highs")
    if res.status != 0:
        raise RuntimeError(f"l1 recovery LP failed: {res.message}")
    return res.x[:d] - res.x[d:]


def gaussian_measurements(m: int, d: int, generator: torch.Generator) -> np.ndarray:
    """A ~ N(0, 1/m)^{m x d}."""
    return (torch.randn(m, d, generator=generator, dtype=torch.float64) / math.sqrt(m)).numpy()


def gaussian_l1_recovery(mean: torch.Tensor, *, measurements: int, noise_std: float, generator: torch.Generator
                         ) -> torch.Tensor:
    """Recover ``mean`` ([d]) from m = ``measurements`` noisy Gaussian measurements by l1 minimisation."""
    d = mean.numel()
    a = gaussian_measurements(measurements, d, generator)
    noise = torch.randn(measurements, generator=generator, dtype=torch.float64).numpy() * noise_std
    b = a @ mean.reshape(-1).double().numpy() + noise
    return torch.from_numpy(l1_recovery(a, b)).reshape(mean.shape).to(mean.dtype)


class BlockRecovery:
    """Block-diagonal Gaussian measurements of a [D] vector: blocks of ``block_size`` coordinates, m_b rows each."""

    def __init__(self, dim: int, *, block_size: int, ratio: float, generator: torch.Generator) -> None:
        self.bounds = [(s, min(dim, s + block_size)) for s in range(0, dim, block_size)]
        self.mats = [gaussian_measurements(max(1, math.ceil(ratio * (e - s))), e - s, generator)
                     for s, e in self.bounds]
        self.op_norm = max(float(np.linalg.norm(a, 2)) for a in self.mats)

    def __call__(self, v: torch.Tensor, *, noise_std: float, generator: torch.Generator) -> torch.Tensor:
        flat = v.reshape(-1).double().numpy()
        out = np.zeros_like(flat)
        for (s, e), a in zip(self.bounds, self.mats):
            noise = torch.randn(a.shape[0], generator=generator, dtype=torch.float64).numpy() * noise_std
            out[s:e] = l1_recovery(a, a @ flat[s:e] + noise)
        return torch.from_numpy(out).reshape(v.shape).to(v.dtype)


# ---------------------------------------------------------------------------------------------------------- loop


def calibrate_sigma(*, iterations: int, sampling_rate: float, target_epsilon: float, delta: float,
                    accountant: str = "pld") -> float:
    return accounting.calibrate_noise_multiplier(
        lambda s: make_step((GaussianSpend(s),), sampling_rate=sampling_rate), steps=iterations, delta=delta,
        target_epsilon=target_epsilon, accountant=accountant)  # type: ignore[arg-type]


def clipped_grad_mean(w: torch.Tensor, batch: glm.LabeledCSR, *, clip: float, denominator: float,
                      x_norms: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """The quantity dp_gd noises: (1/denominator) sum_i clip_C(grad_i) over ``batch`` ([d, K]), and the share of
    clipped examples."""
    x_norms = batch.row_norms(2.0) if x_norms is None else x_norms
    _, r, frac = clipped_residuals(w, batch, x_norms, clip)
    return glm.weighted_grad_sum(batch, r) / denominator, float(frac)


def dp_gd(data: glm.LabeledCSR, *, noise_multiplier: float | None, iterations: int, lr: float, clip: float,
          batch_size: int, estimator: str, generator: torch.Generator, l1_radius: float = 0.0,
          block_size: int = 256, measurement_ratio: float = 0.5, callback: Callback | None = None,
          log_every: int = 10) -> ConvexResult:
    """Noisy (sub)gradient descent with per-sample clipping; ``noise_multiplier=None``: non-private (no noise).

    batch_size 0 = full batch (q = 1, denominator n, sensitivity 2 C / n); else Poisson(q = batch_size / n),
    denominator batch_size (sensitivity C / b). Noise std = noise_multiplier * sensitivity (* ||A||_op).
    """
    n, d, k = len(data), data.num_features, data.num_classes
    dtype = data.x.values().dtype
    q = 1.0 if batch_size <= 0 or batch_size >= n else batch_size / n
    denom = float(n) if q >= 1.0 else float(batch_size)
    sens = mean_sensitivity(clip, n=n, denominator=None if q >= 1.0 else denom)
    x_norms = data.row_norms(2.0)
    w = torch.zeros(d, k, dtype=dtype)
    ledger = accounting.Ledger()
    recovery = (BlockRecovery(d * k, block_size=block_size, ratio=measurement_ratio, generator=generator)
                if estimator == "l1_recovery" else None)
    amp = recovery.op_norm if recovery is not None else 1.0
    clipped_share = 0.0
    for t in range(iterations):
        idx = poisson_batch(n, q, generator)
        batch = data if q >= 1.0 else data.rows(idx)
        g, frac = clipped_grad_mean(w, batch, clip=clip, denominator=denom,
                                    x_norms=x_norms if q >= 1.0 else x_norms[idx])
        clipped_share += frac
        if noise_multiplier is not None:
            std = noise_multiplier * sens
            if recovery is not None:
                g = recovery(g, noise_std=std * amp, generator=generator)
            else:
                g = g + gaussian(g.shape, std, generator, dtype)
                if estimator == "projection":
                    g = project_l1_ball(g, l1_radius)
            ledger.add(make_step((GaussianSpend(noise_multiplier, sens * amp),), sampling_rate=q))
        w = w - lr * g
        if callback is not None and ((t + 1) % log_every == 0 or t == iterations - 1):
            callback(t + 1, w, {"clipped_share": frac})
    info = {"sampling_rate": q, "denominator": denom, "noise_multiplier": noise_multiplier, "sensitivity_l2": sens,
            "noise_std": (noise_multiplier * sens * amp) if noise_multiplier else 0.0,
            "measurement_op_norm": amp if recovery is not None else None,
            "clipped_share": clipped_share / max(iterations, 1), "l1_radius": l1_radius}
    return ConvexResult(w, ledger, iterations, info)
