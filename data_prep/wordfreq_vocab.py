"""``data.vocabulary: wordfreq[:LANG]``: a public vocabulary that ships with the ``vocab`` extra.

The words are the wordfreq package's ``best`` list for LANG (``wordfreq.top_n_list``: most frequent first, lower
case), kept in that order when they pass the run's token filters and can be a token of the corpus, the first
``vocab_size`` of them; the negatives follow its frequencies (``wordfreq.word_frequency``). Nothing of the private
corpus enters the choice, so the vocabulary costs no privacy. wordfreq 3.1.1's data were frozen in 2021 and are
licensed CC BY-SA 4.0 (Robyn Speer, https://github.com/rspeer/wordfreq).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from widedp.config import DataConfig
from widedp.data_prep import corpus as corpus_mod
from widedp.errors import ConfigError
from widedp.extras import needs

#: what every statement and the docs say about the list
VERSION, DATA_YEAR, LICENCE = "3.1.1", 2021, "CC BY-SA 4.0"


def describe(lang: str) -> str:
    """``wordfreq 3.1.1 'en' list (2021 data, CC BY-SA 4.0)``: the source named in privacy statements."""
    return f"wordfreq {VERSION} {lang!r} list ({DATA_YEAR} data, {LICENCE})"


def corpus_token(word: str, cfg: DataConfig, stopwords: frozenset[str]) -> bool:
    """Whether ``word`` (a wordfreq entry, lower case) can be a token of ``cfg``'s filtered corpus: it passes the
    token filters (alphabetic only, stop words removed) and, for ``text:`` and ``hf:`` corpora, the tokeniser keeps
    it whole (``corpus.TOKEN_RE``: ``don't`` is three tokens there; Brown's own tokens keep it)."""
    if cfg.alpha_only and not word.isalpha():
        return False
    if stopwords and word in stopwords:
        return False
    return cfg.corpus == "brown" or corpus_mod.TOKEN_RE.findall(word) == [word]


def wordfreq_words(cfg: DataConfig) -> tuple[list[str], np.ndarray]:
    """The first ``cfg.vocab_size`` words of wordfreq's list for ``cfg.wordfreq_lang`` that ``corpus_token``
    keeps, and [V] float64 their wordfreq frequencies (the negative-sampling weights)."""
    lang = cfg.wordfreq_lang
    if lang is None:
        raise ConfigError(f"data.vocabulary: {cfg.vocabulary!r} is not a wordfreq vocabulary")
    with needs("vocab", f"data.vocabulary: {cfg.vocabulary}"):
        import wordfreq
    langs = wordfreq.available_languages(wordlist="best")
    if lang not in langs:
        raise ConfigError(f"data.vocabulary: wordfreq has no list for {lang!r} (it has {', '.join(sorted(langs))})")
    stop = corpus_mod.stopword_set() if cfg.remove_stopwords else frozenset()
    ranked: Sequence[str] = wordfreq.top_n_list(lang, 10**7, wordlist="best")  # the whole list
    words = list(dict.fromkeys(w for w in ranked if corpus_token(w, cfg, stop)))[: cfg.vocab_size]
    if len(words) < cfg.vocab_size:
        raise ConfigError(f"data.vocab_size: {cfg.vocab_size} is more than the {len(words)} words of {describe(lang)} "
                          "left after the token filters")
    freqs = np.array([wordfreq.word_frequency(w, lang, wordlist="best") for w in words], dtype=np.float64)
    if not (freqs > 0).all():  # every listed word has a frequency; a zero would never be drawn as a negative
        raise ConfigError(f"data.vocabulary: {describe(lang)} gives {words[int(np.argmin(freqs))]!r} frequency 0")
    return words, freqs


def wordfreq_vocab(corpus: corpus_mod.Corpus, cfg: DataConfig) -> corpus_mod.Vocab:
    """``data.vocabulary: wordfreq[:LANG]`` over ``corpus``: corpus words outside the list map to -1; listed words
    the corpus lacks keep their (untrained) rows."""
    words, freqs = wordfreq_words(cfg)
    return corpus_mod.vocab_from_words(corpus, words, freqs)
