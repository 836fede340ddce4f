"""Gaussian noise of the DP step and the L2 sensitivity it is calibrated to (privacy.md §1, step 5)."""

from __future__ import annotations

import torch
from torch import Tensor


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
    device: torch.device | str,
    dtype: torch.dtype,
) -> Tensor:
    """N(0, std²) i.i.d. of the given shape, drawn from ``generator``."""
    return torch.randn(shape, generator=generator, device=device, dtype=dtype).mul_(std)
