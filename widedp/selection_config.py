"""Config sections of the Gaussian mechanisms over row contributions (issue 13): ``dp.selection: {name:
gaussian_threshold}`` and the one-shot pre-selection ``dp.preselect``. (The other selections' configs are in
``widedp.config``, which imports these.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from widedp.configtools import positive
from widedp.errors import ConfigError


def _one_threshold(section: str, threshold: float | None, threshold_sigmas: float | None) -> None:
    if threshold is not None and threshold_sigmas is not None:
        raise ConfigError(f"{section}: give at most one of threshold or threshold_sigmas")


def _tau(threshold: float | None, threshold_sigmas: float | None, sigma: float) -> float:
    if threshold is not None:
        return threshold
    return (1.0 if threshold_sigmas is None else threshold_sigmas) * sigma


@dataclass(frozen=True)
class GaussianThresholdSelectionConfig:
    """Gaussian contribution thresholding (DP-AdaFEST-style, ℓ2-normalised contributions).

    Each sample's contribution vector over rows (1/√r on each of the r rows it touched: ℓ2 norm 1) is summed over
    the batch, N(0, sigma²) is added to every row's count (untouched rows included) and the rows whose noisy count
    exceeds the threshold are selected. A Gaussian mechanism of ℓ2 sensitivity 1 on the step's batch: it folds into
    the gradient noise (1/σ_eff² = 1/σ² + 1/sigma²).

    Args:
        sigma: σ_sel, the noise std in units of the count sensitivity (1).
        threshold: τ in count units; or ``threshold_sigmas`` c: τ = c·sigma (neither: τ = sigma).
        max_rows: at most this many rows per step: when more pass, a uniformly random subset of them (a
            data-independent rule: post-processing, free). null = no cap.
    """

    name: Literal["gaussian_threshold"] = "gaussian_threshold"
    sigma: float = 5.0
    threshold: float | None = None
    threshold_sigmas: float | None = None
    max_rows: int | None = None

    def __post_init__(self) -> None:
        positive("dp.selection.sigma", self.sigma)
        _one_threshold("dp.selection", self.threshold, self.threshold_sigmas)
        if self.max_rows is not None:
            positive("dp.selection.max_rows", self.max_rows)

    @property
    def tau(self) -> float:
        """τ in count units."""
        return _tau(self.threshold, self.threshold_sigmas, self.sigma)


@dataclass(frozen=True)
class PreselectConfig:
    """One-shot DP pre-selection of rows (DP-FEST): before the first step, every training sample's contribution
    vector (ℓ2-normalised as in ``gaussian_threshold``) is summed over the WHOLE training set, N(0, sigma²) is added
    to every row's count, and the ``rows`` largest noisy counts above the threshold are kept; the step then ranges
    over those rows only (the others stay frozen). Charged once: a Gaussian mechanism of ℓ2 sensitivity 1 at
    sampling rate 1.

    Args:
        rows: K, the most rows kept.
        sigma: noise std in units of the count sensitivity (1).
        threshold: τ in count units; or ``threshold_sigmas`` c: τ = c·sigma (neither: τ = sigma).
    """

    rows: int = 1000
    sigma: float = 10.0
    threshold: float | None = None
    threshold_sigmas: float | None = None

    def __post_init__(self) -> None:
        positive("dp.preselect.rows", self.rows)
        positive("dp.preselect.sigma", self.sigma)
        _one_threshold("dp.preselect", self.threshold, self.threshold_sigmas)

    @property
    def tau(self) -> float:
        return _tau(self.threshold, self.threshold_sigmas, self.sigma)
