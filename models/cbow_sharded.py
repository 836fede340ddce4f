"""CBOW with its tables row-sharded across torch.distributed ranks (``widedp.dp.layout.RowBlocks``).

Rank r of W owns block r of the input table and block r of the output table (``RowShard``: contiguous row blocks;
global rows [0, V) input, [V, 2V) output when untied, one table when tied). Every rank sees the whole Poisson batch;
its share of the work is the (sample, row) pairs of the rows it owns. One forward (3 all_reduces of [B, D] or
[B, 1 + K], whatever the vocabulary size)::

    h      = sum_ranks  (1/m) sum_{own context rows c} in[c]           all_reduce [B, D]
    score  = sum_ranks  out[o] . h   over own output rows o            all_reduce [B, 1 + K]
    dL/dh  = sum_ranks  s_o out[o]   over own output rows o            all_reduce [B, D]

then each rank forms the per-sample gradients of its own rows exactly as ``CBOW.per_sample_row_grads`` does (s_o h
for output rows, (1/m) dL/dh for context rows; duplicates summed), so the rows of all ranks together are the
single-process per-sample gradients (tested), and ``dp_step`` on ``RowBlocks`` clips each sample over all its shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from widedp.dp.layout import RowShard
from widedp.dp.rowgrads import PerSampleRows, coalesce
from widedp.models.cbow import CBOW, CBOWBatch
from widedp.models.rowinit import uniform_rows_


def cbow_shard(model: CBOW, rank: int, world: int) -> RowShard:
    """The ``RowShard`` of rank ``rank`` of ``world`` for ``model``'s row space (no dense rows)."""
    if model.vocab_size < world:
        raise ValueError(f"a vocabulary of {model.vocab_size} words cannot be sharded over {world} ranks")
    v = model.vocab_size
    return RowShard(rank, world, (0,) if model.tied else (0, v), (v,) if model.tied else (v, v), 0)


def own_blocks(model: CBOW, shard: RowShard) -> tuple[Tensor, Tensor | None]:
    """(input block, output block or None when tied) of ``shard`` for a meta-device ``model``, drawn as ``CBOW``
    draws its init (input rows ~ U(-a, a), a = init_scale / D; untied output rows zero) from ``model.deferred``'s
    generator, on its device."""
    init = model.deferred
    if init is None:
        raise ValueError("the model has no deferred initialisation (it was not built on the meta device)")
    lo, hi = shard.lo, shard.hi
    dtype = model.input.weight.dtype
    inp = uniform_rows_(torch.empty(hi[0] - lo[0], model.dim, dtype=dtype, device=init.device), first=lo[0],
                        num_rows=model.vocab_size, bound=model.init_scale / model.dim, generator=init.generator())
    out = None if model.tied else torch.zeros(hi[1] - lo[1], model.dim, dtype=dtype, device=init.device)
    return inp, out


class ShardedCBOW(nn.Module):
    """This rank's blocks of a ``CBOW``: copied from ``model``, or, for a model built on the meta device
    (``model.deferred``), drawn here: the one-process model's rows, bit for bit, without the whole table
    (``widedp.models.rowinit``). ``local_tables()`` are adjacent, for ``widedp.dp.optim`` row optimizers over local
    ids (``widedp.dp.layout.RowBlocks.local``)."""

    def __init__(self, model: CBOW, shard: RowShard) -> None:
        super().__init__()
        self.shard, self.vocab_size, self.tied, self.dim = shard, model.vocab_size, model.tied, model.dim
        lo, hi = shard.lo, shard.hi
        inp, out = own_blocks(model, shard) if model.deferred is not None else (
            model.input.weight.detach()[lo[0]:hi[0]].clone(),
            None if model.tied else model.output.weight.detach()[lo[1]:hi[1]].clone())
        self.input = nn.Parameter(inp)
        self.output = None if out is None else nn.Parameter(out)
        self.register_buffer("lo", torch.tensor(lo), persistent=False)
        self.register_buffer("hi", torch.tensor(hi), persistent=False)

    @property
    def num_rows(self) -> int:
        return self.shard.num_rows

    def local_tables(self) -> list[tuple[int, Tensor]]:
        out = [(0, self.input)]
        return out if self.output is None else [*out, (self.shard.own_sizes[0], self.output)]

    def table_keys(self) -> list[str]:
        """The ``CBOW`` state-dict key of each of ``local_tables()`` (a checkpoint names a block by its table)."""
        return ["input.weight"] if self.output is None else ["input.weight", "output.weight"]

    def _own(self, ids: Tensor, table: int) -> tuple[Tensor, Tensor]:
        """ids (any shape, -1 = padding) -> (own mask, local index clamped into the block)."""
        lo, hi = self.lo[table], self.hi[table]
        own = (ids >= lo) & (ids < hi)
        return own, (ids - lo).clamp(0, int(hi - lo) - 1)

    def _lookup(self, ids: Tensor, table: int) -> tuple[Tensor, Tensor]:
        """Rows of ``ids`` from this rank's block (zeros for rows it does not own) and the own mask."""
        weight = self.input if table == 0 or self.output is None else self.output
        own, local = self._own(ids, table)
        rows = weight.detach().index_select(0, local.reshape(-1)).view(*ids.shape, -1)
        return rows * own.unsqueeze(-1).to(rows.dtype), own

    @torch.no_grad()
    def _forward_parts(self, batch: CBOWBatch) -> tuple[Tensor, ...]:
        ctx = batch.context
        mask = ctx >= 0
        wts = mask.to(self.input.dtype) / mask.sum(1, keepdim=True).clamp_min(1)  # [B, C]: 1/m, 0 for padding
        emb, own_in = self._lookup(ctx.clamp_min(0), 0)
        h = (emb * wts.unsqueeze(2)).sum(1)
        out_ids = torch.cat([batch.target.unsqueeze(1), batch.negatives], 1)  # [B, L]
        e, own_out = self._lookup(out_ids, 0 if self.tied else 1)
        if len(batch):
            dist.all_reduce(h)
        scores = torch.bmm(h.unsqueeze(1), e.transpose(1, 2)).squeeze(1)  # own output rows only
        if len(batch):
            dist.all_reduce(scores)
        return ctx, mask, wts, own_in, h, out_ids, e, own_out, scores

    def forward(self, batch: CBOWBatch) -> Tensor:
        """[B] per-sample loss (the same on every rank)."""
        *_, scores = self._forward_parts(batch)
        return F.softplus(scores * _sign(scores)).sum(1)

    @torch.no_grad()
    def per_sample_row_grads(self, batch: CBOWBatch) -> tuple[Tensor, PerSampleRows]:
        """loss [B] (every rank) and the per-sample gradients of this rank's OWN rows (global ids, row space R)."""
        ctx, mask, wts, own_in, h, out_ids, e, own_out, scores = self._forward_parts(batch)
        B, L = out_ids.shape
        loss = F.softplus(scores * _sign(scores)).sum(1)
        s = torch.sigmoid(scores)
        s[:, 0] -= 1  # (s_t, s_n1, ..., s_nK)
        gh = torch.bmm(s.unsqueeze(1), e).squeeze(1)  # own output rows' part of dL/dh
        if B:
            dist.all_reduce(gh)
        shift = 0 if self.tied else self.vocab_size
        D = h.shape[1]
        ctx_keep = (mask & own_in).reshape(-1)
        out_keep = own_out.reshape(-1)
        values = torch.cat([(wts.unsqueeze(2) * gh.unsqueeze(1)).reshape(-1, D)[ctx_keep],
                            (s.unsqueeze(2) * h.unsqueeze(1)).reshape(-1, D)[out_keep]])
        rows = torch.cat([ctx.reshape(-1)[ctx_keep], out_ids.reshape(-1)[out_keep] + shift])
        sample = torch.cat([torch.arange(B, device=h.device).repeat_interleave(ctx.shape[1])[ctx_keep],
                            torch.arange(B, device=h.device).repeat_interleave(L)[out_keep]])
        return loss, coalesce(values, rows, sample, B, self.num_rows)


def _sign(scores: Tensor) -> Tensor:
    """[L] (-1, +1, ..., +1): -log sigma(x) = softplus(-x) for the target, softplus(x) for the negatives."""
    sign = torch.ones(scores.shape[1], dtype=scores.dtype, device=scores.device)
    sign[0] = -1
    return sign
