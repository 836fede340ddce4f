"""What every row selector shares: the per-step context, the ``Selector`` protocol, and the exact sampler of
distinct uniform row ids that keeps selection V-independent (privacy.md §2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from widedp.dp.spend import Spend
from widedp.errors import ConfigError

#: ``sample_distinct`` draws by rejection when 4·(n + excluded) <= R (acceptance >= 3/4), else from a permutation.
_DENSE_FACTOR = 4

#: The row scores a selector reads (``widedp.dp.selection.scores``): ``none``; ``norm`` u_r = min(||ĝ_r||, S0), each
#: row's score moves by <= min(S0, S1/b); ``count`` u_r = min(n_r, S0), n_r the number of samples that touched r,
#: moves by <= min(S0, 1); ``contribution`` c_r = Σ_j 1[r ∈ rows_j]/√|rows_j|, the whole vector moves by <= 1 in ℓ2.
ScoreKind = Literal["none", "norm", "count", "contribution"]


@dataclass(frozen=True)
class SelectionContext:
    """Data-independent per-step information (random sparsification needs the epoch)."""

    epoch: int
    num_epochs: int


class Selector(Protocol):
    """A row-selection mechanism.

    ``score_kind`` names the scores it reads (``ScoreKind``; the step computes only those and passes an empty
    ``scores`` for ``none``); ``score_clip`` is S0 for ``norm`` / ``count`` scores, else ``None``.

    ``spend()`` is what one step of it costs, the only place that says so: ``dp_step``, the distributed step, the
    budget (``widedp epsilon``, calibration, the journal) all read it. It depends on the selector's parameters only
    (known before training, whatever the batch); ``select`` draws the rows.

    Optionally ``public_rows(*, selectable_rows, device) -> Tensor | None``: rows the selector takes every step
    without looking at the batch (a public head, ``widedp.dp.selection.public``); ``dp_step`` adds them to its public
    rows (selected for free, left out of the scores).
    """

    score_kind: ScoreKind
    score_clip: float | None

    def spend(self) -> Spend:
        """What one ``select`` costs (composed with the step's noise on the same Poisson batch)."""
        ...

    def select(self, touched: Tensor, scores: Tensor, *, selectable_rows: int, score_sensitivity: float,
               ctx: SelectionContext, generator: torch.Generator) -> Tensor:
        """Rows drawn among ALL ``selectable_rows`` rows [0, R_sel), untouched ones included (R_sel: the model's
        rows minus those selected every step, or the pre-selected ones).

        Args:
            touched: [U] sorted unique ids in [0, R_sel); scores: [U] (or empty, see above).
            score_sensitivity: how far one sample moves the scores (per row for ``norm`` / ``count``, ℓ2 over all
                rows for ``contribution``).

        Returns:
            [k] distinct int64 row ids on ``touched.device``.
        """
        ...


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
    if n == 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    # No host sync on any path: every size below is known before the draws.
    if _DENSE_FACTOR * (n + u) > num_rows:
        perm = torch.randperm(num_rows, generator=generator, device=device)
        if u:  # the first n not-excluded ids of the permutation (a stable sort of the excluded flag, not a mask)
            perm = perm.index_select(0, torch.sort(member(perm, exclude).to(torch.uint8), stable=True).indices[:n])
        return perm[:n]
    # Each draw is a new kept id with probability >= 3/4 until n are kept (4(n + u) <= R), so 2n + 128 draws keep
    # fewer than n with probability < e^-43 (Chernoff); that never-seen case is an error, not a shorter sample.
    m = 2 * n + 128
    cand = torch.randint(num_rows, (m,), generator=generator, device=device)
    vals = cand.masked_fill(member(cand, exclude), num_rows) if u else cand  # rejected -> sentinel R
    sv, order = torch.sort(vals, stable=True)
    first = torch.ones_like(sv, dtype=torch.bool)
    first[1:] = sv[1:] != sv[:-1]
    first &= sv < num_rows
    # draw positions of first occurrences (stable sort: the earliest), m elsewhere; the n smallest, in draw order
    pos = torch.where(first, order, m).topk(n, largest=False, sorted=True).values
    torch._assert_async(pos[-1] < m, "sample_distinct: fewer distinct draws than rows asked for")
    return cand.index_select(0, pos)


def member(x: Tensor, sorted_set: Tensor) -> Tensor:
    """[len(x)] bool: x_i in sorted_set (non-empty, sorted)."""
    pos = torch.searchsorted(sorted_set, x).clamp_(max=sorted_set.numel() - 1)
    return sorted_set.index_select(0, pos) == x


def dense_scores(touched: Tensor, scores: Tensor, num_rows: int) -> Tensor:
    """[R] scores of all rows (0 where untouched) — O(R): brute-force references only."""
    return scores.new_zeros(num_rows).index_copy_(0, touched, scores)


def num_picks(cfg: Any, num_rows: int) -> int:
    """k of a config with ``k`` or ``gamma`` (the fraction of the R = ``num_rows`` rows); k <= R."""
    k = cfg.k if cfg.k is not None else max(1, round(cfg.gamma * num_rows))
    if k > num_rows:
        raise ConfigError(f"dp.selection.k: {k} exceeds the number of rows R={num_rows}")
    return k

