"""The plan with bounded (truncated Poisson) batches, ``dp.max_batch_size``: δ_B charged outside the ledger beside
the vocabulary's δ_τ, ``auto`` the smallest valid B, a too-small B refused, ε̄ covering what is reported,
calibration landing at the target at the reduced δ, and null changing nothing."""

import math
from dataclasses import replace

import pytest

from widedp import accounting
from widedp.accounting.statement import UnitFacts, for_run, with_batch_bound
from widedp.config import AllRowsConfig, Config, DataConfig, DPConfig, TrainConfig, VocabDPConfig, config_from_dict
from widedp.dp import sampling
from widedp.errors import ConfigError
from widedp.run import plan

DELTA, DELTA_TAU, N, ROWS = 1e-5, 1e-6, 20_000, 50  # batch 200 -> q = 0.01, 2 epochs -> T = 200 steps


def _cfg(*, vocabulary="private_top", **dp_kw):
    data = DataConfig(privacy_unit="sentence", vocabulary=vocabulary,
                      vocab_dp=VocabDPConfig(noise_multiplier=4.0, delta=DELTA_TAU))
    kw = {"clip1": 1.0, "clip2": None, "noise_multiplier": 1.0, "delta": DELTA, "selection": AllRowsConfig(), **dp_kw}
    return Config(data=data, train=TrainConfig(epochs=2, batch_size=200), dp=DPConfig(**kw))


def _plan(cfg):
    return plan.plan(cfg, plan.prefix_of(cfg), num_rows=ROWS, n=N)


def _delta_b(prefix, bound):
    return sampling.truncation_delta(steps=prefix.batch_steps, n=N, q=prefix.batch_rate, bound=bound,
                                     epsilon_bar=prefix.epsilon_bar)


def test_null_changes_nothing():
    cfg = _cfg()
    p = _plan(cfg)
    assert p.prefix == plan.prefix_of(cfg) and p.prefix.batch_delta == 0.0
    assert p.prefix.accounting_delta(DELTA) == DELTA  # exactly: no δ share taken
    runs = [(p.spend, 200)]
    assert plan.composed_epsilon(p.prefix, cfg.dp, runs) == accounting.compose_epsilon(runs, delta=DELTA)


def test_auto_is_the_smallest_valid_bound_and_calibration_lands_at_the_reduced_delta():
    cfg = _cfg(vocabulary="dp", max_batch_size="auto", target_epsilon=3.0, calibrate="noise_multiplier")
    p = _plan(cfg)
    pre, b = p.prefix, p.prefix.batch_bound
    assert pre.epsilon_bar == 3.0 and pre.batch_steps == 200 and pre.batch_rate == pytest.approx(0.01)
    assert _delta_b(pre, b) <= DELTA / plan.AUTO_SHARE < _delta_b(pre, b - 1)
    assert 200 < b < 330  # far above the mean 200: an overflow is rare
    assert pre.accounting_delta(DELTA) == pytest.approx(DELTA - DELTA_TAU - pre.batch_delta, rel=1e-15)
    # calibration: the whole run spends the target at δ − δ_τ − δ_B (within 1% below), never above ε̄
    eps = accounting.compose_epsilon([*pre.runs, (p.spend, 200)], delta=DELTA - DELTA_TAU - pre.batch_delta)
    eps += -math.log1p(-DELTA_TAU)
    assert 0.99 * 3.0 <= eps <= 3.0 == pre.epsilon_bar
    assert p.cap is not None and p.cap >= 200


@pytest.mark.parametrize("bound", ["auto", 290])
def test_without_a_target_eps_bar_covers_the_whole_run(bound):
    cfg = _cfg(max_batch_size=bound, noise_multiplier=1.2)
    p = _plan(cfg)
    whole = plan._composed(p.prefix, p.dp, [(p.spend, 200)], None)  # at δ − δ_B(ε̄), not settled
    assert whole <= p.prefix.epsilon_bar
    assert plan.composed_epsilon(p.prefix, p.dp, [(p.spend, 200)]) == whole
    if bound == "auto":
        assert p.prefix.batch_delta <= DELTA / plan.AUTO_SHARE


def test_a_too_small_bound_is_refused_naming_the_key_and_figures():
    with pytest.raises(ConfigError, match=r"dp\.max_batch_size: 210 units per batch spends δ_B=.*T=200 steps, "
                                          r"N=20,000, q=0\.01.*ε̄=3"):
        _plan(_cfg(max_batch_size=210, target_epsilon=3.0))
    ok = _plan(_cfg(max_batch_size=400, target_epsilon=3.0)).prefix
    assert ok.batch_bound == 400 and 0 <= ok.batch_delta < 1e-30


def test_reports_settle_the_figures_against_eps_bar():
    cfg = _cfg(max_batch_size=290, noise_multiplier=1.2)
    p = _plan(cfg)
    ledger = accounting.Ledger()
    ledger.add(p.spend, count=200)
    out = plan.epsilons(p.dp, ledger, p.prefix)
    assert out["delta_batch"] == p.prefix.batch_delta > 0
    assert out["epsilon"] == plan.composed_epsilon(p.prefix, p.dp, [(p.spend, 200)]) <= p.prefix.epsilon_bar
    # more steps than planned: η counts them, and a figure above ε̄ is recomputed at a δ_B that covers it
    ledger.add(p.spend, count=200)
    more = plan.epsilons(p.dp, ledger, p.prefix)
    assert more["epsilon"] > p.prefix.epsilon_bar and math.isfinite(more["epsilon"])
    bar = more["epsilon"] * (1 + 1e-3) + 1e-3  # (the settled ε̄ is just above the figure it covers)
    covered = replace(p.prefix, batch_steps=400, epsilon_bar=bar)
    direct = accounting.epsilon(ledger, delta=covered.accounting_delta(DELTA))
    assert direct <= bar and more["epsilon"] <= direct + 1e-6


def test_statement_names_the_bound_and_its_delta_share():
    facts = with_batch_bound(UnitFacts("sentence (≤ 32 pairs)"), bound=1252, delta_b=9.49e-9, units="sentences")
    text = for_run(facts, epsilon=7.96, delta=1e-5, accountant="pld", private_rng=True).text
    assert "includes: batches of at most 1,252 sentences (truncated Poisson; δ_B=9.49e-09 of δ)" in text
    assert with_batch_bound(UnitFacts("x"), bound=None, delta_b=0.0, units="xs") == UnitFacts("x")


@pytest.mark.parametrize("value", [0, -3, "big", True, 2.5, [4]])
def test_bad_values_are_one_line_naming_the_key(value):
    with pytest.raises(ConfigError, match=r"^dp\.max_batch_size: ") as e:
        config_from_dict({"dp": {"selection": {"name": "all"}, "max_batch_size": value}})
    assert "\n" not in str(e.value)


def test_values_and_engines():
    for value in ("auto", 64, None):
        assert config_from_dict({"dp": {"selection": {"name": "all"}, "max_batch_size": value}}).dp.max_batch_size \
            == value
    with pytest.raises(ConfigError, match=r"^dp\.max_batch_size: .*dp\.engine: opacus"):
        DPConfig(selection=AllRowsConfig(), engine="opacus", max_batch_size=64)
