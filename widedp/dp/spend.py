"""What each mechanism spent: small frozen records, composed by the accountant (widedp.accounting).

One DP step emits a ``StepSpend``: the mechanisms that looked at the same Poisson batch (sampling rate q), to be
composed *jointly* inside the step and amplified by sampling once (privacy.md §3).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GaussianSpend:
    """Gaussian noise with std ``noise_multiplier * sensitivity`` on an L2-sensitivity-``sensitivity`` query."""

    noise_multiplier: float
    sensitivity: float = 1.0


#: Why the PLD accountant refuses ``DiscreteGaussianSpend`` (the config's error for dp.noise: secure with pld too).
DISCRETE_PLD_REFUSED = ("dp.accountant: pld does not cover dp.noise: secure (the discrete Gaussian's privacy-loss "
                        "distribution is not the continuous Gaussian's; widedp bounds it by RDP only); set "
                        "dp.accountant: rdp")


@dataclass(frozen=True)
class DiscreteGaussianSpend:
    """The step's noise under ``dp.noise: secure`` (``widedp.dp.noise.snapped_release``): Δ̂ rounded onto a grid γ
    with γ·√d <= ``grid_slack``·Δ₂ (d coordinates released), plus discrete Gaussian noise of std
    ``noise_multiplier * sensitivity`` on that grid.

    The rounded vector's ℓ2 sensitivity is at most (1 + grid_slack)·Δ₂, and the multivariate discrete Gaussian
    satisfies the continuous Gaussian's RDP bound α·Δ²/(2s²) for integer shifts of ℓ2 norm <= Δ (Canonne, Kamath &
    Steinke 2020, Thm. 14), so the accountant charges a Gaussian RDP curve of noise multiplier
    ``effective_multiplier`` = σ / (1 + grid_slack) — by RDP only, with the general subsampling bound (the exact
    sampled-Gaussian RDP and the PLD are the continuous Gaussian's: ``widedp.accounting.parts``).
    """

    noise_multiplier: float
    sensitivity: float = 1.0
    grid_slack: float = 2.0**-10

    @property
    def effective_multiplier(self) -> float:
        return self.noise_multiplier / (1.0 + self.grid_slack)


@dataclass(frozen=True)
class GaussianSelectionSpend:
    """A selection that is itself a Gaussian mechanism on the step's batch: N(0, (noise_multiplier·sensitivity)²) on
    every coordinate of an L2-sensitivity-``sensitivity`` query (Gaussian contribution thresholding: noise on every
    row's contribution count, sensitivity 1; rows above the threshold are selected — post-processing).

    The accountant folds it with the step's ``GaussianSpend``: two Gaussians on the same batch are one Gaussian with
    1/σ_eff² = 1/σ² + 1/σ_sel² (exact, not a bound), amplified by sampling once."""

    noise_multiplier: float
    sensitivity: float = 1.0


@dataclass(frozen=True)
class ExponentialSpend:
    """``picks`` exponential-mechanism picks (Gumbel top-k), each ``epsilon``-DP; bounded-range (Cesar & Rogers).
    With ``bounded_range=False``: ``picks`` releases that are only pure ``epsilon``-DP (Laplace noise, a noisy max
    with Laplace noise; the convex algorithms)."""

    epsilon: float
    picks: int
    bounded_range: bool = True


@dataclass(frozen=True)
class SparseVectorSpend:
    """Sparse vector with cutoff c: ``cutoff`` segments each ``epsilon``-DP (pure), charged whether or not the
    segment ended in an above-threshold answer; plus ``cutoff`` Laplace releases of ``epsilon_release`` each when
    the noisy values are released (0 when they are not)."""

    epsilon: float
    cutoff: int
    epsilon_release: float = 0.0


@dataclass(frozen=True)
class FreeSpend:
    """A data-independent mechanism (uniform, random sparsification, all rows): costs nothing."""

    name: str


Spend = (GaussianSpend | DiscreteGaussianSpend | GaussianSelectionSpend | ExponentialSpend | SparseVectorSpend
         | FreeSpend)


@dataclass(frozen=True)
class StepSpend:
    """Everything one step spent on one Poisson(q) batch; ``parts`` are composed jointly before amplification."""

    sampling_rate: float
    parts: tuple[Spend, ...]
