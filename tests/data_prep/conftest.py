"""Data-prep tests: stop words come from the bundled NLTK data when it is there."""

import pytest
from prep_helpers import NLTK_DATA


@pytest.fixture(autouse=True)
def _nltk_stopwords(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop words come from NLTK in most tests here."""
    if NLTK_DATA.is_dir():
        monkeypatch.setenv("NLTK_DATA", str(NLTK_DATA))
