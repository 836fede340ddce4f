"""Row selection of the DP step (paper Alg. 3, step 3) — swappable mechanisms over ALL R rows (privacy.md §2).

Every selector sees the rows the batch touched and their scores u_r = min(||ĝ_r||, S0); rows the batch did not
touch have score 0 and stay candidates (selecting only among touched rows would publish which rows were touched).

- ``ExponentialSelector``: k exponential-mechanism picks = Gumbel top-k of ε''·u/(2Δu) + Gumbel(0,1). ``fast`` is
  O(U + k) and never touches O(R) memory: the m = R − U untouched rows share score 0, so their largest Gumbel
  keys are order statistics (X_i ~ Exp(1); E_1 = X_1/m, E_i = E_{i-1} + X_i/(m−i+1); G_(i) = −ln E_i) attached to
  uniformly random distinct untouched ids (a random ORDER matters: attaching them in sorted id order is biased).
  ``brute`` (the reference) perturbs all R scores.
- ``SparseVectorSelector``: AboveThreshold with cutoff c over all rows in a fresh random order.
- ``UniformSelector``, ``RandomSparsificationSelector``, ``AllRowsSelector``: data-independent, free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from widedp.config import (
    AllRowsConfig,
    ExponentialSelectionConfig,
    RandomSparsificationConfig,
    SelectionConfig,
    SparseVectorSelectionConfig,
    UniformSelectionConfig,
)
from widedp.errors import ConfigError
from widedp.noise import exponential, gumbel, laplace
from widedp.spend import ExponentialSpend, FreeSpend, SparseVectorSpend, Spend

#: ``sample_distinct`` draws by rejection when 4·(n + excluded) <= R (acceptance >= 3/4), else from a permutation.
_DENSE_FACTOR = 4


@dataclass(frozen=True)
class SelectionContext:
    """Data-independent per-step information (random sparsification needs the epoch)."""

    epoch: int
    num_epochs: int


class Selector(Protocol):
    """A row-selection mechanism.

    ``score_clip`` is S0 when the mechanism uses scores, else ``None`` (the step then skips computing them and
    passes an empty ``scores``).
    """

    score_clip: float | None

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
        """touched: [U] sorted unique ids; scores: [U] in [0, S0] (or empty, see above).

        Returns [k] distinct int64 row ids on ``touched.device`` and the mechanism's ``Spend``.
        """
        ...


# ------------------------------------------------------------------------------------------------ primitives


def sample_distinct(
    n: int, num_rows: int, *, exclude: Tensor, generator: torch.Generator, device: Any
) -> Tensor:
    """[n] distinct ids uniform on [0, R) \\ exclude, in uniformly random order; O(n + |exclude|) when sparse.

    Args:
        exclude: [U] sorted unique int64 ids that must not be drawn.

    Sparse case: i.i.d. uniform draws, keep the first occurrence of each non-excluded id in draw order; each new
    kept id is uniform over the ids not yet kept, so the first n kept form a uniform ordered sample (exact).
    """
    u = exclude.numel()
    if n > num_rows - u:
        raise ValueError(f"cannot draw {n} distinct rows out of {num_rows - u}")
    if n == 1:  # the first non-excluded draw
        while True:
            cand = torch.randint(num_rows, (8,), generator=generator, device=device)
            if not u:
                return cand[:1]
            ok = (~_member(cand, exclude)).to(torch.uint8)
            i = int(ok.argmax())
            if ok[i]:
                return cand[i : i + 1]
    if _DENSE_FACTOR * (n + u) > num_rows:
        perm = torch.randperm(num_rows, generator=generator, device=device)
        if u:
            perm = perm[~_member(perm, exclude)]
        return perm[:n]
    chunk = (3 * n) // 2 + 16  # expected >= 9n/8 + 12 kept
    cand = torch.randint(num_rows, (chunk,), generator=generator, device=device)
    while True:
        vals = cand.masked_fill(_member(cand, exclude), num_rows) if u else cand  # rejected -> sentinel R
        sv, order = torch.sort(vals, stable=True)
        first = torch.ones_like(sv, dtype=torch.bool)
        first[1:] = sv[1:] != sv[:-1]
        first &= sv < num_rows
        pos = order[first]  # draw positions of first occurrences (stable sort: the earliest)
        if pos.numel() >= n:
            return cand.index_select(0, pos.sort().values[:n])
        cand = torch.cat([cand, torch.randint(num_rows, (chunk,), generator=generator, device=device)])


def _member(x: Tensor, sorted_set: Tensor) -> Tensor:
    """[len(x)] bool: x_i in sorted_set (non-empty, sorted)."""
    pos = torch.searchsorted(sorted_set, x).clamp_(max=sorted_set.numel() - 1)
    return sorted_set.index_select(0, pos) == x


def _dense_scores(touched: Tensor, scores: Tensor, num_rows: int) -> Tensor:
    """[R] scores of all rows (0 where untouched)."""
    return scores.new_zeros(num_rows).index_copy_(0, touched, scores)


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
            sel = gumbel_topk(_dense_scores(touched, logits, num_rows), self.k, generator=generator)
        else:
            sel = gumbel_topk_sparse(touched, logits, num_rows=num_rows, k=self.k, generator=generator)
        return sel, ExponentialSpend(epsilon=self.epsilon, picks=self.k)


@dataclass(frozen=True)
class SparseVectorSelector:
    """AboveThreshold with cutoff c over all rows in a fresh random order; each segment (ended by an
    above-threshold answer) is ε-DP: threshold noise Lap(Δu/ε1), query noise Lap(2Δu/ε2), ε1 = f·ε, ε2 = (1−f)·ε.
    Returns the (at most c) rows found above, in visiting order. O(R) per step.
    """

    epsilon: float
    threshold: float
    cutoff: int
    threshold_fraction: float
    score_clip: float
    release_values: bool = False
    epsilon_release: float = 0.0

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
        dev, dt = touched.device, scores.dtype
        eps1 = self.threshold_fraction * self.epsilon
        eps2 = self.epsilon - eps1
        order = torch.randperm(num_rows, generator=generator, device=dev)
        # each row is visited at most once and each segment has its own threshold, so drawing every query noise
        # and every threshold up front is the same law as drawing them as the loop goes
        noisy = _dense_scores(touched, scores, num_rows).index_select(0, order)
        noisy += laplace((num_rows,), scale=2 * score_sensitivity / eps2, generator=generator, device=dev, dtype=dt)
        thresholds = laplace(
            (self.cutoff,), scale=score_sensitivity / eps1, generator=generator, device=dev, dtype=dt
        ).add_(self.threshold)
        picks: list[int] = []
        start = 0
        for s in range(self.cutoff):
            if start >= num_rows:
                break
            above = (noisy[start:] >= thresholds[s]).to(torch.uint8)
            i = int(above.argmax())  # first above-threshold answer of this segment
            if not above[i]:
                break
            picks.append(start + i)
            start += i + 1
        sel = order[torch.tensor(picks, dtype=torch.long, device=dev)]
        spend = SparseVectorSpend(
            epsilon=self.epsilon,
            cutoff=self.cutoff,
            epsilon_release=self.epsilon_release if self.release_values else 0.0,
        )
        return sel, spend


@dataclass(frozen=True)
class UniformSelector:
    """k distinct rows uniformly at random (data-independent, free)."""

    k: int
    score_clip: float | None = None  # no scores used

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
        brute_below=BRUTE_BELOW,
    )


def _sparse_vector(cfg: SparseVectorSelectionConfig, num_rows: int) -> SparseVectorSelector:
    return SparseVectorSelector(
        epsilon=cfg.epsilon, threshold=cfg.threshold, cutoff=cfg.cutoff, threshold_fraction=cfg.threshold_fraction,
        score_clip=cfg.score_clip, release_values=cfg.release_values, epsilon_release=cfg.epsilon_release,
    )


def _uniform(cfg: UniformSelectionConfig, num_rows: int) -> UniformSelector:
    return UniformSelector(k=_num_picks(cfg, num_rows))


def _random_sparsification(cfg: RandomSparsificationConfig, num_rows: int) -> RandomSparsificationSelector:
    return RandomSparsificationSelector(final_rate=cfg.final_rate, gradual_cooling=cfg.gradual_cooling)


def _all(cfg: AllRowsConfig, num_rows: int) -> AllRowsSelector:
    return AllRowsSelector()


#: Below this many rows the fast exponential selector perturbs all rows (same law, fewer ops; measured).
BRUTE_BELOW = 4096

_FACTORIES: dict[str, Callable[[Any, int], Selector]] = {
    "exponential": _exponential,
    "sparse_vector": _sparse_vector,
    "uniform": _uniform,
    "random_sparsification": _random_sparsification,
    "all": _all,
}


def make_selector(cfg: SelectionConfig, *, num_rows: int) -> Selector:
    """The selector a ``dp.selection`` config describes, over R = ``num_rows`` rows."""
    if cfg.name not in _FACTORIES:
        raise ConfigError(f"dp.selection.name: unknown selection {cfg.name!r}")
    return _FACTORIES[cfg.name](cfg, num_rows)
