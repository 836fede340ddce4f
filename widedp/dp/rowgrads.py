"""Per-sample gradients kept as the rows each sample touched (never batch x vocab x dim).

A batch of B samples over a row space of R rows (all embedding tables stacked: table t's row r has global id
``table_offset[t] + r``) is stored jagged::

    sample j:        j = 0            j = 1        j = 2      <-- batch indices
    rows:          [ 3, 17, 40 ]    [ 17 ]       [ 5, 40 ]     global row ids, unique within a sample
    values:        [ g, g,  g  ]    [ g ]        [ g, g  ]     one D-vector per (sample, row)
    offsets:       [0,            3,           4,         6]  sample j owns values[offsets[j]:offsets[j+1]]

Duplicate rows within one sample are summed before any norm is taken (``coalesce``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PerSampleRows:
    """Jagged per-sample row gradients.

    Args:
        values: [nnz, D] gradient of each (sample, row) pair.
        rows: [nnz] int64 global row id of each pair.
        offsets: [B + 1] int64, non-decreasing, offsets[0] = 0, offsets[-1] = nnz.
        num_rows: R, the size of the row space (all tables), so selection can range over every row.
    """

    values: Tensor
    rows: Tensor
    offsets: Tensor
    num_rows: int

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1

    @property
    def dim(self) -> int:
        return self.values.shape[1]

    def lengths(self) -> Tensor:
        """[B] number of rows each sample touched."""
        return self.offsets[1:] - self.offsets[:-1]

    def sample_ids(self) -> Tensor:
        """[nnz] the sample each pair belongs to."""
        return torch.repeat_interleave(torch.arange(self.batch_size, device=self.rows.device), self.lengths(),
                                       output_size=self.rows.numel())  # the size is known: no host sync

    def to_dense(self) -> Tensor:
        """[B, R, D] dense copy — for tests on tiny sizes only."""
        out = self.values.new_zeros(self.batch_size, self.num_rows, self.dim)
        out.index_put_((self.sample_ids(), self.rows), self.values, accumulate=True)
        return out


@dataclass(frozen=True)
class PerSampleRowsWithDense(PerSampleRows):
    """``PerSampleRows`` whose last ``always_rows`` rows (of ``num_rows``) are dense parameters: ``dp_step``
    selects them every step (see ``widedp.dp.step``)."""

    always_rows: int = 0


def coalesce(values: Tensor, rows: Tensor, sample: Tensor, batch_size: int, num_rows: int) -> PerSampleRows:
    """Sum duplicate (sample, row) pairs and return them grouped by sample.

    Args:
        values: [n, D]; rows: [n] global ids; sample: [n] sample index of each entry (any order).
    """
    key = sample * num_rows + rows
    uniq, inv = torch.unique(key, return_inverse=True)  # sorted: grouped by sample, then row
    summed = values.new_zeros(uniq.numel(), values.shape[1]).index_add_(0, inv, values)
    s = torch.div(uniq, num_rows, rounding_mode="floor")
    counts = torch.bincount(s, minlength=batch_size)
    offsets = torch.zeros(batch_size + 1, dtype=torch.long, device=values.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return PerSampleRows(values=summed, rows=uniq - s * num_rows, offsets=offsets, num_rows=num_rows)


@dataclass(frozen=True)
class SparseRows:
    """A gradient over the row space that is non-zero on ``rows`` only.

    Args:
        rows: [k] int64 distinct global row ids.
        values: [k, D] the gradient of each of those rows.
        num_rows: R.
    """

    rows: Tensor
    values: Tensor
    num_rows: int

    def to_dense(self) -> Tensor:
        """[R, D] dense copy — tests and small models only."""
        out = self.values.new_zeros(self.num_rows, self.values.shape[1])
        out.index_copy_(0, self.rows, self.values)
        return out
