"""Privacy units: a sentence, a document or a user protected as a whole, not one sample.

A training split's samples are grouped into units, jagged::

    unit u:      0              1         2
    samples:   [12, 40, 7]    [3]       [19, 5]       indices into the split, in corpus order, at most m per unit
    offsets:   [0,            3,        4,       6]   unit u owns samples[offsets[u]:offsets[u+1]]

A unit keeps only its first m samples by a per-record key (CBOW: corpus order, target position then context
position; recsys: the interaction's index in the train split, which is in record-key order,
``widedp.data_prep.splits``): a rule applied to each unit alone, so (for a fixed vocabulary) adding or
removing one unit changes no other unit's samples. With DP, Poisson sampling draws UNITS (q = b / N units, b =
``train.batch_size`` the expected number of units per batch); a drawn unit brings all its kept samples; the
per-sample row gradients of a batch are summed per unit (``group_rows``) BEFORE ``widedp.dp.step.dp_step``, which
then clips each unit's summed gradient at S1 and works in units exactly as it does in samples: the sensitivity
min(S1/b, 2·S2), the selection's score sensitivity and the accountant's q are all per unit.

On several processes (``widedp.run.trainers.sharded``) every rank draws the same units (``UnitPoissonSampler``
seeded by the shared sampling seed) and merges its own rows of each unit (``group_rows``); the row-block layout sums
each unit's squared norm over the ranks, so a unit is clipped over all its rows, as on one process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from widedp.dp.rowgrads import PerSampleRows, coalesce
from widedp.dp.sampling import PoissonSampler
from widedp.errors import ConfigError


@dataclass(frozen=True)
class Units:
    """A split's samples grouped into units (module docstring).

    Attributes:
        samples: [S] int64 sample indices, unit by unit, each unit's in key order (S = kept samples).
        offsets: [N + 1] int64, unit u owns samples[offsets[u]:offsets[u+1]] (every unit has >= 1 sample).
        cap: m, the most samples a unit keeps. dropped: samples beyond the cap (never trained on).
    """

    samples: Tensor
    offsets: Tensor
    cap: int
    dropped: int

    @property
    def num_units(self) -> int:
        return self.offsets.numel() - 1

    def lengths(self) -> Tensor:
        """[N] samples kept per unit."""
        return self.offsets.diff()

    def batch(self, ids: Tensor) -> UnitBatch:
        """The units ``ids`` [N_b] (distinct, on ``offsets``' device) with all their kept samples, unit by unit."""
        start = self.offsets.index_select(0, ids)
        lens = self.offsets.index_select(0, ids + 1) - start
        total = int(lens.sum())
        seg = torch.repeat_interleave(torch.arange(ids.numel(), device=ids.device), lens, output_size=total)
        within = torch.arange(total, device=ids.device) - torch.repeat_interleave(lens.cumsum(0) - lens, lens,
                                                                                   output_size=total)
        pos = start.index_select(0, seg) + within
        return UnitBatch(self.samples.index_select(0, pos), seg, ids.numel())


def group_units(unit_of: np.ndarray, key: np.ndarray, *, cap: int, device: torch.device | str = "cpu") -> Units:
    """Group samples by ``unit_of`` [n] (any ids), each unit's samples sorted by ``key`` [n] and cut to the first
    ``cap``. Units are numbered by increasing id."""
    if cap < 1:
        raise ConfigError(f"data.max_samples_per_unit: must be >= 1, got {cap}")
    unit_of, key = np.asarray(unit_of, dtype=np.int64), np.asarray(key, dtype=np.int64)
    order = np.lexsort((key, unit_of))  # by unit, then key
    u = unit_of[order]
    first = np.r_[True, u[1:] != u[:-1]] if len(u) else np.zeros(0, bool)
    starts = np.flatnonzero(first)
    rank = np.arange(len(u)) - np.repeat(starts, np.diff(np.r_[starts, len(u)]))
    keep = rank < cap
    kept_u = u[keep]
    lengths = np.bincount(np.cumsum(first)[keep] - 1, minlength=len(starts))
    offsets = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    assert len(kept_u) == offsets[-1]
    return Units(torch.as_tensor(order[keep], device=device), torch.as_tensor(offsets, device=device), cap,
                 int((~keep).sum()))


@dataclass(frozen=True)
class UnitBatch:
    """One step's units. samples: [S] split indices; segment: [S] the batch-local unit (0..num_units-1) of each,
    non-decreasing; num_units: units drawn."""

    samples: Tensor
    segment: Tensor
    num_units: int


class UnitPoissonSampler:
    """Every unit joins each step's batch independently with probability ``sampling_rate``, with all its kept
    samples. Stateless per step (``PoissonSampler`` over unit ids), so a resumed run (and every rank of a sharded
    one) draws the same batches. ``max_batch_size``: at most that many UNITS per batch (truncated Poisson,
    ``widedp.dp.sampling``); a batch then holds at most ``max_batch_size * units.cap`` samples."""

    def __init__(self, units: Units, *, sampling_rate: float, seed: int, device: torch.device | str = "cpu",
                 max_batch_size: int | None = None) -> None:
        self.units = units
        self.q = sampling_rate
        self._sampler = PoissonSampler(units.num_units, sampling_rate=sampling_rate, seed=seed, device=device,
                                       max_batch_size=max_batch_size)

    def draw(self, step: int) -> UnitBatch:
        return self.units.batch(self._sampler.batch(step).to(self.units.offsets.device))  # [N_b] distinct unit ids

    def truncated(self, step: int) -> bool:
        """Whether step ``step``'s Poisson batch held more than ``max_batch_size`` units (and was cut)."""
        return self._sampler.truncated(step)


def group_rows(g: PerSampleRows, segment: Tensor, *, num_units: int) -> PerSampleRows:
    """Per-sample row gradients -> per-unit ones: unit u's rows are the sum of its samples' rows (duplicates
    merged), so ``dp_step`` clips each unit's SUMMED gradient at S1. ``segment`` [B]: the unit of each sample.
    Keeps ``g``'s type and extra fields (a recommender's ``always_rows``: dense rows stay last in every unit)."""
    per_pair = segment.index_select(0, g.sample_ids())
    c = coalesce(g.values, g.rows, per_pair, num_units, g.num_rows)
    return dataclasses.replace(g, values=c.values, rows=c.rows, offsets=c.offsets)


# ------------------------------------------------------------------------------------------------ config glue


def privacy_unit(cfg: Any) -> str:
    """The config's unit: ``pair`` / ``sentence`` / ``document`` (cbow), ``interaction`` / ``user`` (recsys),
    ``example`` (a task whose data has no ``privacy_unit``: one item of its dataset)."""
    return getattr(cfg.data, "privacy_unit", "example")


def is_per_sample(cfg: Any) -> bool:
    """True when one sample is the unit (no grouping)."""
    return privacy_unit(cfg) in ("pair", "interaction", "example")


def unit_name(cfg: Any, noun: str) -> str:
    """The unit as statements name it, e.g. ``sentence (≤ 32 pairs)``, ``user (≤ 256 interactions)``; ``noun``:
    what the task calls one of its samples."""
    return f"{privacy_unit(cfg)} (≤ {cfg.data.max_samples_per_unit} {noun})"
