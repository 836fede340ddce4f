"""Privacy wording that must not overclaim, in README, docs/ and the package's own docstrings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted(p for d in ("widedp", "data_prep", "models", "eval") for p in (ROOT / d).rglob("*.py"))]


def _flat(path: Path) -> str:
    """The text with line breaks and docstring indentation folded into single spaces."""
    return re.sub(r"\s+", " ", path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_record_locality_is_claimed_only_for_a_fixed_vocabulary(path):
    """'Adding or removing a unit changes no other sample' holds only when the vocabulary does not move with it
    (a public list, or the DP vocabulary's release): with private_top one sentence changed 3,583 of 3,945 records."""
    text = _flat(path)
    for m in re.finditer(r"changes no other (sample|unit)", text):
        around = text[max(0, m.start() - 300) : m.end() + 300]
        assert "vocabulary" in around, f"{path.name}: '...{text[m.start() - 80 : m.end() + 40]}...'"


@pytest.mark.parametrize("path", TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_negatives_pool_is_not_said_to_ignore_the_data(path):
    """The pool is drawn from the negative-sampling law (unigram^0.75 of the vocabulary's counts), which comes from the
    corpus with private_top: it ignores the batch, not the data."""
    assert "without looking at the data" not in _flat(path), path.name
