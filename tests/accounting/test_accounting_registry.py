"""Accountants are small classes behind one registry: a new one is a subclass plus one registry line, and every entry
point (compose, report, calibration, the config) takes it; the Opacus PRV baseline is an adapter that refuses what it
does not model; ``paper`` is refused everywhere."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from widedp import accounting
from widedp.accounting.base import Accountant
from widedp.accounting.parts import Costs
from widedp.accounting.rdp import rdp_epsilon
from widedp.accounting.registry import ACCOUNTANTS
from widedp.config import DPConfig, ExponentialSelectionConfig
from widedp.dp.spend import ExponentialSpend, GaussianSpend, StepSpend
from widedp.errors import ConfigError

SEL = ExponentialSelectionConfig(k=5, epsilon=0.1, score_clip=0.1)
STEP = StepSpend(0.01, (GaussianSpend(1.0, 0.01), ExponentialSpend(epsilon=0.05, picks=5)))
SGD = StepSpend(0.01, (GaussianSpend(1.0, 0.01),))


class Doubled(Accountant):
    """A toy accountant: twice the RDP figure (a valid, looser bound)."""

    name = "doubled"
    method = "2 x rdp"

    def epsilon(self, runs: Sequence[tuple[Costs, int]], delta: float) -> float:
        return 2 * rdp_epsilon(runs, delta)[0]


def test_a_new_accountant_is_a_class_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(ACCOUNTANTS, "doubled", Doubled())
    rdp = accounting.compose_epsilon([(STEP, 300)], delta=1e-5, accountant="rdp")
    assert accounting.compose_epsilon([(STEP, 300)], delta=1e-5, accountant="doubled") == pytest.approx(2 * rdp)
    rep = accounting.report(STEP, steps=300, delta=1e-5, accountant="doubled")
    assert rep["epsilon"] == rep["epsilon_doubled"] == pytest.approx(2 * rdp) and rep["method"]["doubled"] == "2 x rdp"
    assert DPConfig(clip1=1.0, clip2=1.0, selection=SEL, accountant="doubled").accountant == "doubled"
    sigma = accounting.calibrate_noise_multiplier(
        lambda s: StepSpend(0.01, (GaussianSpend(s, 0.01), ExponentialSpend(epsilon=0.05, picks=5))), steps=300,
        delta=1e-5, target_epsilon=4.0, accountant="doubled")
    got = accounting.compose_epsilon([(StepSpend(0.01, (GaussianSpend(sigma, 0.01), STEP.parts[1])), 300)],
                                     delta=1e-5, accountant="doubled")
    assert 0.99 * 4.0 <= got <= 4.0


def test_every_entry_is_an_accountant_with_one_return_type():
    for name, acct in ACCOUNTANTS.items():
        assert isinstance(acct, Accountant) and acct.name == name
        assert isinstance(acct.epsilon([(Costs(q=0.01, sigma=1.0), 100)], 1e-5), float)


def test_the_opacus_prv_adapter_is_a_baseline_for_dp_sgd_only():
    from opacus.accountants import PRVAccountant

    ref = PRVAccountant()
    ref.history = [(1.0, 0.01, 1000)]
    got = accounting.compose_epsilon([(SGD, 1000)], delta=1e-5, accountant="opacus_prv")
    assert got == pytest.approx(ref.get_epsilon(1e-5), rel=1e-9)
    with pytest.raises(ConfigError, match="opacus_prv accounts for DP-SGD's sampled Gaussian steps only"):
        accounting.compose_epsilon([(STEP, 10)], delta=1e-5, accountant="opacus_prv")
    with pytest.raises(ConfigError, match="dp.accountant: expected one of pld, rdp, got 'opacus_prv'"):
        DPConfig(clip1=1.0, clip2=1.0, selection=SEL, accountant="opacus_prv")


@pytest.mark.parametrize("name", ["paper", "nope"])
def test_paper_and_unknown_names_are_refused_in_one_line(name):
    with pytest.raises(ConfigError, match="dp.accountant") as e:
        accounting.compose_epsilon([(STEP, 10)], delta=1e-5, accountant=name)
    assert "\n" not in str(e.value)
