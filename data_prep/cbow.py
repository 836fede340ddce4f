"""CBOW samples (target, context, negatives) from a corpus, split into train / valid / test, cached on disk.

Pipeline (the ``paper`` preset): tokens lowercased, non-alphabetic tokens and NLTK's 179 English stop words
dropped; vocabulary = the V most frequent remaining words (ties alphabetical); out-of-vocabulary tokens dropped, so
windows run over the in-vocabulary token stream; a window of ``window`` words on EACH side of the target, never
crossing a sentence boundary; one sample per (target, context word) pair (``pair``) or per target (``bag``);
record-local splits (``widedp.data_prep.splits``: each sample's split, its place in the split and its ``negatives``
ids — unigram^0.75, never the target — come from a key of the sample's own content, or its sentence's / document's
with those units, so that, for a fixed vocabulary, adding or removing a unit changes no other sample; a vocabulary
computed from the corpus (``private_top``) changes with it).

The window definition was chosen by counting pairs on Brown with V=1000 (the issue says "about 979K"):

    ==========================  =============  ============
    window                      within sents   across sents
    ==========================  =============  ============
    2 words each side           633,564        930,714
    4 words each side           **979,216**    1,861,420
    ==========================  =============  ============

(on 232,680 in-vocabulary tokens in 57,340 sentences). Windows over the stream *before* OOV words are dropped give
653,164 (4 each side). So "window 4" = 4 in-vocabulary words each side, within sentences: 979,216 pairs, and
224,940 bag samples (targets with a non-empty window). ``brown_10k`` (V=10,000): 2,514,322 pairs. ``brown_full``
(``min_count`` 5: every word seen at least 5 times, V=13,232 of the 40,097 words left after the filters):
2,652,900 pairs (1,591,740 train).

Vocabulary (``data.vocabulary``): ``private_top`` (above), ``file:PATH`` (a public list, ``corpus.file_vocab``),
``wordfreq[:LANG]`` (the wordfreq package's public list, ``wordfreq_vocab``) or
``dp`` (the run's release, ``widedp.dp.vocab``: passed in as ``vocab=``, never cached). The train split also keeps
each sample's sentence, document and corpus-order key for privacy units (``widedp.dp.units``). The splits are
sample-level whatever the unit, but the keys are the unit's (a pair's own content with ``pair``, its sentence's
content and its index there with ``sentence``), so valid/test differ between units (same rates).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from widedp.config import DataConfig
from widedp.data_prep import corpus as corpus_mod
from widedp.data_prep import splits as splits_mod
from widedp.data_prep.samples import (
    draw_negatives_keyed,
    insert_phrase_units,
    insert_phrases,
    window_bags,
    window_pairs,
)
from widedp.data_prep.wordfreq_vocab import wordfreq_vocab
from widedp.errors import ConfigError

_FORMAT = 3  # bump when the prepared arrays change for the same parameters


@dataclass(frozen=True)
class Split:
    """One split. target: [n] int64; context: [n, C] int64 (-1 = padding; ``pair``: C = 1); negatives: [n, K].

    The train split also carries what privacy units need (None on valid/test): sentence, document: [n] int64 the
    sentence / document of each sample (a canary inserted as its own unit has ids of its own); order: [n] int64 a
    key increasing in corpus order (target position, then context position) that ranks a unit's samples.
    """

    target: np.ndarray
    context: np.ndarray
    negatives: np.ndarray
    sentence: np.ndarray | None = None
    document: np.ndarray | None = None
    order: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.target)


@dataclass(frozen=True)
class CBOWData:
    """Prepared CBOW data.

    Attributes:
        vocab: the V words, most frequent first (id = index). counts: [V] int64 clean-corpus counts.
        train, valid, test: the splits. total_samples: samples available before splitting (canary ones included).
        inserted: [m, 2] int64 rows (phrase index, position) of the inserted canaries, position = index in the clean
            in-vocabulary token stream before which the phrase went; None without canaries.
    """

    vocab: list[str]
    counts: np.ndarray
    train: Split
    valid: Split
    test: Split
    total_samples: int
    inserted: np.ndarray | None = None


def prepare_cbow(
    cfg: DataConfig, *, phrases: Sequence[Sequence[str]] = (), repeats: int = 0, insert_seed: int = 0,
    vocab: corpus_mod.Vocab | None = None,
) -> CBOWData:
    """Build (or load from ``cfg.cache_dir``) the CBOW splits of ``cfg``.

    With ``phrases`` and ``repeats > 0``, each phrase (vocabulary words) is inserted ``repeats`` times after the
    vocabulary is chosen on the clean corpus (seeded by ``insert_seed``): with ``privacy_unit: pair`` at random
    positions of the in-vocabulary stream (inside sentences), otherwise as its own sentence and document (one unit
    per insertion) at random sentence boundaries. Every sample touching an inserted token goes to train; clean
    samples keep the split they have without the canaries (up to the few windows an insertion inside a sentence
    changes).

    ``vocab``: the vocabulary to use (``data.vocabulary: dp`` needs the run's released one, see
    ``widedp.dp.vocab``); such data is not cached.
    """
    if repeats < 0:
        raise ConfigError(f"repeats: must be >= 0, got {repeats}")
    if vocab is None and cfg.vocabulary == "dp":
        raise ConfigError("data.vocabulary: dp is drawn by each run (widedp train / widedp canary write it to "
                          "RUN/vocab_release.json); it cannot be prepared without that run's vocabulary")
    canary = bool(phrases) and repeats > 0
    paths = _cache_paths(cfg, phrases, repeats, insert_seed) if vocab is None else None
    if paths is not None and (cached := _load(*paths)) is not None:
        return cached

    corp = corpus_mod.load_corpus(cfg)
    vocab = vocab if vocab is not None else corpus_vocab(corp, cfg)
    tok = vocab.remap[corp.ids]
    sent = corp.sentence_of_token()
    keep = tok >= 0
    tokens, sent = tok[keep], sent[keep]
    doc = corp.document_of_sentence()[sent]

    inserted = None
    is_canary = np.zeros(len(tokens), dtype=bool)
    if canary:
        phrase_ids = _phrase_ids(phrases, vocab.words)
        rng_ins = np.random.default_rng([insert_seed, 3])
        if cfg.privacy_unit == "pair":
            tokens, sent, is_canary, inserted = insert_phrases(tokens, sent, phrase_ids, repeats, rng_ins)
            doc = np.zeros(len(tokens), dtype=np.int64)  # (documents are not used with pair units)
        else:
            tokens, sent, doc, is_canary, inserted = insert_phrase_units(tokens, sent, doc, phrase_ids, repeats,
                                                                         rng_ins)

    t_pos, c_pos = sample_positions(sent, cfg)
    sample_canary = is_canary[t_pos] | (is_canary[c_pos] & (c_pos >= 0)).any(axis=1)
    total = len(t_pos)
    order = t_pos * (2 * cfg.window + 2) + np.where(c_pos[:, 0] >= 0, c_pos[:, 0] - t_pos + cfg.window + 1, 0)
    context_all = np.where(c_pos >= 0, tokens[np.maximum(c_pos, 0)], -1)
    keys = sample_keys(cfg, splits_mod.word_keys(vocab.words), tokens, sent, doc, is_canary, t_pos, context_all,
                       order, sample_canary)
    n_clean = int((~sample_canary).sum())
    rates = splits_mod.split_rates(cfg.splits, n_clean, what=f"{cfg.sample_shape} samples of {cfg.corpus} "
                                   f"(V={cfg.vocab_size})")
    which = splits_mod.assign(keys, rates)
    which[sample_canary] = 0  # every sample that involves a canary is trained on
    parts = []
    for i in range(3):
        idx = splits_mod.members(which, keys, i)
        if i == 0 and len(idx) == 0:
            raise ConfigError(f"data.splits: the train split is empty ({list(cfg.splits)} of {n_clean:,} samples)")
        target = tokens[t_pos[idx]]
        negatives = draw_negatives_keyed(target, vocab.counts, cfg.negatives, keys[idx])
        units = (sent[t_pos[idx]], doc[t_pos[idx]], order[idx]) if i == 0 else ()
        parts.append(Split(target, context_all[idx], negatives, *units))
    data = CBOWData(vocab.words, vocab.counts, *parts, total_samples=total, inserted=inserted)
    if paths is not None:
        _save(*paths, data)
    return data


def corpus_vocab(corp: corpus_mod.Corpus, cfg: DataConfig) -> corpus_mod.Vocab:
    """The vocabulary of ``data.vocabulary`` private_top (the top-V words), file:PATH or wordfreq[:LANG] (``dp``:
    see vocab_dp)."""
    if cfg.vocabulary.startswith("file:"):
        return corpus_mod.file_vocab(corp, cfg.vocabulary[5:], cfg.vocab_size, lowercase=cfg.lowercase)
    if cfg.wordfreq_lang is not None:
        return wordfreq_vocab(corp, cfg)
    return corpus_mod.select_vocab(corp, cfg.vocab_size, source=cfg.corpus, min_count=cfg.min_count)


def sample_positions(sent: np.ndarray, cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """Target positions [n] and context positions [n, C] (-1 padding) of every sample of a stream."""
    if cfg.sample_shape == "pair":
        t_pos, c_pos = window_pairs(sent, cfg.window)
        return t_pos, c_pos[:, None]
    return window_bags(sent, cfg.window)


def sample_keys(
    cfg: DataConfig, words: np.ndarray, tokens: np.ndarray, sent: np.ndarray, doc: np.ndarray, is_canary: np.ndarray,
    t_pos: np.ndarray, context: np.ndarray, order: np.ndarray, sample_canary: np.ndarray,
) -> np.ndarray:
    """[n] uint64 record key of every sample (``widedp.data_prep.splits``), per ``cfg.privacy_unit``; ``words``
    [V] the vocabulary's word keys (``splits.word_keys``): content is keyed by words, not by vocabulary ids.

    ``pair``: the sample's own content (target and context words) and its count among equal samples. ``sentence`` /
    ``document``: the unit's content (its in-vocabulary tokens, sentence by sentence) and its count among equal
    units, then the sample's index within the unit in corpus order. Either way adding or removing one unit leaves
    every other unit's samples with the keys they had. Canary samples (units) are counted apart from clean ones.
    """
    w = np.r_[words, np.uint64(0)]  # index -1 (context padding) -> 0
    if cfg.privacy_unit == "pair":
        return splits_mod.row_keys([w[tokens[t_pos]], w[context]], seed=cfg.seed, purpose="cbow-pair",
                                   group_only=[sample_canary])
    unit_of_token = sent if cfg.privacy_unit == "sentence" else doc
    bounds = np.flatnonzero(np.r_[True, unit_of_token[1:] != unit_of_token[:-1]]) if len(tokens) else np.zeros(0, int)
    # The content of a unit: each of its sentences as (length, word keys...), uint64 little-endian. One stream for
    # the corpus, sliced per unit (sentence boundaries inside a document are content too).
    sent_starts = np.flatnonzero(np.r_[True, sent[1:] != sent[:-1]]) if len(tokens) else np.zeros(0, int)
    lengths = np.diff(np.r_[sent_starts, len(tokens)]).astype(np.uint64)
    stream = np.insert(w[tokens], sent_starts, lengths).astype("<u8").tobytes()
    edges = np.r_[bounds, len(tokens)]
    at = 8 * (edges + np.searchsorted(sent_starts, edges, side="left"))  # byte offsets: markers before a position
    canary = np.add.reduceat(is_canary.astype(np.int64), bounds) > 0 if len(bounds) else np.zeros(0, bool)
    blobs = ((b"canary:" if c else b"") + stream[p:q] for p, q, c in zip(at[:-1].tolist(), at[1:].tolist(),
                                                                         canary.tolist()))
    unit_keys = splits_mod.blob_keys(blobs, seed=cfg.seed, purpose=f"cbow-{cfg.privacy_unit}")
    u = np.searchsorted(bounds, t_pos, side="right") - 1  # the unit of each sample's target
    by_order = np.argsort(order, kind="stable")  # corpus order: a sample's index within its unit counts in it
    rank = np.empty(len(u), dtype=np.int64)
    rank[by_order] = splits_mod.occurrence(u[by_order])
    return splits_mod.combine(unit_keys[u], rank.astype(np.uint64))


def _phrase_ids(phrases: Sequence[Sequence[str]], vocab: list[str]) -> list[np.ndarray]:
    index = {w: i for i, w in enumerate(vocab)}
    out = []
    for j, phrase in enumerate(phrases):
        if isinstance(phrase, str) or len(phrase) == 0:
            raise ConfigError(f"phrases[{j}]: expected a non-empty list of words, got {phrase!r}")
        missing = [w for w in phrase if w not in index]
        if missing:
            raise ConfigError(f"phrases[{j}]: {missing[0]!r} is not in the vocabulary (V={len(vocab)})")
        out.append(np.array([index[w] for w in phrase], dtype=np.int64))
    return out


# -------------------------------------------------------------------------------------------------------- cache


def _cache_paths(
    cfg: DataConfig, phrases: Sequence[Sequence[str]], repeats: int, insert_seed: int
) -> tuple[Path, Path] | None:
    root = corpus_mod.cache_root(cfg)
    if root is None:
        return None
    if phrases and repeats > 0:
        raw = json.dumps([[list(p) for p in phrases], repeats, insert_seed]
                         + (["own_units"] if cfg.privacy_unit != "pair" else []))
        tag = hashlib.sha256(raw.encode()).hexdigest()[:12]
    else:
        tag = "clean"
    stem = f"cbow-v{_FORMAT}-{cfg.cache_key()}-{tag}"
    return root / f"{stem}.npz", root / f"{stem}.vocab.json"


def _save(npz_path: Path, vocab_path: Path, data: CBOWData) -> None:
    arrays = {"counts": data.counts, "total_samples": np.int64(data.total_samples)}
    for name in ("train", "valid", "test"):
        s: Split = getattr(data, name)
        arrays |= {f"{name}_target": s.target.astype(np.int32), f"{name}_context": s.context.astype(np.int32),
                   f"{name}_negatives": s.negatives.astype(np.int32)}
    for a in ("sentence", "document", "order"):
        arrays[f"train_{a}"] = getattr(data.train, a)
    if data.inserted is not None:
        arrays["inserted"] = data.inserted
    # vocab first: the npz appearing is what marks a complete entry
    corpus_mod.write_atomic(vocab_path, lambda f: f.write(json.dumps(data.vocab).encode()))
    corpus_mod.atomic_savez(npz_path, **arrays)


def _load(npz_path: Path, vocab_path: Path) -> CBOWData | None:
    if not (npz_path.is_file() and vocab_path.is_file()):
        return None
    try:
        vocab = json.loads(vocab_path.read_text())
        with np.load(npz_path, allow_pickle=False) as z:
            splits = [
                Split(*(z[f"{name}_{a}"].astype(np.int64) for a in ("target", "context", "negatives")),
                      *((z[f"train_{a}"].astype(np.int64) for a in ("sentence", "document", "order"))
                        if name == "train" else ()))
                for name in ("train", "valid", "test")
            ]
            inserted = z["inserted"].astype(np.int64) if "inserted" in z.files else None
            counts = z["counts"]
            counts = counts.astype(np.int64) if counts.dtype.kind in "iu" else counts.astype(np.float64)
            return CBOWData(vocab, counts, *splits, total_samples=int(z["total_samples"]), inserted=inserted)
    except corpus_mod.DAMAGED:  # damaged entry: rebuild
        return None
