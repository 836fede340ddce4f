"""Shared pieces of the convex algorithms: spend records of pure-DP / zCDP mechanisms and their conversion to the
accountant's records, epsilon of a ledger, per-sample clipping of GLM gradients, and the result type.

Adjacency everywhere is add/remove of one training example (the accountant's). Sensitivities are derived for the
quantity each mechanism actually computes on D and on D' = D +- z, each with its OWN size when the code divides by
the dataset's size (``mean_sensitivity``): a sum of clipped per-example terms divided by a fixed public denominator
(a configured batch size b) moves by <= clip / b, but a mean over the dataset's own n moves by up to 2 clip / n
(the denominator changes too). The training-set size n itself (noise scales, sampling rates) is treated as public.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from widedp import accounting
from widedp.dp.spend import ExponentialSpend, GaussianSpend, SparseVectorSpend, StepSpend
from widedp.models import glm

# ------------------------------------------------------------------------------------------------ spend records


@dataclass(frozen=True)
class ZCDPGaussianSpend:
    """A Gaussian mechanism that is ``rho``-zCDP: noise std = sensitivity / sqrt(2 rho) (Bun & Steinke Prop. 1.6)."""

    rho: float


#: A pure eps-DP release run ``picks`` times (Laplace noise, report-noisy-max with Laplace noise) is
#: ``ExponentialSpend(eps, picks, bounded_range=False)``; a noisy max with Gumbel noise (the exponential mechanism)
#: is bounded-range (``bounded_range=True``).
ConvexSpend = ExponentialSpend | ZCDPGaussianSpend | GaussianSpend | SparseVectorSpend


def to_accountant(part: ConvexSpend) -> Any:
    """One of the records above as a record of ``widedp.dp.spend`` (which the accountant composes)."""
    if isinstance(part, ZCDPGaussianSpend):
        return GaussianSpend(noise_multiplier=1.0 / math.sqrt(2.0 * part.rho))
    return part


def step(parts: Sequence[ConvexSpend], *, sampling_rate: float = 1.0) -> StepSpend:
    """A StepSpend (accountant records) of ``parts`` on one Poisson(q) batch (q = 1: the whole dataset)."""
    return StepSpend(sampling_rate=float(sampling_rate), parts=tuple(to_accountant(p) for p in parts))


def collapse_full_batch(ledger: accounting.Ledger) -> accounting.Ledger:
    """An equivalent ledger with every full-batch (q = 1) record merged into ONE step.

    With q = 1 composing mechanisms inside a step and across steps is the same adaptive composition, so this is
    exact; it lets the PLD accountant handle runs whose Gaussian noise changes every iteration (DP-AGD) with one
    FFT instead of one per distinct record. Subsampled records (q < 1) are kept as they are.
    """
    parts: list[Any] = []
    out = accounting.Ledger()
    for s, n in ledger.runs:
        if s.sampling_rate >= 1.0:
            for p in s.parts:
                if isinstance(p, GaussianSpend):
                    parts.append(GaussianSpend(p.noise_multiplier / math.sqrt(n)))  # n equal Gaussians = one
                elif isinstance(p, ExponentialSpend):
                    parts.append(ExponentialSpend(p.epsilon, p.picks * n, p.bounded_range))
                elif isinstance(p, SparseVectorSpend):
                    parts.append(SparseVectorSpend(p.epsilon, p.cutoff * n, p.epsilon_release))
                else:
                    parts.append(p)
        else:
            out.add(s, n)
    if parts:
        out.add(StepSpend(1.0, tuple(parts)))
    return out


def ledger_epsilon(ledger: accounting.Ledger, *, delta: float, accountant: str = "pld") -> float:
    """eps at delta of everything in ``ledger`` (0 for an empty one)."""
    if ledger.steps == 0:
        return 0.0
    return accounting.epsilon(collapse_full_batch(ledger), delta=delta, accountant=accountant)  # type: ignore[arg-type]


def zcdp_rho_for(epsilon: float, delta: float) -> float:
    """The largest rho with rho + 2 sqrt(rho log(1/delta)) <= epsilon (Bun & Steinke Prop. 1.3; Lee & Kifer)."""
    ld = math.log(1.0 / delta)
    return (math.sqrt(ld + epsilon) - math.sqrt(ld)) ** 2


def zcdp_epsilon(rho: float, delta: float) -> float:
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))


# ------------------------------------------------------------------------------------------------------- GLM math


def mean_sensitivity(clip: float, *, n: int, denominator: float | None) -> float:
    """Add/remove sensitivity (in the norm ``clip`` bounds) of (1/den) sum_{i in batch} clip_C(g_i).

    ``denominator`` given (a fixed public number, e.g. the expected Poisson batch size b): the sums differ by one
    term, ||c_z|| <= C, so clip / b. ``denominator=None``: the mean over the dataset's own size, n on D and n +- 1
    on D'. Adding z to D (size n): mean' - mean = (c_z - mean) / (n + 1), and removing z from D (size n):
    mean - mean' = (c_z - mean) / (n - 1) with ||c_z - mean|| <= 2 C (n - 1) / n (mean includes c_z); both are
    <= 2 C / n, the bound charged (the 2 is attained up to (n-1)/n: all gradients aligned, c_z opposite).
    """
    if denominator is not None:
        return clip / denominator
    return 2.0 * clip / n



def clipped_residuals(w: torch.Tensor, data: glm.LabeledCSR, x_norms: torch.Tensor, clip: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample loss [n], residuals scaled so that each gradient x_i r_i^T has L2 norm <= clip: [n, K], and the
    fraction of samples clipped (scalar)."""
    loss, r = glm.residuals(w, data)
    norms = glm.grad_norms(data, r, x_norms)
    scale = torch.clamp(clip / norms.clamp_min(1e-30), max=1.0)
    return loss, r * scale[:, None], (scale < 1).double().mean()


def poisson_batch(n: int, q: float, generator: torch.Generator) -> torch.Tensor:
    """[m] indices of a Poisson(q) sample of range(n)."""
    if q >= 1.0:
        return torch.arange(n)
    return torch.nonzero(torch.rand(n, generator=generator) < q)[:, 0]


def laplace(shape: Sequence[int] | torch.Size, scale: float, generator: torch.Generator,
            dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Lap(scale) noise by inverse CDF from the explicit generator."""
    u = torch.rand(tuple(shape), generator=generator, dtype=torch.float64) - 0.5
    return (-scale * torch.sign(u) * torch.log1p(-2.0 * u.abs())).to(dtype)


def gumbel(shape: Sequence[int] | torch.Size, generator: torch.Generator, dtype: torch.dtype = torch.float64
           ) -> torch.Tensor:
    u = torch.rand(tuple(shape), generator=generator, dtype=torch.float64).clamp_min(1e-300)
    return (-torch.log(-torch.log(u))).to(dtype)


def gaussian(shape: Sequence[int] | torch.Size, std: float, generator: torch.Generator,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=generator, dtype=dtype) * std


# --------------------------------------------------------------------------------------------------------- result

#: Called every few iterations with (iteration, W, extra stats) -> None (the trainer logs train/test metrics).
Callback = Callable[[int, torch.Tensor, dict[str, Any]], None]


@dataclass
class ConvexResult:
    """What an algorithm returns: the final weights [d, K], its privacy ledger (accountant records), the number of
    iterations run, and algorithm-specific figures (calibrated noise, chosen steps, ...)."""

    w: torch.Tensor
    ledger: accounting.Ledger
    iterations: int
    info: dict[str, Any] = field(default_factory=dict)
