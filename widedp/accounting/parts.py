"""Reduce a ``StepSpend`` to the few numbers the accountants need (and validate it).

A step is Poisson(q) subsampling of the adaptive composition of its parts. For accounting, every part maps to a
worst-case (dominating) pair or an RDP curve:

- all ``GaussianSpend`` parts together are one Gaussian with noise multiplier ``(sum sigma_i^-2)^(-1/2)``
  (``noise_multiplier`` is already relative to ``sensitivity``, so ``sensitivity`` is not used);
- a ``DiscreteGaussianSpend`` (``dp.noise: secure``) folds in the same way at its ``effective_multiplier``
  σ/(1 + grid_slack) — as an RDP curve only: the discrete Gaussian meets the continuous one's RDP bound α/(2σ²) for
  integer shifts (Canonne, Kamath & Steinke 2020, Thm. 14) and RDP composition adds curves, but its privacy-loss
  distribution, and its subsampled RDP, are not the continuous Gaussian's. ``Costs.discrete`` marks such a step:
  the RDP accountant then subsamples it with the general bound and the PLD accountant refuses it;
- a ``GaussianSelectionSpend`` (Gaussian contribution thresholding) is a Gaussian mechanism on the same batch too:
  it folds into that Gaussian exactly. With ℓ2 sensitivities Δ_i and noise σ_iΔ_i, one add/remove moves the means by
  μ_i with ||μ_i|| <= Δ_i; the joint privacy loss is that of N(0, I) vs N(m, I) with ||m||² = Σ ||μ_i||²/(σ_iΔ_i)²
  <= Σ 1/σ_i², i.e. one Gaussian with multiplier σ_eff = (Σ σ_i^-2)^(-1/2) (``joint_sigma``), and the same holds
  after Poisson subsampling of the whole step (the mixture pair is a function of m alone, rotation invariance);
  adaptivity (the gradient noise lands on the rows the selection chose) does not change either pair;
- an ``ExponentialSpend`` is ``picks`` mechanisms each ``epsilon``-bounded-range (``bounded_range=True``) or
  ``epsilon``-DP (pure, ``bounded_range=False``);
- a ``SparseVectorSpend`` is ``cutoff`` pure ``epsilon``-DP segments plus ``cutoff`` pure ``epsilon_release``-DP
  Laplace releases;
- a ``FreeSpend`` costs nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from widedp.dp.spend import (
    DiscreteGaussianSpend,
    ExponentialSpend,
    FreeSpend,
    GaussianSelectionSpend,
    GaussianSpend,
    SparseVectorSpend,
    StepSpend,
)
from widedp.errors import ConfigError


@dataclass(frozen=True)
class Costs:
    """A step in accounting terms.

    Attributes:
        q: Poisson sampling rate in (0, 1].
        sigma: noise multiplier of the gradient noise (all ``GaussianSpend`` parts folded), or None.
        bounded_range: ((epsilon, count), ...): ``count`` mechanisms each epsilon-bounded-range.
        pure: ((epsilon, count), ...): ``count`` mechanisms each pure epsilon-DP.
        selection_sigma: noise multiplier of the selection's Gaussian mechanisms (``GaussianSelectionSpend``,
            folded), or None.
        discrete: the step's noise includes a ``DiscreteGaussianSpend`` (folded into ``sigma`` at its effective
            multiplier): only its RDP curve is known, so no accountant may use the continuous Gaussian's exact
            subsampled RDP or PLD for it.

    The accountants use ``joint_sigma`` (every Gaussian of the step folded) and ``is_gaussian``.
    """

    q: float
    sigma: float | None
    bounded_range: tuple[tuple[float, int], ...] = ()
    pure: tuple[tuple[float, int], ...] = ()
    selection_sigma: float | None = None
    discrete: bool = False

    @property
    def joint_sigma(self) -> float | None:
        """The one Gaussian equivalent to all the step's Gaussians: (Σ σ_i^-2)^(-1/2), None when there are none."""
        inv = sum(s**-2 for s in (self.sigma, self.selection_sigma) if s is not None)
        return inv**-0.5 if inv > 0 else None

    @property
    def is_gaussian(self) -> bool:
        """No mechanism other than Gaussians (then the step is exactly one subsampled Gaussian, or free)."""
        return not (self.bounded_range or self.pure)

    @property
    def has_selection(self) -> bool:
        return bool(self.bounded_range or self.pure) or self.selection_sigma is not None

    @property
    def is_free(self) -> bool:
        return self.joint_sigma is None and self.is_gaussian

    @property
    def exact_gaussian(self) -> bool:
        """Exactly one subsampled continuous Gaussian (Gaussian selections folded in), or free: the accountants'
        closed forms (sampled-Gaussian RDP, Gaussian PLD) apply."""
        return self.is_gaussian and not self.discrete

    def noise_only(self) -> Costs:
        return Costs(self.q, self.sigma, discrete=self.discrete)

    def selection_only(self) -> Costs:
        return Costs(self.q, None, self.bounded_range, self.pure, self.selection_sigma)


def _inverse_variance(key: str, s: float) -> float:
    """1/σ² of a Gaussian part (0 for σ = inf: no noise budget spent); σ must be > 0."""
    if not (isinstance(s, (int, float)) and s > 0):
        raise ConfigError(f"{key}: must be > 0, got {s!r}")
    return 1.0 / float(s) ** 2 if math.isfinite(s) else 0.0


def _check_eps(name: str, eps: float) -> None:
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ConfigError(f"{name}: must be a finite number >= 0, got {eps!r}")


def _check_count(name: str, n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"{name}: must be an integer >= 0, got {n!r}")


def costs_of(step: StepSpend) -> Costs:
    """Validate ``step`` and reduce it to ``Costs`` (equal steps give equal, hashable ``Costs``)."""
    if not isinstance(step, StepSpend):
        raise ConfigError(f"accounting: expected a StepSpend, got {type(step).__name__}")
    q = step.sampling_rate
    if not (isinstance(q, (int, float)) and 0 < q <= 1):
        raise ConfigError(f"sampling_rate: must be in (0, 1], got {q!r}")
    inv_var, inv_var_sel, discrete = 0.0, 0.0, False
    br: dict[float, int] = {}
    pure: dict[float, int] = {}
    for part in step.parts:
        if isinstance(part, GaussianSpend):
            inv_var += _inverse_variance("noise_multiplier", part.noise_multiplier)
        elif isinstance(part, DiscreteGaussianSpend):
            _check_eps("discrete_gaussian grid_slack", part.grid_slack)
            inv_var += _inverse_variance("noise_multiplier", part.noise_multiplier) * (1.0 + part.grid_slack) ** 2
            discrete = True
        elif isinstance(part, GaussianSelectionSpend):
            inv_var_sel += _inverse_variance("selection noise_multiplier", part.noise_multiplier)
        elif isinstance(part, ExponentialSpend):
            _check_eps("exponential epsilon", part.epsilon)
            _check_count("exponential picks", part.picks)
            target = br if part.bounded_range else pure
            if part.epsilon > 0 and part.picks > 0:
                target[float(part.epsilon)] = target.get(float(part.epsilon), 0) + part.picks
        elif isinstance(part, SparseVectorSpend):
            _check_eps("sparse_vector epsilon", part.epsilon)
            _check_eps("sparse_vector epsilon_release", part.epsilon_release)
            _check_count("sparse_vector cutoff", part.cutoff)
            for eps in (part.epsilon, part.epsilon_release):
                if eps > 0 and part.cutoff > 0:
                    pure[float(eps)] = pure.get(float(eps), 0) + part.cutoff
        elif isinstance(part, FreeSpend):
            continue
        else:
            raise ConfigError(f"accounting: unknown spend record {part!r}")
    sigma = inv_var**-0.5 if inv_var > 0 else None
    sel_sigma = inv_var_sel**-0.5 if inv_var_sel > 0 else None
    return Costs(float(q), sigma, tuple(sorted(br.items())), tuple(sorted(pure.items())), sel_sigma, discrete)
