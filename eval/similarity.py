"""Word similarity of embedding vectors: Spearman correlation with human judgements (WordSim-353, SimLex-999), the
share of pairs in the vocabulary, and nearest neighbours by cosine.

The score of a pair set is gensim's ``KeyedVectors.evaluate_word_pairs`` (default arguments) computed exactly, in
float64, without building a gensim model: lines starting with ``#`` and lines that are not ``word<TAB>word<TAB>score``
are skipped; words are matched case-insensitively (upper-cased; of words equal up to case the first in vocabulary
order is used); a pair with a word outside the vocabulary is left out (and counted); the model's similarity is the
cosine (0 for a zero vector); Spearman's ρ and Pearson's r are scipy's over the pairs left (with ρ's approximate
95% interval, Fisher's z with Fieller et al.'s variance 1.06 / (n − 3): over the ~40 pairs a small vocabulary
keeps it is about ±0.3 wide, so such ρ differ by chance). Unlike gensim's
default, the whole vocabulary is used (gensim's ``restrict_vocab`` keeps the first 300,000 words). The pair files
are gensim's bundled copies (``gensim.test.utils.datapath``: the ``eval`` extra).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from widedp.errors import ConfigError
from widedp.extras import needs

#: benchmark key -> (its name in reports, gensim's bundled file)
BENCHMARKS: dict[str, tuple[str, str]] = {"wordsim353": ("WordSim-353", "wordsim353.tsv"),
                                          "simlex999": ("SimLex-999", "simlex999.txt")}


@dataclass(frozen=True)
class PairSet:
    """Word pairs with human similarity scores. first, second: [P] the words as written; gold: [P] float64 scores."""

    name: str
    first: tuple[str, ...]
    second: tuple[str, ...]
    gold: np.ndarray


def parse_pairs(name: str, text: str) -> PairSet:
    """The pairs of a gensim-format file's ``text`` (see the module docstring for what is skipped)."""
    first, second, gold = [], [], []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 3:
            continue
        try:
            score = float(parts[2])
        except ValueError:
            continue
        first.append(parts[0])
        second.append(parts[1])
        gold.append(score)
    return PairSet(name, tuple(first), tuple(second), np.asarray(gold, dtype=np.float64))


@cache
def benchmark(key: str) -> PairSet:
    """The pair set ``key`` of ``BENCHMARKS`` from gensim's test data (MissingExtraError without gensim)."""
    with needs("eval", "word similarity (widedp eval)"):
        from gensim.test.utils import datapath
    title, file = BENCHMARKS[key]
    path = Path(datapath(file))
    try:
        return parse_pairs(title, path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the {title} pairs ({type(e).__name__})") from None


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """[V, D] float64 rows scaled to norm 1 (zero rows stay zero)."""
    v = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return np.divide(v, norms, out=np.zeros_like(v), where=norms > 0)


def case_index(words: Sequence[str]) -> dict[str, int]:
    """Upper-cased word -> its first row (gensim's case-insensitive lookup)."""
    index: dict[str, int] = {}
    for i, w in enumerate(words):
        index.setdefault(w.upper(), i)
    return index


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def pair_scores(words: Sequence[str], vectors: np.ndarray, pairs: PairSet) -> dict[str, Any]:
    """Correlation of the cosines of ``vectors`` [V, D] (row i = ``words[i]``) with ``pairs``' gold scores.

    Returns spearman and pearson (None with fewer than 2 pairs in the vocabulary or a constant side),
    spearman_ci95 ([lo, hi], ``spearman_interval``; None below 4 pairs), pairs (P), in_vocab (pairs with both words
    in the vocabulary) and share_in_vocab = in_vocab / P."""
    from scipy import stats

    if len(words) != len(vectors):
        raise ValueError(f"{len(words)} words for {len(vectors)} vectors")
    index = case_index(words)
    hits = [(index.get(a.upper()), index.get(b.upper())) for a, b in zip(pairs.first, pairs.second)]
    keep = np.array([a is not None and b is not None for a, b in hits], dtype=bool)
    total, n = len(hits), int(keep.sum())
    out: dict[str, Any] = {"pairs": total, "in_vocab": n, "share_in_vocab": n / total if total else None,
                           "spearman": None, "spearman_ci95": None, "pearson": None}
    if n >= 2:
        ia = np.array([a for (a, _), k in zip(hits, keep) if k])
        ib = np.array([b for (_, b), k in zip(hits, keep) if k])
        unit = unit_rows(vectors)
        cos = np.einsum("pd,pd->p", unit[ia], unit[ib])
        gold = pairs.gold[keep]
        if np.ptp(cos) > 0 and np.ptp(gold) > 0:
            out["spearman"] = _finite(stats.spearmanr(gold, cos).statistic)
            out["pearson"] = _finite(stats.pearsonr(gold, cos).statistic)
            out["spearman_ci95"] = spearman_interval(out["spearman"], n)
    return out


def spearman_interval(rho: float | None, n: int) -> list[float] | None:
    """Approximate 95% interval of a Spearman ρ over ``n`` pairs: tanh(atanh ρ ± 1.96 √(1.06 / (n − 3))) (Fieller,
    Hartley & Pearson 1957); None when ρ is None or n < 4."""
    if rho is None or n < 4:
        return None
    z = math.atanh(min(max(rho, -1 + 1e-15), 1 - 1e-15))
    half = 1.959964 * math.sqrt(1.06 / (n - 3))
    return [math.tanh(z - half), math.tanh(z + half)]


def neighbours(words: Sequence[str], vectors: np.ndarray, probes: Sequence[str], *, k: int = 5
               ) -> dict[str, list[tuple[str, float]]]:
    """The ``k`` nearest words by cosine of each probe word (itself left out), nearest first, with the cosine;
    probes outside ``words`` are left out."""
    unit = unit_rows(vectors)
    index = {w: i for i, w in reversed(list(enumerate(words)))}
    out: dict[str, list[tuple[str, float]]] = {}
    for w in probes:
        i = index.get(w)
        if i is None:
            continue
        cos = unit @ unit[i]
        cos[i] = -np.inf
        top = np.argsort(-cos, kind="stable")[: min(k, len(words) - 1)]
        out[w] = [(words[j], round(float(cos[j]), 4)) for j in top]
    return out


def default_probes(words: Sequence[str], *, count: int = 8) -> list[str]:
    """The first ``count`` vocabulary words (most frequent first for a top-V, wordfreq or DP vocabulary) that occur
    in the benchmarks' pairs: frequent words whose neighbours a reader can judge."""
    bench = {w.upper() for key in BENCHMARKS for ps in (benchmark(key),) for w in ps.first + ps.second}
    return [w for w in words if w.upper() in bench][:count]


def word_similarity(words: Sequence[str], vectors: np.ndarray) -> dict[str, dict[str, Any]]:
    """``pair_scores`` on every benchmark of ``BENCHMARKS``, by key."""
    return {key: {"name": BENCHMARKS[key][0]} | pair_scores(words, vectors, benchmark(key)) for key in BENCHMARKS}
