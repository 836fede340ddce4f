"""Record-local splits: a record's split, its place in the split and its stored random draws (CBOW negatives) are
functions of the record alone — its content and how many identical records come before it — never of its position
in the data.

Why: a positional split (a seeded permutation cut into train / valid / test) is not stable: adding or removing one
record moves many others between the splits, so adjacent datasets give training sets far apart and an ε for the
training split says nothing about the dataset. Here the map dataset -> training split is 1-stable: adjacent datasets
(one unit added or removed) give training splits that differ in that unit's training records only, so the
guarantee of the DP training carries over to the dataset. The seed need not be secret (the argument holds for any
fixed function); it is ``data.seed``.

    record r       content c(r) (exact: a pair's words, a sentence's words, an interaction's raw fields)
                   k(r) = the number of records with the same content before r
    key(r)       = H(seed, c(r), k(r))                 uint64 (blake2b / splitmix64)
    u(r)         = key(r) / 2^64 in [0, 1)             train if u < f_train, valid if u < f_train + f_valid,
                                                       test if u < f_train + f_valid + f_test, else unused

Identical records are interchangeable, so the copy that is added or removed can be taken to be the last one
(k = count): every other keeps its key. A unit made of several records (a sentence's samples) keys its unit by its
content and its records by their index within the unit: ``key = H(unit key, j)``.

Split sizes are Binomial (fractions f of ``data.splits``); a size given as a count n becomes the rate n / N over the
N records, which makes the rate depend on the data's size (listed in the privacy statement).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from widedp.errors import ConfigError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (a bijection that spreads every input bit)."""
    with np.errstate(over="ignore"):  # arithmetic mod 2^64 is the point (numpy warns on scalars only)
        z = np.asarray(x, dtype=np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def combine(h: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Fold ``x`` (uint64, broadcast) into the running key ``h``: order-sensitive."""
    return mix(np.asarray(h, dtype=np.uint64) ^ mix(x))


def hash64(data: bytes) -> int:
    """blake2b-64 of ``data`` as an int (little-endian): the hash of every byte content keyed here."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def seed_key(seed: int, purpose: str) -> np.uint64:
    """A 64-bit key for ``purpose`` (e.g. "cbow-split") from ``data.seed``."""
    return np.uint64(hash64(f"widedp/{purpose}/{int(seed)}".encode()))


def as_words(col: np.ndarray) -> np.ndarray:
    """A column's values as uint64 words that depend on each value alone: integers as themselves, floats by their
    bits (-0.0 as 0.0), anything else (strings, mixed objects) by blake2b of its ``repr``."""
    a = np.asarray(col)
    if a.dtype.kind in "iub":
        return a.astype(np.int64).view(np.uint64)
    if a.dtype.kind == "f":
        f = a.astype(np.float64) + 0.0  # -0.0 -> 0.0
        return f.view(np.uint64)
    uniq, inv = np.unique(a.astype(str), return_inverse=True)
    words = np.array([hash64(repr(v).encode()) for v in uniq.tolist()], dtype=np.uint64)
    return words[inv.reshape(-1)]


def word_keys(words: Sequence[str]) -> np.ndarray:
    """[V] uint64 key of each vocabulary word, from the word itself (so records keyed through it do not depend on
    the vocabulary's order or size). Checked distinct and non-zero (0 pads): equal keys then mean equal words."""
    out = np.array([hash64(w.encode()) for w in words], dtype=np.uint64)
    if len(np.unique(out)) != len(out) or (out == 0).any():  # pragma: no cover - a 64-bit collision
        raise RuntimeError("two vocabulary words share a 64-bit key")
    return out


def _codes(col: np.ndarray) -> np.ndarray:
    """[n] int64 exact equality classes of a column's values (strings compared as strings, not by hash)."""
    a = np.asarray(col)
    a = a if a.dtype.kind in "iubf" else a.astype(str)
    return np.unique(a, return_inverse=True)[1].reshape(-1).astype(np.int64)


def occurrence(groups: np.ndarray) -> np.ndarray:
    """[n] int64: for each record, how many records of the same group (exact ids, any order) come before it."""
    g = np.asarray(groups)
    if len(g) == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(g, kind="stable")
    s = g[order]
    first = np.r_[True, s[1:] != s[:-1]]
    starts = np.flatnonzero(first)
    rank = np.arange(len(s)) - np.repeat(starts, np.diff(np.r_[starts, len(s)]))
    out = np.empty(len(g), dtype=np.int64)
    out[order] = rank
    return out


def row_keys(columns: Sequence[np.ndarray], *, seed: int, purpose: str,
             group_only: Sequence[np.ndarray] = ()) -> np.ndarray:
    """[n] uint64 key of each row of ``columns`` (each [n], or [n, C] for several columns): H(seed, content, k).

    ``group_only``: [n] columns that separate occurrence counts without entering the key (a canary flag: clean
    records count their copies among clean records only).
    """
    arrays = [np.asarray(c) for c in columns]
    n = len(arrays[0]) if arrays else 0
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    cols = [c.reshape(n, -1) for c in arrays]
    words = [as_words(c[:, j]) for c in cols for j in range(c.shape[1])]
    h = np.full(n, seed_key(seed, purpose), dtype=np.uint64)
    for w in words:
        h = combine(h, w)
    codes = [_codes(c[:, j]) for c in cols for j in range(c.shape[1])]
    codes += [_codes(g.reshape(len(g), -1)[:, j]) for g in map(np.asarray, group_only)
              for j in range(g.reshape(len(g), -1).shape[1])]
    group = np.unique(np.stack(codes, axis=1), axis=0, return_inverse=True)[1].reshape(-1)
    return combine(h, occurrence(group).astype(np.uint64))


def blob_keys(blobs: Iterable[bytes], *, seed: int, purpose: str) -> np.ndarray:
    """[m] uint64 key of each variable-length content (a sentence's token bytes): H(seed, bytes, k), k counting
    equal blobs before it."""
    prefix = f"widedp/{purpose}/{int(seed)}/".encode()
    seen: dict[bytes, int] = {}
    out = []
    for b in blobs:
        k = seen.get(b, 0)
        seen[b] = k + 1
        out.append(hash64(prefix + k.to_bytes(8, "little") + b))
    return np.array(out, dtype=np.uint64)


def uniform(keys: np.ndarray) -> np.ndarray:
    """[n] float64 in [0, 1): the top 53 bits of each key."""
    return (np.asarray(keys, dtype=np.uint64) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def split_rates(splits: Sequence[float], total: int, *, what: str = "samples") -> tuple[float, float, float]:
    """Rates (f_train, f_valid, f_test) of ``data.splits``: a float <= 1 is a fraction; an int (or a float > 1) is
    an expected count n, the rate n / ``total``."""
    rates = []
    for s in splits:
        if _is_fraction(s):
            rates.append(float(s))
        elif float(s) != int(s):
            raise ConfigError(f"data.splits: {s} is neither a fraction <= 1 nor a whole number of samples")
        elif total == 0:
            rates.append(0.0 if int(s) == 0 else 2.0)
        else:
            rates.append(int(s) / total)
    if sum(rates) > 1 + 1e-9:
        raise ConfigError(f"data.splits: {list(splits)} asks for more than the {total:,} {what}")
    if rates[0] <= 0:
        raise ConfigError(f"data.splits: the train split is empty ({list(splits)} of {total:,} {what})")
    return rates[0], rates[1], rates[2]


def _is_fraction(s: float) -> bool:
    return isinstance(s, float) and s <= 1


def counted(splits: Sequence[float]) -> bool:
    """Whether any size of ``data.splits`` is a count (its rate then depends on the data's size)."""
    return not all(map(_is_fraction, splits))


def assign(keys: np.ndarray, rates: tuple[float, float, float]) -> np.ndarray:
    """[n] int8 split of each record: 0 train, 1 valid, 2 test, -1 unused (``u`` against cumulative rates)."""
    u = uniform(keys)
    edges = np.cumsum(rates)
    out = np.searchsorted(edges, u, side="right").astype(np.int8)
    out[out > 2] = -1
    return out


def members(split: np.ndarray, keys: np.ndarray, which: int) -> np.ndarray:
    """Indices of the records in split ``which``, ordered by key (an order each record's key alone decides)."""
    idx = np.flatnonzero(split == which)
    return idx[np.argsort(keys[idx], kind="stable")]


def keyed_uniforms(keys: np.ndarray, stream: int, attempt: int = 0) -> np.ndarray:
    """[n] float64 in [0, 1): draw number ``stream`` (attempt ``attempt``) of each record, from its key alone."""
    return uniform(combine(combine(keys, np.uint64(stream)), np.uint64(attempt) + np.uint64(1 << 32)))
