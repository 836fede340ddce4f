"""A distributed run's checkpoint: each rank's part (RUN/shards/) and the full model on rank 0.

    RUN/checkpoint.pt                 rank 0: the full model (gathered), step, history, ledger, world_size
    RUN/shards/rank{R}-{STEP}.pt      rank R: its table blocks and its row optimizer's state as of STEP
    RUN/private/rng-{STEP}-rank{R}.pt rank R: its generators' states as of STEP (``widedp.dp.rng``)

A checkpoint at step S: every rank writes its files of S (atomically), a barrier, rank 0 writes checkpoint.pt, a
barrier, every rank deletes its files of other steps. A kill -9 at any moment leaves the files of the step
checkpoint.pt names. Resume reads them on as many ranks as wrote them (``world_size``); another number of ranks
is a one-line error (no resharding).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from widedp.run.checkpoint import _atomic_write

SHARDS_DIR = "shards"
_SHARD_RE = re.compile(r"^rank(\d+)-(\d+)\.pt$")


def shard_path(out: Path, *, step: int, rank: int) -> Path:
    return out / SHARDS_DIR / f"rank{rank}-{step}.pt"


def save_shard(out: Path, state: dict[str, Any], *, step: int, rank: int, world: int) -> None:
    """Write rank ``rank``'s part of the checkpoint of ``step`` (tensors and numbers only) atomically."""
    doc = {"step": step, "rank": rank, "world_size": world, **state}
    _atomic_write(shard_path(out, step=step, rank=rank), lambda f: torch.save(doc, f))


def load_shard(out: Path, *, step: int, rank: int, world: int, device: torch.device
               ) -> tuple[dict[str, Any] | None, str | None]:
    """Rank ``rank``'s part of the checkpoint of ``step``, or (None, the one-line error)."""
    path = shard_path(out, step=step, rank=rank)
    if not path.is_file():
        return None, f"{path}: missing (rank {rank}'s part of the checkpoint of step {step})"
    try:
        doc = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # a truncated or tampered file: one line, never code execution
        return None, f"{path}: cannot be loaded safely ({type(e).__name__})"
    if (doc.get("step"), doc.get("rank"), doc.get("world_size")) != (step, rank, world):
        return None, (f"{path}: holds step {doc.get('step')} of rank {doc.get('rank')} of {doc.get('world_size')}, "
                      f"expected step {step} of rank {rank} of {world}")
    return doc, None


def prune_shards(out: Path, keep_step: int, *, rank: int) -> None:
    """Delete rank ``rank``'s shard files of other steps (after the checkpoint of ``keep_step`` is written)."""
    d = out / SHARDS_DIR
    for p in d.iterdir() if d.is_dir() else ():
        m = _SHARD_RE.match(p.name)
        if m and int(m.group(1)) == rank and int(m.group(2)) != keep_step:
            p.unlink(missing_ok=True)


@torch.no_grad()
def gather_tables(full: list[tuple[int, Tensor]], local: list[tuple[int, Tensor]], shard: Any) -> None:
    """Rank 0's ``full`` tables (a task model's ``row_tables()``) receive every rank's blocks (its sharded model's
    ``local_tables()``, table t's block = rows [lo, hi) of ``shard``, a ``RowShard``); tables after the sharded
    ones (a recommender's MLP rows) are replicated: rank 0's copy is theirs. A collective."""
    world, rank = shard.world, shard.rank
    for t, ((_, dst), (_, mine)) in enumerate(zip(full, local)):
        if t >= len(shard.sizes):
            if rank == 0:
                dst.detach().copy_(mine)
            continue
        n = shard.sizes[t]
        bounds = [n * r // world for r in range(world + 1)]
        pad = mine.new_zeros(max(b - a for a, b in zip(bounds, bounds[1:])), mine.shape[1])
        pad[: mine.shape[0]] = mine
        parts = [torch.empty_like(pad) for _ in range(world)] if rank == 0 else None
        dist.gather(pad, parts, dst=0)
        if parts is not None:
            for r, part in enumerate(parts):
                dst.detach()[bounds[r]:bounds[r + 1]] = part[: bounds[r + 1] - bounds[r]]
