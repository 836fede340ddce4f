"""The ``dp.selection`` section (one frozen dataclass per mechanism, ``SELECTIONS``: name -> class; a mechanism whose
privacy can be calibrated names its knob by ``with_privacy(x)``, ε increasing in x) and the one-shot
pre-selection ``dp.preselect``. ``widedp.config`` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal, Protocol

from widedp.config.tools import k_or_gamma, positive
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
        threshold_sigmas: c, for τ = c·sigma (instead of ``threshold``).
        max_rows: at most this many rows per step: when more pass, a uniformly random subset of them (a
            data-independent rule: post-processing, free). null = no cap.
        public_head: H: the first H rows of each table (with a public vocabulary in frequency order, e.g.
            ``data.vocabulary: wordfreq``: its H most frequent words) are selected every step for free and left out
            of the contribution counts, which are then normalised over each unit's other rows; the threshold ranges
            over the other rows (``max_rows`` caps those picks). null = no head.
    """

    name: Literal["gaussian_threshold"] = "gaussian_threshold"
    selector: ClassVar[str] = "widedp.dp.selection.gaussian:GaussianThresholdSelector"
    privacy_keys: ClassVar[tuple[str, ...]] = ("sigma",)  # a --set switch to it must give them (config.tools)
    uses_tables: ClassVar[bool] = True  # its selector takes the model's table starts (make_selector)
    sigma: float = 5.0
    threshold: float | None = None
    threshold_sigmas: float | None = None
    max_rows: int | None = None
    public_head: int | None = None

    def __post_init__(self) -> None:
        positive("dp.selection.sigma", self.sigma)
        _one_threshold("dp.selection", self.threshold, self.threshold_sigmas)
        if self.max_rows is not None:
            positive("dp.selection.max_rows", self.max_rows)
        if self.public_head is not None:
            positive("dp.selection.public_head", self.public_head)

    @property
    def tau(self) -> float:
        """τ in count units."""
        return _tau(self.threshold, self.threshold_sigmas, self.sigma)

    def with_privacy(self, x: float) -> GaussianThresholdSelectionConfig:
        """The knob calibration moves: x = 1/sigma (ε grows with it); ``threshold_sigmas`` keeps τ = c·sigma."""
        return replace(self, sigma=1.0 / x)


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
        threshold_sigmas: c, for τ = c·sigma (instead of ``threshold``).
        table_rows: optional per-table caps [K_1, ...] in the model's table order (CBOW untied: input, output),
            summing to ``rows``: the K_t largest noisy counts of each table (post-processing of the same noisy
            counts; a public split). null: the K largest over all rows pooled.
    """

    rows: int = 1000
    sigma: float = 10.0
    threshold: float | None = None
    threshold_sigmas: float | None = None
    table_rows: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        positive("dp.preselect.rows", self.rows)
        positive("dp.preselect.sigma", self.sigma)
        _one_threshold("dp.preselect", self.threshold, self.threshold_sigmas)
        if self.table_rows is not None:
            for k in self.table_rows:
                positive("dp.preselect.table_rows", k)
            if sum(self.table_rows) != self.rows:
                raise ConfigError(f"dp.preselect.table_rows: {list(self.table_rows)} sums to {sum(self.table_rows)}, "
                                  f"not dp.preselect.rows ({self.rows})")

    @property
    def tau(self) -> float:
        return _tau(self.threshold, self.threshold_sigmas, self.sigma)


@dataclass(frozen=True)
class ExponentialSelectionConfig:
    """Exponential mechanism, k picks without replacement (Gumbel top-k over ALL rows).

    Args:
        k: rows selected per step; or ``gamma``: the fraction of all rows (k = max(1, round(gamma * R))).
        gamma: the fraction of all R rows selected per step (instead of ``k``).
        epsilon: epsilon'' of each pick.
        score_clip: S0; a row's score is min(||g_r||_2, S0) (``score: count``: min(n_r, S0)).
        method: ``auto`` (``brute`` below 4,096 rows or where R <= 4(rows touched + k), else ``sparse``), ``sparse``
            (always O(rows touched + k): order statistics for the untouched rows) or ``brute`` (O(R) reference);
            the same output law.
        score: ``norm`` (gradient norms, sensitivity min(S0, S1/b)) or ``count`` (n_r, the number of samples that
            touched row r: scale-free, sensitivity min(S0, 1); needs score_clip >= 1).
    """

    name: Literal["exponential"] = "exponential"
    selector: ClassVar[str] = "widedp.dp.selection.exponential:ExponentialSelector"
    privacy_keys: ClassVar[tuple[str, ...]] = ("epsilon",)
    k: int | None = None
    gamma: float | None = None
    epsilon: float = 1.0
    score_clip: float = 0.1
    method: Literal["auto", "sparse", "brute"] = "auto"
    score: Literal["norm", "count"] = "norm"

    def __post_init__(self) -> None:
        k_or_gamma("dp.selection", self.k, self.gamma)
        positive("dp.selection.epsilon", self.epsilon)
        positive("dp.selection.score_clip", self.score_clip)
        _count_clip(self.score, self.score_clip)

    def with_privacy(self, x: float) -> ExponentialSelectionConfig:
        """The knob calibration moves: x = epsilon'' of each pick."""
        return replace(self, epsilon=x)


def _count_clip(score: str, score_clip: float) -> None:
    if score == "count" and score_clip < 1:
        raise ConfigError(f"dp.selection.score_clip: caps the counts with score: count, so it must be >= 1 "
                          f"(a count cap, e.g. the batch size), got {score_clip}")


@dataclass(frozen=True)
class SparseVectorSelectionConfig:
    """Sparse vector technique (AboveThreshold with cutoff c) over ALL rows in a fresh random order.

    Args:
        epsilon: budget of one segment (one above-threshold answer); threshold_fraction of it goes to the
            threshold noise, the rest to the query noise.
        threshold: T, in score units (scores are min(||g_r||, S0)).
        cutoff: c, the number of rows selected at most (each selected row ends a segment; charged c segments).
        threshold_fraction: the share of ``epsilon`` spent on the threshold noise.
        score_clip: S0.
        release_values: also release u_r + Lap (NumericSparse) — costs ``epsilon_release`` per selected row.
        epsilon_release: ε of each released value (with ``release_values``).
        method: ``sparse`` (O(rows touched + c): geometric skips over the untouched rows) or ``brute`` (O(R)
            reference); the same output law.
        score: ``norm`` or ``count`` (as for exponential).
    """

    name: Literal["sparse_vector"] = "sparse_vector"
    selector: ClassVar[str] = "widedp.dp.selection.svt:SparseVectorSelector"
    privacy_keys: ClassVar[tuple[str, ...]] = ("epsilon",)
    epsilon: float = 1.0
    threshold: float = 0.05
    cutoff: int = 1
    threshold_fraction: float = 0.5
    score_clip: float = 0.1
    # NumericSparse: also release the noisy values
    release_values: bool = False
    epsilon_release: float = 0.0
    method: Literal["sparse", "brute"] = "sparse"
    score: Literal["norm", "count"] = "norm"

    def __post_init__(self) -> None:
        positive("dp.selection.epsilon", self.epsilon)
        positive("dp.selection.cutoff", self.cutoff)
        positive("dp.selection.score_clip", self.score_clip)
        _count_clip(self.score, self.score_clip)
        if not 0 < self.threshold_fraction < 1:
            raise ConfigError(f"dp.selection.threshold_fraction: must be in (0, 1), got {self.threshold_fraction}")
        if self.release_values and self.epsilon_release <= 0:
            raise ConfigError("dp.selection.epsilon_release: must be > 0 when release_values is true")

    def with_privacy(self, x: float) -> SparseVectorSelectionConfig:
        """The knob calibration moves: x = the epsilon of one segment."""
        return replace(self, epsilon=x)


@dataclass(frozen=True)
class UniformSelectionConfig:
    """k rows uniformly at random (data-independent, free). k or gamma as for exponential.

    Args:
        k: rows selected per step; or ``gamma``.
        gamma: the fraction of all R rows selected per step (instead of ``k``).
    """

    name: Literal["uniform"] = "uniform"
    selector: ClassVar[str] = "widedp.dp.selection.free:UniformSelector"
    k: int | None = None
    gamma: float | None = None

    def __post_init__(self) -> None:
        k_or_gamma("dp.selection", self.k, self.gamma)


@dataclass(frozen=True)
class PublicTopSelectionConfig:
    """The first ``rows_per_table`` rows of each table, every step: data-independent, free. With a public
    vocabulary in frequency order (``data.vocabulary: wordfreq``; ``file:PATH``: the list's order) these are its
    most frequent words; the step is DP-SGD on them and the other rows never change (``widedp.dp.selection.public``).

    Args:
        rows_per_table: H, the head rows of each table (all of a smaller table).
    """

    name: Literal["public_top"] = "public_top"
    selector: ClassVar[str] = "widedp.dp.selection.public:PublicTopSelector"
    uses_tables: ClassVar[bool] = True
    rows_per_table: int = 1000

    def __post_init__(self) -> None:
        positive("dp.selection.rows_per_table", self.rows_per_table)


@dataclass(frozen=True)
class RandomSparsificationConfig:
    """Random sparsification (Zhu & Blaschko): one random row mask per epoch, data-independent (free).

    The sparsification rate r(e) of epoch e (0-based, E epochs) is ``final_rate * e / (E - 1)`` with gradual
    cooling, ``final_rate`` from the first epoch without; a fraction 1 - r(e) of all rows is kept.

    Args:
        final_rate: r*, the fraction of rows dropped in the last epoch.
        gradual_cooling: r(e) grows linearly from 0 to ``final_rate`` (true) or is ``final_rate`` from the first
            epoch (false).
    """

    name: Literal["random_sparsification"] = "random_sparsification"
    selector: ClassVar[str] = "widedp.dp.selection.free:RandomSparsificationSelector"
    final_rate: float = 0.9
    gradual_cooling: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.final_rate < 1:
            raise ConfigError(f"dp.selection.final_rate: must be in [0, 1), got {self.final_rate}")


@dataclass(frozen=True)
class AllRowsConfig:
    """Every row selected: DP-SGD on the same model."""

    name: Literal["all"] = "all"
    selector: ClassVar[str] = "widedp.dp.selection.free:AllRowsSelector"


#: ``dp.selection.method: fast`` meant "O(U + k), except brute force on small row spaces" (exponential) and
#: "O(U + c)" (sparse vector); renamed to what each does.
_RENAMED_METHODS = {
    "exponential": "auto (the O(rows touched + k) path, brute force below 4,096 rows), sparse or brute",
    "sparse_vector": "sparse (O(rows touched + c)) or brute",
}


def refuse_renamed_method(name: str, raw: dict) -> None:
    """One line naming ``dp.selection.method`` and its new values when a config still says ``fast``."""
    if raw.get("method") == "fast" and name in _RENAMED_METHODS:
        raise ConfigError(f"dp.selection.method: 'fast' was renamed; use {_RENAMED_METHODS[name]}")


class SelectionConfig(Protocol):
    """What every ``dp.selection`` class has: its ``name`` and ``selector``, the import path of its selector class
    (whose ``from_config(cfg, num_rows=R)`` builds it). A new mechanism is its selector file, its config class and
    one line in ``SELECTIONS``. A class with privacy parameters names them in ``privacy_keys`` (a ClassVar; none
    when absent): ``--set dp.selection.name=`` switching to it must give them (``widedp.config.tools``). A class
    whose selector needs the model's table layout sets ``uses_tables`` (a ClassVar): its ``from_config`` then also
    takes ``table_starts``."""

    name: str
    selector: ClassVar[str]


SELECTIONS: dict[str, type] = {
    "exponential": ExponentialSelectionConfig,
    "sparse_vector": SparseVectorSelectionConfig,
    "uniform": UniformSelectionConfig,
    "random_sparsification": RandomSparsificationConfig,
    "all": AllRowsConfig,
    "gaussian_threshold": GaussianThresholdSelectionConfig,
    "public_top": PublicTopSelectionConfig,
}
