"""Row selection of the DP step (paper Alg. 3, step 3) — swappable mechanisms over ALL R rows (privacy.md §2).

Every selector sees the rows the batch touched and their scores (``Selector.score_kind``: gradient norms
u_r = min(||ĝ_r||, S0), sample counts, or ℓ2-normalised contribution counts; ``widedp.dp.selection.scores``); rows the
batch did not touch have score 0 and stay candidates (selecting only among touched rows would publish which rows
were touched). Each selector returns the ``Spend`` it charges.

- ``ExponentialSelector``: k exponential-mechanism picks = Gumbel top-k of ε''·u/(2Δu) + Gumbel(0,1). ``fast`` is
  O(U + k) and never touches O(R) memory: the m = R − U untouched rows share score 0, so their largest Gumbel
  keys are order statistics (X_i ~ Exp(1); E_1 = X_1/m, E_i = E_{i-1} + X_i/(m−i+1); G_(i) = −ln E_i) attached to
  uniformly random distinct untouched ids (a random ORDER matters: attaching them in sorted id order is biased).
  ``brute`` (the reference) perturbs all R scores.
- ``SparseVectorSelector`` (``widedp.dp.selection.svt``): AboveThreshold with cutoff c over all rows in a fresh random
  order; ``fast`` is O(U + c) (geometric skips over the untouched rows), ``brute`` O(R).
- ``GaussianThresholdSelector`` (``widedp.dp.selection.gaussian``): contribution counts + N(0, σ_sel²) > τ over all
  rows, false positives drawn exactly in O(expected count); a Gaussian mechanism folded into the step's noise.
- ``UniformSelector``, ``RandomSparsificationSelector``, ``AllRowsSelector``: data-independent, free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from widedp.config import (
    AllRowsConfig,
    ExponentialSelectionConfig,
    GaussianThresholdSelectionConfig,
    RandomSparsificationConfig,
    SelectionConfig,
    SparseVectorSelectionConfig,
    UniformSelectionConfig,
)
from widedp.dp.noise import exponential, gumbel
from widedp.dp.selection.base import (
    _DENSE_FACTOR,
    ScoreKind,
    SelectionContext,
    Selector,
    dense_scores,
    member,
    sample_distinct,
)
from widedp.dp.selection.gaussian import GaussianThresholdSelector
from widedp.dp.selection.svt import SparseVectorSelector
from widedp.dp.spend import ExponentialSpend, FreeSpend, Spend
from widedp.errors import ConfigError

__all__ = [
    "AllRowsSelector",
    "ExponentialSelector",
    "GaussianThresholdSelector",
    "RandomSparsificationSelector",
    "ScoreKind",
    "SelectionContext",
    "Selector",
    "SparseVectorSelector",
    "UniformSelector",
    "gumbel_topk",
    "gumbel_topk_sparse",
    "make_selector",
    "member",
    "sample_distinct",
]

# ------------------------------------------------------------------------------------------------ primitives


def gumbel_topk(logits: Tensor, k: int, *, generator: torch.Generator) -> Tensor:
    """Brute-force Gumbel top-k along the last dim ([..., R] -> [..., k], in pick order) — the reference law of k
    sequential exponential-mechanism picks with P(r) ∝ exp(logits_r)."""
    keys = gumbel(tuple(logits.shape), generator=generator, device=logits.device, dtype=logits.dtype)
    return keys.add_(logits).topk(k, dim=-1).indices


def gumbel_topk_sparse(
    touched: Tensor, logits: Tensor, *, num_rows: int, k: int, generator: torch.Generator
) -> Tensor:
    """Same law as ``gumbel_topk`` on the dense [R] logits that are ``logits`` on ``touched`` and 0 elsewhere,
    in O(U + k): the top min(k, m) Gumbel keys of the m untouched rows as order statistics on random distinct ids.

    Returns [k] row ids in pick order.
    """
    dev, dt = touched.device, logits.dtype
    u = touched.numel()
    m = num_rows - u
    n = min(k, m)
    keys = gumbel((u,), generator=generator, device=dev, dtype=dt).add_(logits)
    ids = touched
    if n > 0:
        x = exponential((n,), generator=generator, device=dev, dtype=dt)
        g_untouched = x.div_(torch.arange(m, m - n, -1, device=dev, dtype=dt)).cumsum_(0).log_().neg_()
        keys = torch.cat([keys, g_untouched])
        ids = torch.cat([touched, sample_distinct(n, num_rows, exclude=touched, generator=generator, device=dev)])
    return ids.index_select(0, keys.topk(k).indices)


# ------------------------------------------------------------------------------------------------- selectors


def _num_picks(cfg: ExponentialSelectionConfig | UniformSelectionConfig, num_rows: int) -> int:
    k = cfg.k if cfg.k is not None else max(1, round(cfg.gamma * num_rows))
    if k > num_rows:
        raise ConfigError(f"dp.selection.k: {k} exceeds the number of rows R={num_rows}")
    return k


@dataclass(frozen=True)
class ExponentialSelector:
    """k exponential-mechanism picks of ε'' each, score sensitivity Δu; charged ``ExponentialSpend(ε'', k)``.

    ``brute_below``: the fast method still perturbs all rows when R <= this or R < 4(U + k) (the same law; fewer
    ops there).
    """

    k: int
    epsilon: float
    score_clip: float
    method: str = "fast"
    brute_below: int = 0
    score_kind: ScoreKind = "norm"

    def key_scale(self, score_sensitivity: float) -> float:
        """The factor of u_r in the Gumbel keys: ε'' / (2Δu)."""
        return self.epsilon / (2.0 * score_sensitivity)

    def select(
        self,
        touched: Tensor,
        scores: Tensor,
        *,
        num_rows: int,
        score_sensitivity: float,
        ctx: SelectionContext,
        generator: torch.Generator,
    ) -> tuple[Tensor, Spend]:
        logits = scores * self.key_scale(score_sensitivity)
        # the fast path's id sampler is O(R) itself when 4(U + k) > R: then brute force has fewer ops
        if self.method == "brute" or num_rows <= max(self.brute_below, _DENSE_FACTOR * (touched.numel() + self.k)):
            sel = gumbel_topk(dense_scores(touched, logits, num_rows), self.k, generator=generator)
        else:
            sel = gumbel_topk_sparse(touched, logits, num_rows=num_rows, k=self.k, generator=generator)
        return sel, ExponentialSpend(epsilon=self.epsilon, picks=self.k)


@dataclass(frozen=True)
class UniformSelector:
    """k distinct rows uniformly at random (data-independent, free)."""

    k: int
    score_clip: float | None = None  # no scores used
    score_kind: ScoreKind = "none"

    def select(
        self,
        touched: Tensor,
        scores: Tensor,
        *,
        num_rows: int,
        score_sensitivity: float,
        ctx: SelectionContext,
        generator: torch.Generator,
    ) -> tuple[Tensor, Spend]:
        empty = touched.new_zeros(0)
        sel = sample_distinct(self.k, num_rows, exclude=empty, generator=generator, device=touched.device)
        return sel, FreeSpend("uniform")


@dataclass(eq=False)
class RandomSparsificationSelector:
    """Zhu & Blaschko's random sparsification: one uniformly random mask per epoch keeping round((1 − r(e))·R)
    rows (at least 1), r(e) = final_rate·e/(E−1) with gradual cooling (final_rate when E = 1), final_rate
    without. The mask is a function of (the step generator's seed, epoch), cached for the epoch.
    """

    final_rate: float
    gradual_cooling: bool = True
    score_clip: float | None = None  # no scores used
    score_kind: ScoreKind = "none"
    _epoch: int | None = field(default=None, init=False, repr=False)
    _mask: Tensor | None = field(default=None, init=False, repr=False)

    def rate(self, ctx: SelectionContext) -> float:
        if not self.gradual_cooling or ctx.num_epochs <= 1:
            return self.final_rate
        return self.final_rate * ctx.epoch / (ctx.num_epochs - 1)

    def select(
        self,
        touched: Tensor,
        scores: Tensor,
        *,
        num_rows: int,
        score_sensitivity: float,
        ctx: SelectionContext,
        generator: torch.Generator,
    ) -> tuple[Tensor, Spend]:
        mask = self._mask
        if self._epoch != ctx.epoch or mask is None or mask.device != touched.device:
            # the epoch's mask comes from its own stream (seeded by the step generator's seed and the epoch), so a
            # run resumed mid-epoch redraws the same mask and leaves the step generator's draws untouched
            epoch_gen = torch.Generator().manual_seed((generator.initial_seed() * 1_000_003 + ctx.epoch) % 2**63)
            kept = max(1, round((1.0 - self.rate(ctx)) * num_rows))
            mask = torch.randperm(num_rows, generator=epoch_gen)[:kept].sort().values.to(touched.device)
            self._epoch, self._mask = ctx.epoch, mask
        return mask, FreeSpend("random_sparsification")


@dataclass(eq=False)
class AllRowsSelector:
    """Every row (DP-SGD)."""

    score_clip: float | None = None  # no scores used
    score_kind: ScoreKind = "none"
    _all: Tensor | None = field(default=None, init=False, repr=False)

    def select(
        self,
        touched: Tensor,
        scores: Tensor,
        *,
        num_rows: int,
        score_sensitivity: float,
        ctx: SelectionContext,
        generator: torch.Generator,
    ) -> tuple[Tensor, Spend]:
        rows = self._all
        if rows is None or rows.numel() != num_rows or rows.device != touched.device:
            rows = self._all = torch.arange(num_rows, device=touched.device)
        return rows, FreeSpend("all")


# ------------------------------------------------------------------------------------------------- factory


def _exponential(cfg: ExponentialSelectionConfig, num_rows: int) -> ExponentialSelector:
    return ExponentialSelector(
        k=_num_picks(cfg, num_rows), epsilon=cfg.epsilon, score_clip=cfg.score_clip, method=cfg.method,
        brute_below=BRUTE_BELOW, score_kind=cfg.score,
    )


def _sparse_vector(cfg: SparseVectorSelectionConfig, num_rows: int) -> SparseVectorSelector:
    return SparseVectorSelector(
        epsilon=cfg.epsilon, threshold=cfg.threshold, cutoff=cfg.cutoff, threshold_fraction=cfg.threshold_fraction,
        score_clip=cfg.score_clip, release_values=cfg.release_values, epsilon_release=cfg.epsilon_release,
        method=cfg.method, score_kind=cfg.score,
    )


def _uniform(cfg: UniformSelectionConfig, num_rows: int) -> UniformSelector:
    return UniformSelector(k=_num_picks(cfg, num_rows))


def _random_sparsification(cfg: RandomSparsificationConfig, num_rows: int) -> RandomSparsificationSelector:
    return RandomSparsificationSelector(final_rate=cfg.final_rate, gradual_cooling=cfg.gradual_cooling)


def _all(cfg: AllRowsConfig, num_rows: int) -> AllRowsSelector:
    return AllRowsSelector()


def _gaussian_threshold(cfg: GaussianThresholdSelectionConfig, num_rows: int) -> GaussianThresholdSelector:
    return GaussianThresholdSelector(sigma=cfg.sigma, threshold=cfg.tau, max_rows=cfg.max_rows)


#: Below this many rows the fast exponential selector perturbs all rows (same law, fewer ops; measured).
BRUTE_BELOW = 4096

_FACTORIES: dict[str, Callable[[Any, int], Selector]] = {
    "exponential": _exponential,
    "sparse_vector": _sparse_vector,
    "uniform": _uniform,
    "random_sparsification": _random_sparsification,
    "all": _all,
    "gaussian_threshold": _gaussian_threshold,
}


def make_selector(cfg: SelectionConfig, *, num_rows: int) -> Selector:
    """The selector a ``dp.selection`` config describes, over R = ``num_rows`` rows."""
    if cfg.name not in _FACTORIES:
        raise ConfigError(f"dp.selection.name: unknown selection {cfg.name!r}")
    return _FACTORIES[cfg.name](cfg, num_rows)
