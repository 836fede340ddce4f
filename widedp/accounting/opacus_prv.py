"""Opacus' PRV accountant as a widedp accountant, for the DP-SGD baseline (``dp.engine: opacus``) only: it models
sampled Gaussian steps with no selection, which is all Opacus' DP-SGD spends."""

from __future__ import annotations

from collections.abc import Sequence

from widedp.accounting.base import Accountant
from widedp.accounting.parts import Costs
from widedp.extras import needs


class OpacusPRVAccountant(Accountant):
    """``opacus.accountants.PRVAccountant`` over the history [(σ, q, steps)] of plain sampled Gaussian steps."""

    name = "opacus_prv"
    headline = False
    discrete_noise = False
    method = "Opacus' PRV accountant (Gopi et al. 2021) of the sampled Gaussian, DP-SGD steps only"

    def refusal(self, costs: Costs) -> str | None:
        if costs.discrete or costs.bounded_range or costs.pure or costs.selection_sigma is not None:
            return "dp.accountant: opacus_prv accounts for DP-SGD's sampled Gaussian steps only (no selection)"
        return None

    def epsilon(self, runs: Sequence[tuple[Costs, int]], delta: float) -> float:
        with needs("opacus", "dp.accountant: opacus_prv"):
            from opacus.accountants import PRVAccountant

        history = [(c.sigma, c.q, n) for c, n in runs if n > 0 and c.sigma is not None]
        if not history:
            return 0.0
        acc = PRVAccountant()
        acc.history = history
        return float(acc.get_epsilon(delta))
