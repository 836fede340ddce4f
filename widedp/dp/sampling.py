"""Batch sampling: Poisson sampling for DP training, shuffled fixed-size batches for non-private training.

Both samplers are *stateless per step*: the batch of global step ``t`` is a pure function of (seed, t), so a run
resumed from a checkpoint at step t sees exactly the batches an uninterrupted run would have seen.

Truncated Poisson sampling (``dp.max_batch_size``: B; Chua et al. 2024, "Scalable DP-SGD: Shuffling vs. Poisson
Subsampling"): each step's batch is drawn by Poisson sampling; when it holds m > B units, a uniformly random B of
them are kept (the first B of its uniformly random order), so a non-overflowing step is the plain Poisson batch.
Privacy: couple the truncated run M' with the plain run M on the same randomness; they differ only on the event E
that some step overflows, and on any dataset of at most N + 1 units (q fixed, as the accountant assumes)
P(E) <= eta = T * P[Binomial(N + 1, q) > B] over T steps. If M is (eps, delta_L)-DP then for every S and neighbours
D, D': P[M'(D) in S] <= P[M(D) in S] + eta <= e^eps P[M(D') in S] + delta_L + eta
<= e^eps P[M'(D') in S] + delta_L + (1 + e^eps) eta: M' is (eps, delta_L + delta_B) with
delta_B = (1 + e^eps) * eta (``truncation_delta``). The count of truncated steps, released with the run, is 0 off E,
so (M', count) obeys the same bound. ``widedp.run.plan`` charges delta_B (at an eps_bar >= every reported eps).
"""

from __future__ import annotations

import math

import torch
from scipy.stats import binom
from torch import Tensor

from widedp.dp import rng
from widedp.dp.selection.base import member

_CHUNK = 1024  # Poisson steps drawn together (one generator seeding per chunk)
_DENSE_FACTOR = 4  # a batch of m > n / 4 is a permutation prefix (as ``widedp.dp.selection.base.sample_distinct``)
_BLOCK = 2**16  # draws deduplicated together


def _gen(seed: int, salt: int, device: torch.device) -> torch.Generator:
    return rng.generator(rng.derived_seed(seed, f"poisson:{salt}"))  # every bit of the secret seed matters


class PoissonSampler:
    """Every one of ``n`` examples joins each step's batch independently with probability ``sampling_rate``.

    The batch size is Binomial(n, q); the members are a uniform subset of that size, in random order
    (``uniform_subsets``). Steps are drawn ``_CHUNK`` at a time, in O(sum of their batch sizes) time and memory.
    ``max_batch_size`` B (None: unbounded): a batch of m > B keeps its first B members, a uniformly random B of them
    in random order (truncated Poisson, module docstring); ``truncated(step)`` says whether step's batch was cut.
    """

    def __init__(self, n: int, *, sampling_rate: float, seed: int, device: torch.device | str = "cpu",
                 max_batch_size: int | None = None) -> None:
        if not 0 < sampling_rate <= 1:
            raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.n, self.q, self.seed, self.bound = n, sampling_rate, seed, max_batch_size
        self.device = torch.device(device)
        self._chunk_id = -1
        self._batches: list[Tensor] = []
        self._cut: list[bool] = []

    def batch(self, step: int) -> Tensor:
        """[min(m, B)] int64 indices (on ``device``) of the examples in global step ``step``'s batch."""
        self._load(step)
        return self._batches[step % _CHUNK]

    def truncated(self, step: int) -> bool:
        """Whether step ``step``'s Poisson batch held more than ``max_batch_size`` examples (and was cut)."""
        self._load(step)
        return self._cut[step % _CHUNK]

    def _load(self, step: int) -> None:
        chunk = step // _CHUNK
        if chunk != self._chunk_id:
            self._batches, self._cut = self._draw_chunk(chunk)
            self._chunk_id = chunk

    def _draw_chunk(self, chunk: int) -> tuple[list[Tensor], list[bool]]:
        """The chunk's batches (views into one [sum m] tensor on ``device``, each cut to B) and which were cut."""
        g = _gen(self.seed, chunk, self.device)
        counts = self._sizes(g)
        flat = uniform_subsets(counts, self.n, generator=g)
        batches = list(torch.split(flat.to(self.device, non_blocking=True), counts.tolist()))
        if self.bound is None:
            return batches, [False] * len(batches)
        return [x[: self.bound] for x in batches], (counts > self.bound).tolist()

    def _sizes(self, g: torch.Generator) -> Tensor:
        """[_CHUNK] int64 Binomial(n, q) batch sizes. In float64: float32 rounds n above 2^24 (2^24 + 1 -> 2^24) and
        q to 24 bits, which is then not the q the accountant charges."""
        n, q = (torch.full((_CHUNK,), v, dtype=torch.float64) for v in (float(self.n), self.q))
        return torch.binomial(n, q, generator=g).long()


#: ln of the smallest normal float64 (~2.2e-308), with a margin: below it scipy's survival function is subnormal and
#: loses relative precision (it was seen a third below the true tail), so ``log_overflow`` bounds the tail instead
_NORMAL_LOG = -700.0


def log_overflow(n: int, q: float, bound: int) -> float:
    """ln P[Binomial(n, q) > bound]: one step's overflow probability over n units (-inf for bound >= n). Exact to
    float64 relative precision far into the tail (scipy's regularised incomplete beta); where that is subnormal or
    underflows (below ~1e-304, ``_NORMAL_LOG``), an upper bound, so that e^ε̄ times it is never under-charged: with
    k = bound + 1, the pmf's ratio p(j+1)/p(j) is at most r = (n−k)q/((k+1)(1−q)) for j >= k, so
    P[X >= k] <= p(k)/(1 − r) when r < 1, else C(n, k)·q^k (a union bound over the sets of k units)."""
    if bound >= n:
        return -math.inf
    v = float(binom.logsf(bound, n, q))
    if v > _NORMAL_LOG:
        return v
    k = bound + 1  # scipy's sf is subnormal (imprecise, possibly below the tail) or 0: the bound below
    log_union = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * math.log(q)
    r = (n - k) * q / ((k + 1) * (1 - q))
    return log_union + (n - k) * math.log1p(-q) - math.log1p(-r) if r < 1 else log_union


def truncation_delta(*, steps: int, n: int, q: float, bound: int, epsilon_bar: float) -> float:
    """delta_B = (1 + e^eps_bar) * steps * P[Binomial(n + 1, q) > bound] (module docstring), valid for every
    reported eps <= ``epsilon_bar`` over ``steps`` steps on N = ``n`` units (a neighbour has at most n + 1); in log
    space (e^eps_bar may overflow a float)."""
    log_eta = math.log(max(steps, 1)) + log_overflow(n + 1, q, bound)
    if log_eta == -math.inf:
        return 0.0
    log_d = math.log1p(math.exp(-epsilon_bar)) + epsilon_bar + log_eta if epsilon_bar > 0 else math.log(2) + log_eta
    return math.exp(log_d) if log_d < 700 else math.inf


def smallest_bound(*, steps: int, n: int, q: float, epsilon_bar: float, delta_b: float) -> int:
    """The smallest B >= 1 whose ``truncation_delta`` is at most ``delta_b`` (binary search; B = n + 1 never
    overflows, so one exists)."""
    lo, hi = 1, n + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if truncation_delta(steps=steps, n=n, q=q, bound=mid, epsilon_bar=epsilon_bar) <= delta_b:
            hi = mid
        else:
            lo = mid + 1
    return lo


def uniform_subsets(counts: Tensor, n: int, *, generator: torch.Generator) -> Tensor:
    """[sum(counts)] int64: segment i (``counts[i]`` long, in order) is a uniform random subset of [0, n) of that
    size, in random order, independently over segments. O(sum(counts)) time and memory (CPU).

    A segment with 4·m <= n takes the first m distinct values of its own i.i.d. uniform sequence (each new distinct
    value is uniform over the values not yet taken: an exact uniform ordered sample; only the duplicates cost
    redraws, all segments at once). A denser one is a permutation prefix (O(n) <= O(4m)).
    """
    counts = counts.long().cpu()
    dense = _DENSE_FACTOR * counts > n
    sparse = counts.masked_fill(dense, 0)
    # segments in blocks of ~_BLOCK draws, so the temporaries stay small next to the result
    _, per_block = torch.unique_consecutive((torch.cumsum(sparse, 0) - sparse) // _BLOCK, return_counts=True)
    flat = torch.cat([_first_distinct(c, n, generator) for c in torch.split(sparse, per_block.tolist())])
    if not bool(dense.any()):
        return flat
    parts = list(torch.split(flat, sparse.tolist()))
    for i in dense.nonzero().flatten().tolist():
        parts[i] = torch.randperm(n, generator=generator)[: int(counts[i])]
    return torch.cat(parts)  # a copy: no n-long permutation stays alive


def _first_distinct(counts: Tensor, n: int, generator: torch.Generator) -> Tensor:
    """Per segment, the first ``counts[i]`` distinct values of an i.i.d. uniform sequence on [0, n) (needs
    4·counts[i] <= n). One sort drops the repeats of the first counts[i] draws; each short segment then draws
    2·deficit + 8 more, keeping the new values' first occurrences (in order) up to its deficit."""
    segs = torch.arange(counts.numel())
    seg = segs.repeat_interleave(counts)  # segment-contiguous, in draw order (as every piece below)
    ids = torch.randint(max(n, 1), (seg.numel(),), generator=generator)
    keep, drawn = _first_occurrences(seg * n + ids)
    pieces = [(ids[keep], seg[keep])]
    taken = [drawn]  # sorted (segment, id) keys drawn so far
    have = torch.bincount(pieces[0][1], minlength=counts.numel())
    while bool((deficit := counts - have).any()):
        extra = torch.where(deficit > 0, 2 * deficit + 8, 0)
        e_seg = segs.repeat_interleave(extra)
        e = torch.randint(n, (e_seg.numel(),), generator=generator)
        e_keys = e_seg * n + e
        new, drawn = _first_occurrences(e_keys)
        for t in taken:
            new &= ~member(e_keys, t)
        e, e_seg = _head(e[new], e_seg[new], deficit)
        pieces.append((e, e_seg))
        taken.append(drawn)  # (also the draws not kept: harmless, they are never first occurrences again)
        have += torch.bincount(e_seg, minlength=counts.numel())
    out = torch.empty(int(counts.sum()), dtype=torch.long)
    filled = torch.cumsum(counts, 0) - counts  # next free slot of each segment
    for p_ids, p_seg in pieces:
        h = torch.bincount(p_seg, minlength=counts.numel())
        out[filled[p_seg] + torch.arange(p_seg.numel()) - (torch.cumsum(h, 0) - h)[p_seg]] = p_ids
        filled += h
    return out


def _first_occurrences(keys: Tensor) -> tuple[Tensor, Tensor]:
    """[len(keys)] bool, keys[i] does not occur in keys[:i]; and the distinct keys, sorted."""
    sk, order = torch.sort(keys, stable=True)
    first = torch.ones_like(sk, dtype=torch.bool)
    first[1:] = sk[1:] != sk[:-1]
    return torch.zeros_like(first).index_fill_(0, order[first], True), sk[first]


def _head(values: Tensor, seg: Tensor, limit: Tensor) -> tuple[Tensor, Tensor]:
    """The first ``limit[s]`` entries of each segment s of (segment-contiguous) ``values``."""
    h = torch.bincount(seg, minlength=limit.numel())
    ok = torch.arange(seg.numel()) - (torch.cumsum(h, 0) - h)[seg] < limit[seg]
    return values[ok], seg[ok]


class ShuffledBatches:
    """Non-private: each epoch a fresh permutation, cut into ``ceil(n / b)`` batches (the last may be short)."""

    def __init__(self, n: int, *, batch_size: int, seed: int, device: torch.device | str = "cpu") -> None:
        self.n, self.b, self.seed = n, batch_size, seed
        self.device = torch.device(device)
        self.steps_per_epoch = -(-n // batch_size)
        self._epoch = -1
        self._perm: Tensor | None = None

    def batch(self, step: int) -> Tensor:
        epoch, pos = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._perm = torch.randperm(self.n, generator=_gen(self.seed, epoch, self.device)).to(self.device)
            self._epoch = epoch
        assert self._perm is not None
        return self._perm[pos * self.b : (pos + 1) * self.b]
