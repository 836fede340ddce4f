"""Vectorised CBOW sample construction over an in-vocabulary token stream: windows, negatives, canary insertion.

A *stream* is ``tokens [N]`` (vocabulary ids) with ``sent [N]`` (the sentence of each token, non-decreasing);
windows never cross a sentence boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from widedp.errors import ConfigError


def window_pairs(sent: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Every ordered (target, context) position pair at distance 1..``window`` within one sentence.

    Returns ``t [n]``, ``c [n]`` (int64 positions), grouped by distance d = 1..window (a fixed order).
    """
    n = len(sent)
    ts: list[np.ndarray] = [np.zeros(0, np.int64)]
    cs: list[np.ndarray] = [np.zeros(0, np.int64)]
    for d in range(1, min(window, n - 1) + 1):
        i = np.flatnonzero(sent[:-d] == sent[d:])
        ts += [i, i + d]
        cs += [i + d, i]
    return np.concatenate(ts), np.concatenate(cs)


def window_bags(sent: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Each position with its whole window (up to ``window`` words each side, same sentence).

    Returns ``t [n]`` and ``c [n, 2*window]`` (int64 positions; left context then right context, in order, padded at
    the end with -1). Positions with an empty window (one-word sentences) are left out.
    """
    n = len(sent)
    offs = np.concatenate([np.arange(-window, 0), np.arange(1, window + 1)])
    pos = np.arange(n)[:, None] + offs[None, :]
    valid = (pos >= 0) & (pos < n)
    valid &= sent[np.clip(pos, 0, max(n - 1, 0))] == sent[:, None]
    order = np.argsort(~valid, axis=1, kind="stable")  # valid entries first, order kept
    pos = np.take_along_axis(np.where(valid, pos, -1), order, axis=1)
    keep = valid.any(axis=1)
    return np.flatnonzero(keep), pos[keep]


def draw_negatives_keyed(target: np.ndarray, counts: np.ndarray, k: int, keys: np.ndarray) -> np.ndarray:
    """``[n, k]`` ids drawn i.i.d. from unigram^0.75 over the vocabulary, each redrawn while equal to its target; row
    i's draws come from its record key ``keys[i]`` alone (``widedp.data_prep.splits``): a record's negatives do not
    depend on the others.

    So a row's negatives follow ``p(w) / (1 - p(target))`` for ``w != target``, with ``p ∝ counts**0.75``.
    Walker's alias method: O(1) per draw (binary search over the cdf was 4x slower at V=10K).
    """
    from widedp.data_prep.splits import keyed_uniforms

    n = len(target)
    if k == 0 or n == 0:
        return np.zeros((n, k), dtype=np.int64)
    if len(counts) < 2:
        raise ConfigError("data.negatives: a vocabulary of one word leaves no negative different from the target")
    prob, alias = alias_table(counts.astype(np.float64) ** 0.75)
    v = len(prob)
    neg = np.empty((n, k), dtype=np.int64)
    for j in range(k):
        rows, attempt = np.arange(n), 0
        while len(rows):
            kr = keys[rows]
            i = np.minimum((keyed_uniforms(kr, 2 * j, attempt) * v).astype(np.int64), v - 1)
            pick = np.where(keyed_uniforms(kr, 2 * j + 1, attempt) < prob[i], i, alias[i])
            neg[rows, j] = pick
            rows = rows[pick == target[rows]]
            attempt += 1
    return neg


def alias_table(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vose's alias table of ``weights [V]``: draw i uniformly, keep it with ``prob[i]``, else take ``alias[i]``."""
    v = len(weights)
    scaled = (weights * (v / weights.sum())).tolist()
    prob = np.ones(v)
    alias = np.arange(v)
    small = [i for i, x in enumerate(scaled) if x < 1.0]
    large = [i for i, x in enumerate(scaled) if x >= 1.0]
    while small and large:
        s, g = small.pop(), large.pop()
        prob[s], alias[s] = scaled[s], g
        scaled[g] += scaled[s] - 1.0
        (small if scaled[g] < 1.0 else large).append(g)
    return prob, alias  # leftovers (rounding) keep prob 1


def insert_phrases(
    tokens: np.ndarray,
    sent: np.ndarray,
    phrases: Sequence[np.ndarray],
    repeats: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Insert each phrase (vocabulary ids) ``repeats`` times at uniformly random positions of the stream.

    Insertion ``(j, p)`` puts phrase j before stream token p (p uniform in 0..N; p = N appends), inside the
    sentence of that token (the last sentence for p = N); insertions at the same p keep their draw order.

    Returns ``tokens [N']``, ``sent [N']``, ``is_canary [N']`` (bool: an inserted token) and ``inserted [m, 2]``
    (int64 rows ``(phrase index, p)`` sorted by p, m = len(phrases) * repeats).
    """
    n = len(tokens)
    m = len(phrases) * repeats
    phrase_ix = np.repeat(np.arange(len(phrases)), repeats)
    pos = rng.integers(0, n + 1, size=m)
    order = np.lexsort((np.arange(m), pos))
    phrase_ix, pos = phrase_ix[order], pos[order]
    new_tokens, (new_sent,), is_canary, fill = _place(tokens, [sent], phrases, phrase_ix, pos)
    fill(new_sent, sent[np.minimum(pos, n - 1)])
    return new_tokens, new_sent, is_canary, np.stack([phrase_ix, pos], axis=1).astype(np.int64)


def insert_phrase_units(
    tokens: np.ndarray,
    sent: np.ndarray,
    doc: np.ndarray,
    phrases: Sequence[np.ndarray],
    repeats: int,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Insert each phrase ``repeats`` times as its OWN sentence and document (a privacy unit of its own), each at a
    uniformly random sentence boundary of the stream (0, the start of each sentence, or N), so no clean sample
    changes. Insertion k (in stream order) gets sentence id ``max(sent) + 1 + k`` and document id
    ``max(doc) + 1 + k``: equal ids stay contiguous, which is all the windows need.

    Returns ``tokens [N']``, ``sent [N']``, ``doc [N']``, ``is_canary [N']`` and ``inserted [m, 2]`` (rows
    ``(phrase index, p)`` sorted by p: the phrase went before stream token p).
    """
    n = len(tokens)
    m = len(phrases) * repeats
    starts = np.flatnonzero(np.r_[True, sent[1:] != sent[:-1]]) if n else np.zeros(0, np.int64)
    bounds = np.r_[starts, n].astype(np.int64)
    phrase_ix = np.repeat(np.arange(len(phrases)), repeats)
    pos = bounds[rng.integers(0, len(bounds), size=m)]
    order = np.lexsort((np.arange(m), pos))
    phrase_ix, pos = phrase_ix[order], pos[order]
    new_tokens, (new_sent, new_doc), is_canary, fill = _place(tokens, [sent, doc], phrases, phrase_ix, pos)
    fill(new_sent, (int(sent.max()) + 1 if n else 0) + np.arange(m))
    fill(new_doc, (int(doc.max()) + 1 if n else 0) + np.arange(m))
    return new_tokens, new_sent, new_doc, is_canary, np.stack([phrase_ix, pos], axis=1).astype(np.int64)


def _place(
    tokens: np.ndarray, cols: list[np.ndarray], phrases: Sequence[np.ndarray], phrase_ix: np.ndarray, pos: np.ndarray
) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, Callable[[np.ndarray, np.ndarray], None]]:
    """Put phrase ``phrase_ix[i]`` before stream token ``pos[i]`` (``pos`` sorted). Returns the new tokens, the
    per-token columns ``cols`` carried along, is_canary, and ``fill(col, values [m])`` that sets every token of
    insertion i in a new column to ``values[i]``."""
    n = len(tokens)
    m = len(phrase_ix)
    lens = np.array([len(p) for p in phrases], dtype=np.int64)
    ins_len = lens[phrase_ix]
    cum = np.concatenate([[0], np.cumsum(ins_len)])
    total = n + int(cum[-1])

    new_tokens = np.empty(total, dtype=np.int64)
    new_cols = [np.zeros(total, dtype=np.int64) for _ in cols]
    is_canary = np.zeros(total, dtype=bool)
    # clean token i moves right by the length of every insertion placed before it (p <= i)
    clean_at = np.arange(n) + cum[np.searchsorted(pos, np.arange(n), side="right")]
    new_tokens[clean_at] = tokens
    for new, old in zip(new_cols, cols):
        new[clean_at] = old
    start = pos + cum[:-1]
    ins_at = np.repeat(start, ins_len) + (np.arange(cum[-1]) - np.repeat(cum[:-1], ins_len))
    flat = np.concatenate([np.asarray(phrases[j], dtype=np.int64) for j in phrase_ix]) if m else np.zeros(0, int)
    new_tokens[ins_at] = flat
    is_canary[ins_at] = True

    def fill(col: np.ndarray, values: np.ndarray) -> None:
        col[ins_at] = np.repeat(np.asarray(values, dtype=np.int64), ins_len)

    return new_tokens, new_cols, is_canary, fill
