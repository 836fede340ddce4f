"""Audit of ``dp.max_batch_size`` (truncated Poisson batches): regression tests for defects found in review (now
fixed); fast (the plan and the tail only, no training)."""

import math

import pytest

from widedp import accounting
from widedp.config import AllRowsConfig, Config, DataConfig, DPConfig, TrainConfig, VocabDPConfig
from widedp.dp import sampling
from widedp.run import plan

DELTA, DELTA_TAU, N, ROWS, T = 1e-5, 1e-6, 20_000, 50, 200  # batch 200 -> q = 0.01, 2 epochs -> T = 200 steps


def _plan(**dp_kw):
    data = DataConfig(privacy_unit="sentence", vocabulary="private_top",
                      vocab_dp=VocabDPConfig(noise_multiplier=4.0, delta=DELTA_TAU))
    kw = {"clip1": 1.0, "clip2": None, "noise_multiplier": 1.2, "delta": DELTA, "selection": AllRowsConfig(),
          **dp_kw}
    cfg = Config(data=data, train=TrainConfig(epochs=2, batch_size=200), dp=DPConfig(**kw))
    return plan.plan(cfg, plan.prefix_of(cfg), num_rows=ROWS, n=N)


def _ledger(p, steps):
    ledger = accounting.Ledger()
    ledger.add(p.spend, count=steps)
    return ledger


def test_reported_delta_batch_covers_the_reported_epsilon():
    """Fixed: plan.epsilons: a figure settled above the plan's ε̄ (more steps than planned) is returned with
    delta_batch at the plan's ε̄, not at the ε̄ that covers it: the δ_B reported (metrics, summary's
    delta_batch/epsilon_bar, the statement's 'δ_B=... of δ') understates the δ share the reported ε actually uses."""
    p = _plan(max_batch_size=290)
    out = plan.epsilons(p.dp, _ledger(p, 2 * T), p.prefix)  # twice the planned steps (e.g. recharged after a loss)
    assert out["epsilon"] > p.prefix.epsilon_bar and math.isfinite(out["epsilon"])
    needed = sampling.truncation_delta(steps=2 * T, n=N, q=p.prefix.batch_rate, bound=290,
                                       epsilon_bar=out["epsilon"])
    assert out["delta_batch"] >= needed


def test_a_report_past_the_planned_steps_never_raises():
    """Fixed: plan.epsilons evaluates prefix.accounting_delta unguarded: when more steps than planned push δ_B to δ −
    δ_τ or above, it raises ConfigError from a report (per-epoch ε, the summary), stopping a run mid-way that can
    never finish on resume, where _settled would give ∞."""
    p = _plan(max_batch_size=283)  # accepted: δ_B ≈ 0.65·δ at T = 200
    assert 0 < p.prefix.batch_delta < DELTA - DELTA_TAU
    out = plan.epsilons(p.dp, _ledger(p, 3 * T), p.prefix)
    assert out["epsilon"] >= p.prefix.epsilon_bar  # (∞, or a figure covered by its own δ_B)


def _log_pmf(n, q, k):
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(q)
            + (n - k) * math.log1p(-q))


@pytest.mark.parametrize(("n", "q", "bound"), [(100_000, 0.01, 2431), (3000, 0.1, 1086), (2000, 0.3, 1435)])
def test_overflow_tail_is_an_upper_bound_in_the_subnormal_range(n, q, bound):
    """Fixed: sampling.log_overflow: where scipy's sf is subnormal (ln between ~-745 and -708) binom.logsf loses
    precision and is returned as is, up to ~1/3 below the true tail: not an upper bound there (the fallback only
    handles an sf of exactly 0), so δ_B can be under-charged."""
    # the tail's first 50 terms, sum of P[X = k] for k = bound + 1 .. bound + 50, are a lower bound on P[X > bound]
    terms = [_log_pmf(n, q, k) for k in range(bound + 1, bound + 51)]
    top = max(terms)
    lower = top + math.log(sum(math.exp(t - top) for t in terms))
    assert -745 < lower < -708
    assert sampling.log_overflow(n, q, bound) >= lower
