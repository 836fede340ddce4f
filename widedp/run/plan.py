"""A DP run's privacy plan, in one place: what it spends before the first step (the prefix), what every step spends,
calibration to ``dp.target_epsilon``, the budget stop, and the ε it reports — for ``widedp train`` (the engines),
``widedp epsilon``, ``widedp compare`` and ``PrivacyEngine`` alike.

The prefix: the DP vocabulary (``widedp.dp.vocab``) and the one-shot row pre-selection (``dp.preselect``,
``widedp.dp.selection.preselect``, drawn by ``widedp.run.preselect_setup``), each one Gaussian of sensitivity 1 at
sampling rate 1, recorded in the ledger once before the first step. The vocabulary's threshold adds δ_τ
(``data.vocab_dp.delta``) that no ledger entry carries, so every ε of such a run is
``eps_ledger(dp.delta − δ_τ) + ln(1 / (1 − δ_τ))`` at the run's ``dp.delta`` (why that is valid: ``widedp.dp.vocab``).
Calibration and the budget stop solve for that same figure through the accountant's one solver
(``widedp.accounting.calibrate``, its ``prefix=``), at the shifted δ and target. Which knob calibration moves is the
selection's own (``with_privacy`` on its config class); one without it cannot calibrate ``selection_epsilon``.

Bounded batches (``dp.max_batch_size``: B, truncated Poisson, ``widedp.dp.sampling``) add δ_B = (1 + e^ε̄)·η,
η = T·P[Binomial(N + 1, q) > B], to the δ no ledger entry carries: the ledger is evaluated at
δ − δ_τ − δ_B, where ε̄ must bound every ε then reported with it (including the vocabulary's ln(1/(1 − δ_τ))).
ε̄ is ``dp.target_epsilon`` when set (calibration and the budget stop keep the run's ε at or below it); without a
target, the whole run's ε at δ − δ_τ − δ/1000 for ``auto`` (whose B keeps δ_B <= δ/1000, so no reported ε exceeds
it), or for a given B the least ε̄ found that covers the whole run's ε at its own δ_B (``_settle``). A figure that
still exceeds ε̄ (more steps than planned, the RDP cross-check) is settled the same way on its own: ε̄ raised to
it, δ_B recomputed, until it is covered (else ∞). Every (ε, δ) printed is thus (ε_L + ln(1/(1 − δ_τ)),
δ_L + δ_τ + δ_B) with ε at most the ε̄ of its δ_B.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from widedp import accounting
from widedp.accounting.pld import PLDRangeError
from widedp.config import Config, DPConfig
from widedp.dp import sampling, units
from widedp.dp.selection import make_selector
from widedp.dp.spend import GaussianSpend, StepSpend
from widedp.dp.step import dp_step_spend
from widedp.errors import ConfigError


def sampling_rate(dp: DPConfig, batch_size: int, n: int) -> float:
    """q: ``dp.sampling_rate`` when the config fixes it, else b / n (n: the training units, i.e. the data's size)."""
    return dp.sampling_rate if dp.sampling_rate is not None else batch_size / n


def steps_per_epoch(batch_size: int, n: int, *, rate: float | None = None) -> int:
    """Poisson steps per epoch: round(n / b), or round(1 / q) for a fixed sampling rate q."""
    return max(1, round(1 / rate)) if rate is not None else max(1, round(n / batch_size))


def check_data(cfg: Config, n: int, *, new: bool = True) -> None:
    """What a DP plan asks of the N = ``n`` training units (samples, or units when a unit groups samples): at most
    N expected samples per step when q is b/N, and for a ``new`` run a ``dp.delta`` below 1/N unless
    ``dp.allow_large_delta`` (a resumed run keeps what it started with). One line naming the key otherwise."""
    assert cfg.dp is not None
    dp, b = cfg.dp, cfg.train.batch_size
    what = f"{n:,} training {units.privacy_unit(cfg)}{'s' if n != 1 else ''}"
    if dp.sampling_rate is None and b > n:
        raise ConfigError(f"train.batch_size: {b:,} is above the {what} (N); Poisson sampling's rate b/N must be at "
                          "most 1: lower it (or fix dp.sampling_rate)")
    if new and dp.delta >= 1 / n and not dp.allow_large_delta:
        raise ConfigError(f"dp.delta: {dp.delta:g} is not below 1/N = {1 / n:.3g} (N = {what}): publishing each "
                          f"{units.privacy_unit(cfg)} in the clear with probability δ meets it (about "
                          f"{dp.delta * n:,.1f} of them); lower it, or set dp.allow_large_delta: true")


def total_steps(cfg: Config, n: int) -> int:
    """Steps of the whole run: epochs x steps per epoch (n/b Poisson steps with DP), capped by train.max_steps."""
    per_epoch = (steps_per_epoch(cfg.train.batch_size, n, rate=cfg.dp.sampling_rate) if cfg.dp is not None
                 else -(-n // cfg.train.batch_size))
    t = cfg.train.epochs * per_epoch
    return min(t, cfg.train.max_steps) if cfg.train.max_steps else t


def step_spend(dp: DPConfig, *, num_rows: int, batch_size: int, n: int) -> StepSpend:
    """The StepSpend every step of this config emits: ``dp_step_spend`` of the selector ``make_selector`` builds over
    the model's R = ``num_rows`` rows (the record the step itself emits)."""
    return dp_step_spend(make_selector(dp.selection, num_rows=num_rows), sampling_rate=sampling_rate(dp, batch_size, n),
                         noise_multiplier=dp.noise_multiplier, clip1=dp.clip1, clip2=dp.clip2, batch_size=batch_size,
                         noise=dp.noise)


def vocabulary_spend(vocab_dp: Any) -> StepSpend:
    """The DP vocabulary's ledger entry: one Gaussian of l2 sensitivity 1 and noise multiplier
    ``vocab_dp.noise_multiplier`` on the whole corpus (sampling rate 1); its threshold's δ is ``Prefix``'s."""
    return StepSpend(sampling_rate=1.0, parts=(GaussianSpend(noise_multiplier=vocab_dp.noise_multiplier,
                                                             sensitivity=1.0),))


def preselect_runs(dp: DPConfig) -> list[tuple[StepSpend, int]]:
    """What the pre-selection spends before the first step: ``[(its one Gaussian, 1)]`` with ``dp.preselect``."""
    if dp.preselect is None:
        return []
    from widedp.dp.selection.preselect import preselect_step

    return [(preselect_step(dp.preselect), 1)]


@dataclass(frozen=True)
class Prefix:
    """entries: steps recorded before the first training step (each once); threshold_delta: δ spent outside the
    ledger (the vocabulary's threshold); vocabulary: the run draws a DP vocabulary (its entry is ``entries[0]``; the
    task's build releases it, ``widedp.tasks.Task.build``'s ``noise_seed``); batch_*: the truncated batches'
    δ_B, also outside the ledger (``batch_delta``, module docstring)."""

    entries: tuple[StepSpend, ...] = ()
    threshold_delta: float = 0.0
    vocabulary: bool = False
    batch_bound: int | None = None  # B of dp.max_batch_size (resolved); the rest: what δ_B is computed from
    batch_units: int = 0  # N
    batch_rate: float = 1.0  # q
    batch_steps: int = 0  # T
    epsilon_bar: float = 0.0  # ε̄

    @property
    def runs(self) -> list[tuple[StepSpend, int]]:
        return [(p, 1) for p in self.entries]

    @property
    def epsilon_extra(self) -> float:
        """ln(1 / (1 - δ_τ)): the remove direction's factor (``widedp.dp.vocab``)."""
        return -math.log1p(-self.threshold_delta)

    @property
    def batch_delta(self) -> float:
        """δ_B = (1 + e^ε̄)·T·P[Binomial(N + 1, q) > B]; 0 without a bound."""
        if self.batch_bound is None:
            return 0.0
        return sampling.truncation_delta(steps=self.batch_steps, n=self.batch_units, q=self.batch_rate,
                                         bound=self.batch_bound, epsilon_bar=self.epsilon_bar)

    def accounting_delta(self, delta: float) -> float:
        """The δ the ledger is evaluated at: the run's δ minus the threshold's and the truncated batches'."""
        d = delta - self.threshold_delta - self.batch_delta
        if not d > 0 and self.batch_bound is not None:
            also = f" (with the vocabulary's δ_τ={self.threshold_delta:g})" if self.threshold_delta else ""
            raise ConfigError(f"dp.max_batch_size: {self.batch_bound:,} units per batch spends δ_B="
                              f"{self.batch_delta:.3g}{also}, not below dp.delta ({delta:g}), at T={self.batch_steps:,}"
                              f" steps, N={self.batch_units:,}, q={self.batch_rate:.4g}, ε̄={self.epsilon_bar:.4g}; "
                              "raise it, or use auto")
        if not d > 0:
            raise ConfigError(f"data.vocab_dp.delta: {self.threshold_delta:g} must be below dp.delta ({delta:g})")
        return d

    def what(self) -> str:
        """What the prefix holds, in words."""
        names = ["the DP vocabulary"] if self.vocabulary else []
        return " and ".join(names + ["the row pre-selection"] * (len(self.entries) > len(names)))


def prefix_of(cfg: Config) -> Prefix:
    """The prefix of ``cfg`` (empty unless it has a dp: section and its data asks for ``vocabulary: dp``, a
    CBOW's, or it has ``dp.preselect``)."""
    if cfg.dp is None:
        return Prefix()
    pre = tuple(step for step, _ in preselect_runs(cfg.dp))
    if getattr(cfg.data, "vocabulary", "") != "dp":
        return Prefix(pre)
    prefix = Prefix((vocabulary_spend(cfg.data.vocab_dp), *pre), cfg.data.vocab_dp.delta, vocabulary=True)
    prefix.accounting_delta(cfg.dp.delta)  # refuse a threshold δ >= dp.delta early
    return prefix


def composed_epsilon(prefix: Prefix, dp: DPConfig, runs: list[tuple[StepSpend, int]],
                     accountant: str | None = None) -> float:
    """ε of the prefix composed with ``runs`` [(step spend, count)] at the run's δ (inf out of PLD range), settled
    against the truncated batches' ε̄ (``_settled``)."""
    return composed_epsilon_with(prefix, dp, runs, accountant)[0]


def composed_epsilon_with(prefix: Prefix, dp: DPConfig, runs: list[tuple[StepSpend, int]],
                          accountant: str | None = None) -> tuple[float, Prefix]:
    """``composed_epsilon`` and the prefix whose ε̄ and δ_B (``batch_delta``) go with it."""
    return _settled_with(lambda p: _composed(p, dp, runs, accountant), prefix)


def _composed(prefix: Prefix, dp: DPConfig, runs: list[tuple[StepSpend, int]], accountant: str | None,
              delta: float | None = None) -> float:
    """``composed_epsilon`` at ``prefix.accounting_delta`` (or the ledger's δ ``delta``), not settled."""
    at = prefix.accounting_delta(dp.delta) if delta is None else delta
    try:
        e = accounting.compose_epsilon(prefix.runs + runs, delta=at, accountant=accountant or dp.accountant)
    except PLDRangeError:
        return math.inf
    return e + prefix.epsilon_extra


#: how often ``_settle`` raises ε̄ before it gives up
_SETTLE_TRIES = 6


def _settle(evaluate: Callable[[Prefix], float], prefix: Prefix) -> tuple[float, Prefix]:
    """``evaluate(prefix)``, an ε at ``prefix.accounting_delta``, valid with the truncated batches' δ_B only when it is
    at most ε̄: otherwise ε̄ is raised just above it and the figure recomputed (smaller δ_L, larger δ_B) until it is
    covered. Returns (ε, the prefix whose ε̄ covers it), or (∞, ...) after ``_SETTLE_TRIES``; ConfigError (naming
    ``dp.max_batch_size``) when δ_B leaves no δ."""
    e = evaluate(prefix)
    for _ in range(_SETTLE_TRIES):
        if prefix.batch_bound is None or e <= prefix.epsilon_bar:
            return e, prefix
        prefix = replace(prefix, epsilon_bar=e * (1 + 1e-3) + 1e-3)
        e = evaluate(prefix)
    return math.inf, prefix


def _settled(evaluate: Callable[[Prefix], float], prefix: Prefix) -> float:
    """``_settle``'s ε; ∞ where δ_B leaves no δ (a report never stops a run). Without a bound: ``evaluate``'s."""
    return _settled_with(evaluate, prefix)[0]


def _settled_with(evaluate: Callable[[Prefix], float], prefix: Prefix) -> tuple[float, Prefix]:
    """``_settled``'s ε and the prefix whose ε̄ (and so δ_B) goes with it."""
    if prefix.batch_bound is None:
        return evaluate(prefix), prefix
    try:
        return _settle(evaluate, prefix)
    except ConfigError:
        return math.inf, prefix


def epsilons(dp: DPConfig, ledger: accounting.Ledger, prefix: Prefix | None = None) -> dict[str, Any]:
    """What a run reports for its ledger (the prefix's entries are in it): ``epsilon`` by the run's accountant,
    ``epsilon_accountant`` naming it, ``epsilon_rdp`` (the cross-check); 0 for an empty ledger. With bounded batches
    each figure is settled against ε̄ (``_settled``) over at least the steps drawn, and comes with the ε̄ and δ_B it
    is valid with: ``epsilon_bar`` / ``delta_batch`` (the headline's), ``epsilon_bar_rdp`` / ``delta_batch_rdp``;
    ∞ where δ_B leaves no δ (a report never stops a run)."""
    prefix = prefix or Prefix()
    if prefix.batch_bound is None:
        out = accounting.headline_epsilons(ledger, delta=prefix.accounting_delta(dp.delta), accountant=dp.accountant)
        if ledger.steps and prefix.threshold_delta:
            out["epsilon"] += prefix.epsilon_extra
            out["epsilon_rdp"] += prefix.epsilon_extra
        return out
    trained = ledger.steps - len(prefix.entries)
    if trained > prefix.batch_steps:  # more steps drawn than planned
        prefix = replace(prefix, batch_steps=trained)
    if not ledger.steps:
        return {"epsilon": 0.0, "epsilon_accountant": dp.accountant, "epsilon_rdp": 0.0}
    out: dict[str, Any] = {"epsilon_accountant": dp.accountant}
    for key, acct in (("epsilon", dp.accountant), ("epsilon_rdp", "rdp")):
        e, covering = _settled_with(lambda p, a=acct: _ledger_epsilon(p, dp, ledger, a), prefix)
        tail = "" if key == "epsilon" else "_rdp"  # the δ_B (and ε̄) each figure is valid with
        out |= {key: e, f"delta_batch{tail}": covering.batch_delta, f"epsilon_bar{tail}": covering.epsilon_bar}
    return out


def _ledger_epsilon(prefix: Prefix, dp: DPConfig, ledger: accounting.Ledger, accountant: str) -> float:
    """The ledger's ε by ``accountant`` at ``prefix.accounting_delta`` (the vocabulary's factor included)."""
    out = accounting.headline_epsilons(ledger, delta=prefix.accounting_delta(dp.delta), accountant=accountant)
    return out["epsilon"] + (prefix.epsilon_extra if prefix.threshold_delta else 0.0)


def calibrated(dp: DPConfig, *, steps: int, batch_size: int, num_rows: int, n: int,
               prefix: Prefix | None = None) -> DPConfig:
    """``dp`` with σ or the selection's knob solved so that the prefix AND ``steps`` training steps spend
    ``dp.target_epsilon`` (within 1% below it), when ``dp.calibrate`` asks."""
    prefix = prefix or Prefix()
    if dp.calibrate == "none":
        return dp
    assert dp.target_epsilon is not None
    if prefix.entries and composed_epsilon(prefix, dp, []) >= dp.target_epsilon:
        raise ConfigError(f"dp.target_epsilon: {dp.target_epsilon:g} is infeasible: {prefix.what()} alone spends "
                          f"{composed_epsilon(prefix, dp, []):.4g}; raise its noise multiplier or the target")
    kw: dict[str, Any] = {"steps": steps, "delta": prefix.accounting_delta(dp.delta), "accountant": dp.accountant,
                          "target_epsilon": dp.target_epsilon - prefix.epsilon_extra, "prefix": prefix.runs}
    at = {"num_rows": num_rows, "batch_size": batch_size, "n": n}
    if dp.calibrate == "noise_multiplier":
        sigma = accounting.calibrate_noise_multiplier(
            lambda s: step_spend(replace(dp, noise_multiplier=s), **at), **kw)
        return replace(dp, noise_multiplier=sigma)
    knob = dp.selection.with_privacy  # DPConfig refuses selection_epsilon for a selection without this knob
    x = accounting.calibrate_selection_epsilon(lambda e: step_spend(replace(dp, selection=knob(e)), **at), **kw)
    return replace(dp, selection=knob(x))


def budget_steps(dp: DPConfig, step: StepSpend, prefix: Prefix | None = None) -> int | None:
    """The most training steps whose composition with the prefix stays within ``dp.target_epsilon`` (None = no
    target; 0 when the prefix alone exceeds it)."""
    if dp.target_epsilon is None:
        return None
    prefix = prefix or Prefix()
    if prefix.entries and composed_epsilon(prefix, dp, []) > dp.target_epsilon:
        return 0
    return accounting.max_steps(step, delta=prefix.accounting_delta(dp.delta),
                                target_epsilon=dp.target_epsilon - prefix.epsilon_extra, accountant=dp.accountant,
                                prefix=prefix.runs)


@dataclass(frozen=True)
class DPPlan:
    """A DP run's privacy plan: ``prefix`` (what is spent before the first step), ``dp`` (calibrated), ``spend``
    (what every step spends), ``cap`` (the most training steps within ``dp.target_epsilon``; None = no target)."""

    prefix: Prefix
    dp: DPConfig
    spend: StepSpend
    cap: int | None


def plan(cfg: Config, prefix: Prefix, *, num_rows: int, n: int, new: bool = True) -> DPPlan:
    """The plan of ``cfg`` over ``n`` training samples (or units) and ``num_rows`` selectable rows, after
    ``prefix``: the same for a run (``widedp.run.trainers``) and for ``widedp epsilon``
    (``widedp.commands.epsilon``). ``new``: not a resumed run (``check_data``). The plan's prefix carries the
    truncated batches' bound and δ_B (``bounded``)."""
    assert cfg.dp is not None
    check_data(cfg, n, new=new)
    b, steps = cfg.train.batch_size, total_steps(cfg, n)
    prefix = bounded(cfg, prefix, n=n, steps=steps,
                     spend=lambda: step_spend(cfg.dp, num_rows=num_rows, batch_size=b, n=n))  # type: ignore[arg-type]
    dp = calibrated(cfg.dp, steps=steps, batch_size=b, num_rows=num_rows, n=n, prefix=prefix)
    spend = step_spend(dp, num_rows=num_rows, batch_size=b, n=n)
    return DPPlan(prefix, dp, spend, budget_steps(dp, spend, prefix))


#: ``dp.max_batch_size: auto``: the smallest B whose δ_B is at most dp.delta / AUTO_SHARE
AUTO_SHARE = 1000


def bounded(cfg: Config, prefix: Prefix, *, n: int, steps: int, spend: Callable[[], StepSpend]) -> Prefix:
    """``prefix`` with the truncated batches of ``dp.max_batch_size`` (unchanged when null) over ``n`` units and
    ``steps`` steps, each spending ``spend()`` (the uncalibrated step: without a target nothing is calibrated): B
    resolved (``auto``), ε̄ chosen and verified (module docstring). A B whose δ_B leaves no δ: one line naming
    the key."""
    dp = cfg.dp
    assert dp is not None
    if dp.max_batch_size is None:
        return prefix
    q = sampling_rate(dp, cfg.train.batch_size, n)
    auto = dp.max_batch_size == "auto"
    if dp.target_epsilon is not None:
        bar = dp.target_epsilon  # calibration and the budget stop keep every reported ε at or below it
    else:
        runs = [(spend(), steps)]  # auto: ε at δ − δ_τ − δ/1000 bounds ε at δ_B <= δ/1000; a given B: a first guess
        at = prefix.accounting_delta(dp.delta) - dp.delta / AUTO_SHARE * auto
        if not at > 0:
            raise ConfigError(f"dp.max_batch_size: auto needs dp.delta / {AUTO_SHARE} beside data.vocab_dp.delta "
                              f"({prefix.threshold_delta:g}) within dp.delta ({dp.delta:g}); lower the latter")
        bar = _composed(prefix, dp, runs, None, at)
    bound = (sampling.smallest_bound(steps=steps, n=n, q=q, epsilon_bar=bar, delta_b=dp.delta / AUTO_SHARE) if auto
             else int(dp.max_batch_size))
    out = replace(prefix, batch_bound=bound, batch_units=n, batch_rate=q, batch_steps=steps, epsilon_bar=bar)
    out.accounting_delta(dp.delta)  # refuses a δ_B that leaves no δ
    if dp.target_epsilon is None and not auto:
        e, out = _settle(lambda p: _composed(p, dp, runs, None), out)
        if e > out.epsilon_bar:
            raise ConfigError(f"dp.max_batch_size: {bound:,} units per batch: no ε̄ covers the run's ε with its own δ_B "
                              f"(last ε={e:.4g}); raise it, or use auto")
    return out
