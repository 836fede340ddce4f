"""Data preparation: filters, vocabulary, windows, negatives, splits, cache, errors, Brown."""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from pathlib import Path

import numpy as np
import pytest
from prep_helpers import (
    CAT,
    DOG,
    NLTK_DATA,
    SAT,
    TINY,
    WORDS,
    all_splits,
    pairs_of,
    random_text,
    tiny_cfg,
)
from scipy import stats

from widedp.config import DATA_PRESETS, DataConfig
from widedp.data_prep import corpus
from widedp.data_prep.cbow import prepare_cbow
from widedp.data_prep.samples import draw_negatives_keyed
from widedp.data_prep.splits import row_keys, split_rates
from widedp.errors import ConfigError

# ---------------------------------------------------------------------------------------- preprocessing by hand


def test_vocab_order_and_counts(tmp_path: Path) -> None:
    d = prepare_cbow(tiny_cfg(tmp_path))
    assert d.vocab == ["cat", "dog", "sat", "bird"]
    assert d.counts.tolist() == [3, 2, 2, 1]
    assert d.counts.dtype == np.int64


def test_pairs_window_1_by_hand(tmp_path: Path) -> None:
    d = prepare_cbow(tiny_cfg(tmp_path, window=1))
    # in-vocab stream per sentence: [cat sat] [dog sat] [cat cat dog] [bird] (mat dropped before windowing)
    expected = sorted([(CAT, (SAT,)), (SAT, (CAT,)), (DOG, (SAT,)), (SAT, (DOG,)),
                       (CAT, (CAT,)), (CAT, (CAT,)), (CAT, (DOG,)), (DOG, (CAT,))])
    assert d.total_samples == 8
    assert pairs_of(d.train) == expected
    for s in all_splits(d):
        assert s.target.dtype == s.context.dtype == s.negatives.dtype == np.int64
        assert s.context.shape == (len(s), 1) and s.negatives.shape == (len(s), 2)


def test_pairs_window_2_stay_within_sentences(tmp_path: Path) -> None:
    d = prepare_cbow(tiny_cfg(tmp_path, window=2))
    # window 2 adds only cat(first)<->dog in [cat cat dog]; nothing crosses a sentence boundary
    assert d.total_samples == 10
    assert collections.Counter(pairs_of(d.train))[(CAT, (DOG,))] == 2


def test_bag_contexts_and_padding(tmp_path: Path) -> None:
    d = prepare_cbow(tiny_cfg(tmp_path, window=2, sample_shape="bag"))
    expected = sorted([
        (CAT, (SAT, -1, -1, -1)), (SAT, (CAT, -1, -1, -1)),  # [cat sat]
        (DOG, (SAT, -1, -1, -1)), (SAT, (DOG, -1, -1, -1)),  # [dog sat]
        (CAT, (CAT, DOG, -1, -1)), (CAT, (CAT, DOG, -1, -1)), (DOG, (CAT, CAT, -1, -1)),  # [cat cat dog]
    ])  # [bird] has an empty window: no sample
    assert d.total_samples == 7
    assert d.train.context.shape == (7, 4)
    assert pairs_of(d.train) == expected


def test_bag_and_pair_agree(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    text = random_text(rng, 60, WORDS[:12], np.full(12, 1 / 12))
    kw = dict(vocab_size=10, window=3, negatives=0)
    pair = prepare_cbow(tiny_cfg(tmp_path, text, **kw))
    bag = prepare_cbow(tiny_cfg(tmp_path, text, sample_shape="bag", **kw))
    from_bags = sorted((t, (c,)) for t, row in zip(bag.train.target.tolist(), bag.train.context.tolist())
                       for c in row if c >= 0)
    assert from_bags == pairs_of(pair.train)
    assert bag.train.context.shape[1] == 6


def test_stopwords_and_alpha_filters(tmp_path: Path) -> None:
    assert len(corpus.stopword_set()) == 179
    text = "The cat , the dog 42 x1 Dog\n"
    words = lambda **kw: set(corpus.load_corpus(tiny_cfg(tmp_path, text, **kw)).words.tolist())  # noqa: E731
    assert words() == {"cat", "dog"}
    assert words(remove_stopwords=False) == {"the", "cat", "dog"}
    assert words(alpha_only=False) == {"cat", ",", "dog", "42", "x1"}
    assert words(lowercase=False) == {"cat", "dog", "Dog"}  # stop words match case-insensitively
    assert words(lowercase=False, remove_stopwords=False, alpha_only=False) == {
        "The", "the", "cat", ",", "dog", "42", "x1", "Dog"}


def test_max_sentences(tmp_path: Path) -> None:
    d = prepare_cbow(tiny_cfg(tmp_path, vocab_size=3, max_sentences=2))  # [cat sat mat] [dog sat]
    assert d.vocab == ["sat", "cat", "dog"]
    assert d.total_samples == 4


# --------------------------------------------------------------------------------------------------- negatives


def test_keyed_negatives_follow_unigram_075_and_depend_on_their_key_only() -> None:
    counts = np.array([4096, 512, 64, 8, 1])
    target = np.repeat([0, 2], 10_000)
    keys = row_keys([np.arange(20_000)], seed=3, purpose="test")
    neg = draw_negatives_keyed(target, counts, 8, keys)
    assert neg.shape == (20_000, 8) and not (neg == target[:, None]).any()
    for t in (0, 2):
        obs = np.bincount(neg[target == t].ravel(), minlength=5)
        others = np.arange(5) != t
        for power, ok in ((0.75, True), (1.0, False)):  # 1.0: negative control
            q = counts[others] ** power
            p = stats.chisquare(obs[others], q / q.sum() * obs[others].sum()).pvalue
            assert (p > 1e-3) if ok else (p < 1e-12)
    # row i's negatives are a function of (target i, key i): the same in any company
    sub = np.array([5, 17_000, 3])
    np.testing.assert_array_equal(draw_negatives_keyed(target[sub], counts, 8, keys[sub]), neg[sub])


def test_negatives_in_prepared_data(tmp_path: Path) -> None:
    d = prepare_cbow(tiny_cfg(tmp_path, negatives=8))
    for s in all_splits(d):
        assert not (s.negatives == s.target[:, None]).any()
        assert ((s.negatives >= 0) & (s.negatives < 4)).all()


def test_one_word_vocab_cannot_have_negatives(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.negatives"):
        prepare_cbow(tiny_cfg(tmp_path, "a a a\n", vocab_size=1, remove_stopwords=False))


# ------------------------------------------------------------------------------------------ determinism, splits


def test_seeded_determinism(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    text = random_text(rng, 200, WORDS, np.full(20, 1 / 20))
    kw = dict(vocab_size=15, window=2, negatives=4, splits=(300, 100, 100))
    a, b = prepare_cbow(tiny_cfg(tmp_path, text, **kw)), prepare_cbow(tiny_cfg(tmp_path, text, **kw))
    c = prepare_cbow(tiny_cfg(tmp_path, text, seed=1, **kw))
    for name in ("train", "valid", "test"):
        for f in ("target", "context", "negatives"):
            np.testing.assert_array_equal(getattr(getattr(a, name), f), getattr(getattr(b, name), f))
    assert not np.array_equal(a.train.target, c.train.target)
    assert not np.array_equal(a.train.negatives, c.train.negatives)


def test_split_sizes_are_binomial_and_partition_the_samples(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    text = random_text(rng, 200, WORDS, np.full(20, 1 / 20))
    full = prepare_cbow(tiny_cfg(tmp_path, text, vocab_size=15, window=2))
    n = full.total_samples
    for splits in ((0.6, 0.2, 0.2), (n - 300, 100, 200)):
        d = prepare_cbow(tiny_cfg(tmp_path, text, vocab_size=15, window=2, splits=splits))
        rates = np.array(splits, dtype=float) / (1 if splits[0] < 1 else n)
        sizes = np.array([len(s) for s in all_splits(d)])
        assert (np.abs(sizes - rates * n) <= 4 * np.sqrt(n * rates * (1 - rates))).all(), (sizes, rates * n)
        merged = collections.Counter(p for s in all_splits(d) for p in pairs_of(s))
        assert merged == collections.Counter(pairs_of(full.train))  # a partition of all samples
    half = prepare_cbow(tiny_cfg(tmp_path, text, vocab_size=15, window=2, splits=(0.5, 0.0, 0.0)))
    assert abs(len(half.train) - n / 2) <= 4 * np.sqrt(n / 4)  # the rest unused


def test_split_rates() -> None:
    assert split_rates((0.5, 0.25, 0.25), 10) == (0.5, 0.25, 0.25)
    assert split_rates((6, 2, 2), 10) == (0.6, 0.2, 0.2)
    assert split_rates((1.0, 0.0, 0.0), 7) == (1.0, 0.0, 0.0)
    for bad in ((6, 3, 2), (2.5, 0, 0), (0, 1, 1)):
        with pytest.raises(ConfigError, match="data.splits"):
            split_rates(bad, 10)


def test_too_large_splits_raise(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.splits: .*more than the 8"):
        prepare_cbow(tiny_cfg(tmp_path, splits=(5, 2, 2)))


# --------------------------------------------------------------------------------------------------------- cache


def test_cache_hit_does_not_read_the_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tiny_cfg(tmp_path, cache_dir=str(tmp_path / "cache"), negatives=3)
    a = prepare_cbow(cfg)
    assert len(list((tmp_path / "cache").glob("cbow-*.npz"))) == 1

    def boom(*_: object) -> None:
        raise AssertionError("corpus read on a cache hit")

    monkeypatch.setattr(corpus, "load_corpus", boom)
    monkeypatch.setattr(corpus, "read_sentences", boom)
    b = prepare_cbow(cfg)
    assert b.vocab == a.vocab and b.total_samples == a.total_samples
    np.testing.assert_array_equal(b.counts, a.counts)
    for sa, sb in zip(all_splits(a), all_splits(b)):
        for f in ("target", "context", "negatives"):
            assert getattr(sb, f).dtype == np.int64
            np.testing.assert_array_equal(getattr(sa, f), getattr(sb, f))
    with pytest.raises(AssertionError, match="cache hit"):  # a new parameter is a miss
        prepare_cbow(dataclasses.replace(cfg, seed=5))


def test_truncated_cache_files_are_rebuilt(tmp_path: Path) -> None:
    """A cut-off npz (a killed writer on another tool, a full disk) is a miss, not a BadZipFile traceback."""
    from widedp.config.recsys import RecsysDataConfig
    from widedp.data_prep.interactions import prepare_interactions

    cfg = tiny_cfg(tmp_path, cache_dir=str(tmp_path / "cache"), negatives=3)
    first = prepare_cbow(cfg)
    rcfg = RecsysDataConfig(num_users=20, num_items=30, num_interactions=300, cache_dir=str(tmp_path / "cache"))
    inter = prepare_interactions(rcfg)
    for f in (tmp_path / "cache").glob("*.npz"):
        f.write_bytes(f.read_bytes()[:200])
    again = prepare_cbow(cfg)
    assert np.array_equal(again.train.target, first.train.target) and again.vocab == first.vocab
    assert np.array_equal(prepare_interactions(rcfg).train.label, inter.train.label)


def test_corpus_cache_serves_other_vocab_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = str(tmp_path / "cache")
    cfg = tiny_cfg(tmp_path, cache_dir=cache, vocab_size=4)
    prepare_cbow(cfg)
    monkeypatch.setattr(corpus, "read_sentences", lambda *_: (_ for _ in ()).throw(AssertionError("read")))
    assert prepare_cbow(dataclasses.replace(cfg, vocab_size=5)).vocab[-1] == "mat"
    Path(cfg.corpus[5:]).write_text(TINY + "emu\n")  # an edited file is a miss
    with pytest.raises(AssertionError, match="read"):
        prepare_cbow(cfg)
    assert not list(Path(cache).glob(".*.tmp"))  # temporary files are replaced, not left behind


# -------------------------------------------------------------------------------------------------------- errors


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        DataConfig(preset="custom", corpus=f"text:{tmp_path / 'nope.txt'}")
    cfg = tiny_cfg(tmp_path)
    Path(cfg.corpus[5:]).unlink()  # vanished after the config was validated
    with pytest.raises(ConfigError, match="file not found"):
        prepare_cbow(cfg)


def test_empty_corpus(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no tokens left"):
        prepare_cbow(tiny_cfg(tmp_path, "The, and 42 .\n\nof the\n"))


def test_vocab_larger_than_distinct_words(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.vocab_size: 6 .* 5 distinct"):
        prepare_cbow(tiny_cfg(tmp_path, vocab_size=6))


def test_nltk_missing_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import nltk
    from nltk.corpus.reader import WordListCorpusReader
    from nltk.corpus.util import LazyCorpusLoader

    monkeypatch.delenv("NLTK_DATA", raising=False)
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    monkeypatch.setattr(nltk.corpus, "stopwords", LazyCorpusLoader("stopwords", WordListCorpusReader, r".*"))
    tried = []
    monkeypatch.setattr(nltk, "download", lambda name, **kw: tried.append(name) or False)
    with pytest.raises(ConfigError, match="nltk.downloader brown stopwords"):
        corpus.stopword_set()
    assert tried == ["stopwords"]


def test_hf_column_and_load_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": ["The cat sat on the mat.", "the dog sat", "cat cat dog"], "n": [1, 2, 3]})
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config, split: ds)
    d = prepare_cbow(DataConfig(preset="custom", corpus="hf:toy", vocab_size=3, window=1, negatives=1,
                                splits=(1.0, 0.0, 0.0), cache_dir=""))
    assert d.vocab == ["cat", "dog", "sat"] and d.total_samples == 8
    with pytest.raises(ConfigError, match="data.hf_column: .*'body'"):
        prepare_cbow(DataConfig(preset="custom", corpus="hf:toy", hf_column="body", cache_dir=""))

    def fail(*_: object, **__: object) -> None:
        raise FileNotFoundError("Dataset 'nope/nope' doesn't exist on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", fail)
    with pytest.raises(ConfigError, match="data.corpus: cannot load .*'nope/nope'"):
        prepare_cbow(DataConfig(preset="custom", corpus="hf:nope/nope", cache_dir=""))


# --------------------------------------------------------------------------------------------------------- Brown


def _use_nltk_data(monkeypatch: pytest.MonkeyPatch) -> None:
    if NLTK_DATA.is_dir():
        monkeypatch.setenv("NLTK_DATA", str(NLTK_DATA))
    elif not os.environ.get("NLTK_DATA"):
        pytest.skip("no NLTK data: set NLTK_DATA to a folder with brown and stopwords")


def test_brown_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_nltk_data(monkeypatch)
    cfg = DataConfig(**(DATA_PRESETS["paper"] | dict(max_sentences=1000, vocab_size=200, splits=(0.5, 0.25, 0.25),
                                                      cache_dir=str(tmp_path / "cache"))))
    t0 = time.perf_counter()
    d = prepare_cbow(cfg)
    cold = time.perf_counter() - t0
    assert d.vocab[0] == "said"  # the news sentences open Brown
    assert len(d.vocab) == 200 and all(w.isalpha() and w.islower() for w in d.vocab)
    assert not {"the", "of", "and", "a"} & set(d.vocab)
    assert d.train.negatives.shape == (len(d.train), 8)
    t0 = time.perf_counter()
    prepare_cbow(cfg)
    assert time.perf_counter() - t0 < min(1.0, cold)


@pytest.mark.slow
def test_brown_paper_pair_count(brown_cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The count documented in widedp.data_prep.cbow (the issue: "about 979K")."""
    _use_nltk_data(monkeypatch)
    cfg = DataConfig(**(DATA_PRESETS["paper"] | dict(cache_dir=brown_cache)))
    d = prepare_cbow(cfg)
    assert d.total_samples == 979_216
    for s, n in zip(all_splits(d), (200_000, 100_000, 200_000)):  # expected counts: rate n / 979,216
        assert abs(len(s) - n) <= 4 * np.sqrt(n * (1 - n / 979_216)), (len(s), n)
    assert len(d.vocab) == 1000 and d.counts[0] >= d.counts[-1]
