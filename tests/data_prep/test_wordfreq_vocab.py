"""``data.vocabulary: wordfreq[:LANG]``: the wordfreq list's first V words passing the token filters, whatever the
corpus; its frequencies as the negatives' weights; a public vocabulary in every statement; one-line errors."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from prep_helpers import tiny_cfg

from widedp.cli import main
from widedp.config import DataConfig
from widedp.data_prep.cbow import prepare_cbow
from widedp.data_prep.corpus import stopword_set
from widedp.data_prep.wordfreq_vocab import corpus_token, describe, wordfreq_words
from widedp.errors import ConfigError
from widedp.extras import MissingExtraError

wordfreq = pytest.importorskip("wordfreq")

#: English text made of common words (and a few the list lacks)
TEXT = "".join(f"the people said {a} time {b} would make new work zzqx {a}\n"
               for a, b in [("good", "way"), ("back", "year"), ("first", "know"), ("like", "one")] * 25)


def test_the_first_words_passing_the_filters_in_wordfreq_order(tmp_path):
    cfg = tiny_cfg(tmp_path, TEXT, vocab_size=25, vocabulary="wordfreq")
    words, freqs = wordfreq_words(cfg)
    stop = stopword_set()
    ranked = wordfreq.top_n_list("en", 5000, wordlist="best")
    expect = [w for w in ranked if w.isalpha() and w not in stop][:25]  # brute force
    assert words == expect and "the" not in words and "said" in words
    assert np.array_equal(freqs, [wordfreq.word_frequency(w, "en", wordlist="best") for w in expect])
    assert (np.diff(freqs) <= 0).all() and freqs.min() > 0  # most frequent first
    # the filters decide: without stop-word removal "the" leads, as in wordfreq's list
    assert wordfreq_words(tiny_cfg(tmp_path, TEXT, vocab_size=3, vocabulary="wordfreq:en",
                                   remove_stopwords=False))[0] == ranked[:3]


def test_data_independent_and_weights_from_the_list(tmp_path):
    a = prepare_cbow(tiny_cfg(tmp_path, TEXT, vocab_size=25, vocabulary="wordfreq"))
    b = prepare_cbow(tiny_cfg(tmp_path, "zzqx year way " * 7 + "\n" + TEXT[:500], vocab_size=25,
                              vocabulary="wordfreq"))
    assert a.vocab == b.vocab == wordfreq_words(tiny_cfg(tmp_path, TEXT, vocab_size=25, vocabulary="wordfreq"))[0]
    assert np.array_equal(a.counts, b.counts)
    # only in-list tokens make samples: zzqx (not in the list) never appears, "the" is a stop word
    used = set(a.train.target.tolist()) | set(a.train.context.ravel().tolist())
    assert {a.vocab[i] for i in used} <= {"people", "said", "good", "time", "way", "would", "make", "new", "work",
                                          "back", "year", "first", "know", "like", "one"}


def test_tokens_the_corpus_can_have(tmp_path):
    text_cfg = tiny_cfg(tmp_path, TEXT, alpha_only=False, remove_stopwords=False)
    brown_cfg = DataConfig(preset="custom", alpha_only=False, remove_stopwords=False)
    assert not corpus_token("don't", text_cfg, frozenset())  # TOKEN_RE splits it: never a token of a text corpus
    assert corpus_token("don't", brown_cfg, frozenset())  # NLTK's Brown tokens keep it
    assert corpus_token("2021", text_cfg, frozenset()) and not corpus_token("2021", DataConfig(), frozenset())
    assert not corpus_token("the", DataConfig(), frozenset({"the"}))


@pytest.mark.parametrize("kw,needle", [
    ({"vocabulary": "wordfreq:english"}, "wordfreq:LANG takes a language code"),
    ({"vocabulary": "wordfreq", "lowercase": False}, "need data.lowercase: true"),
    ({"vocabulary": "wordfreq", "min_count": 3}, "data.min_count"),
    ({"vocabulary": "wordfrequency"}, "expected private_top, dp, file:PATH, wordfreq or wordfreq:LANG"),
])
def test_config_errors(tmp_path, kw, needle):
    with pytest.raises(ConfigError, match=needle):
        tiny_cfg(tmp_path, TEXT, **kw)


def test_build_errors_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"wordfreq has no list for 'xx' \(it has .*en"):
        wordfreq_words(tiny_cfg(tmp_path, TEXT, vocabulary="wordfreq:xx"))
    with pytest.raises(ConfigError, match=r"data.vocab_size: 400000 is more than the \d+ words of wordfreq 3.1.1 "):
        wordfreq_words(tiny_cfg(tmp_path, TEXT, vocab_size=400_000, vocabulary="wordfreq"))
    monkeypatch.setitem(sys.modules, "wordfreq", None)  # a core install: import wordfreq fails
    with pytest.raises(MissingExtraError, match=r"wordfreq needs wordfreq, .*pip install 'widedp\[vocab\]'"):
        wordfreq_words(tiny_cfg(tmp_path, TEXT, vocabulary="wordfreq"))


def test_cache_key_names_the_list(tmp_path):
    keys = {tiny_cfg(tmp_path, TEXT, vocabulary=v).cache_key() for v in ("private_top", "wordfreq", "wordfreq:fr")}
    assert len(keys) == 3


def test_run_statement_says_public(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f'data: {{preset: custom, corpus: "text:{corpus}", vocab_size: 12, vocabulary: wordfreq, '
                   f'splits: [0.6, 0.2, 0.2], cache_dir: "{tmp_path / "cache"}"}}\n'
                   "model: {dim: 8, tied: false}\n"
                   "train: {epochs: 1, batch_size: 10, optimizer: lazy_adam, lr: 0.01, eval_max_samples: 50}\n"
                   "dp: {clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, sampling_rate: 0.05, "
                   "selection: {name: uniform, k: 4}}\n")
    assert main(["train", str(cfg), "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "data.vocabulary: private_top" not in err  # no "not private" warning
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    text = summary["privacy"]["text"]
    assert "the vocabulary: public (data.vocabulary: wordfreq)" in text and describe("en") in text
    assert describe("en") == "wordfreq 3.1.1 'en' list (2021 data, CC BY-SA 4.0)"
    assert "vocabulary not private" not in text and summary["privacy"]["not_covered"] == []
    vocab = json.loads((tmp_path / "run" / "vocab.json").read_text())
    assert vocab == wordfreq_words(tiny_cfg(tmp_path, TEXT, vocab_size=12, vocabulary="wordfreq"))[0]
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "rel")]) == 0
    assert "the vocabulary: public" in json.loads((tmp_path / "rel" / "privacy.json").read_text())["text"]
