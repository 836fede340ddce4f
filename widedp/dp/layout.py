"""Where the rows of the DP step live: the ``RowLayout`` that ``widedp.dp.step.dp_step`` takes, as jax_privacy's noise
addition takes its strategy. The step composes its stages once (clip S1 -> aggregate -> score -> select -> restrict
-> clip S2 -> noise); a layout supplies the few operations whose implementation depends on where rows sit:

- ``clip_aggregate``: per-sample norms and ĝ. A sample's rows may sit on several processes: its norm is the
  reduction of the parts' ``SampleNorms`` (scale: MAX, sumsq: SUM over the processes), so the S1 clip sees the
  whole sample; the always-selected (replicated) rows' ĝ is summed over the processes;
- ``sample_rows``: a ``contribution`` score's normaliser |rows_j| (the parts' counts, summed);
- ``select``: rows among ALL selectable rows, the same ids on every process;
- ``own``: which selected rows this process releases (each row has exactly one releaser);
- ``clip_l2``: Δ̂'s S2 clip, whose norm is the reduction of the parts' squared norms;
- ``release``: each released row's noise drawn once: by its owner; a replicated row by one process, broadcast;
- ``local``: the update in this process's own row space (what its row optimizer indexes);
- ``refuses``: the step's options (by config key) the layout does not carry; ``check_options`` is the one place
  that refuses them.

Layouts:

- ``SingleProcess()``: every row here; each operation is the identity of the one-process step, so
  ``dp_step(g, ..., layout=SingleProcess())`` is the step (bit for bit, the fused clip kernels included).
- ``RowBlocks(shard, shared=...)``: every table cut into contiguous row blocks across a process group
  (``RowShard``: rank r owns block r of each table); the always-selected rows (a recommender's MLP) are replicated,
  each process takes the samples [rB/W, (r+1)B/W) of them into the norms and ĝ. Selection: the exponential
  mechanism is exact blockwise (each process perturbs its own rows with its own Gumbel keys, untouched ones
  through order statistics, keeps its top k; the top k of the all_gathered candidates is the Gumbel top-k of all
  rows: ``sharded_gumbel_topk``); every other selector runs on the all_gathered (touched, score) pairs with
  ``shared``, a generator seeded alike on every process (the single-process selection for that seed). Public rows
  (``data.negatives_pool``) work as on one process; so does ``dp.preselect`` (its kept rows, drawn once by rank 0
  and sent to every process, restrict the selector, which then takes the all_gathered path).

Other layouts the protocol expresses (not implemented): torchrec's table-wise plan is ``RowBlocks`` with whole
tables as blocks (one owner per table). Column-wise: a row split across ranks by columns; ``clip_aggregate``
reduces the partial squared norms of each sample (the same MAX/SUM reduction as row blocks), a ``norm`` score
u_r = min(sqrt(Σ_ranks ‖ĝ_r[cols]‖²), S0) needs the per-row partial squared norms all_reduced before ``select``
(every rank then holds the same scores and selects with ``shared``), ``own`` keeps every selected row (each rank
releases its columns of it, drawing its own columns' noise), ``clip_l2`` sums partial squared norms. Data-parallel
(replicated) tables: every row is replicated, so all rows are handled as ``RowBlocks``' MLP rows: samples split
across processes, ĝ summed, the selection made with ``shared``, the noise drawn once and broadcast.

The process-group helpers (joining a group, a free port for tests) live in ``widedp.distributed.ranks``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from widedp.dp.clipping import (
    ClipInfo,
    SampleNorms,
    aggregate,
    clip_aggregate,
    clip_l2,
    clip_per_sample,
    sample_scale,
    sample_sumsq,
)
from widedp.dp.noise import exponential, gumbel, noisy
from widedp.dp.rowgrads import PerSampleRows, SparseRows
from widedp.dp.selection import SelectionContext, Selector, sample_distinct
from widedp.dp.selection.scores import sample_row_counts
from widedp.errors import ConfigError

#: The step's options a layout may refuse, by config key (``RowLayout.refuses``).
OPTIONS = ("dp.preselect", "data.negatives_pool")


class RowLayout(Protocol):
    """How the step's rows are laid out over processes (module docstring). Shapes: B samples, R rows of the row space
    (A of them always selected, the last ones), U touched rows here, k selected, D the row width."""

    name: str
    refuses: frozenset[str]

    def clip_aggregate(self, g: PerSampleRows, *, clip1: float, batch_size: float, always_from: int | None,
                       fused: bool | None) -> tuple[Tensor, Tensor, ClipInfo]:
        """(touched [U] sorted ids held here, ghat [U, D], ``ClipInfo`` [B] of the whole samples); with
        ``always_from``, the rows [always_from, R) are the last touched ones and their ĝ is the whole batch's."""
        ...

    def sample_rows(self, g: PerSampleRows, touched: Tensor) -> Tensor | None:
        """[B] each sample's distinct rows of ``touched`` over every process (None: ``g`` holds them all)."""
        ...

    def select(self, selector: Selector, touched: Tensor, scores: Tensor, *, selectable_rows: int,
               score_sensitivity: float, ctx: SelectionContext, generator: torch.Generator) -> Tensor:
        """``selector.select`` over every process's rows: [k] ids, the same on every process."""
        ...

    def own(self, selected: Tensor) -> Tensor:
        """[k'] the rows of ``selected`` [k] this process releases."""
        ...

    def clip_l2(self, delta: Tensor, *, clip: float | None, replicated: int) -> tuple[Tensor, Tensor]:
        """Δ̂ [k' + A, D] (own rows, then the A replicated ones) scaled so that the whole release has norm <= clip;
        and whether it was clipped (0-dim bool)."""
        ...

    def release(self, delta: Tensor, *, replicated: int, std: float, sensitivity: float, noise: str,
                generator: torch.Generator, released_dim: int) -> Tensor:
        """[k' + A, D] Δ̂ plus its noise (``widedp.dp.noise.noisy``), every row's drawn once over the processes;
        ``released_dim``: the coordinates the whole step releases."""
        ...

    def local(self, grad: SparseRows) -> SparseRows:
        """``grad`` (global ids) in this process's row space."""
        ...


def check_options(layout: RowLayout, used: Mapping[str, bool]) -> None:
    """ConfigError (one line, naming the key) for an option in use (``used``: key -> in use) the layout refuses."""
    for key, on in used.items():
        if on and key in layout.refuses:
            raise ConfigError(f"{key}: not available on {layout.name}")


@dataclass(frozen=True)
class SingleProcess:
    """Every row on this process: each operation is the one-process step's."""

    name: str = "one process"
    refuses: frozenset[str] = frozenset()

    def clip_aggregate(self, g: PerSampleRows, *, clip1: float, batch_size: float, always_from: int | None,
                       fused: bool | None) -> tuple[Tensor, Tensor, ClipInfo]:
        return clip_aggregate(g, clip1=clip1, batch_size=batch_size, fused=fused, always_from=always_from)

    def sample_rows(self, g: PerSampleRows, touched: Tensor) -> Tensor | None:
        return None

    def select(self, selector: Selector, touched: Tensor, scores: Tensor, *, selectable_rows: int,
               score_sensitivity: float, ctx: SelectionContext, generator: torch.Generator) -> Tensor:
        return selector.select(touched, scores, selectable_rows=selectable_rows, score_sensitivity=score_sensitivity,
                               ctx=ctx, generator=generator)

    def own(self, selected: Tensor) -> Tensor:
        return selected

    def clip_l2(self, delta: Tensor, *, clip: float | None, replicated: int) -> tuple[Tensor, Tensor]:
        return clip_l2(delta, clip=clip)

    def release(self, delta: Tensor, *, replicated: int, std: float, sensitivity: float, noise: str,
                generator: torch.Generator, released_dim: int) -> Tensor:
        return noisy(delta, std=std, sensitivity=sensitivity, noise=noise, generator=generator,
                     released_dim=released_dim)

    def local(self, grad: SparseRows) -> SparseRows:
        return grad


# ------------------------------------------------------------------------------------------------ row blocks


@dataclass(frozen=True)
class RowShard:
    """Rank ``rank`` of ``world`` owns rows [lo[t], hi[t]) of table t (global rows offsets[t] + r); the
    ``num_dense_rows`` rows after the tables are replicated."""

    rank: int
    world: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    num_dense_rows: int

    @property
    def lo(self) -> tuple[int, ...]:
        return tuple(n * self.rank // self.world for n in self.sizes)

    @property
    def hi(self) -> tuple[int, ...]:
        return tuple(n * (self.rank + 1) // self.world for n in self.sizes)

    @property
    def num_rows(self) -> int:
        """R_emb: embedding rows of all ranks."""
        return self.offsets[-1] + self.sizes[-1]

    @property
    def own_sizes(self) -> tuple[int, ...]:
        return tuple(h - l for l, h in zip(self.lo, self.hi))

    @property
    def own_offsets(self) -> tuple[int, ...]:
        """Local row offset of each table's own block (the local row space is adjacent, table by table)."""
        out, at = [], 0
        for n in self.own_sizes:
            out.append(at)
            at += n
        return tuple(out)

    @property
    def num_own(self) -> int:
        return sum(self.own_sizes)

    def tensors(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """[T] offsets, lo, own sizes, own offsets on ``device``."""
        t = torch.tensor([self.offsets, self.lo, self.own_sizes, self.own_offsets], device=device)
        return t[0], t[1], t[2], t[3]

    def is_own(self, rows: Tensor) -> Tensor:
        """[n] bool: global embedding row is owned by this rank."""
        off, lo, size, _ = self.tensors(rows.device)
        t = torch.searchsorted(off, rows, right=True) - 1
        r = rows - off.index_select(0, t) - lo.index_select(0, t)
        return (r >= 0) & (r < size.index_select(0, t))

    def to_local(self, rows: Tensor) -> Tensor:
        """Global ids of own rows (or dense rows >= R_emb) -> the local row space [0, n_own + A)."""
        off, lo, _, loc = self.tensors(rows.device)
        dense = rows >= self.num_rows
        t = torch.searchsorted(off, rows.clamp(max=self.num_rows - 1), right=True) - 1
        emb = rows - off.index_select(0, t) - lo.index_select(0, t) + loc.index_select(0, t)
        return torch.where(dense, rows - self.num_rows + self.num_own, emb)

    def own_to_global(self, local: Tensor) -> Tensor:
        """Local own-row ids [0, n_own) -> global ids."""
        off, lo, _, loc = self.tensors(local.device)
        t = torch.searchsorted(loc, local, right=True) - 1
        return local - loc.index_select(0, t) + off.index_select(0, t) + lo.index_select(0, t)

    def samples(self, batch: int) -> tuple[int, int]:
        """[lo, hi): the samples of a batch of ``batch`` whose replicated rows this rank takes."""
        return batch * self.rank // self.world, batch * (self.rank + 1) // self.world


def _all_gather_var(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Concatenation over ranks of 1-D/2-D tensors whose first dim differs by rank."""
    world = dist.get_world_size(group)
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    sizes_l = [int(s) for s in sizes]
    pad = t.new_zeros((max(sizes_l), *t.shape[1:]))
    pad[: t.shape[0]] = t
    out = [torch.zeros_like(pad) for _ in range(world)]
    dist.all_gather(out, pad, group=group)
    return torch.cat([o[:s] for o, s in zip(out, sizes_l)])


def sharded_gumbel_topk(touched: Tensor, logits: Tensor, shard: RowShard, *, k: int, generator: torch.Generator,
                        group: dist.ProcessGroup | None = None) -> Tensor:
    """Global Gumbel top-k over all R_emb rows (logits 0 on untouched rows) from each rank's own rows.

    Args:
        touched: [U_r] sorted OWN global ids; logits: [U_r]; generator: this rank's own.

    Returns:
        [k] global ids in pick order, the same on every rank.
    """
    dev, dt = touched.device, logits.dtype
    m = shard.num_own - touched.numel()
    n = min(k, m)
    keys = gumbel((touched.numel(),), generator=generator, device=dev, dtype=dt).add_(logits)
    ids = touched
    if n > 0:
        x = exponential((n,), generator=generator, device=dev, dtype=dt)
        g_untouched = x.div_(torch.arange(m, m - n, -1, device=dev, dtype=dt)).cumsum_(0).log_().neg_()
        loc = sample_distinct(n, shard.num_own, exclude=shard.to_local(touched), generator=generator, device=dev)
        keys, ids = torch.cat([keys, g_untouched]), torch.cat([ids, shard.own_to_global(loc)])
    c = min(k, keys.numel())
    top = keys.topk(c)
    cand_keys = torch.full((k,), float("-inf"), device=dev, dtype=dt)
    cand_ids = torch.full((k,), -1, device=dev, dtype=torch.long)
    cand_keys[:c], cand_ids[:c] = top.values, ids.index_select(0, top.indices)
    all_keys = [torch.empty_like(cand_keys) for _ in range(shard.world)]
    all_ids = [torch.empty_like(cand_ids) for _ in range(shard.world)]
    dist.all_gather(all_keys, cand_keys, group=group)
    dist.all_gather(all_ids, cand_ids, group=group)
    return torch.cat(all_ids).index_select(0, torch.cat(all_keys).topk(k).indices)


@dataclass(frozen=True)
class RowBlocks:
    """Tables in contiguous row blocks across ``group`` (default: the whole world), this process owning ``shard``'s;
    the always-selected rows replicated (module docstring). ``shared``: a generator seeded identically on every
    process (selections made alike everywhere); the step's ``generator`` is this process's own (its rows' Gumbel
    keys and noise; on rank 0 the replicated rows' noise).

    ``g`` in the step: the per-sample gradients of this process's OWN rows (global ids, ``num_rows`` = R_emb + A)
    and every sample's A replicated rows (``PerSampleRowsWithDense``, as one process holds them).
    """

    shard: RowShard
    shared: torch.Generator
    group: dist.ProcessGroup | None = None
    name: str = "several processes (row blocks)"
    refuses: frozenset[str] = frozenset()

    def _share(self, g: PerSampleRows, always_from: int | None) -> PerSampleRows:
        """``g`` with the replicated rows' pairs of the samples other processes take dropped."""
        if always_from is None or always_from >= g.num_rows:
            return g
        lo, hi = self.shard.samples(g.batch_size)
        sample = g.sample_ids()
        keep = (g.rows < always_from) | ((sample >= lo) & (sample < hi))
        per_sample = torch.zeros(g.batch_size, dtype=torch.long, device=g.rows.device).index_add_(0, sample,
                                                                                                  keep.long())
        offsets = torch.cat([per_sample.new_zeros(1), per_sample.cumsum(0)])
        return PerSampleRows(g.values[keep], g.rows[keep], offsets, g.num_rows)

    def clip_aggregate(self, g: PerSampleRows, *, clip1: float, batch_size: float, always_from: int | None,
                       fused: bool | None) -> tuple[Tensor, Tensor, ClipInfo]:
        mine = self._share(g, always_from)
        scale = sample_scale(mine)  # [B]; +inf: a non-finite entry
        dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=self.group)
        sumsq = sample_sumsq(mine, scale)  # [B] this process's parts
        dist.all_reduce(sumsq, group=self.group)
        clipped, clip = clip_per_sample(mine, clip1=clip1, norms=SampleNorms(scale, sumsq))
        touched, ghat = aggregate(clipped, batch_size=batch_size, always_from=always_from)
        a = 0 if always_from is None else g.num_rows - always_from
        if a > 0:  # the replicated rows' ĝ: the sum over every process's samples
            rep = ghat[-a:].contiguous()
            dist.all_reduce(rep, group=self.group)
            ghat[-a:] = rep
        return touched, ghat, clip

    def sample_rows(self, g: PerSampleRows, touched: Tensor) -> Tensor | None:
        counts = sample_row_counts(g, touched)
        dist.all_reduce(counts, group=self.group)
        return counts

    def select(self, selector: Selector, touched: Tensor, scores: Tensor, *, selectable_rows: int,
               score_sensitivity: float, ctx: SelectionContext, generator: torch.Generator) -> Tensor:
        if selectable_rows != self.shard.num_rows:
            raise ValueError(f"row blocks select among all {self.shard.num_rows} rows, not {selectable_rows}")
        logits = getattr(selector, "gumbel_logits", None)  # a Gumbel top-k law: exact blockwise, top k merged
        if logits is not None:
            return sharded_gumbel_topk(touched, logits(scores, score_sensitivity), self.shard, k=selector.k,
                                       generator=generator, group=self.group)
        all_touched = _all_gather_var(touched, self.group)
        order = torch.argsort(all_touched)
        if selector.score_kind != "none":
            scores = _all_gather_var(scores, self.group).index_select(0, order)
        return selector.select(all_touched.index_select(0, order), scores, selectable_rows=selectable_rows,
                               score_sensitivity=score_sensitivity, ctx=ctx, generator=self.shared)

    def own(self, selected: Tensor) -> Tensor:
        return selected.index_select(0, self.shard.is_own(selected).nonzero().squeeze(1))

    def clip_l2(self, delta: Tensor, *, clip: float | None, replicated: int) -> tuple[Tensor, Tensor]:
        if clip is None:
            return delta, torch.zeros((), dtype=torch.bool, device=delta.device)
        n = delta.shape[0] - replicated
        sq = delta[:n].square().sum().reshape(1)
        dist.all_reduce(sq, group=self.group)  # Δ̂'s own rows over the processes; the replicated ones are here
        ratio = (sq + delta[n:].square().sum()).sqrt_().div_(clip).reshape(())
        return delta * ratio.clamp(min=1.0).reciprocal_(), ratio > 1

    def release(self, delta: Tensor, *, replicated: int, std: float, sensitivity: float, noise: str,
                generator: torch.Generator, released_dim: int) -> Tensor:
        n = delta.shape[0] - replicated
        own = noisy(delta[:n], std=std, sensitivity=sensitivity, noise=noise, generator=generator,
                    released_dim=released_dim)
        if not replicated:
            return own
        rep = torch.empty_like(delta[n:])
        if self.shard.rank == 0:  # drawn once; the replicas' Δ̂ are equal, so rank 0's release is everyone's
            rep = noisy(delta[n:], std=std, sensitivity=sensitivity, noise=noise, generator=generator,
                        released_dim=released_dim)
        if self.group is None:
            dist.broadcast(rep, src=0)
        else:
            dist.broadcast(rep, group=self.group, group_src=0)
        return torch.cat([own, rep])

    def local(self, grad: SparseRows) -> SparseRows:
        s = self.shard
        return SparseRows(s.to_local(grad.rows), grad.values, s.num_own + grad.num_rows - s.num_rows)
