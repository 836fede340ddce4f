"""Sparse DP mean estimation (Ghazi et al. poster) and the noisy-gradient-descent loop that uses it to aggregate
clipped per-sample gradients (``sparse_mean_gd``; with ``estimator: gaussian`` the loop is plain DP-SGD / DP-GD).

Estimators of a mean of s-sparse vectors with ||z||_2 <= L (so the mean lies in the l1 ball of radius L sqrt(s)):
- projection mechanism (Nikolov, Talwar & Zhang): z^ = argmin{||z - (mean + xi)||_2 : ||z||_1 <= L sqrt(s)}, xi
  Laplace (poster: b = 2 L sqrt(s) / (n eps)) or Gaussian (poster: sigma^2 = 8 L^2 ln(1.25/delta) / (n eps)^2).
- Gaussian l1 recovery (compressed sensing): A ~ N(0, 1/m)^{m x d}, m = n eps sqrt(s ln(d/s) / ln(1/delta)),
  b = A mean + N(0, sigma^2 I), sigma^2 = 18 L^2 ln(2.5/delta) / (n eps)^2; z~ = argmin{||z||_1 : A z = b}, an LP
  solved with scipy.optimize.linprog(method="highs") on z = u - v, u, v >= 0.
  The poster's sigma relies on A acting as a near-isometry on s-sparse vectors (RIP, which holds w.h.p. over A and
  cannot be certified for a given A). In the GD loop we instead use the certified add/remove sensitivity
  ||A||_op clip / b (A block-diagonal, ||A||_op = max over blocks of the largest singular value, computed).

In the GD loop (per step, Poisson(q) batch, fixed denominator b = q n, per-sample L2 clip C):
    g^ = (1/b) sum_i clip_C(grad_i)          (add/remove L2 sensitivity C / b)
    gaussian:    g~ = g^ + N(0, (sigma C / b)^2)
    projection:  g~ = Proj_{l1 ball of radius l1_radius}(g^ + N(0, (sigma C / b)^2))
    l1_recovery: blocks of ``block_size`` coordinates, m_b = ceil(ratio * block_size) rows each,
                 g~ = argmin ||z||_1 s.t. A z = A g^ + N(0, (sigma ||A||_op C / b)^2)
and sigma is calibrated by the accountant for the target eps over T steps (StepSpend(q, Gaussian(sigma))).
"""

from __future__ import annotations

import math

import numpy as np
import scipy.optimize
import torch

from widedp import accounting
from widedp.convex.common import Callback, ConvexResult, GaussianSpend, clipped_residuals, gaussian, poisson_batch
from widedp.convex.common import step as make_step
from widedp.models import glm

# ---------------------------------------------------------------------------------------------------- estimators


def project_l1_ball(v: torch.Tensor, radius: float) -> torch.Tensor:
    """Euclidean projection of ``v`` (any shape) onto {||z||_1 <= radius} (Duchi et al. 2008, sort-based)."""
    flat = v.reshape(-1)
    if float(flat.abs().sum()) <= radius:
        return v.clone()
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


def dp_gd(data: glm.SparseRows, *, noise_multiplier: float | None, iterations: int, lr: float, clip: float,
          batch_size: int, estimator: str, generator: torch.Generator, l1_radius: float = 0.0,
          block_size: int = 256, measurement_ratio: float = 0.5, callback: Callback | None = None,
          log_every: int = 10) -> ConvexResult:
    """Noisy (sub)gradient descent with per-sample clipping; ``noise_multiplier=None``: non-private (no noise).

    batch_size 0 = full batch (q = 1, denominator n); else Poisson(q = batch_size / n), denominator batch_size.
    """
    n, d, k = len(data), data.num_features, data.num_classes
    dtype = data.x.values().dtype
    q = 1.0 if batch_size <= 0 or batch_size >= n else batch_size / n
    denom = float(n) if q >= 1.0 else float(batch_size)
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
        _, r, frac = clipped_residuals(w, batch, x_norms if q >= 1.0 else x_norms[idx], clip)
        clipped_share += float(frac)
        g = glm.weighted_grad_sum(batch, r) / denom
        if noise_multiplier is not None:
            std = noise_multiplier * clip / denom
            if recovery is not None:
                g = recovery(g, noise_std=std * amp, generator=generator)
            else:
                g = g + gaussian(g.shape, std, generator, dtype)
                if estimator == "projection":
                    g = project_l1_ball(g, l1_radius)
            ledger.add(make_step((GaussianSpend(noise_multiplier, clip * amp / denom),), sampling_rate=q))
        w = w - lr * g
        if callback is not None and ((t + 1) % log_every == 0 or t == iterations - 1):
            callback(t + 1, w, {"clipped_share": float(frac)})
    info = {"sampling_rate": q, "denominator": denom, "noise_multiplier": noise_multiplier,
            "noise_std": (noise_multiplier * clip * amp / denom) if noise_multiplier else 0.0,
            "measurement_op_norm": amp if recovery is not None else None,
            "clipped_share": clipped_share / max(iterations, 1), "l1_radius": l1_radius}
    return ConvexResult(w, ledger, iterations, info)
