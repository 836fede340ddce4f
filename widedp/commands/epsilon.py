"""``widedp epsilon CONFIG``: the privacy a config would spend over its whole run, as JSON, without training.

It makes the privacy plan a run makes (``widedp.run.plan``: the prefix, calibration, the per-step spend, the budget
cap) from the task's n, rows and units (``widedp.tasks.Task.shape``), so the figure is the one the run reports.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from widedp import accounting
from widedp.accounting.statement import for_config, for_run, with_batch_bound
from widedp.config import Config
from widedp.dp import sampling, units
from widedp.errors import ConfigError
from widedp.extras import needs
from widedp.run import plan as plans
from widedp.tasks import AlgorithmTask, get_task


def epsilon_report(cfg: Config) -> dict[str, Any]:
    """What ``cfg`` would spend (``epsilon``: everything, at ``dp.delta``), its settings, and ``privacy``: the
    statement the run would make. With privacy units, a DP vocabulary or a row pre-selection also ``n_units``,
    ``privacy_unit``, ..., ``epsilon_training_only`` (the steps alone, at ``dp.delta``), ``vocabulary`` and
    ``preselect``; with ``dp.max_batch_size``, ``max_batch_size`` (B, δ_B, ε̄, ...)."""
    task = get_task(cfg.task)
    if isinstance(task, AlgorithmTask):
        return task.epsilon_report(cfg)
    if cfg.dp is None:
        raise ConfigError("epsilon: the config has no dp: section (non-private training spends no budget)")
    shape = task.shape(cfg)
    grouped = task.units(cfg, shape.train, device="cpu")
    n_units = grouped.num_units if grouped is not None else shape.n
    plan = plans.plan(cfg, plans.prefix_of(cfg), num_rows=shape.num_rows, n=n_units)
    dp, b, prefix = plan.dp, cfg.train.batch_size, plan.prefix  # the prefix with dp.max_batch_size's δ_B
    steps = plans.total_steps(cfg, n_units)
    if plan.cap is not None:
        steps = min(steps, plan.cap)
    rep = accounting.report(plan.spend, steps=steps, delta=prefix.accounting_delta(dp.delta),
                             accountant=dp.accountant)
    rep.update({"n_train": shape.n, "batch_size": b, "selection": dp.selection.name,
                "selection_epsilon": getattr(dp.selection, "epsilon", None), "budget_steps": plan.cap})
    if not units.is_per_sample(cfg) or prefix.entries:
        rep.update({"n_units": n_units, "privacy_unit": units.privacy_unit(cfg),
                    "batch_size_unit": "units" if not units.is_per_sample(cfg) else "samples", **shape.notes})
    if not units.is_per_sample(cfg):
        rep["max_samples_per_unit"] = cfg.data.max_samples_per_unit
    if prefix.entries:
        _with_prefix(rep, cfg, plan, steps)
    facts = for_config(task.privacy(cfg), cfg)
    if prefix.batch_bound is not None:
        _with_bound(rep, plan, steps)
        facts = with_batch_bound(facts, bound=prefix.batch_bound, delta_b=rep["max_batch_size"]["delta_batch"],
                                 units=f"{units.privacy_unit(cfg)}s")
    accountant = dp.accountant
    if dp.engine == "opacus":  # the run reports Opacus' own accountant: so does its plan
        accountant = _opacus(rep, dp, plans.sampling_rate(dp, b, n_units), steps)
    st = for_run(facts, epsilon=rep["epsilon"], delta=dp.delta, accountant=accountant,
                 private_rng=dp.rng == "secure")
    return {"privacy": st.text} | rep


def _opacus(rep: dict[str, Any], dp: Any, q: float, steps: int) -> str:
    """``rep``'s epsilon by Opacus' accountant (PRV for ``dp.accountant: pld`` where it works, else RDP), as the
    Opacus engine's summary reports it; widedp's figure stays as ``epsilon_widedp``. Returns the accountant's name."""
    with needs("opacus", "dp.engine: opacus"):
        from widedp.run.trainers.opacus_baseline import opacus_epsilons

    e = opacus_epsilons([(dp.noise_multiplier, q, steps)] if steps else [], dp.delta)
    acct = "prv" if dp.accountant == "pld" and e["prv"] is not None else "rdp"
    rep.update({"epsilon_widedp": rep["epsilon"], "epsilon": e[acct], "epsilon_opacus_rdp": e["rdp"],
                "accountant": f"opacus {acct}"})
    return f"Opacus {acct.upper()}"


def _with_prefix(rep: dict[str, Any], cfg: Config, plan: plans.DPPlan, steps: int) -> None:
    """The DP vocabulary and the row pre-selection composed with the steps: ``epsilon`` covers all, and
    ``epsilon_training_only`` the steps alone at ``dp.delta`` (not at the ledger's δ − δ_τ: what the steps would
    cost in a run without the prefix)."""
    prefix, dp = plan.prefix, plan.dp
    rep["epsilon_training_only"] = accounting.compose_epsilon([(plan.spend, steps)] if steps else [], delta=dp.delta,
                                                              accountant=dp.accountant)
    for key, acct in (("epsilon_pld", "pld"), ("epsilon_rdp", "rdp")):
        rep[key] = plans.composed_epsilon(prefix, dp, [(plan.spend, steps)], acct)
    rep["epsilon"] = rep["epsilon_pld"] if dp.accountant == "pld" else rep["epsilon_rdp"]
    rep["delta"] = dp.delta
    if dp.preselect is not None:  # the last prefix entry
        rep["preselect"] = {"mechanism": "one-shot Gaussian row pre-selection (widedp.dp.selection.preselect)",
                            "sampling_rate": 1.0, "noise_multiplier": dp.preselect.sigma, "sensitivity": 1.0,
                            "rows": dp.preselect.rows, "threshold": dp.preselect.tau,
                            "epsilon_alone": plans.composed_epsilon(plans.Prefix(prefix.entries[-1:]), dp, [])}
    if prefix.vocabulary:  # the first prefix entry
        v, first = cfg.data.vocab_dp, replace(prefix, entries=prefix.entries[:1])
        rep["vocabulary"] = {"mechanism": "Gaussian partition selection (widedp.dp.vocab)", "sampling_rate": 1.0,
                             "noise_multiplier": v.noise_multiplier, "sensitivity": 1.0,
                             "max_words_per_unit": v.max_words_per_unit, "threshold_delta": v.delta,
                             "epsilon_alone": plans.composed_epsilon(first, dp, []),
                             "accounting": f"ledger eps at delta - {v.delta:g} (vocabulary Gaussian + steps) "
                                           f"+ ln(1/(1 - {v.delta:g}))"}


def _with_bound(rep: dict[str, Any], plan: plans.DPPlan, steps: int) -> None:
    """``dp.max_batch_size``: its resolved B and what δ_B is computed from; ``epsilon_pld`` / ``epsilon_rdp`` (and
    ``epsilon``) as the run reports them: at δ − δ_τ − δ_B, each settled against ε̄ (``plans.composed_epsilon_with``),
    with the ε̄ and δ_B each is valid with (the headline's, and the RDP cross-check's ``*_rdp``);
    ``epsilon_training_only`` (with a prefix) the steps alone at δ − δ_B."""
    prefix, dp = plan.prefix, plan.dp
    covering = {}  # accountant -> the prefix whose ε̄ and δ_B go with its figure
    for key, acct in (("epsilon_pld", "pld"), ("epsilon_rdp", "rdp")):
        rep[key], covering[acct] = plans.composed_epsilon_with(prefix, dp, [(plan.spend, steps)] if steps else [],
                                                               acct)
    rep["epsilon"] = rep["epsilon_pld"] if dp.accountant == "pld" else rep["epsilon_rdp"]
    if "epsilon_training_only" in rep:  # the steps alone, their truncated batches' δ_B included
        alone = replace(prefix, entries=(), threshold_delta=0.0, vocabulary=False)
        rep["epsilon_training_only"] = plans.composed_epsilon(alone, dp, [(plan.spend, steps)] if steps else [])
    assert prefix.batch_bound is not None
    rep["delta"] = dp.delta
    head, rdp = covering[dp.accountant], covering["rdp"]
    log_tail = sampling.log_overflow(prefix.batch_units + 1, prefix.batch_rate, prefix.batch_bound)
    rep["max_batch_size"] = {
        "bound": prefix.batch_bound, "auto": dp.max_batch_size == "auto", "delta_batch": head.batch_delta,
        "epsilon_bar": head.epsilon_bar, "delta_batch_rdp": rdp.batch_delta, "epsilon_bar_rdp": rdp.epsilon_bar,
        "steps": prefix.batch_steps, "n_units": prefix.batch_units,
        "sampling_rate": prefix.batch_rate, "overflow_per_step": math.exp(log_tail),
        "accounting": "truncated Poisson: ledger eps at delta - delta_tau - delta_B, delta_B = (1 + e^eps_bar) * T * "
                      "P[Binomial(N + 1, q) > B] (widedp.dp.sampling)"}
