"""The privacy statement every printed ε comes with: its unit, adjacency, δ, accountant, and what it does not cover.

    (ε=2.51, δ=1e-05) for adding/removing one (target, context) pair [PLD accountant];
    not covered: vocabulary not private: the top-V words of the training corpus ... and the negative-sampling ...
    (ε=7.96, δ=1e-05) for adding/removing one sentence (≤ 32 pairs) [PLD accountant]; includes: the DP vocabulary
    (Gaussian partition selection, σ=4, ≤ 32 words per sentence, δ_τ=1e-06 of δ)
    ...; includes: batches of at most 1,245 sentences (truncated Poisson; δ_B=1e-08 of δ)

A statement is stored as a dict in ``summary.json`` (``"privacy"``), the export's ``privacy.json`` and the CLI's
output, with ``widedp_version`` (the widedp that trained the run); ``text`` is the one line printed wherever ε is.
What ε covers besides the steps comes from the task (``UnitFacts.includes``: the DP vocabulary) and from the dp:
section (``with_preselect``: the row pre-selection) and from the plan (``with_batch_bound``: bounded batches).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from widedp import __version__

#: A Poisson-sampled run with q = b / N uses the number N of training units, which add/remove changes by one
#: (``dp.sampling_rate`` fixes q in the config instead).
SIZE_NOT_COVERED = ("the data's size (N training units, treated as public as Opacus does: it sets the sampling "
                    "rate q = b/N; dp.sampling_rate fixes q instead)")

#: ADJACENCY -> the words used in the statement.
ADJACENCY = {"add_remove": "adding/removing", "replace": "replacing"}


@dataclass(frozen=True)
class PrivacyStatement:
    """What a run (or a config) guarantees.

    Args:
        epsilon, delta: the guarantee (epsilon None: non-private).
        unit: the privacy unit, e.g. "(target, context) pair", "sentence", "training example".
        adjacency: ``add_remove`` | ``replace``.
        accountant: how epsilon was computed (e.g. "PLD", "zCDP").
        not_covered: things computed from private data that epsilon does not cover.
        includes: releases besides the training that epsilon does cover (e.g. the DP vocabulary).
        private: False when the run is not private at all (no DP, or reproducible randomness).
        reason: why it is not private (when ``private`` is False).
    """

    epsilon: float | None
    delta: float | None
    unit: str
    adjacency: str = "add_remove"
    accountant: str = "PLD"
    not_covered: tuple[str, ...] = ()
    private: bool = True
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    includes: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        if self.epsilon is None:
            return f"NOT PRIVATE: {self.reason or 'trained without differential privacy'}"
        head = (f"(ε={self.epsilon:.4g}, δ={self.delta:g}) for {ADJACENCY.get(self.adjacency, self.adjacency)} one "
                f"{self.unit} [{self.accountant} accountant]")
        if self.includes:
            head += "; includes: " + "; ".join(self.includes)
        if self.not_covered:
            head += "; not covered: " + "; ".join(self.not_covered)
        if not self.private:
            head = f"NOT PRIVATE ({self.reason}); nominal " + head
        return head

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        if self.epsilon is None:  # no ε: no accountant either
            d["accountant"] = None
        d["not_covered"] = list(self.not_covered)
        d["includes"] = list(self.includes)
        d["text"] = self.text
        d["widedp_version"] = __version__
        return d


@dataclass(frozen=True)
class UnitFacts:
    """What a run's epsilon protects (``unit``), what it does not cover, what it includes besides the steps: a
    task's facts (``widedp.tasks.Task.privacy``)."""

    unit: str
    not_covered: tuple[str, ...] = ()
    includes: tuple[str, ...] = ()


def for_run(facts: UnitFacts, *, epsilon: float | None, delta: float | None, accountant: str, private_rng: bool,
            extra: dict[str, Any] | None = None) -> PrivacyStatement:
    """The statement of a run (or config) of a task the loop trains (``facts``: its unit and gaps): epsilon None =
    trained without DP."""
    from widedp.dp.rng import NOT_PRIVATE

    if epsilon is None:
        return PrivacyStatement(None, None, facts.unit, private=False, reason="trained without differential privacy")
    name = accountant.upper() if accountant.islower() else accountant  # "pld" -> "PLD"; "Opacus PRV" as it is
    return PrivacyStatement(epsilon, delta, facts.unit, accountant=name,
                            not_covered=facts.not_covered, private=private_rng,
                            reason="" if private_rng else NOT_PRIVATE, extra=extra or {}, includes=facts.includes)


#: train.keep_best with DP: which epoch's weights are released is chosen by a non-private validation loss.
KEEP_BEST_NOT_COVERED = ("train.keep_best: the epoch whose weights are kept is chosen by the loss on the validation "
                         "split (private data, without DP)")


def for_config(facts: UnitFacts, cfg: Any) -> UnitFacts:
    """``facts`` of a task with what the run's own options add: the pre-selection (``with_preselect``), the data's
    size (a gap unless ``dp.sampling_rate`` fixes q) and ``train.keep_best`` (a gap)."""
    dp = getattr(cfg, "dp", None)
    facts = with_preselect(facts, dp)
    gaps = facts.not_covered
    if dp is not None and getattr(dp, "sampling_rate", None) is None:
        gaps = (*gaps, SIZE_NOT_COVERED)
    if getattr(getattr(cfg, "train", None), "keep_best", False):
        gaps = (*gaps, KEEP_BEST_NOT_COVERED)
    return replace(facts, not_covered=gaps)


def with_preselect(facts: UnitFacts, dp: Any) -> UnitFacts:
    """``facts`` with the one-shot row pre-selection (``dp.preselect`` of the dp: section ``dp``, charged before the
    first step) among what ε includes; unchanged without one."""
    pre = getattr(dp, "preselect", None)
    if pre is None:
        return facts
    what = (f"the one-shot row pre-selection: Gaussian, σ={pre.sigma:g} on ℓ2-normalised contribution counts, "
            f"≤ {pre.rows} rows kept (only they are ever updated)")
    return replace(facts, includes=(*facts.includes, what))


def with_batch_bound(facts: UnitFacts, *, bound: int | None, delta_b: float, units: str) -> UnitFacts:
    """``facts`` with the truncated Poisson batches (``dp.max_batch_size``: at most ``bound`` ``units`` per batch, a
    larger one cut to a random ``bound`` of them; ``widedp.dp.sampling``) and their share ``delta_b`` of δ among what
    ε includes; unchanged without a bound."""
    if bound is None:
        return facts
    what = f"batches of at most {bound:,} {units} (truncated Poisson; δ_B={delta_b:.3g} of δ)"
    return replace(facts, includes=(*facts.includes, what))
