"""``data.min_count`` and the whole-Brown preset ``brown_full``: the vocabulary is every word occurring at
least min_count times after the filters (at most vocab_size of them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from widedp.config import DATA_PRESETS, DataConfig, config_from_dict
from widedp.data_prep.cbow import prepare_cbow
from widedp.errors import ConfigError

# counts after the filters (no stop words removed here): qa 5, qb 4, qc 3, qd 2, qe 1
TEXT = "qa qb qc qd qe\nqa qb qc qd\nqa qb qc\nqa qb\nqa\n"


def _cfg(tmp_path: Path, **kw: object) -> DataConfig:
    p = tmp_path / "c.txt"
    p.write_text(TEXT, encoding="utf-8")
    base: dict[str, object] = dict(preset="custom", corpus=f"text:{p}", vocab_size=5, window=2, negatives=1,
                                   splits=(1.0, 0.0, 0.0), cache_dir="", remove_stopwords=False)
    return DataConfig(**(base | kw))


@pytest.mark.parametrize(("min_count", "vocab_size", "words"), [
    (1, 5, ["qa", "qb", "qc", "qd", "qe"]), (2, 5, ["qa", "qb", "qc", "qd"]), (3, 50, ["qa", "qb", "qc"]),
    (3, 2, ["qa", "qb"]), (4, 50, ["qa", "qb"])])
def test_min_count_keeps_the_frequent_words(tmp_path: Path, min_count: int, vocab_size: int, words: list[str]) -> None:
    d = prepare_cbow(_cfg(tmp_path, min_count=min_count, vocab_size=vocab_size))
    assert d.vocab == words and d.counts.tolist() == [5, 4, 3, 2, 1][:len(words)]
    ids = np.concatenate([d.train.target, d.train.context.ravel()])
    assert ids.max() == len(words) - 1  # every sample is in-vocabulary


def test_min_count_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.min_count: no word occurs 6 times"):
        prepare_cbow(_cfg(tmp_path, min_count=6))
    with pytest.raises(ConfigError, match="data.min_count"):
        _cfg(tmp_path, min_count=0)
    with pytest.raises(ConfigError, match="data.min_count: applies to the top-V"):
        _cfg(tmp_path, min_count=2, vocabulary="dp", privacy_unit="sentence")


def test_brown_full_preset_and_unchanged_hashes() -> None:
    pre = DATA_PRESETS["brown_full"]
    assert pre["min_count"] == 5 and pre["vocab_size"] == 13_232 and pre["splits"] == [0.6, 0.2, 0.2]
    cfg = config_from_dict({"data": {"preset": "brown_full"}})
    assert cfg.data.min_count == 5 and cfg.data.vocab_size == 13_232
    # configs written before min_count existed keep their hash (resume, compare's reuse); a minimum changes it
    assert DataConfig.hash_view({"min_count": 1}) == {} and DataConfig.hash_view({"min_count": 5}) == {"min_count": 5}
    assert config_from_dict({"data": {"preset": "brown_10k"}}).hash() != config_from_dict(
        {"data": {"preset": "brown_10k", "min_count": 2}}).hash()


@pytest.mark.extended  # the whole of Brown (11 s): CI keeps to tiny data
def test_brown_full_vocabulary(brown_cache: str) -> None:
    """The figures documented in the preset: V = 13,232 words seen >= 5 times, 2,652,900 pairs."""
    from widedp.data_prep import corpus

    cfg = config_from_dict({"data": {"preset": "brown_full", "cache_dir": brown_cache}}).data
    try:
        d = prepare_cbow(cfg)
    except ConfigError as e:
        pytest.skip(f"no Brown: {e}")
    counts = np.bincount(corpus.load_corpus(cfg).ids)
    assert len(d.vocab) == 13_232 == int((counts >= 5).sum()) and d.counts.min() == 5
    assert d.total_samples == 2_652_900
    assert abs(len(d.train) - 0.6 * 2_652_900) <= 4 * (2_652_900 * 0.6 * 0.4) ** 0.5  # Binomial: 1.59M
