"""``make_private`` on a torchrec ``DistributedModelParallel`` (DMP) model: the one-process DP step over tables that
torchrec sharded across the ranks of a process group.

What a rank holds, and where the step's work is done (``widedp.dp.layout.RowBlocks`` over a ``TableShard``):

- its share of the ONE Poisson batch: every rank draws the same batch of dataset indices from the same sampling
  seed (rank 0's, broadcast) and takes its contiguous part; samples are numbered rank by rank;
- the gradient of each local sample's pooled embeddings, captured at the output of each sharded
  ``EmbeddingBagCollection`` (a forward hook swaps its output for a leaf: the backward never reaches torchrec's
  lookup, so no fused optimizer and no dense-kernel gradient ever touches a table); with the KJT that went in,
  this gives each local sample's row gradients of EVERY table (values / rows / offsets, as on one process);
- the step: every rank's table entries are all_gathered and each table's rows go to its DP owner (``owner``):
  table-wise: the rank that holds the table; column-wise: the holder of its first column slice (it sees whole
  rows, so scores, clipping and noise are those of whole rows); data-parallel (replicated): one rank per table,
  round robin. Each sample's S1 norm is the sum of its parts' squared norms over the ranks (owners' rows + the
  sample's own rank's dense rows), the dense (MLP) rows' ĝ is summed over ranks, their noise drawn once by rank 0;
  each selected row's noise is drawn once, by its owner, with the owner's own generator;
- the release: the owners' noisy rows are all_gathered and every rank applies the rows and columns it holds
  (a replicated table on every rank, a column slice by its holder) with widedp's row optimizer; the dense
  parameters get the same noisy gradient on every rank and the user's optimizer steps them.

So the DP step, the sensitivity, the accountant's q and the ledger are the single process's with the global
batch; only where the arithmetic runs differs. Refused (one line): row-wise and grid plans, a rank holding two
slices of one table, ``EmbeddingCollection`` (sequence) shards, unsharded tables beside sharded ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from widedp.api.capture import Capture, IdOutOfRangeError, Record, Table, UnsupportedModelError, read_outside
from widedp.dp.layout import RowShard, _all_gather_var
from widedp.dp.rowgrads import PerSampleRows, PerSampleRowsWithDense, coalesce

KINDS = ("data_parallel", "table_wise", "column_wise", "table_column_wise")


def is_dmp(model: nn.Module) -> bool:
    """Is ``model`` torchrec's ``DistributedModelParallel``?"""
    t = type(model)
    return t.__name__ == "DistributedModelParallel" and t.__module__.startswith("torchrec")


@dataclass(frozen=True)
class LocalSlice:
    """This rank's part of a table: rows [r0, r1) x columns [c0, c1), ``view`` a view of torchrec's storage."""

    view: Tensor
    rows: tuple[int, int]
    cols: tuple[int, int]


@dataclass(frozen=True)
class ShardedTable:
    """One table of a sharded ``EmbeddingBagCollection``: its place in the row space (``table``: global rows
    [offset, offset + V); its ``weight`` a stride-0 stand-in of the global shape), torchrec's sharding ``kind``, the
    rank that selects and noises its rows (``owner``), the KJT features it pools, and this rank's slice."""

    table: Table
    kind: str
    owner: int
    features: tuple[str, ...]
    mean: bool
    local: LocalSlice | None


@dataclass(frozen=True)
class TableShard(RowShard):
    """A ``RowShard`` whose blocks are given: rank ``rank`` owns rows [bounds[t][0], bounds[t][1]) of table t (a
    whole table, or none of it). Every rank holds the replicated (dense) rows of its own samples only, so all of
    them are its share (``samples``)."""

    bounds: tuple[tuple[int, int], ...] = ()

    @property
    def lo(self) -> tuple[int, ...]:
        return tuple(b[0] for b in self.bounds)

    @property
    def hi(self) -> tuple[int, ...]:
        return tuple(b[1] for b in self.bounds)

    def samples(self, batch: int) -> tuple[int, int]:
        return 0, batch


def _is_sharded(m: nn.Module, name: str) -> bool:
    return type(m).__name__ == name and type(m).__module__.startswith("torchrec.distributed")


def sharded_modules(inner: nn.Module) -> list[tuple[str, nn.Module]]:
    """The sharded ``EmbeddingBagCollection`` modules of the DMP's unwrapped module (refusing what is not one)."""
    found = []
    for name, m in inner.named_modules():
        if _is_sharded(m, "ShardedEmbeddingBagCollection"):
            found.append((name, m))
        elif type(m).__module__.startswith("torchrec.distributed") and type(m).__name__.startswith("Sharded"):
            raise UnsupportedModelError(f"{name} ({type(m).__name__}): only sharded EmbeddingBagCollections are "
                                        "supported on several processes")
    if not found:
        raise UnsupportedModelError("DistributedModelParallel model without a sharded EmbeddingBagCollection: "
                                    "widedp trains wide models' tables")
    return found


def _local_slice(sebc: nn.Module, name: str, spec: Any, rank: int, num_rows: int, dim: int) -> LocalSlice | None:
    view = sebc.embedding_bags[name].weight
    if spec.sharding_type == "data_parallel":
        return LocalSlice(view, (0, num_rows), (0, dim))
    mine = [s for s in spec.sharding_spec.shards if s.placement.rank() == rank]
    if len(mine) > 1:
        raise UnsupportedModelError(f"{name}: rank {rank} holds {len(mine)} slices of this table; use a plan with "
                                    "at most one slice per rank")
    if not mine:
        return None
    (r0, c0), (nr, nc) = mine[0].shard_offsets, mine[0].shard_sizes
    return LocalSlice(view, (r0, r0 + nr), (c0, c0 + nc))


def _owner(spec: Any, index: int, world: int) -> int:
    if spec.sharding_type == "data_parallel":
        return index % world
    return min(s.placement.rank() for s in spec.sharding_spec.shards)


def discover(modules: list[tuple[str, nn.Module]], *, rank: int, world: int) -> list[ShardedTable]:
    """Every table of ``modules`` in order (global offsets in order), with its owner and this rank's slice."""
    out: list[ShardedTable] = []
    offset = 0
    for mname, sebc in modules:
        for cfg in sebc._embedding_bag_configs:
            spec = sebc.module_sharding_plan[cfg.name]
            label = f"{mname}.{cfg.name}" if mname else cfg.name
            if spec.sharding_type not in KINDS:
                raise UnsupportedModelError(f"{label}: sharding type {spec.sharding_type} is not supported (use one "
                                            f"of {', '.join(KINDS)})")
            if cfg.pooling.name not in ("SUM", "MEAN"):
                raise UnsupportedModelError(f"{label}: pooling {cfg.pooling.name} (use SUM or MEAN)")
            v, d = cfg.num_embeddings, cfg.embedding_dim
            w = sebc.embedding_bags[cfg.name].weight
            stand_in = torch.zeros((), dtype=w.dtype, device=w.device).expand(v, d)  # the global shape, no storage
            out.append(ShardedTable(Table(label, stand_in, offset), spec.sharding_type,
                                    _owner(spec, len(out), world), tuple(cfg.feature_names),
                                    cfg.pooling.name == "MEAN", _local_slice(sebc, cfg.name, spec, rank, v, d)))
            offset += v
    return out


def table_shard(tables: list[ShardedTable], *, rank: int, world: int, num_dense_rows: int) -> TableShard:
    """The ``TableShard`` of ``rank``: the whole of each table it owns."""
    return TableShard(rank=rank, world=world, offsets=tuple(t.table.offset for t in tables),
                      sizes=tuple(t.table.num_rows for t in tables), num_dense_rows=num_dense_rows,
                      bounds=tuple((0, t.table.num_rows if t.owner == rank else 0) for t in tables))


class ShardedCapture:
    """Hooks on the sharded collections that record each feature's lookups into ``capture.records`` (as
    ``Capture`` records an unsharded collection's) and cut the backward off torchrec's lookups. An error one rank
    finds (an id out of range, a table read outside its lookup) is raised on every rank (``agree``): the others
    would otherwise wait in the next collective."""

    def __init__(self, capture: Capture, modules: list[tuple[str, nn.Module]], tables: list[ShardedTable],
                 group: Any = None) -> None:
        self.capture, self.group = capture, group
        self._params = [(f"{name}.{n}" if name else n, p) for name, m in modules for n, p in m.named_parameters()]
        capture.sharded_check = self.check_untouched
        self._features: dict[int, dict[str, ShardedTable]] = {}
        self._pending: dict[int, list[tuple[str, Record]]] = {}
        at = 0
        for _, sebc in modules:
            n = len(sebc._embedding_bag_configs)
            self._features[id(sebc)] = {f: t for t in tables[at : at + n] for f in t.features}
            at += n
            capture._handles.append(sebc.register_forward_pre_hook(self._pre))
            capture._handles.append(sebc.register_forward_hook(self._post))

    def check_untouched(self) -> None:
        """``Capture.check_tables_untouched`` for torchrec's tables: a gradient on one of their parameters (a read
        outside the lookup; the user's optimizer would step it) is cleared and refused on every rank."""
        touched = [n for n, p in self._params if p.grad is not None]
        for _, p in self._params:
            p.grad = None
        agree(read_outside(touched[0].removesuffix(".weight")) if touched else None, self.group)

    def _pre(self, m: nn.Module, args: tuple[Any, ...]) -> None:
        kjt = args[0]
        if kjt.variable_stride_per_key():
            raise UnsupportedModelError(f"{self.capture._label(m)}: variable-batch KJTs are not supported")
        batch = kjt.stride()
        jts = kjt.to_dict() if batch else None  # (torchrec's to_dict fails on a rank's empty share of a batch)
        error = None
        for f, t in self._features[id(m)].items():
            error = error or (_bad_ids(t, f, jts[f].values()) if jts is not None else None)
        agree(error, self.group, kind=IdOutOfRangeError)
        records = []
        for f, t in self._features[id(m)].items():
            if jts is None or not self.capture._recording(m):
                continue
            jt = jts[f]
            ids, lengths = jt.values(), jt.lengths()
            sample = torch.repeat_interleave(torch.arange(batch, device=ids.device), lengths)
            w = jt.weights_or_none() if m._is_weighted else None
            scale = None if w is None else w.detach().to(t.table.weight.dtype)
            if t.mean:
                inv = lengths.clamp_min(1).reciprocal().to(t.table.weight.dtype).index_select(0, sample)
                scale = inv if scale is None else scale * inv
            records.append((f, Record(batch=batch, table=t.table, rows=ids.long() + t.table.offset, src=sample,
                                      sample=sample, scale=scale)))
        self._pending[id(m)] = records

    def _post(self, m: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
        from torchrec import KeyedTensor

        kt = out.wait() if hasattr(out, "wait") else out
        values = kt.values().detach()  # no gradient into torchrec's lookups (their fused optimizers never run)
        records = self._pending.pop(id(m), [])
        if records:
            values.requires_grad_(True)
            cols = dict(zip(kt.keys(), _column_ranges(kt.length_per_key())))
            cuts = [(rec, *cols[f]) for f, rec in records]

            def split(g: Tensor) -> None:  # each feature's columns of the pooled gradient [B, sum of dims]
                for rec, a, b in cuts:
                    rec.add_grad(g[:, a:b])

            values.register_hook(split)
            self.capture.records.extend(rec for _, rec in records)
        return KeyedTensor(keys=kt.keys(), length_per_key=kt.length_per_key(), values=values)


def _column_ranges(lengths: list[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for n in lengths:
        out.append((at, at + n))
        at += n
    return out


def _bad_ids(t: ShardedTable, feature: str, ids: Tensor) -> str | None:
    bad = (ids < 0) | (ids >= t.table.num_rows)
    if ids.numel() and bool(bad.any()):
        pos = int(bad.nonzero()[0])
        return (f"{t.table.name} (feature {feature}): id {int(ids[pos])} is outside the table's {t.table.num_rows} "
                f"rows [0, {t.table.num_rows}); map ids to rows before the lookup")
    return None


def agree(error: str | None, group: Any = None, *, kind: type[Exception] = UnsupportedModelError) -> None:
    """Raise ``kind`` on every rank when any rank has an ``error`` (its own message; the others name the rank)."""
    flag = torch.tensor([dist.get_rank(group) if error is not None else -1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise kind(error)
    if int(flag) >= 0:
        raise kind(f"rank {int(flag)} stopped the step (its error says why)")


def global_rows(g: PerSampleRows, shard: TableShard, *, always_rows: int,
                group: dist.ProcessGroup | None = None) -> PerSampleRowsWithDense:
    """This rank's share of the global batch's per-sample rows (``RowBlocks``' ``g``) from its local samples' rows
    ``g`` (every table, then the dense rows): every rank's table entries whose rows this rank owns, and its own
    samples' dense rows; samples numbered rank by rank."""
    r_tab = g.num_rows - always_rows
    sample = g.sample_ids()
    tab = g.rows < r_tab
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(shard.world)]
    dist.all_gather(sizes, torch.tensor([g.batch_size]), group=group)
    start, total = int(sum(sizes[: shard.rank])), int(sum(sizes))
    rows = _all_gather_var(g.rows[tab], group)
    values = _all_gather_var(g.values[tab], group)
    samples = _all_gather_var(sample[tab] + start, group)
    own = shard.is_own(rows) if rows.numel() else rows.new_zeros(0, dtype=torch.bool)
    dense = ~tab
    out = coalesce(torch.cat([values[own], g.values[dense]]), torch.cat([rows[own], g.rows[dense]]),
                   torch.cat([samples[own], sample[dense] + start]), total, g.num_rows)
    return PerSampleRowsWithDense(out.values, out.rows, out.offsets, g.num_rows, always_rows=always_rows)


def dense_total(world: int, group: dist.ProcessGroup | None = None) -> Callable[[Tensor], Tensor]:
    """The dense parameters' summed per-sample gradients as DDP leaves them in ``.grad``: the mean over ranks."""

    def total(local: Tensor) -> Tensor:
        out = local.clone()
        dist.all_reduce(out, group=group)
        return out / world

    return total
