"""Noise of the DP step: the Gaussian and the L2 sensitivity it is calibrated to (privacy.md §1, step 5), and the
Exp / Gumbel / Laplace draws of the selection mechanisms. All randomness from an explicit generator."""

from __future__ import annotations

import math

import torch
from torch import Tensor

Device = torch.device | str


def sensitivity(*, clip1: float, clip2: float | None, batch_size: float) -> float:
    """Add/remove L2 sensitivity Δ₂ of Δ̂ = clip_S2(M ⊙ ĝ), ĝ = (1/b) Σ_j clip_S1(g_j).

    Removing a sample moves ĝ by at most S1/b; clipping is a 1-Lipschitz projection onto the S2-ball, whose
    diameter is 2·S2. Hence min(S1/b, 2·S2) (the paper's min(S1/b, S2) is too small when S2 < S1/b).
    """
    s1 = clip1 / batch_size
    return s1 if clip2 is None else min(s1, 2.0 * clip2)


def gaussian_noise(
    shape: tuple[int, ...] | torch.Size,
    *,
    std: float,
    generator: torch.Generator,
    device: Device,
    dtype: torch.dtype,
) -> Tensor:
    """N(0, std²) i.i.d. of the given shape, drawn from ``generator``."""
    return torch.normal(0.0, std, tuple(shape), generator=generator, device=device, dtype=dtype)


# From torch.rand (uniform on [0, 1)): several times faster than Tensor.exponential_ on CPU.
def exponential(shape: tuple[int, ...], *, generator: torch.Generator, device: Device, dtype: torch.dtype) -> Tensor:
    """Exp(1) = −ln(1 − U), finite."""
    return torch.rand(shape, generator=generator, device=device, dtype=dtype).neg_().log1p_().neg_()


def gumbel(shape: tuple[int, ...], *, generator: torch.Generator, device: Device, dtype: torch.dtype) -> Tensor:
    """Gumbel(0, 1) = −ln(−ln U), never +inf (U = 0 gives −inf: never picked)."""
    return torch.rand(shape, generator=generator, device=device, dtype=dtype).log_().neg_().log_().neg_()


def laplace(
    shape: tuple[int, ...], *, scale: float, generator: torch.Generator, device: Device, dtype: torch.dtype
) -> Tensor:
    """Laplace(0, scale) as the difference of two Exp(1) (exact law)."""
    e = exponential((2, *shape), generator=generator, device=device, dtype=dtype)
    return (e[0] - e[1]).mul_(scale)


# ------------------------------------------------------------------------------ floating-point-safe noise (secure)

#: ``dp.noise``: ``gaussian`` (torch's continuous sampler, the default) | ``secure`` (``snapped_release``).
NOISES: tuple[str, ...] = ("gaussian", "secure")
#: Secure mode's grid γ satisfies γ·√d <= GRID_SLACK·Δ₂ (d coordinates released), so rounding onto the grid grows the
#: ℓ2 sensitivity by at most this factor: the accountant charges σ / (1 + GRID_SLACK) (``DiscreteGaussianSpend``).
GRID_SLACK: float = 2.0**-10
#: |x/γ| is clamped to 2^51 and the discrete Gaussian's σ kept below 2^46 (|Z| < 37·2^46 < 2^52), so the lattice
#: sum round(x/γ) + Z stays below 2^53 in magnitude: integer-valued float64 arithmetic on it is exact.
_LATTICE_LIMIT = 2.0**51
_MAX_SIGMA = 2.0**46
#: Proposals drawn at once on the CPU (larger rounds spill the float64 temporaries out of the cache).
_CPU_CHUNK = 1 << 16


def grid_step(*, sensitivity: float, dim: int) -> float:
    """γ: the largest power of two with γ·√dim <= GRID_SLACK·Δ₂ (a power of two: x/γ and n·γ are exact scalings)."""
    if not (sensitivity > 0 and math.isfinite(sensitivity)):
        raise ValueError(f"grid_step: sensitivity must be finite and > 0, got {sensitivity!r}")
    return 2.0 ** math.floor(math.log2(GRID_SLACK * sensitivity / math.sqrt(max(int(dim), 1))))


def _proposal_scale(sigma: float) -> tuple[int, int]:
    """(blocks, block): the proposal's scale t = blocks·block >= ⌊σ⌋ + 1 (CKS's rejection sampler is exact for any
    t > 0; t near σ keeps its acceptance high), block the largest power of two <= t/4 (1 for σ < 7), so that
    blocks ∈ [4, 8] once σ >= 7."""
    t0 = math.floor(sigma) + 1
    block = 2 ** max((t0 // 4).bit_length() - 1, 0)
    return -(-t0 // block), block


def _proposals(m: int, *, sigma: float, generator: torch.Generator, device: Device) -> tuple[Tensor, Tensor]:
    """m proposals of CKS's rejection sampler and whether each is accepted: ([m] integer-valued float64, [m] bool).

    Proposal: Y = ±M (sign from the top bit of a uniform), M = block·A + B with A = ⌊blocks·E⌋, E = −ln u ~ Exp(1)
    (P(A >= j) = exp(−j·block/t); u = 0 gives an infinite M, never accepted) and B uniform on {0, ..., block − 1}:
    P(Y = y) ∝ exp(−A·block/t) for y ≠ 0, and twice that at 0 (both signs). CKS accept with
    exp(−(|y| − σ²/t)²/(2σ²)) for a DLap(t) proposal ∝ exp(−|y|/t); ours lacks the factor exp(−B/t), so it is moved
    into the acceptance, exp(−(M − σ²/t)²/(2σ²) − B/t) <= 1, halved at y = 0 (CKS reject (−, 0) instead): the
    accepted law is N_Z(0, σ²). B (the top bits of a 53-bit uniform; block a power of two) is exactly uniform, and
    A has few likely values (ratio exp(−block/t) >= e^−1/4): each of its probabilities is off by ~2^−53 absolute
    (relative: ~1e-15 near 0, <= ~1e-12 for |y| <= 6σ; ⌊t·E⌋ from one uniform would be off by ~t·2^−52 relative,
    with holes in its tail). The acceptance uniform is the third uniform's 52 bits below its sign bit: 3 uniforms,
    1 log, 1 exp a proposal.
    """
    blocks, block = _proposal_scale(sigma)
    t = float(blocks * block)
    u = torch.rand((3, m), generator=generator, device=device, dtype=torch.float64)
    mag = u[0].log_().mul_(-float(blocks)).floor_().mul_(float(block))
    b = u[1].mul_(float(block)).floor_()  # block is a power of two: u·block < block, each value 2^53/block times
    mag.add_(b)
    sign = u[2] - 0.5
    w = u[2].mul_(2.0).frac_()  # exact: the 52 bits below the sign bit, uniform on [0, 1)
    p = (mag - sigma * sigma / t).square_().mul_(-0.5 / (sigma * sigma)).sub_(b.mul_(1.0 / t)).exp_()
    p = torch.where(mag == 0, p * 0.5, p)
    return mag.copysign_(sign), w < p


def discrete_gaussian_f64(n: int, *, sigma: float, generator: torch.Generator, device: Device) -> Tensor:
    """[n] integer-valued float64 i.i.d. discrete Gaussian N_Z(0, σ²): P(z) ∝ exp(−z²/(2σ²)) on the integers.

    Canonne, Kamath & Steinke 2020's rejection sampler (``_proposals``), vectorised: a round draws ~n/0.62 proposals
    and keeps the first n accepted ones (the accepted values of i.i.d. proposals are i.i.d. N_Z(0, σ²)); another
    round draws for what is missing (rare on CUDA for σ >= 7 and large n: one host sync; on the CPU rounds hold at
    most 65,536 proposals, which keeps them in cache). How many rounds and proposals depends on the draws only, never
    on data. Float64 limits, none data-dependent: acceptance probabilities to ~1e-16 relative, proposals as in
    ``_proposals``, and the 52-bit acceptance uniform never accepts a probability < 2^−52, which cuts the support at
    |z| ≈ σ + 8.5σ (N_Z's mass beyond: < 1e-20).
    """
    if not (sigma > 0 and math.isfinite(sigma)) or sigma >= _MAX_SIGMA:
        raise ValueError(f"discrete_gaussian: sigma must be in (0, 2^46), got {sigma!r}")
    rate = 0.62 if sigma >= 7.0 else 0.45  # a little under the acceptance per proposal (>= 0.65 for σ >= 7)
    chunk = _CPU_CHUNK if torch.device(device).type == "cpu" else n + n  # (CPU: temporaries that stay in cache)
    out, done = torch.empty(n, dtype=torch.float64, device=device), 0
    while done < n:
        y, ok = _proposals(min(int((n - done) / rate) + 64, chunk), sigma=sigma, generator=generator, device=device)
        got = y[ok][: n - done]
        out[done: done + got.numel()] = got
        done += got.numel()
    return out


def discrete_gaussian(n: int, *, sigma: float, generator: torch.Generator, device: Device) -> Tensor:
    """[n] int64 i.i.d. discrete Gaussian N_Z(0, σ²) (``discrete_gaussian_f64``)."""
    return discrete_gaussian_f64(n, sigma=sigma, generator=generator, device=device).to(torch.int64)


def snapped_release(x: Tensor, *, std: float, sensitivity: float, generator: torch.Generator,
                    released_dim: int | None = None) -> Tensor:
    """The secure release of ``x`` (any shape, e.g. [k, D]): γ·(round(x/γ) + Z), Z ~ N_Z(0, (std/γ)²) i.i.d.,
    γ = ``grid_step(sensitivity=Δ₂, dim=d)``, d = ``released_dim`` (default x.numel(); with several blocks
    released by one mechanism, e.g. the shards of a distributed step, the total, so that every block uses one γ).

    x is mapped to the integer lattice (float64 x/γ, clamped to ±2^51, rounded: a clamp and a rounding to nearest
    move each coordinate of a difference by at most 1, so the lattice vector's ℓ2 sensitivity is at most
    Δ₂/γ + √d <= (1 + GRID_SLACK)·Δ₂/γ), the integer noise is added exactly (integer-valued float64 below 2^53),
    and the released tensor is computed from that integer alone (times γ, then cast to x.dtype): its value, and
    every bit of it, is a function of round(x/γ) + Z only, so no floating-point artefact of a continuous sampler
    reaches it. Variance per coordinate: std² (the discrete Gaussian's deficit is O(exp(−2π²s²)), s = std/γ >=
    1024·σ here). In float32 the values are multiples of γ too (γ·n rounded to 24 bits stays one when |n| >= 2^24).
    """
    d = x.numel() if released_dim is None else released_dim
    gamma = grid_step(sensitivity=sensitivity, dim=d)
    lattice = x.to(torch.float64, copy=True).mul_(1.0 / gamma).clamp_(-_LATTICE_LIMIT, _LATTICE_LIMIT).round_()
    z = discrete_gaussian_f64(x.numel(), sigma=std / gamma, generator=generator, device=x.device)
    return lattice.add_(z.view(x.shape)).mul_(gamma).to(x.dtype)


def noisy(x: Tensor, *, std: float, sensitivity: float, noise: str, generator: torch.Generator,
          released_dim: int | None = None) -> Tensor:
    """x + noise of std ``std`` on every coordinate (x: any shape, e.g. [k, D]): ``noise`` = ``gaussian``:
    x + ``gaussian_noise`` (the default's exact draws); ``secure``: ``snapped_release``."""
    if noise == "secure":
        return snapped_release(x, std=std, sensitivity=sensitivity, generator=generator, released_dim=released_dim)
    if noise != "gaussian":
        raise ValueError(f"noise: expected one of {', '.join(NOISES)}, got {noise!r}")
    return x + gaussian_noise(x.shape, std=std, generator=generator, device=x.device, dtype=x.dtype)
