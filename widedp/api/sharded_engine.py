"""What ``PrivacyEngine`` does differently for a torchrec ``DistributedModelParallel`` model: one ``DMPModel`` holds
the process group, the tables' owners and slices (``widedp.api.sharded``) and the few operations the engine calls
(seeds from rank 0, each rank's part of the Poisson batch, the step's layout, the update of the held slices)."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from widedp.api.capture import Capture
from widedp.api.per_sample import Layout
from widedp.api.sharded import (
    ShardedCapture,
    ShardedTable,
    dense_total,
    discover,
    global_rows,
    is_dmp,
    sharded_modules,
    table_shard,
)
from widedp.api.update import ShardedUpdater
from widedp.distributed.ranks import derive_seed
from widedp.dp import rng
from widedp.dp.layout import RowBlocks
from widedp.dp.rowgrads import PerSampleRows, PerSampleRowsWithDense
from widedp.errors import ConfigError

__all__ = ["DMPModel", "is_dmp"]

_MODES = ("secure", "reproducible")


class DMPModel:
    """A DMP-sharded model as the engine trains it (``widedp.api.sharded``'s docstring says how)."""

    def __init__(self, model: nn.Module, modules: list[tuple[str, nn.Module]], tables: list[ShardedTable], *,
                 rank: int, world: int, group: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        self.model, self.modules, self.tables = model, modules, tables
        self.rank, self.world, self.group = rank, world, group
        self._layouts: dict[int, RowBlocks] = {}
        # DMP's default wraps the dense layers in DDP, which leaves the mean over ranks in their .grad
        self.ddp = isinstance(getattr(model, "_dmp_wrapped_module", None), DistributedDataParallel)

    @classmethod
    def of(cls, model: nn.Module, dataset: Any, *, batch_size: int) -> DMPModel:
        """The tables of ``model`` (a DMP) on this rank; every rank must give the same (whole) ``dataset`` — the
        Poisson batch is drawn over all of it — and per-rank ``batch_size`` (a ConfigError otherwise; the dataset
        is compared by its size and a checksum of its first and last items)."""
        if not dist.is_initialized():
            raise ConfigError("make_private: a DistributedModelParallel model needs its process group initialised")
        group = getattr(getattr(model, "_env", None), "process_group", None)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        modules = sharded_modules(model.module)
        tables = discover(modules, rank=rank, world=world)
        n = len(dataset)
        mine = torch.tensor([n, batch_size, zlib.crc32(repr((dataset[0], dataset[n - 1])).encode())])
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine, group=group)
        if any(not torch.equal(e[:2], mine[:2]) for e in every):
            raise ConfigError(f"make_private: every rank must pass the same dataset and batch_size; got (len(dataset), "
                              f"batch_size) = {[tuple(e[:2].tolist()) for e in every]} by rank")
        if any(not torch.equal(e, mine) for e in every):
            raise ConfigError("make_private: every rank must pass the same whole dataset (the Poisson batch is drawn "
                              "over all of it and each rank takes its part); the ranks' first or last items differ "
                              "(a per-rank shard of the data?)")
        return cls(model, modules, tables, rank=rank, world=world, group=group)

    @property
    def table_list(self) -> list[Any]:
        """The tables' places in the row space (``widedp.api.capture.Table``), in order."""
        return [t.table for t in self.tables]

    def seeds_from_rank0(self, seeds: rng.RunSeeds) -> rng.RunSeeds:
        """Rank 0's seeds on every rank, sent over the process group (every rank samples the same batches)."""
        t = torch.tensor([seeds.sampling, seeds.noise, _MODES.index(seeds.mode)], dtype=torch.int64)
        if self.group is None:
            dist.broadcast(t, src=0)
        else:
            dist.broadcast(t, group=self.group, group_src=0)
        sampling, noise, mode = (int(v) for v in t.tolist())
        return rng.RunSeeds(sampling=sampling, noise=noise, mode=_MODES[mode])  # type: ignore[arg-type]

    def generators(self, noise_seed: int, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
        """(this rank's own generator, the generator every rank shares), both secret derivations of the noise
        seed."""
        return (rng.generator(derive_seed(noise_seed, f"rank{self.rank}"), device),
                rng.generator(derive_seed(noise_seed, "shared"), device))

    def capture(self) -> Capture:
        """The hooks of the unwrapped module: its dense layers as on one process, its sharded collections'
        lookups by ``ShardedCapture``."""
        cap = Capture(self.model.module, sharded=tuple(m for _, m in self.modules))
        if cap.tables:
            cap.remove()
            raise ConfigError(f"make_private: {cap.tables[0].name} is an unsharded table beside sharded ones; shard "
                              "every table (a data_parallel plan replicates a small one)")
        ShardedCapture(cap, self.modules, self.tables, self.group)
        return cap

    def updater(self, layout: Layout, optimizer: torch.optim.Optimizer, name: str | None) -> ShardedUpdater:
        return ShardedUpdater(layout, optimizer, name, self.tables, group=self.group)

    def local_items(self, indices: list[int]) -> list[int]:
        b = len(indices)
        return indices[b * self.rank // self.world : b * (self.rank + 1) // self.world]

    @property
    def dense_total(self) -> Callable[[Tensor], Tensor] | None:
        """What the backward leaves in a dense ``.grad`` from this rank's summed per-sample gradients."""
        return dense_total(self.world, self.group) if self.ddp else None

    def layout(self, shared: torch.Generator) -> RowBlocks:
        """The step's layout: ``RowBlocks`` over the tables' owners (the same object every step)."""
        if id(shared) not in self._layouts:
            self._layouts = {id(shared): RowBlocks(self._shard, shared=shared, group=self.group,
                                                   name="DistributedModelParallel")}
        return self._layouts[id(shared)]

    def global_rows(self, g: PerSampleRows, always_rows: int) -> PerSampleRowsWithDense:
        if not hasattr(self, "_shard"):
            self._shard = table_shard(self.tables, rank=self.rank, world=self.world, num_dense_rows=always_rows)
        return global_rows(g, self._shard, always_rows=always_rows, group=self.group)

    def describe(self) -> dict[str, Any]:
        """For the privacy statement: the processes and each table's sharding."""
        return {"processes": self.world, "sharding": {t.table.name: t.kind for t in self.tables}}
