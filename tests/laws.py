"""Exact laws the statistical tests compare samplers against."""

from __future__ import annotations

import itertools

import numpy as np


def ordered_law(logits, k: int) -> dict[tuple[int, ...], float]:
    """Exact law of k sequential exponential-mechanism picks without replacement, P(r) ∝ exp(logits_r)."""
    w = np.exp(np.asarray(logits, dtype=np.float64))
    law = {}
    for o in itertools.permutations(range(len(w)), k):
        p, left = 1.0, w.sum()
        for r in o:
            p *= w[r] / left
            left -= w[r]
        law[o] = p
    return law
