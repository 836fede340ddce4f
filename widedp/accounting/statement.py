"""The privacy statement every printed ε comes with: its unit, adjacency, δ, accountant, and what it does not cover.

    (ε=2.51, δ=1e-05) for adding/removing one (target, context) pair [PLD accountant];
    not covered: vocabulary not private: the top-V words of the training corpus ... and the negative-sampling ...
    (ε=7.96, δ=1e-05) for adding/removing one sentence (≤ 32 pairs) [PLD accountant]; includes: the DP vocabulary
    (Gaussian partition selection, σ=4, ≤ 32 words per sentence, δ_τ=1e-06 of δ)

A statement is stored as a dict in ``summary.json`` (``"privacy"``), the export's ``privacy.json`` and the CLI's
output; ``text`` is the one line printed wherever ε is.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

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
        d["not_covered"] = list(self.not_covered)
        d["includes"] = list(self.includes)
        d["text"] = self.text
        return d


VOCAB_NOT_COVERED = ("vocabulary not private: the vocabulary (the top-V words of the training corpus by count, ties "
                     "at the cut included) and the negative-sampling distribution (their counts)")
IDS_NOT_COVERED = "the embedding-table sizes and id -> row numbering (computed from the data's distinct ids)"


def unit_and_gaps(cfg: Any) -> tuple[str, tuple[str, ...]]:
    """The privacy unit of a ``cbow`` / ``recsys`` config and what its ε does not cover."""
    from widedp.dp import units

    if cfg.task == "cbow":
        if units.is_per_sample(cfg):
            shape = getattr(cfg.data, "sample_shape", "pair")
            unit = "(target, context) pair" if shape == "pair" else "(target, context window) sample"
        else:
            unit = units.unit_name(cfg)
        vocabulary = getattr(cfg.data, "vocabulary", "private_top")
        return unit, ((VOCAB_NOT_COVERED,) if vocabulary == "private_top" else ())
    if cfg.task == "recsys":
        source = getattr(cfg.data, "source", "synthetic")
        unit = "interaction (one user-item example)" if units.is_per_sample(cfg) else units.unit_name(cfg)
        return unit, (() if source == "synthetic" else (IDS_NOT_COVERED,))
    return "training example", ()


def includes(cfg: Any) -> tuple[str, ...]:
    """What ε covers besides the training steps: the DP vocabulary (or a public word list: nothing to cover) and the
    one-shot row pre-selection."""
    pre = getattr(cfg.dp, "preselect", None) if cfg.dp is not None else None
    extra = () if pre is None else (f"the one-shot row pre-selection: Gaussian, σ={pre.sigma:g} on ℓ2-normalised "
                                    f"contribution counts, ≤ {pre.rows} rows kept (only they are ever updated)",)
    return _vocabulary_includes(cfg) + extra


def _vocabulary_includes(cfg: Any) -> tuple[str, ...]:
    vocabulary = getattr(cfg.data, "vocabulary", "private_top") if cfg.task == "cbow" else "private_top"
    if vocabulary == "dp" and cfg.dp is not None:
        v = cfg.data.vocab_dp
        return (f"the DP vocabulary and its noisy counts (the negative-sampling distribution): Gaussian partition "
                f"selection, σ={v.noise_multiplier:g}, ≤ {v.max_words_per_unit} words per {cfg.data.privacy_unit}, "
                f"threshold δ_τ={v.delta:g} of δ",)
    if vocabulary.startswith("file:"):
        return ("the vocabulary: a public word list (data.vocabulary: file:PATH), nothing private spent on it",)
    return ()


def for_run(cfg: Any, *, epsilon: float | None, delta: float | None, accountant: str, private_rng: bool,
            extra: dict[str, Any] | None = None) -> PrivacyStatement:
    """The statement of a ``cbow`` / ``recsys`` run (or config): epsilon None = trained without DP."""
    from widedp.dp.rng import NOT_PRIVATE

    unit, gaps = unit_and_gaps(cfg)
    if epsilon is None:
        return PrivacyStatement(None, None, unit, private=False, reason="trained without differential privacy")
    return PrivacyStatement(epsilon, delta, unit, accountant=accountant.upper(), not_covered=gaps,
                            private=private_rng, reason="" if private_rng else NOT_PRIVATE, extra=extra or {},
                            includes=includes(cfg))
