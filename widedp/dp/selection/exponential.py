"""The exponential mechanism over ALL R rows (privacy.md §2): k picks = Gumbel top-k of ε''·u/(2Δu) + Gumbel(0,1).

Methods, all with the same output law (R = rows the selector ranges over, U = rows touched):
- ``sparse`` (``gumbel_topk_sparse``) is O(U + k) and never touches O(R) memory: the m = R − U untouched rows share
  score 0, so their largest Gumbel keys are order statistics (X_i ~ Exp(1); E_1 = X_1/m, E_i = E_{i-1} + X_i/(m−i+1);
  G_(i) = −ln E_i) attached to uniformly random distinct untouched ids (a random ORDER matters: attaching them in
  sorted id order is biased);
- ``brute`` (``gumbel_topk``, the reference) perturbs all R scores;
- ``auto`` (the default): ``brute`` when R <= ``BRUTE_BELOW`` or R <= 4(U + k) (there the sparse path's id sampler
  is O(R) itself and brute force has fewer ops), else ``sparse``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from widedp.dp.noise import exponential, gumbel
from widedp.dp.selection.base import (
    _DENSE_FACTOR,
    ScoreKind,
    SelectionContext,
    dense_scores,
    num_picks,
    sample_distinct,
)
from widedp.dp.spend import ExponentialSpend, Spend

#: ``auto`` perturbs all rows up to this many (the same law, fewer ops there; measured).
BRUTE_BELOW = 4096


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


@dataclass(frozen=True)
class ExponentialSelector:
    """k exponential-mechanism picks of ε'' each, score sensitivity Δu; charged ``ExponentialSpend(ε'', k)``.
    ``method``: ``auto`` | ``sparse`` | ``brute`` (module docstring)."""

    k: int
    epsilon: float
    score_clip: float
    method: str = "auto"
    score_kind: ScoreKind = "norm"

    def __post_init__(self) -> None:
        if self.method not in ("auto", "sparse", "brute"):
            raise ValueError(f"method: expected auto, sparse or brute, got {self.method!r}")

    @classmethod
    def from_config(cls, cfg: Any, *, num_rows: int) -> ExponentialSelector:
        """From ``ExponentialSelectionConfig`` over R = ``num_rows`` rows."""
        return cls(k=num_picks(cfg, num_rows), epsilon=cfg.epsilon, score_clip=cfg.score_clip, method=cfg.method,
                   score_kind=cfg.score)

    def key_scale(self, score_sensitivity: float) -> float:
        """The factor of u_r in the Gumbel keys: ε'' / (2Δu)."""
        return self.epsilon / (2.0 * score_sensitivity)

    def gumbel_logits(self, scores: Tensor, score_sensitivity: float) -> Tensor:
        """[U] the logits whose Gumbel top-k is this selector's law (a row layout may merge it blockwise)."""
        return scores * self.key_scale(score_sensitivity)

    def spend(self) -> Spend:
        return ExponentialSpend(epsilon=self.epsilon, picks=self.k)

    def select(self, touched: Tensor, scores: Tensor, *, selectable_rows: int, score_sensitivity: float,
               ctx: SelectionContext, generator: torch.Generator) -> Tensor:
        logits = scores * self.key_scale(score_sensitivity)
        r = selectable_rows
        if self.method == "brute" or (
            self.method == "auto" and r <= max(BRUTE_BELOW, _DENSE_FACTOR * (touched.numel() + self.k))
        ):
            return gumbel_topk(dense_scores(touched, logits, r), self.k, generator=generator)
        return gumbel_topk_sparse(touched, logits, num_rows=r, k=self.k, generator=generator)
