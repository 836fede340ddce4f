"""Noise of the DP step: the Gaussian and the L2 sensitivity it is calibrated to (privacy.md §1, step 5), and the
Exp / Gumbel / Laplace draws of the selection mechanisms. All randomness from an explicit generator."""

from __future__ import annotations

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
