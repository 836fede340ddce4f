"""What every accountant (``pld``, ``rdp``) must satisfy, as a base class subclassed once per accountant (the pattern
of dp_accounting's privacy_accountant_test.py), plus the invariant it missed: composing a record ``count=k`` times
at once equals k single compositions (privacy.md §3: dp_accounting's development head ignored ``count`` for its
exponential-mechanism event).

The module-level composers (``pld_epsilon`` / ``rdp_epsilon``) compose run by run without merging equal records, so
``[(c, 1)] * k`` really is k compositions; the front door (``compose_epsilon``, ``Ledger``) merges them first.
"""

from __future__ import annotations

import pytest

from widedp.accounting import Ledger, compose_epsilon, epsilon, epsilon_for_step
from widedp.accounting import pld as P
from widedp.accounting import rdp as R
from widedp.accounting.parts import Costs, costs_of
from widedp.dp.spend import (
    ExponentialSpend,
    FreeSpend,
    GaussianSelectionSpend,
    GaussianSpend,
    SparseVectorSpend,
    StepSpend,
)

DELTA = 1e-5
Q, T = 1e-4, 200_000  # privacy.md's reference setting: n = 200K, b = 20, 20 epochs
FREE = StepSpend(0.05, (FreeSpend("uniform"),))
STEPS = [
    StepSpend(0.05, (GaussianSpend(0.9), ExponentialSpend(0.3, 4))),
    StepSpend(0.05, (GaussianSpend(0.9), SparseVectorSpend(0.3, 2, 0.1))),
    StepSpend(0.05, (GaussianSpend(0.9), FreeSpend("uniform"))),
    StepSpend(0.05, (GaussianSpend(1.2), GaussianSelectionSpend(3.0))),
]
IDS = ["exponential", "sparse_vector", "free", "gaussian_selection"]


class AccountantContract:
    """Subclass per accountant: set ``name``, ``compose`` (the module-level composer: no merging), the reference
    figures ``(step factory, steps, eps, abs tolerance)`` (the paper's joint step: test_accounting_{pld,rdp}.py),
    how much k steps must cost over one (``growth``) and how exactly k compositions match one (``rel``: PLD
    discretises, RDP adds curves)."""

    __test__ = False
    name: str
    growth: float
    rel: float
    k: int = 6
    references: tuple = ()

    def compose(self, runs: list[tuple[Costs, int]]) -> float:
        raise NotImplementedError

    @pytest.mark.parametrize("step", STEPS, ids=IDS)
    def test_count_k_equals_k_single_composes(self, step):
        c, k = costs_of(step), self.k
        one_run = self.compose([(c, k)])
        assert one_run == pytest.approx(self.compose([(c, 1)] * k), rel=self.rel)
        assert one_run > self.growth * self.compose([(c, 1)])  # count is not ignored
        # the front door merges equal records (composition commutes), free runs in between cost nothing
        front = compose_epsilon([(step, 2), (FREE, 3), (step, k - 2)], delta=DELTA, accountant=self.name)
        assert front == pytest.approx(one_run, rel=1e-3)
        ledger = Ledger()
        for _ in range(k):
            ledger.add(step)
        assert epsilon(ledger, delta=DELTA, accountant=self.name) == pytest.approx(one_run, rel=1e-3)

    @pytest.mark.parametrize("step", STEPS, ids=IDS)
    def test_epsilon_grows_with_steps_and_shrinks_with_delta(self, step):
        eps = [epsilon_for_step(step, steps=t, delta=DELTA, accountant=self.name) for t in (1, 10, 100, 1000)]
        assert all(a < b for a, b in zip(eps, eps[1:])), eps
        looser = epsilon_for_step(step, steps=100, delta=1e-3, accountant=self.name)
        assert 0 < looser < eps[2]

    @pytest.mark.parametrize("step", STEPS[:2], ids=IDS[:2])
    def test_joint_step_costs_more_than_either_part(self, step):
        joint = epsilon_for_step(step, steps=200, delta=DELTA, accountant=self.name)
        for part in step.parts:
            alone = epsilon_for_step(StepSpend(step.sampling_rate, (part,)), steps=200, delta=DELTA,
                                     accountant=self.name)
            assert 0 < alone < joint

    def test_free_steps_and_no_steps_cost_nothing(self):
        assert epsilon_for_step(FREE, steps=10_000, delta=DELTA, accountant=self.name) == 0.0
        assert epsilon_for_step(STEPS[0], steps=0, delta=DELTA, accountant=self.name) == 0.0
        assert epsilon(Ledger(), delta=DELTA, accountant=self.name) == 0.0

    def test_reference_figures(self):
        for make, steps, expected, tol in self.references:
            got = epsilon_for_step(make(), steps=steps, delta=DELTA, accountant=self.name)
            assert got == pytest.approx(expected, abs=tol), (make, steps)


class TestPLD(AccountantContract):
    __test__ = True
    name, growth, rel = "pld", 1.3, 1e-3
    references = (
        (lambda: StepSpend(Q, (GaussianSpend(0.5),)), T, 2.418, 1e-3),  # privacy.md: the Gaussian part alone
    )

    def compose(self, runs):
        return P.pld_epsilon(runs, DELTA)


class TestRDP(AccountantContract):
    __test__ = True
    name, growth, rel, k = "rdp", 1.2, 1e-9, 37
    references = (
        (lambda: StepSpend(Q, (GaussianSpend(0.5),)), T, 3.522, 1e-3),  # privacy.md: the Gaussian part alone
        (lambda: StepSpend(Q, (GaussianSpend(0.32),)), T, 26.06, 0.01),  # privacy.md: plain DP-SGD at sigma 0.32
    )

    def compose(self, runs):
        return R.rdp_epsilon(runs, DELTA)[0]
