"""The whole budget of a run: one-off releases before the first step (the DP vocabulary) composed with the steps,
and the training in privacy units (issue 11).

The DP vocabulary (``widedp.dp.vocab``) is recorded in the run's ledger as one step at sampling rate 1 whose only
part is its Gaussian (noise multiplier sigma_v, sensitivity 1): ``RunBudget.prefix``. Its threshold adds
delta_tau (``data.vocab_dp.delta``) that no ledger entry carries, so every epsilon of such a run is
``eps_ledger(dp.delta - delta_tau) + ln(1 / (1 - delta_tau))`` at the run's ``dp.delta`` (why that is valid: the
``widedp.dp.vocab`` docstring). Calibration and the budget stop solve for that same figure. The one-shot row
pre-selection (``dp.preselect``, ``widedp.dp.selection.preselect``; drawn by ``widedp.run.preselect_setup``) is a
prefix entry too: one Gaussian (sigma_pre, sensitivity 1) at sampling rate 1, after the vocabulary's. Runs with
neither go through ``widedp.run.budget`` unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from widedp import accounting
from widedp.accounting.pld import PLDRangeError
from widedp.config import Config, DPConfig, GaussianThresholdSelectionConfig
from widedp.dp.spend import StepSpend
from widedp.errors import ConfigError
from widedp.run import budget


@dataclass(frozen=True)
class RunBudget:
    """prefix: steps recorded before the first training step (each once); threshold_delta: delta spent outside the
    ledger (the vocabulary's threshold); vocabulary: the run draws a DP vocabulary (its entry is ``prefix[0]``; the
    task's build releases it, ``widedp.tasks.Task.build``'s ``noise_seed``)."""

    prefix: tuple[StepSpend, ...] = ()
    threshold_delta: float = 0.0
    vocabulary: bool = False

    @property
    def prefix_steps(self) -> int:
        return len(self.prefix)

    @property
    def epsilon_extra(self) -> float:
        """ln(1 / (1 - delta_tau)): the remove direction's factor (``widedp.dp.vocab``)."""
        return -math.log1p(-self.threshold_delta)

    def accounting_delta(self, delta: float) -> float:
        """The delta the ledger is evaluated at: the run's delta minus the threshold's."""
        d = delta - self.threshold_delta
        if not d > 0:
            raise ConfigError(f"data.vocab_dp.delta: {self.threshold_delta:g} must be below dp.delta ({delta:g})")
        return d


def for_config(cfg: Config) -> RunBudget:
    """The run budget of ``cfg`` (empty unless it has a dp: section and its data asks for ``vocabulary: dp``, a
    CBOW's, or it has ``dp.preselect``)."""
    if cfg.dp is None:
        return RunBudget()
    pre = tuple(step for step, _ in budget.preselect_runs(cfg.dp))
    if getattr(cfg.data, "vocabulary", "") != "dp":
        return RunBudget(pre)
    rb = RunBudget((budget.vocabulary_spend(cfg.data.vocab_dp), *pre), cfg.data.vocab_dp.delta, vocabulary=True)
    rb.accounting_delta(cfg.dp.delta)  # refuse a threshold delta >= dp.delta early
    return rb


def composed_epsilon(rb: RunBudget, dp: DPConfig, runs: list[tuple[StepSpend, int]], accountant: str | None = None
                     ) -> float:
    """eps of the prefix composed with ``runs`` [(step spend, count)] at the run's delta (inf out of PLD range)."""
    try:
        e = accounting.compose_epsilon([(p, 1) for p in rb.prefix] + runs, delta=rb.accounting_delta(dp.delta),
                                       accountant=accountant or dp.accountant)
    except PLDRangeError:
        return math.inf
    return e + rb.epsilon_extra


def epsilons(dp: DPConfig, ledger: accounting.Ledger, rb: RunBudget) -> dict[str, Any]:
    """What a run reports for its ledger (prefix included): ``epsilon``, ``epsilon_accountant``, ``epsilon_rdp``."""
    if not rb.prefix and not rb.threshold_delta:
        return budget.ledger_epsilons(dp, ledger)
    out = accounting.headline_epsilons(ledger, delta=rb.accounting_delta(dp.delta), accountant=dp.accountant)
    if ledger.steps:
        out["epsilon"] += rb.epsilon_extra
        out["epsilon_rdp"] += rb.epsilon_extra
    return out


def calibrated(cfg: Config, *, num_rows: int, n: int, rb: RunBudget) -> DPConfig:
    """``cfg.dp`` with sigma (or the selection's epsilon) solved so that the prefix AND the training steps spend
    ``dp.target_epsilon`` (within 1% below it); ``budget.calibrated`` when there is no prefix."""
    dp = cfg.dp
    assert dp is not None
    if not rb.prefix or dp.calibrate == "none":
        return budget.calibrated(cfg, num_rows=num_rows, n=n)
    b, steps = cfg.train.batch_size, budget.total_steps(cfg, n)
    target = dp.target_epsilon
    assert target is not None
    if composed_epsilon(rb, dp, []) >= target:
        raise ConfigError(f"dp.target_epsilon: {target:g} is infeasible: {_prefix_what(rb)} alone spends "
                          f"{composed_epsilon(rb, dp, []):.4g}; raise its noise multiplier or the target")
    if dp.calibrate == "noise_multiplier":
        def make(x: float) -> DPConfig:
            return replace(dp, noise_multiplier=x)
        increasing = False
    elif isinstance(dp.selection, GaussianThresholdSelectionConfig):  # its parameter is 1/sigma_sel
        def make(x: float) -> DPConfig:
            return replace(dp, selection=replace(dp.selection, sigma=1.0 / x))
        increasing = True
    elif hasattr(dp.selection, "epsilon"):
        def make(x: float) -> DPConfig:
            return replace(dp, selection=replace(dp.selection, epsilon=x))
        increasing = True
    else:
        raise ConfigError(f"dp.calibrate: selection_epsilon with {_prefix_what(rb)} needs a selection with an "
                          f"epsilon, not {dp.selection.name!r}")
    # start from the training-only answer (at the ledger's delta): the joint eps is a little above the target there
    dp0 = budget.calibrated(replace(cfg, dp=replace(dp, delta=rb.accounting_delta(dp.delta))), num_rows=num_rows,
                            n=n)
    gt = isinstance(dp.selection, GaussianThresholdSelectionConfig)
    x0 = dp0.noise_multiplier if not increasing else (1.0 / dp0.selection.sigma if gt else dp0.selection.epsilon)

    def f(x: float) -> float:
        return composed_epsilon(rb, dp, [(budget.step_spend(make(x), num_rows=num_rows, batch_size=b, n=n), steps)])

    return make(_solve(f, target, x0=x0, increasing=increasing))


def _prefix_what(rb: RunBudget) -> str:
    what = ["the DP vocabulary"] if rb.vocabulary else []
    return " and ".join(what + ["the row pre-selection"] * (len(rb.prefix) > len(what)))


def _solve(f: Callable[[float], float], target: float, *, x0: float, increasing: bool, tol: float = 0.01) -> float:
    """x with (1 - tol) target <= f(x) <= target for a monotone f, searching in log x from x0 (bracket, bisect)."""
    up = 1.15 if increasing else 1 / 1.15  # x * up raises eps
    good, bad = None, None
    x = x0
    for _ in range(200):
        v = f(x)
        if (1 - tol) * target <= v <= target:
            return x
        if v <= target:
            good = x
            if bad is not None:
                break
            x = x * up
        else:
            bad = x
            if good is not None:
                break
            x = x / up
    if good is None or bad is None:
        raise ConfigError(f"calibration: no value reaches eps <= {target:g} with what is spent before the first step")
    for _ in range(60):
        mid = math.sqrt(good * bad)
        v = f(mid)
        if (1 - tol) * target <= v <= target:
            return mid
        good, bad = (mid, bad) if v <= target else (good, mid)
    return good


def budget_steps(dp: DPConfig, step: StepSpend, rb: RunBudget) -> int | None:
    """The most TRAINING steps whose composition with the prefix stays within ``dp.target_epsilon`` (None = no
    target); ``budget.budget_steps`` when there is no prefix."""
    if dp.target_epsilon is None:
        return None
    if not rb.prefix:
        return budget.budget_steps(dp, step)
    target = dp.target_epsilon
    if composed_epsilon(rb, dp, []) > target:
        return 0
    hi = accounting.max_steps(step, delta=rb.accounting_delta(dp.delta), target_epsilon=target,
                              accountant=dp.accountant)  # training alone: an upper bound
    if composed_epsilon(rb, dp, [(step, hi)]) <= target:
        return hi
    lo = 0  # eps(lo) <= target < eps(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if composed_epsilon(rb, dp, [(step, mid)]) <= target else (lo, mid)
    return lo


# ---------------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class DPPlan:
    """A DP run's privacy plan: ``rb`` (what is spent before the first step), ``dp`` (calibrated), ``spend`` (what
    every step spends), ``cap`` (the most training steps within ``dp.target_epsilon``; None = no target)."""

    rb: RunBudget
    dp: DPConfig
    spend: StepSpend
    cap: int | None


def plan(cfg: Config, rb: RunBudget, *, num_rows: int, n: int) -> DPPlan:
    """The plan of ``cfg`` over ``n`` training samples (or units) and ``num_rows`` selectable rows, after ``rb``:
    the same for a run (``widedp.run.engines``) and for ``widedp epsilon`` (``widedp.run.epsilon``)."""
    dp = calibrated(cfg, num_rows=num_rows, n=n, rb=rb)
    spend = budget.step_spend(dp, num_rows=num_rows, batch_size=cfg.train.batch_size, n=n)
    return DPPlan(rb, dp, spend, budget_steps(dp, spend, rb))
