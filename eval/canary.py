"""The secret sharer (Carlini et al. 2019; paper Sec. 6.5): canary phrases, their ranks, exposure and χ².

For a three-word phrase c = (c0, c1, c2) and a CBOW model with full-softmax scores
``Pr(w | bag) = softmax(mean(in[bag]) @ out^T)`` the log-perplexity is::

    P(c) = -log Pr(c1 | {c0}) - log Pr(c2 | {c0, c1})

Rank (the paper's): ``rank(c) = #{r in R : P(r) >= P(c)}`` over |R| candidates r = (c0, c1', c2') drawn i.i.d. with
(c1', c2') uniform over ordered pairs of DISTINCT vocabulary words. A candidate equal to c itself (it can be drawn)
scores bit-identically and counts. High rank = the model prefers c to random phrases = memorised. For a phrase
drawn from the candidates' law that the model never saw, the rank is uniform on {0, ..., |R|} (up to such exact
ties, probability 1 / (V (V - 1)) per candidate). Canaries and controls are drawn from that law too (c1 != c2; the
paper's "words uniform over the vocabulary" differs only for the 1/V of phrases with c1 = c2), so a control's
rank histogram is exactly uniform in expectation.

Position (Carlini's rank, 1 = lowest perplexity) among R plus c itself, ties in c's favour (consistent with rank):
``position = 1 + #{r : P(r) < P(c)} = |R| + 1 - rank``, and ``exposure = log2 |R| - log2 position``, in
[log2(|R| / (|R| + 1)), log2 |R|]; a never-seen phrase has mean exposure ≈ log2 e ≈ 1.44 bits.

Scoring is batched, no Python loop per phrase or candidate: for a chunk of phrases, every distinct context bag
{c0, c1'} among their candidates (at most V per c0) gets one full-vocabulary log-softmax row, and the candidates
gather from those rows — through ``model.log_prob`` (any model), or for the CBOW in closed form from two [V, V]
tables (``CBOWTables``, ~10x faster on a CPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from scipy import stats
from torch import Tensor

from widedp.errors import ConfigError

#: Phrases are scored (and their candidates drawn) in chunks of about this many candidates.
CANDIDATES_PER_CHUNK = 1 << 20
#: Float32 elements of one [distinct bags, V] log-softmax block of the ``log_prob`` method (128 MiB).
LOG_PROB_ELEMENTS = 1 << 25
#: ``auto`` uses the factorised method up to this vocabulary size ([V, V] float64 tables: 512 MiB at 8192).
FACTORIZED_MAX_V = 8192


def check_vocab(vocab_size: int) -> None:
    if vocab_size < 3:
        raise ConfigError(f"data.vocab_size: the canary evaluation needs at least 3 words, got {vocab_size}")


def sample_phrases(vocab_size: int, num: int, *, generator: torch.Generator, exclude: Tensor | None = None) -> Tensor:
    """``num`` distinct phrases [num, 3] int64: c0 uniform, (c1, c2) uniform over ordered pairs with c1 != c2.

    ``exclude`` [m, 3]: phrases that must not be drawn (e.g. the canaries, when drawing controls).
    """
    check_vocab(vocab_size)
    taken = 0 if exclude is None else len(exclude)
    space = vocab_size * vocab_size * (vocab_size - 1)
    if num + taken > space // 2:
        raise ConfigError(f"--num-canaries: {num} distinct phrases (besides {taken}) are too many for a vocabulary "
                          f"of {vocab_size} words ({space} possible phrases)")
    seen = set() if exclude is None else {tuple(p) for p in exclude.tolist()}
    out: list[tuple[int, ...]] = []
    while len(out) < num:
        c0 = torch.randint(vocab_size, (num - len(out),), generator=generator)
        for p in _draw(vocab_size, c0, generator).tolist():
            if tuple(p) not in seen:
                seen.add(tuple(p))
                out.append(tuple(p))
    return torch.tensor(out, dtype=torch.long).view(-1, 3)


def _draw(vocab_size: int, c0: Tensor, generator: torch.Generator) -> Tensor:
    """c0 [n] -> [n, 3] phrases (c0, c1, c2) with (c1, c2) uniform over ordered pairs of distinct words."""
    n = len(c0)
    c1 = torch.randint(vocab_size, (n,), generator=generator)
    c2 = torch.randint(vocab_size - 1, (n,), generator=generator)
    c2 += (c2 >= c1).long()  # uniform over the V - 1 words != c1
    return torch.stack([c0, c1, c2], 1)


@dataclass(frozen=True)
class PhraseRanks:
    """Scores of N phrases against |R| = ``num_candidates`` sampled candidates each.

    log_perplexity: [N] float64 P(c). rank: [N] int64 #{r : P(r) >= P(c)} in [0, |R|].
    """

    log_perplexity: Tensor
    rank: Tensor
    num_candidates: int

    @property
    def position(self) -> Tensor:
        """[N] 1-based position of the phrase among R plus itself, 1 = lowest perplexity (ties: phrase first)."""
        return self.num_candidates + 1 - self.rank

    @property
    def exposure(self) -> Tensor:
        """[N] float64 log2 |R| - log2 position."""
        return math.log2(self.num_candidates) - torch.log2(self.position.double())


@torch.inference_mode()
def phrase_ranks(model: Any, phrases: Tensor, *, num_candidates: int, generator: torch.Generator,
                 method: Literal["auto", "factorized", "log_prob"] = "auto") -> PhraseRanks:
    """Log-perplexity and rank of each phrase [N, 3] (vocabulary ids) under ``model``, on the model's device.

    ``method``: ``log_prob`` uses only ``model.log_prob(context [B, C] int64, -1 padding) -> [B, V]`` (one
    full-vocabulary row per distinct bag {c0, c1'}: O(N V^2 D) for |R| >= V); ``factorized`` uses the CBOW's
    mean-bag structure (exact, float64, O(V^2 D + n0 V^2) for n0 distinct c0, see ``CBOWTables``); ``auto`` picks
    ``factorized`` for a CBOW with V <= ``FACTORIZED_MAX_V``. Candidates are drawn on the CPU from ``generator``
    in chunks of a fixed number of phrases, in input order: the same candidates for every method and device.
    """
    if num_candidates < 1:
        raise ConfigError(f"--num-candidates: must be >= 1, got {num_candidates}")
    vocab = model.vocab_size
    check_vocab(vocab)
    n = len(phrases)
    phrases = phrases.to(torch.long).cpu()
    if n and (int(phrases.min()) < 0 or int(phrases.max()) >= vocab):
        raise ConfigError(f"canaries: word ids outside the vocabulary of {vocab} words (wrong run directory?)")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    score = make_scorer(model, method)
    perp = torch.empty(n, dtype=torch.float64)
    rank = torch.empty(n, dtype=torch.long)
    per_chunk = max(1, CANDIDATES_PER_CHUNK // (num_candidates + 1))
    try:
        for s in range(0, n, per_chunk):
            e = min(n, s + per_chunk)
            cand = _draw(vocab, phrases[s:e, 0].repeat_interleave(num_candidates), generator)
            # the phrase itself is candidate 0 of its row: scored by exactly the same gathers, so ties are exact
            allp = torch.cat([phrases[s:e, None, :], cand.view(e - s, num_candidates, 3)], 1).to(device)
            scores = score(allp)  # [chunk, 1 + R]
            perp[s:e] = scores[:, 0].double().cpu()
            rank[s:e] = ranks_from_scores(scores).cpu()
    finally:
        model.train(was_training)
    return PhraseRanks(perp, rank, num_candidates)


def ranks_from_scores(scores: Tensor) -> Tensor:
    """scores [m, 1 + R] (column 0: the phrase's P, then its candidates') -> [m] int64 #{j >= 1 : P_j >= P_0}."""
    return (scores[:, 1:] >= scores[:, :1]).sum(1)


def make_scorer(model: Any, method: str = "auto") -> Callable[[Tensor], Tensor]:
    """A function p [m, K, 3] (phrases sharing c0 within each row, on the model's device) -> [m, K] P.

    ``auto``: ``factorized`` for a CBOW (a model with ``input`` and ``out_weight``) with V <= FACTORIZED_MAX_V,
    else ``log_prob``.
    """
    if method == "auto":
        cbow = hasattr(model, "out_weight") and hasattr(model, "input")
        method = "factorized" if cbow and model.vocab_size <= FACTORIZED_MAX_V else "log_prob"
    if method == "factorized":
        return CBOWTables.of(model).log_perplexity
    if method == "log_prob":
        return _LogProbScorer(model)
    raise ConfigError(f"--method: expected auto, factorized or log_prob, got {method!r}")


class _LogProbScorer:
    """P for phrases [m, K, 3] sharing c0 within each row, through ``model.log_prob`` only (float32)."""

    def __init__(self, model: Any) -> None:
        self.model, self.vocab = model, model.vocab_size

    def __call__(self, p: Tensor) -> Tensor:
        rows = max(1, LOG_PROB_ELEMENTS // (min(p.shape[1], self.vocab) * self.vocab))
        return torch.cat([self._score(p[i : i + rows]) for i in range(0, len(p), rows)])

    def _score(self, p: Tensor) -> Tensor:
        m, k, _ = p.shape
        c0 = p[:, 0, 0]  # [m]
        first = self.model.log_prob(c0[:, None]).gather(1, p[:, :, 1])  # log Pr(c1' | {c0}) [m, K]
        key = c0[:, None] * self.vocab + p[:, :, 1]  # bag {c0, c1'}
        uniq, inv = torch.unique(key.reshape(-1), return_inverse=True)
        lp2 = self.model.log_prob(torch.stack([uniq // self.vocab, uniq % self.vocab], 1))  # [U, V]
        second = lp2.view(-1).index_select(0, inv * self.vocab + p[:, :, 2].reshape(-1)).view(m, k)
        return -(first + second)


@dataclass(frozen=True)
class CBOWTables:
    """Exact closed form of a mean-bag CBOW's two-word log-probabilities, float64.

    With A = in @ out^T [V, V]: log Pr(a | {c0}) = A[c0, a] - logsumexp_w A[c0, w]; the bag {c0, a} has logits
    (A[c0] + A[a]) / 2, whose logsumexp factorises: with m_x = max_w A[x, w] / 2 and E[x, w] = exp(A[x, w] / 2 - m_x)
    (entries in (0, 1]), lse(c0, a) = m_c0 + m_a + log (E E^T)[c0, a] — a matmul instead of V exps per bag.
    """

    a: Tensor  # [V, V] float64
    lse1: Tensor  # [V] logsumexp of each row of A
    half_max: Tensor  # [V] m_x
    e: Tensor  # [V, V] E

    @classmethod
    def of(cls, model: Any) -> CBOWTables:
        w_in = model.input.weight.detach().double()
        a = w_in @ model.out_weight.detach().double().t()
        half_max = a.amax(1) / 2
        return cls(a, torch.logsumexp(a, 1), half_max, torch.exp(a / 2 - half_max[:, None]))

    def log_perplexity(self, p: Tensor) -> Tensor:
        """p [m, K, 3] phrases sharing c0 within each row -> [m, K] float64 P."""
        v = self.a.shape[0]
        c0, a, b = p[:, :, 0], p[:, :, 1], p[:, :, 2]
        rows, local = torch.unique(p[:, 0, 0], return_inverse=True)  # distinct c0 of the chunk
        lse2 = (self.e.index_select(0, rows) @ self.e.t()).log_()  # [n0, V]
        if not torch.isfinite(lse2).all():
            raise ConfigError("canary: logits too large for the factorised log-sum-exp; use method log_prob")
        lse2 += self.half_max.index_select(0, rows)[:, None] + self.half_max[None, :]
        def take(t: Tensor, idx: Tensor) -> Tensor:  # index_select: faster than advanced indexing
            return t.reshape(-1).index_select(0, idx.reshape(-1)).view(idx.shape)

        first = take(self.a, c0 * v + a) - take(self.lse1, c0)
        second = (take(self.a, c0 * v + b) + take(self.a, a * v + b)) / 2 - take(lse2, local[:, None] * v + a)
        return -(first + second)


# ------------------------------------------------------------------------------------------------- statistics


def rank_histogram(rank: Tensor | np.ndarray, num_candidates: int, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Counts of ranks in ``bins`` equal-width bins over {0..|R|} (bin = rank * bins // (|R| + 1)), and the counts
    expected under the uniform law on {0..|R|} (exact: bins hold floor/ceil((|R| + 1) / bins) integers)."""
    if bins < 2 or bins > num_candidates + 1:
        raise ConfigError(f"--bins: need 2 <= bins <= num_candidates + 1 = {num_candidates + 1}, got {bins}")
    r = np.asarray(rank, dtype=np.int64)
    idx = r * bins // (num_candidates + 1)
    counts = np.bincount(idx, minlength=bins)
    width = np.bincount(np.arange(num_candidates + 1) * bins // (num_candidates + 1), minlength=bins)
    return counts, width * (len(r) / (num_candidates + 1))


def uniformity(rank: Tensor | np.ndarray, num_candidates: int, bins: int) -> dict[str, Any]:
    """Pearson χ² of the rank histogram against uniform.

    ``chi2``: scipy's statistic on counts; ``chi2_distance``: chi2 / N = Σ (p_i - q_i)² / q_i on frequencies (a
    sample-size-free distance, what the paper's Table 2 appears to report); ``p_value``: of chisquare with
    bins - 1 degrees of freedom.
    """
    counts, expected = rank_histogram(rank, num_candidates, bins)
    n = int(counts.sum())
    if n == 0:
        return {"chi2": float("nan"), "chi2_distance": float("nan"), "p_value": float("nan"), "bins": bins,
                "histogram": counts.tolist(), "expected": expected.tolist()}
    res = stats.chisquare(counts, expected)
    return {"chi2": float(res.statistic), "chi2_distance": float(res.statistic) / n, "p_value": float(res.pvalue),
            "bins": bins, "histogram": counts.tolist(), "expected": expected.tolist()}


def summarize(r: PhraseRanks, *, bins: int) -> dict[str, Any]:
    """χ² against uniform, exposure stats and the per-phrase rank / log-perplexity / exposure lists."""
    exp = r.exposure
    out = uniformity(r.rank, r.num_candidates, bins)
    out["exposure"] = {"mean": float(exp.mean()), "median": float(exp.median()), "max": float(exp.max()),
                       "max_possible": math.log2(r.num_candidates)} if len(exp) else {}
    out["mean_rank_fraction"] = float(r.rank.double().mean() / r.num_candidates) if len(exp) else float("nan")
    out["rank"] = r.rank.tolist()
    out["log_perplexity"] = [round(x, 6) for x in r.log_perplexity.tolist()]
    out["exposure_per_phrase"] = [round(x, 6) for x in exp.tolist()]
    return out
