"""Read a corpus (Brown via NLTK, a local text file, a Hugging Face dataset), filter its tokens, pick a vocabulary.

The filtered corpus is kept as integer ids into an alphabetically sorted word list, sentence by sentence, and cached
on disk (``<cache_dir>/corpus-<key>.npz``) so that Brown (7–12 s through NLTK) is read once per filter setting and
``max_sentences``.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import uuid
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from widedp.config import DataConfig
from widedp.config.data import TokenFilter
from widedp.errors import ConfigError
from widedp.extras import needs

#: Tokeniser of ``text:`` and ``hf:`` corpora: runs of word characters, or single punctuation marks.
TOKEN_RE = re.compile(r"\w+|[^\w\s]")

_NLTK_HINT = "run `python -m nltk.downloader brown stopwords` or point NLTK_DATA at a folder that holds them"


@dataclass(frozen=True)
class Corpus:
    """A filtered corpus.

    Attributes:
        words: [W] str, the distinct words left after filtering, sorted alphabetically (an id = an index here).
        ids: [T] int64, the filtered tokens of all sentences, concatenated.
        offsets: [S+1] int64, sentence s is ``ids[offsets[s]:offsets[s+1]]`` (sentences left empty are kept).
        documents: [S] int64 non-decreasing, the document of each sentence (None: each sentence is a document).
    """

    words: np.ndarray
    ids: np.ndarray
    offsets: np.ndarray
    documents: np.ndarray | None = None

    @property
    def num_sentences(self) -> int:
        return len(self.offsets) - 1

    def sentence_of_token(self) -> np.ndarray:
        """[T] int64 the sentence of each token."""
        return np.repeat(np.arange(self.num_sentences), np.diff(self.offsets))

    def document_of_sentence(self) -> np.ndarray:
        """[S] int64 the document of each sentence."""
        return np.arange(self.num_sentences) if self.documents is None else self.documents


@dataclass(frozen=True)
class Vocab:
    """The ``V`` most frequent words of a corpus (ties broken alphabetically).

    Attributes:
        words: the V words, most frequent first. counts: [V] their negative-sampling weights (int64 corpus counts
            for the top-V; float64 for a word list or a DP vocabulary).
        remap: [W] int64, corpus word id -> vocabulary id, or -1 for a word outside the vocabulary.
    """

    words: list[str]
    counts: np.ndarray
    remap: np.ndarray


# ------------------------------------------------------------------------------------------------------ reading


def read_sentences(cfg: DataConfig) -> tuple[list[Sequence[str]], np.ndarray]:
    """The raw token lists of ``cfg.corpus``, unfiltered (Brown: NLTK's sentences; text/hf: one per line/row), and
    [S] int64 the document of each (Brown: its source file; text: blocks of lines between blank lines; hf: each row
    its own document); only the first ``cfg.max_sentences`` when that is not 0."""
    limit = cfg.max_sentences or None
    if cfg.corpus == "brown":
        return _brown_sentences(limit)
    if cfg.corpus.startswith("text:"):
        return _text_sentences(cfg.corpus[5:], limit)
    sents = _hf_sentences(cfg, limit)
    return sents, np.arange(len(sents), dtype=np.int64)


def _brown_sentences(limit: int | None) -> tuple[list[list[str]], np.ndarray]:
    brown = _nltk_corpus("brown")
    out: list[list[str]] = []
    docs: list[int] = []
    for d, fid in enumerate(brown.fileids()):  # brown.sents() is these files' sentences in this order
        if limit is not None and len(out) >= limit:
            break
        sents = brown.sents(fid)
        part = [list(s) for s in (sents[: limit - len(out)] if limit is not None else sents)]
        out += part
        docs += [d] * len(part)
    return out, np.asarray(docs, dtype=np.int64)


def stopword_set() -> frozenset[str]:
    """NLTK's English stop words (179 words in NLTK 3.9+)."""
    return frozenset(_nltk_corpus("stopwords").words("english"))


def _nltk_corpus(name: str) -> Any:  # an NLTK corpus reader
    """``nltk.corpus.<name>``, downloading it quietly when missing; ConfigError when that fails too."""
    import nltk

    # NLTK reads NLTK_DATA once, at import; honour a value set later (tests, notebooks).
    for p in reversed(os.environ.get("NLTK_DATA", "").split(os.pathsep)):
        if p and p not in nltk.data.path:
            nltk.data.path.insert(0, p)
    corpus = getattr(nltk.corpus, name)
    try:
        corpus.fileids()  # any attribute access loads it
        return corpus
    except LookupError:
        pass
    try:
        ok = nltk.download(name, quiet=True, raise_on_error=True, print_error_to=io.StringIO())
    except Exception:  # offline: URLError, ValueError, ...
        ok = False
    try:
        if not ok:
            raise LookupError(name)
        corpus = getattr(nltk.corpus, name)
        corpus.fileids()  # any attribute access loads it
        return corpus
    except LookupError:
        raise ConfigError(f"data.corpus: NLTK resource {name!r} not found and could not be downloaded; "
                          f"{_NLTK_HINT}") from None


def _text_sentences(path: str, limit: int | None) -> tuple[list[list[str]], np.ndarray]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"data.corpus: file not found: {path}")
    out: list[list[str]] = []
    docs: list[int] = []
    doc, blank = 0, False
    try:
        with p.open(encoding="utf-8") as f:
            for line in f:
                if limit is not None and len(out) >= limit:
                    break
                if "\x00" in line:  # valid UTF-8 but not text: say so, not "too few distinct words"
                    raise ConfigError(f"data.corpus: {path} is a binary file (a NUL byte on line {len(out) + 1}), "
                                      "not text")
                if line.strip():
                    doc += blank  # a blank line before this one closed the previous document
                    blank = False
                else:
                    blank = True
                out.append(TOKEN_RE.findall(line))
                docs.append(doc)
    except UnicodeDecodeError as e:
        raise ConfigError(f"data.corpus: {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return out, np.asarray(docs, dtype=np.int64)


def _hf_sentences(cfg: DataConfig, limit: int | None) -> list[list[str]]:
    name, _, config = cfg.corpus[3:].partition(":")
    if not name:
        raise ConfigError(f"data.corpus: expected hf:NAME[:CONFIG], got {cfg.corpus!r}")
    with needs("data", "data.corpus: hf:NAME"):
        import datasets

    try:
        ds = datasets.load_dataset(name, config or None, split=cfg.hf_split)
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"data.corpus: cannot load Hugging Face dataset {cfg.corpus[3:]!r} "
                          f"(split {cfg.hf_split!r}): {msg}") from None
    if cfg.hf_column not in ds.column_names:
        raise ConfigError(f"data.hf_column: dataset {cfg.corpus[3:]!r} has no column {cfg.hf_column!r} "
                          f"(columns: {', '.join(ds.column_names)})")
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
    # datasets 5.x: ds[col] is a lazy Column; iterate it.
    return [TOKEN_RE.findall(t) if isinstance(t, str) else [] for t in ds[cfg.hf_column]]


# ---------------------------------------------------------------------------------------------------- filtering


def filter_sentences(
    sentences: Iterable[Sequence[str]], *, lowercase: bool, alpha_only: bool, stopwords: frozenset[str] = frozenset(),
    documents: np.ndarray | None = None,
) -> Corpus:
    """Apply the token filters, in this order: lowercase, alphabetic only, stop-word removal.

    Stop words are matched case-insensitively (``The`` is removed also when ``lowercase`` is false).
    ``documents``: [S] the document of each sentence (kept as ``Corpus.documents``).
    """
    flat: list[str] = []
    lengths: list[int] = []
    for sent in sentences:
        n0 = len(flat)
        for w in sent:
            if lowercase:
                w = w.lower()
            if alpha_only and not w.isalpha():
                continue
            if stopwords and w.lower() in stopwords:
                continue
            flat.append(w)
        lengths.append(len(flat) - n0)
    words = sorted(set(flat))
    index = {w: i for i, w in enumerate(words)}
    ids = np.fromiter((index[w] for w in flat), dtype=np.int64, count=len(flat))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Corpus(np.array(words, dtype=str), ids, offsets, documents)


def apply_filters(sentences: Iterable[Sequence[str]], tokens: TokenFilter, *,
                  documents: np.ndarray | None = None) -> Corpus:
    """``filter_sentences`` with a config's token filters (NLTK's English stop words when ``remove_stopwords``)."""
    stop = stopword_set() if tokens.remove_stopwords else frozenset()
    return filter_sentences(sentences, lowercase=tokens.lowercase, alpha_only=tokens.alpha_only, stopwords=stop,
                            documents=documents)


def load_corpus(cfg: DataConfig) -> Corpus:
    """The filtered corpus of ``cfg``, from the cache when there."""
    path = _corpus_cache_path(cfg)
    corpus = _load_cached(path) if path is not None else None
    if corpus is None:
        sentences, documents = read_sentences(cfg)  # first: corpus errors come before those about stop words
        corpus = apply_filters(sentences, cfg, documents=documents)
        if path is not None:
            _save_cached(path, corpus)
    return corpus


def select_vocab(corpus: Corpus, vocab_size: int, *, source: str = "", min_count: int = 1) -> Vocab:
    """The ``vocab_size`` most frequent words, ties broken alphabetically; ConfigError when too few words. With
    ``min_count`` > 1: the words occurring at least that often, at most ``vocab_size`` of them."""
    counts = np.bincount(corpus.ids, minlength=len(corpus.words))
    distinct = int(np.count_nonzero(counts))
    if distinct == 0:
        raise ConfigError(f"data.corpus: no tokens left after filtering in {source or 'the corpus'}")
    if min_count > 1:
        frequent = int(np.count_nonzero(counts >= min_count))
        if frequent == 0:
            raise ConfigError(f"data.min_count: no word occurs {min_count} times in {source or 'the corpus'}")
        vocab_size = min(vocab_size, frequent)
    if vocab_size > distinct:
        raise ConfigError(f"data.vocab_size: {vocab_size} is more than the {distinct} distinct words left after "
                          f"filtering {source or 'the corpus'}")
    order = np.argsort(-counts, kind="stable")[:vocab_size]  # stable: equal counts stay alphabetical
    remap = np.full(len(corpus.words), -1, dtype=np.int64)
    remap[order] = np.arange(vocab_size)
    return Vocab([str(w) for w in corpus.words[order]], counts[order].astype(np.int64), remap)


def vocab_from_words(corpus: Corpus, words: Sequence[str], weights: np.ndarray) -> Vocab:
    """The vocabulary ``words`` (id = position) with negative-sampling weights ``weights`` [V] (float; counts, noisy
    counts or a Zipf law). Corpus words outside it map to -1; words the corpus lacks keep their (untrained) rows."""
    index = {w: i for i, w in enumerate(words)}
    if len(index) != len(words):
        raise ConfigError("data.vocabulary: the word list repeats a word")
    remap = np.fromiter((index.get(str(w), -1) for w in corpus.words), dtype=np.int64, count=len(corpus.words))
    return Vocab([str(w) for w in words], np.asarray(weights, dtype=np.float64), remap)


def file_vocab(corpus: Corpus, path: str, vocab_size: int, *, lowercase: bool) -> Vocab:
    """``data.vocabulary: file:PATH``: the first ``vocab_size`` words of a public list (one per line, ``word`` or
    ``word count``; blank lines skipped). Negative-sampling weights: the counts when every line has one, else a Zipf
    law over the list's order, weight(rank r) = 1/r (r = 1, 2, ...)."""
    p = Path(path).expanduser()
    words: list[str] = []
    counts: list[float] = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"data.vocabulary: cannot read {path} ({type(e).__name__})") from None
    for i, line in enumerate(lines):
        parts = line.split()
        if not parts:
            continue
        if len(parts) > 2 or (len(parts) == 2 and not _positive_number(parts[1])):
            raise ConfigError(f"data.vocabulary: {path} line {i + 1}: expected 'word' or 'word count', got {line!r}")
        words.append(parts[0].lower() if lowercase else parts[0])
        counts.append(float(parts[1]) if len(parts) == 2 else math.nan)
        if len(words) == vocab_size:
            break
    if len(words) < 2:
        raise ConfigError(f"data.vocabulary: {path} lists {len(words)} word(s); need at least 2")
    c = np.asarray(counts)
    weights = c if not np.isnan(c).any() else 1.0 / np.arange(1, len(words) + 1)
    return vocab_from_words(corpus, words, weights)


def _positive_number(s: str) -> bool:
    try:
        return float(s) > 0 and math.isfinite(float(s))
    except ValueError:
        return False


# -------------------------------------------------------------------------------------------------------- cache


def cache_root(cfg: DataConfig) -> Path | None:
    """``cfg.cache_dir`` (relative to the working directory), or None when caching is off (empty string)."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else None


def _corpus_cache_path(cfg: DataConfig) -> Path | None:
    root = cache_root(cfg)
    if root is None:
        return None
    key: dict[str, object] = {"corpus": cfg.corpus, "lowercase": cfg.lowercase, "alpha_only": cfg.alpha_only,
                              "remove_stopwords": cfg.remove_stopwords, "max_sentences": cfg.max_sentences,
                              "token_re": TOKEN_RE.pattern, "v": 2}
    if cfg.corpus.startswith("text:"):
        p = Path(cfg.corpus[5:]).expanduser()
        if p.is_file():
            st = p.stat()
            key["stat"] = [str(p.resolve()), st.st_size, st.st_mtime_ns]
    if cfg.corpus.startswith("hf:"):
        key["hf"] = [cfg.hf_split, cfg.hf_column]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"corpus-{digest}.npz"


#: what reading a damaged (truncated, overwritten) cache file raises: the entry is then rebuilt
DAMAGED = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile)


def _load_cached(path: Path) -> Corpus | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            return Corpus(z["words"], z["ids"].astype(np.int64), z["offsets"].astype(np.int64),
                          z["documents"].astype(np.int64))
    except DAMAGED:  # a damaged cache file is rebuilt
        return None


def _save_cached(path: Path, corpus: Corpus) -> None:
    atomic_savez(path, words=corpus.words, ids=corpus.ids.astype(np.int32), offsets=corpus.offsets,
                 documents=corpus.document_of_sentence())


def atomic_savez(path: Path, **arrays: np.ndarray) -> None:
    """``np.savez`` to a temporary file beside ``path``, then ``os.replace`` (readers never see a partial file)."""
    write_atomic(path, lambda f: np.savez(f, **arrays))


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` through ``write(file)`` into a temporary file beside it, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
