"""Data preparation: filters, vocabulary, windows, negatives, splits, canaries, cache, errors."""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from widedp.config import DATA_PRESETS, DataConfig
from widedp.data_prep import corpus
from widedp.data_prep.cbow import CBOWData, Split, prepare_cbow, resolve_splits
from widedp.data_prep.samples import draw_negatives, insert_phrases
from widedp.errors import ConfigError

NLTK_DATA = Path(__file__).resolve().parents[2] / "shared" / "nltk_data"  # /work/shared/nltk_data

# After lowercase + alphabetic + stop words: [cat sat mat] [dog sat] [cat cat dog] [bird]
# counts cat 3, dog 2, sat 2, bird 1, mat 1 -> V=4: cat, dog, sat, bird (ties alphabetical); mat is OOV.
TINY = "The cat sat on the mat.\nthe dog sat\ncat cat dog 42 x1\nbird\n"
CAT, DOG, SAT, BIRD = 0, 1, 2, 3


@pytest.fixture(autouse=True)
def _nltk_stopwords(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stop words come from NLTK in most tests here."""
    if NLTK_DATA.is_dir():
        monkeypatch.setenv("NLTK_DATA", str(NLTK_DATA))


def _write(tmp_path: Path, text: str, name: str = "c.txt") -> str:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return f"text:{p}"


def _cfg(tmp_path: Path, text: str = TINY, **kw: object) -> DataConfig:
    base: dict[str, object] = dict(preset="custom", corpus=_write(tmp_path, text), vocab_size=4, window=1,
                                   negatives=2, splits=(1.0, 0.0, 0.0), cache_dir="")
    return DataConfig(**(base | kw))


def _pairs(split: Split) -> list[tuple[int, ...]]:
    return sorted(zip(split.target.tolist(), map(tuple, split.context.tolist())))


def _all(d: CBOWData) -> list[Split]:
    return [d.train, d.valid, d.test]


WORDS = [f"q{chr(97 + i)}" for i in range(20)]  # qa..qt: no NLTK stop word among them


def _random_text(rng: np.random.Generator, n_lines: int, words: list[str], p: np.ndarray) -> str:
    lines = [" ".join(rng.choice(words, size=rng.integers(1, 12), p=p)) for _ in range(n_lines)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- preprocessing by hand


def test_vocab_order_and_counts(tmp_path: Path) -> None:
    d = prepare_cbow(_cfg(tmp_path))
    assert d.vocab == ["cat", "dog", "sat", "bird"]
    assert d.counts.tolist() == [3, 2, 2, 1]
    assert d.counts.dtype == np.int64


def test_pairs_window_1_by_hand(tmp_path: Path) -> None:
    d = prepare_cbow(_cfg(tmp_path, window=1))
    # in-vocab stream per sentence: [cat sat] [dog sat] [cat cat dog] [bird] (mat dropped before windowing)
    expected = sorted([(CAT, (SAT,)), (SAT, (CAT,)), (DOG, (SAT,)), (SAT, (DOG,)),
                       (CAT, (CAT,)), (CAT, (CAT,)), (CAT, (DOG,)), (DOG, (CAT,))])
    assert d.total_samples == 8
    assert _pairs(d.train) == expected
    for s in _all(d):
        assert s.target.dtype == s.context.dtype == s.negatives.dtype == np.int64
        assert s.context.shape == (len(s), 1) and s.negatives.shape == (len(s), 2)


def test_pairs_window_2_stay_within_sentences(tmp_path: Path) -> None:
    d = prepare_cbow(_cfg(tmp_path, window=2))
    # window 2 adds only cat(first)<->dog in [cat cat dog]; nothing crosses a sentence boundary
    assert d.total_samples == 10
    assert collections.Counter(_pairs(d.train))[(CAT, (DOG,))] == 2


def test_bag_contexts_and_padding(tmp_path: Path) -> None:
    d = prepare_cbow(_cfg(tmp_path, window=2, sample_shape="bag"))
    expected = sorted([
        (CAT, (SAT, -1, -1, -1)), (SAT, (CAT, -1, -1, -1)),  # [cat sat]
        (DOG, (SAT, -1, -1, -1)), (SAT, (DOG, -1, -1, -1)),  # [dog sat]
        (CAT, (CAT, DOG, -1, -1)), (CAT, (CAT, DOG, -1, -1)), (DOG, (CAT, CAT, -1, -1)),  # [cat cat dog]
    ])  # [bird] has an empty window: no sample
    assert d.total_samples == 7
    assert d.train.context.shape == (7, 4)
    assert _pairs(d.train) == expected


def test_bag_and_pair_agree(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    text = _random_text(rng, 60, WORDS[:12], np.full(12, 1 / 12))
    kw = dict(vocab_size=10, window=3, negatives=0)
    pair = prepare_cbow(_cfg(tmp_path, text, **kw))
    bag = prepare_cbow(_cfg(tmp_path, text, sample_shape="bag", **kw))
    from_bags = sorted((t, (c,)) for t, row in zip(bag.train.target.tolist(), bag.train.context.tolist())
                       for c in row if c >= 0)
    assert from_bags == _pairs(pair.train)
    assert bag.train.context.shape[1] == 6


def test_stopwords_and_alpha_filters(tmp_path: Path) -> None:
    assert len(corpus.stopword_set()) == 179
    text = "The cat , the dog 42 x1 Dog\n"
    words = lambda **kw: set(corpus.load_corpus(_cfg(tmp_path, text, **kw)).words.tolist())  # noqa: E731
    assert words() == {"cat", "dog"}
    assert words(remove_stopwords=False) == {"the", "cat", "dog"}
    assert words(alpha_only=False) == {"cat", ",", "dog", "42", "x1"}
    assert words(lowercase=False) == {"cat", "dog", "Dog"}  # stop words match case-insensitively
    assert words(lowercase=False, remove_stopwords=False, alpha_only=False) == {
        "The", "the", "cat", ",", "dog", "42", "x1", "Dog"}


def test_max_sentences(tmp_path: Path) -> None:
    d = prepare_cbow(_cfg(tmp_path, vocab_size=3, max_sentences=2))  # [cat sat mat] [dog sat]
    assert d.vocab == ["sat", "cat", "dog"]
    assert d.total_samples == 4


# --------------------------------------------------------------------------------------------------- negatives


def test_negatives_follow_unigram_075_and_avoid_target() -> None:
    counts = np.array([4096, 512, 64, 8, 1])
    rng = np.random.default_rng(0)
    target = np.repeat([0, 2], 10_000)
    neg = draw_negatives(target, counts, 8, rng)
    assert neg.shape == (20_000, 8) and neg.dtype == np.int64
    assert not (neg == target[:, None]).any()
    for t in (0, 2):
        obs = np.bincount(neg[target == t].ravel(), minlength=5)
        assert obs[t] == 0
        others = np.arange(5) != t

        def pvalue(power: float, obs: np.ndarray = obs, others: np.ndarray = others) -> float:
            q = counts[others] ** power
            return stats.chisquare(obs[others], q / q.sum() * obs[others].sum()).pvalue

        assert pvalue(0.75) > 1e-3
        assert pvalue(1.0) < 1e-12  # negative control: plain unigram is rejected


def test_negatives_in_prepared_data(tmp_path: Path) -> None:
    d = prepare_cbow(_cfg(tmp_path, negatives=8))
    for s in _all(d):
        assert not (s.negatives == s.target[:, None]).any()
        assert ((s.negatives >= 0) & (s.negatives < 4)).all()


def test_one_word_vocab_cannot_have_negatives(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.negatives"):
        prepare_cbow(_cfg(tmp_path, "a a a\n", vocab_size=1, remove_stopwords=False))


# ------------------------------------------------------------------------------------------ determinism, splits


def test_seeded_determinism(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    text = _random_text(rng, 200, WORDS, np.full(20, 1 / 20))
    kw = dict(vocab_size=15, window=2, negatives=4, splits=(300, 100, 100))
    a, b = prepare_cbow(_cfg(tmp_path, text, **kw)), prepare_cbow(_cfg(tmp_path, text, **kw))
    c = prepare_cbow(_cfg(tmp_path, text, seed=1, **kw))
    for name in ("train", "valid", "test"):
        for f in ("target", "context", "negatives"):
            np.testing.assert_array_equal(getattr(getattr(a, name), f), getattr(getattr(b, name), f))
    assert not np.array_equal(a.train.target, c.train.target)
    assert not np.array_equal(a.train.negatives, c.train.negatives)


def test_split_sizes_and_disjoint_cover(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    text = _random_text(rng, 200, WORDS, np.full(20, 1 / 20))
    full = prepare_cbow(_cfg(tmp_path, text, vocab_size=15, window=2))
    n = full.total_samples
    d = prepare_cbow(_cfg(tmp_path, text, vocab_size=15, window=2, splits=(0.6, 0.2, 0.2)))
    assert [len(s) for s in _all(d)] == [int(0.6 * n), int(0.2 * n), int(0.2 * n)]
    d = prepare_cbow(_cfg(tmp_path, text, vocab_size=15, window=2, splits=(n - 30, 10, 20)))
    assert [len(s) for s in _all(d)] == [n - 30, 10, 20]
    merged = collections.Counter(p for s in _all(d) for p in _pairs(s))
    assert merged == collections.Counter(_pairs(full.train))  # a partition of all samples


def test_resolve_splits() -> None:
    assert resolve_splits((0.5, 0.25, 0.25), 10) == (5, 2, 2)
    assert resolve_splits((6, 2, 2), 10) == (6, 2, 2)
    assert resolve_splits((1.0, 0.0, 0.0), 7) == (7, 0, 0)
    with pytest.raises(ConfigError, match="data.splits"):
        resolve_splits((6, 3, 2), 10)
    with pytest.raises(ConfigError, match="data.splits"):
        resolve_splits((2.5, 0, 0), 10)


def test_too_large_splits_raise(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.splits: .*only 8"):
        prepare_cbow(_cfg(tmp_path, splits=(5, 2, 2)))


# --------------------------------------------------------------------------------------------------------- cache


def test_cache_hit_does_not_read_the_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _cfg(tmp_path, cache_dir=str(tmp_path / "cache"), negatives=3)
    a = prepare_cbow(cfg)
    assert len(list((tmp_path / "cache").glob("cbow-*.npz"))) == 1

    def boom(*_: object) -> None:
        raise AssertionError("corpus read on a cache hit")

    monkeypatch.setattr(corpus, "load_corpus", boom)
    monkeypatch.setattr(corpus, "read_sentences", boom)
    b = prepare_cbow(cfg)
    assert b.vocab == a.vocab and b.total_samples == a.total_samples
    np.testing.assert_array_equal(b.counts, a.counts)
    for sa, sb in zip(_all(a), _all(b)):
        for f in ("target", "context", "negatives"):
            assert getattr(sb, f).dtype == np.int64
            np.testing.assert_array_equal(getattr(sa, f), getattr(sb, f))
    with pytest.raises(AssertionError, match="cache hit"):  # a new parameter is a miss
        prepare_cbow(dataclasses.replace(cfg, seed=5))


def test_corpus_cache_serves_other_vocab_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = str(tmp_path / "cache")
    cfg = _cfg(tmp_path, cache_dir=cache, vocab_size=4)
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
    cfg = _cfg(tmp_path)
    Path(cfg.corpus[5:]).unlink()  # vanished after the config was validated
    with pytest.raises(ConfigError, match="file not found"):
        prepare_cbow(cfg)


def test_empty_corpus(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no tokens left"):
        prepare_cbow(_cfg(tmp_path, "The, and 42 .\n\nof the\n"))


def test_vocab_larger_than_distinct_words(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.vocab_size: 6 .* 5 distinct"):
        prepare_cbow(_cfg(tmp_path, vocab_size=6))


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


# ------------------------------------------------------------------------------------------------------ canaries


def test_insert_phrases_matches_list_insertion() -> None:
    tokens, sent = np.array([10, 11, 12, 13]), np.array([0, 0, 1, 1])
    phrases = [np.array([7, 8]), np.array([9])]
    new, new_sent, is_can, ins = insert_phrases(tokens, sent, phrases, 3, np.random.default_rng(4))
    assert ins.shape == (6, 2) and np.bincount(ins[:, 0]).tolist() == [3, 3]
    ref: list[tuple[int, int, bool]] = []
    for i in range(len(tokens) + 1):
        for j in ins[ins[:, 1] == i, 0]:
            s = int(sent[min(i, len(tokens) - 1)])
            ref += [(int(w), s, True) for w in phrases[j]]
        if i < len(tokens):
            ref.append((int(tokens[i]), int(sent[i]), False))
    assert list(zip(new.tolist(), new_sent.tolist(), is_can.tolist())) == ref


@pytest.mark.parametrize("shape", ["pair", "bag"])
def test_canaries_land_in_train(tmp_path: Path, shape: str) -> None:
    rng = np.random.default_rng(3)
    text = _random_text(rng, 300, WORDS, np.full(20, 1 / 20)) + "zebra\n"  # zebra: in vocab, in no clean window
    kw = dict(vocab_size=21, window=2, negatives=2, sample_shape=shape, splits=(0.5, 0.2, 0.2))
    clean = prepare_cbow(_cfg(tmp_path, text, **kw))
    phrases, repeats = [["zebra", "qa"], ["qb", "qc", "qd"]], 7
    d = prepare_cbow(_cfg(tmp_path, text, **kw), phrases=phrases, repeats=repeats, insert_seed=11)
    assert d.vocab == clean.vocab and d.vocab[-1] == "zebra"
    assert d.inserted is not None and d.inserted.shape == (14, 2)
    assert np.bincount(d.inserted[:, 0]).tolist() == [repeats, repeats]  # each phrase `repeats` times
    assert [len(s) for s in _all(d)] == [int(f * d.total_samples) for f in (0.5, 0.2, 0.2)]

    zebra = d.vocab.index("zebra")

    def touches_zebra(s: Split) -> np.ndarray:
        return (s.target == zebra) | (s.context == zebra).any(axis=1)

    total, n_zebra = _reference_counts(_sentence_ids(text, d.vocab), d, phrases, window=2, shape=shape)
    assert d.total_samples == total
    assert not touches_zebra(d.valid).any() and not touches_zebra(d.test).any()
    assert touches_zebra(d.train).sum() == n_zebra > 0  # every sample of an inserted zebra is in train
    if shape == "bag":
        assert (d.train.target == zebra).sum() == repeats  # one zebra token per insertion


def _sentence_ids(text: str, vocab: list[str]) -> list[list[int]]:
    index = {w: i for i, w in enumerate(vocab)}
    return [[index[w] for w in line.split() if w in index] for line in text.splitlines()]


def _reference_counts(
    sents: list[list[int]], d: CBOWData, phrases: list[list[str]], *, window: int, shape: str
) -> tuple[int, int]:
    """Naive loops over the stream rebuilt from ``d.inserted``: (all samples, samples touching an inserted zebra)."""
    assert d.inserted is not None
    index = {w: i for i, w in enumerate(d.vocab)}
    zebra = index["zebra"]
    flat = [(w, s) for s, line in enumerate(sents) for w in line]
    stream: list[tuple[int, int]] = []
    for i in range(len(flat) + 1):
        for j in d.inserted[d.inserted[:, 1] == i, 0]:
            stream += [(index[w], flat[min(i, len(flat) - 1)][1]) for w in phrases[j]]
        if i < len(flat):
            stream.append(flat[i])
    total = n_zebra = 0
    for t, (wt, st) in enumerate(stream):
        ctx = [c for c in range(t - window, t + window + 1) if c != t and 0 <= c < len(stream) and stream[c][1] == st]
        if shape == "pair":
            total += len(ctx)
            n_zebra += sum(wt == zebra or stream[c][0] == zebra for c in ctx)
        elif ctx:
            total += 1
            n_zebra += wt == zebra or any(stream[c][0] == zebra for c in ctx)
    return total, n_zebra


def test_canary_word_not_in_vocab(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="phrases\\[1\\]: 'mat' is not in the vocabulary"):
        prepare_cbow(_cfg(tmp_path), phrases=[["cat"], ["dog", "mat"]], repeats=1)


def test_canaries_need_room_in_train(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="canary"):
        prepare_cbow(_cfg(tmp_path, splits=(2, 0, 0)), phrases=[["cat", "dog"]], repeats=3)


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
    assert [len(s) for s in _all(d)] == [200_000, 100_000, 200_000]
    assert len(d.vocab) == 1000 and d.counts[0] >= d.counts[-1]
