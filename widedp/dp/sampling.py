"""Batch sampling: Poisson sampling for DP training, shuffled fixed-size batches for non-private training.

Both samplers are *stateless per step*: the batch of global step ``t`` is a pure function of (seed, t), so a run
resumed from a checkpoint at step t sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import torch
from torch import Tensor

_CHUNK = 1024  # Poisson steps drawn together (one generator seeding per chunk)


def _gen(seed: int, salt: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed((seed * 1_000_003 + salt * 7919 + 0x5EED) % (2**63 - 1))
    return g


class PoissonSampler:
    """Every one of ``n`` examples joins each step's batch independently with probability ``sampling_rate``.

    The batch size is Binomial(n, q); the members are a uniform subset of that size (drawn by rejection: iid
    uniform ids, a step whose ids collide is redrawn as a random permutation prefix — both are uniform subsets).
    """

    def __init__(self, n: int, *, sampling_rate: float, seed: int, device: torch.device | str = "cpu") -> None:
        if not 0 < sampling_rate <= 1:
            raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
        self.n, self.q, self.seed = n, sampling_rate, seed
        self.device = torch.device(device)
        self._chunk_id = -1
        self._batches: list[Tensor] = []

    def batch(self, step: int) -> Tensor:
        """[m] int64 indices (on ``device``) of the examples in global step ``step``'s batch."""
        chunk, pos = divmod(step, _CHUNK)
        if chunk != self._chunk_id:
            self._batches = self._draw_chunk(chunk)
            self._chunk_id = chunk
        return self._batches[pos]

    def _draw_chunk(self, chunk: int) -> list[Tensor]:
        g = _gen(self.seed, chunk, self.device)
        counts = torch.binomial(torch.full((_CHUNK,), float(self.n)), torch.full((_CHUNK,), self.q), generator=g)
        counts = counts.long()
        ids = torch.randint(self.n, (int(counts.sum()),), generator=g)
        parts = list(torch.split(ids, counts.tolist()))
        for i, p in enumerate(parts):
            if p.numel() > 1 and torch.unique(p).numel() < p.numel():
                parts[i] = torch.randperm(self.n, generator=g)[: p.numel()]
        return [p.to(self.device, non_blocking=True) for p in parts]


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
