"""What every row selector must satisfy, as a base class subclassed once per implementation (the pattern of
dp_accounting's privacy_accountant_test.py): distinct in-range ids, ``spend()`` is what the step records (and what
the budget composes), untouched rows stay candidates (privacy.md §1.2), determinism for a fixed generator, empty
batches, and ``count=k`` composition of its spend equal to k single ones in both accountants.

The output laws themselves are tested per mechanism (test_selection.py, test_selection_svt.py,
test_selection_gaussian.py, test_preselect.py).
"""

from __future__ import annotations

import pytest
import torch

from widedp.accounting import pld as P
from widedp.accounting import rdp as R
from widedp.accounting.parts import costs_of
from widedp.config import (
    AllRowsConfig,
    DPConfig,
    ExponentialSelectionConfig,
    GaussianThresholdSelectionConfig,
    RandomSparsificationConfig,
    SelectionConfig,
    SparseVectorSelectionConfig,
    UniformSelectionConfig,
)
from widedp.dp.rowgrads import PerSampleRows, coalesce
from widedp.dp.selection import SelectionContext, Selector, make_selector
from widedp.dp.spend import ExponentialSpend, FreeSpend, GaussianSelectionSpend, SparseVectorSpend, StepSpend
from widedp.dp.step import dp_step, dp_step_spend
from widedp.errors import ConfigError
from widedp.run.plan import step_spend
from widedp.run.preselect_setup import Preselection, restrict_selector

ROWS, DIM, DELTA = 12, 3, 1e-5
CTX = SelectionContext(epoch=1, num_epochs=3)
STEP = {"batch_size": 10.0, "sampling_rate": 0.01, "clip1": 1.0, "clip2": 0.05, "noise_multiplier": 0.8}
TOUCHED = torch.tensor([2, 5, 7])


def batch(seed: int, size: int) -> PerSampleRows:
    """``size`` samples touching 1-3 of ``ROWS`` rows each (size 0: the empty Poisson batch)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 4, (size,), generator=gen)
    rows = torch.randint(ROWS, (int(lens.sum()),), generator=gen)
    values = torch.randn(rows.numel(), DIM, generator=gen, dtype=torch.float64)
    return coalesce(values, rows, torch.repeat_interleave(torch.arange(size), lens), size, ROWS)


class SelectorContract:
    """Subclass per selector: ``make()`` a fresh one over ``ROWS`` rows (``config``: the ``dp.selection`` the factory
    builds it from, if any), ``k`` its exact number of rows (None: varies), ``favours_touched`` whether rows with
    ``high`` scores (a large score of its kind; untouched rows have 0) must be picked more often than the others."""

    __test__ = False
    config: SelectionConfig | None = None
    k: int | None = None
    favours_touched = True
    high = 1.0

    def make(self) -> Selector:
        assert self.config is not None
        return make_selector(self.config, num_rows=ROWS)

    def select(self, sel: Selector, touched: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        scores = torch.full((touched.numel(),), self.high, dtype=torch.float64)
        if sel.score_kind == "none":
            scores = scores[:0]
        return sel.select(touched, scores, selectable_rows=ROWS, score_sensitivity=1.0, ctx=CTX, generator=gen)

    def candidates(self) -> set[int]:
        """The rows it may ever select."""
        return set(range(ROWS))

    def test_ids_are_distinct_int64_in_range(self):
        sel, gen = self.make(), torch.Generator().manual_seed(0)
        for touched in (TOUCHED, TOUCHED[:0], torch.arange(ROWS)):
            for _ in range(20):
                s = self.select(sel, touched, gen)
                assert s.dtype == torch.long and s.dim() == 1 and s.unique().numel() == s.numel()
                assert set(s.tolist()) <= self.candidates()
                if self.k is not None:
                    assert s.numel() == self.k

    def test_spend_is_what_the_step_records(self):
        sel = self.make()
        before = sel.spend()
        res = dp_step(batch(1, 6), selector=sel, ctx=CTX, generator=torch.Generator().manual_seed(1), **STEP)
        assert res.spend == dp_step_spend(sel, **STEP) and res.spend.parts[1] == sel.spend() == before
        if self.config is not None:  # and what the budget (calibration, journal, widedp epsilon) composes
            dp = DPConfig(clip1=STEP["clip1"], clip2=STEP["clip2"], noise_multiplier=STEP["noise_multiplier"],
                          selection=self.config)
            assert res.spend == step_spend(dp, num_rows=ROWS, batch_size=10, n=1000)

    def test_untouched_rows_stay_candidates(self):
        """Scores only on touched rows: untouched rows are still picked, and (data-dependent) touched rows more."""
        sel, gen = self.make(), torch.Generator().manual_seed(2)
        hits = torch.zeros(ROWS)
        for _ in range(400):
            hits.index_put_((self.select(sel, TOUCHED, gen),), torch.tensor(1.0), accumulate=True)
        untouched = sorted(self.candidates() - set(TOUCHED.tolist()))
        assert hits[untouched].sum() > 0
        if self.favours_touched:
            assert hits[TOUCHED].mean() > 1.2 * hits[untouched].mean()

    def test_deterministic_for_a_fixed_generator(self):
        runs = []
        for _ in range(2):
            sel, gen = self.make(), torch.Generator().manual_seed(3)
            runs.append([self.select(sel, t, gen).tolist() for t in (TOUCHED, TOUCHED[:0], TOUCHED)])
        assert runs[0] == runs[1]

    def test_empty_batch(self):
        sel = self.make()
        assert set(self.select(sel, TOUCHED[:0], torch.Generator().manual_seed(4)).tolist()) <= self.candidates()
        res = dp_step(batch(5, 0), selector=sel, ctx=CTX, generator=torch.Generator().manual_seed(4), **STEP)
        assert res.grad.values.shape == (res.selected.numel(), DIM) and res.spend == dp_step_spend(sel, **STEP)
        assert torch.isfinite(res.grad.values).all()

    def test_count_k_composes_as_k_single_steps(self):
        k = 5
        step = dp_step_spend(self.make(), **{**STEP, "sampling_rate": 0.05})
        sel_only = costs_of(StepSpend(step.sampling_rate, step.parts[1:]))
        for c in (costs_of(step), sel_only):
            assert P.pld_epsilon([(c, k)], DELTA) == pytest.approx(P.pld_epsilon([(c, 1)] * k, DELTA), rel=1e-3)
            assert R.rdp_epsilon([(c, k)], DELTA)[0] == pytest.approx(R.rdp_epsilon([(c, 1)] * k, DELTA)[0], rel=1e-9)
        alone = [P.pld_epsilon([(sel_only, n)], DELTA) for n in (1, k)]
        if isinstance(step.parts[1], FreeSpend):
            assert alone == [0.0, 0.0]
        else:
            assert 0 < alone[0] < alone[1]


class TestExponentialAuto(SelectorContract):
    __test__ = True
    config, k = ExponentialSelectionConfig(k=2, epsilon=2.0, score_clip=1.0), 2


class TestExponentialSparse(SelectorContract):
    __test__ = True
    config, k = ExponentialSelectionConfig(k=2, epsilon=2.0, score_clip=1.0, method="sparse"), 2


class TestExponentialBrute(SelectorContract):
    __test__ = True
    config, k = ExponentialSelectionConfig(k=2, epsilon=2.0, score_clip=1.0, method="brute"), 2


class TestExponentialCounts(SelectorContract):
    __test__ = True
    config, k, high = ExponentialSelectionConfig(k=3, epsilon=1.0, score_clip=4.0, score="count"), 3, 3.0


class TestSparseVector(SelectorContract):
    __test__ = True
    config = SparseVectorSelectionConfig(epsilon=4.0, threshold=0.5, cutoff=3, score_clip=1.0)


class TestSparseVectorBrute(SelectorContract):
    __test__ = True
    config = SparseVectorSelectionConfig(epsilon=4.0, threshold=0.5, cutoff=3, score_clip=1.0, method="brute",
                                         release_values=True, epsilon_release=0.5)


class TestGaussianThreshold(SelectorContract):
    __test__ = True
    config, high = GaussianThresholdSelectionConfig(sigma=1.0, threshold=1.0), 3.0


class TestGaussianThresholdCapped(SelectorContract):
    __test__ = True
    config, high, k = GaussianThresholdSelectionConfig(sigma=0.5, threshold=-5.0, max_rows=4), 3.0, 4
    favours_touched = False  # every row passes: the cap's uniform subset is all that is left (still charged)


class TestUniform(SelectorContract):
    __test__ = True
    config, k, favours_touched = UniformSelectionConfig(k=4), 4, False


class TestRandomSparsification(SelectorContract):
    __test__ = True
    config, favours_touched = RandomSparsificationConfig(final_rate=0.5), False
    k = round((1 - 0.5 * CTX.epoch / (CTX.num_epochs - 1)) * ROWS)  # gradual cooling: r(1) = 0.25 of 3 epochs

    def test_untouched_rows_stay_candidates(self):
        """One mask per epoch (from the step generator's seed): over seeds, every row is kept sometimes."""
        kept = set()
        for seed in range(30):
            kept |= set(self.select(self.make(), TOUCHED, torch.Generator().manual_seed(seed)).tolist())
        assert kept == set(range(ROWS))


class TestAllRows(SelectorContract):
    __test__ = True
    config, k, favours_touched = AllRowsConfig(), ROWS, False


class TestPreselectedExponential(SelectorContract):
    """An exponential selector over the pre-selected rows only, built as a run with ``dp.preselect`` builds it
    (``widedp.run.preselect_setup.restrict_selector`` on the factory's selector over all R rows), so its spend must
    be the budget's ``step_spend`` of ``dp.selection`` (the pre-selection itself is charged once, separately)."""

    __test__ = True
    config = ExponentialSelectionConfig(k=2, epsilon=2.0, score_clip=1.0)
    k = 2
    rows = torch.tensor([0, 2, 3, 5, 7, 8, 10, 11])

    def make(self) -> Selector:
        return restrict_selector(make_selector(self.config, num_rows=ROWS), Preselection(self.rows, ROWS))

    def candidates(self) -> set[int]:
        return set(self.rows.tolist())


def test_factory_spend_records_and_k():
    """The records the ledger keeps (pinned), k from ``k`` or ``gamma`` of R, and k > R refused."""
    cases = [
        (ExponentialSelectionConfig(k=3, epsilon=0.5), 3, ExponentialSpend(epsilon=0.5, picks=3)),
        (ExponentialSelectionConfig(gamma=0.05, method="brute"), 5, ExponentialSpend(epsilon=1.0, picks=5)),
        (SparseVectorSelectionConfig(cutoff=2, epsilon=3.0), None, SparseVectorSpend(epsilon=3.0, cutoff=2)),
        (SparseVectorSelectionConfig(release_values=True, epsilon_release=0.2), None,
         SparseVectorSpend(epsilon=1.0, cutoff=1, epsilon_release=0.2)),
        (GaussianThresholdSelectionConfig(sigma=4.0), None, GaussianSelectionSpend(4.0, 1.0)),
        (UniformSelectionConfig(gamma=0.001), 1, FreeSpend("uniform")),
        (RandomSparsificationConfig(final_rate=0.5), None, FreeSpend("random_sparsification")),
        (AllRowsConfig(), None, FreeSpend("all")),
    ]
    for cfg, k, spend in cases:
        sel = make_selector(cfg, num_rows=100)
        assert sel.spend() == spend and getattr(sel, "k", None) == k, cfg
        assert sel.score_clip == getattr(cfg, "score_clip", None)
    for cfg in (ExponentialSelectionConfig(k=101), UniformSelectionConfig(k=101)):
        with pytest.raises(ConfigError, match="dp.selection.k"):
            make_selector(cfg, num_rows=100)


class _TouchedOnly:
    """Broken: the exponential mechanism among the touched rows only (publishes which rows the batch touched)."""

    def __init__(self, base: Selector) -> None:
        self.base, self.score_kind, self.score_clip = base, base.score_kind, base.score_clip

    def spend(self):
        return self.base.spend()

    def select(self, touched, scores, *, selectable_rows, score_sensitivity, ctx, generator):
        local = self.base.select(torch.arange(touched.numel()), scores, selectable_rows=touched.numel(),
                                 score_sensitivity=score_sensitivity, ctx=ctx, generator=generator)
        return touched.index_select(0, local)


class _GlobalRNG:
    """Broken: draws from torch's global generator instead of the one it is handed."""

    score_kind, score_clip = "none", None

    def spend(self):
        return FreeSpend("uniform")

    def select(self, touched, scores, *, selectable_rows, score_sensitivity, ctx, generator):
        return torch.randperm(selectable_rows)[:4]


def test_the_contract_catches_broken_selectors():
    class TouchedOnly(TestExponentialSparse):
        def make(self):
            return _TouchedOnly(make_selector(self.config, num_rows=ROWS))

    class GlobalRNG(TestUniform):
        def make(self):
            return _GlobalRNG()

    with pytest.raises(AssertionError):
        TouchedOnly().test_untouched_rows_stay_candidates()
    with pytest.raises(AssertionError):
        GlobalRNG().test_deterministic_for_a_fixed_generator()
    GlobalRNG().test_ids_are_distinct_int64_in_range()  # the rest of its contract holds
