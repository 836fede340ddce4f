"""Row blocks of a seeded table initialisation, materialised by the process that owns them and by no other.

For training on several processes a task builds its model on the meta device (shapes, no storage) and records a
``Deferred``: the seed of the CPU generator the one-process build draws the initial weights from, and the device
they go to. Each rank's sharded model (``widedp.models.cbow_sharded``, ``widedp.models.recsys_sharded``) then draws
the whole initialisation stream again, in chunks of rows, from a generator seeded alike and keeps its own rows
(``uniform_rows_``): its blocks equal, bit for bit, the rows of the one-process model, in memory O(own rows + one
chunk).

Why pieces give the whole draw: on the CPU, ``Tensor.uniform_`` is a serial kernel taking a fixed number of generator
outputs per element (one for float32, two for float64), in order, so drawing a table piece by piece from one
generator yields the elements of the whole-tensor draw and leaves the generator where that draw leaves it.
``normal_`` differs: from 16 elements on it transforms blocks of 16 and redraws the last 16 when the size is not a
multiple of 16, so pieces equal the whole draw only when every piece but the last is a multiple of 16 elements and
the last has at least 16. No table here is drawn from it (both rules: tests/models/test_rowinit.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: elements drawn at once for the rows a rank does not keep (4 MiB of float32)
CHUNK = 1 << 20


@dataclass(frozen=True)
class Deferred:
    """A meta-device model's initialisation, deferred to whoever materialises its rows: ``generator()`` replays the
    one-process build's init stream (a CPU generator seeded with ``seed``); the rows then go to ``device``."""

    seed: int
    device: torch.device

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)


def uniform_rows_(out: Tensor, *, first: int, num_rows: int, bound: float, generator: torch.Generator) -> Tensor:
    """Fill ``out`` [n, D] (contiguous, any device) with rows [first, first + n) of ``torch.empty(num_rows, D,
    dtype=out.dtype).uniform_(-bound, bound, generator=generator)`` (a CPU generator), bit for bit, and leave
    ``generator`` where that whole draw leaves it. Returns ``out``."""
    n, dim = out.shape
    if first < 0 or first + n > num_rows:
        raise ValueError(f"rows [{first}, {first + n}) are not rows of a table of {num_rows}")
    if not out.is_contiguous():
        raise ValueError("uniform_rows_ fills a contiguous tensor (its elements in the draw's order)")
    _skip(first * dim, bound=bound, generator=generator, dtype=out.dtype)
    with torch.no_grad():
        if out.device.type == "cpu":
            out.uniform_(-bound, bound, generator=generator)
        else:
            out.copy_(torch.empty(n, dim, dtype=out.dtype).uniform_(-bound, bound, generator=generator))
    _skip((num_rows - first - n) * dim, bound=bound, generator=generator, dtype=out.dtype)
    return out


def _skip(count: int, *, bound: float, generator: torch.Generator, dtype: torch.dtype) -> None:
    """Move ``generator`` past ``count`` elements of a uniform draw of ``dtype``, ``CHUNK`` at a time."""
    scratch = torch.empty(min(count, CHUNK), dtype=dtype)
    while count > 0:
        n = min(count, CHUNK)
        scratch[:n].uniform_(-bound, bound, generator=generator)
        count -= n
