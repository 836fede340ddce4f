"""A ``RecsysModel`` with its tables in row blocks across torch.distributed ranks (``widedp.dp.layout.RowBlocks``).

Every table is cut into ``world`` contiguous row blocks; rank r owns block r of each table (its "own rows",
enumerated table by table: the local row space [0, n_own)), and the dense (MLP) rows are replicated. The batch (a
Poisson sample drawn with the same seed everywhere) is the same on every rank.

Why plain collectives and not torchrec's sharding: torchrec 1.8's ``EmbeddingBagCollectionSharder`` offers no
row-wise sharding when the compute device is CPU (its planner raises "No available sharding type" for
``row_wise`` and allows only data_parallel / table_wise / column_wise there), and its sharded tables are fused TBE
kernels that expose no per-parameter gradients (torchrec #1614), while the DP step needs the pooled-output
gradients, per-row ownership for the selection and in-place updates of the local shards. So each rank keeps a
torchrec ``EmbeddingBagCollection`` of its own blocks (weighted SUM bags: weight 0 for rows it does not own, 1/|bag|
for MEAN) and the ranks talk through all_reduce (gloo on CPU, NCCL on CUDA).

Per-sample gradients (``ShardedRecsys.per_sample_row_grads``, then ``widedp.dp.step.dp_step`` on ``RowBlocks``):
1. partial pooled embeddings from own rows -> all_reduce(SUM): every rank has the full pooled [B, F, D];
2. the head (closed form, ``widedp.models.recsys.head_grads``) runs on every rank: identical loss, pooled
   gradients and per-sample MLP gradients everywhere (redundant MLP compute, no communication);
3. per-sample rows of OWN embedding rows, then every sample's MLP rows (``RowBlocks`` takes each rank's share of
   the samples of those into the norms and ĝ).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from widedp.dp.layout import RowShard
from widedp.dp.rowgrads import PerSampleRowsWithDense, coalesce
from widedp.models.recsys import (
    RecsysBatch,
    RecsysModel,
    binary_metrics,
    dense_layers,
    entry_grads,
    head_grads,
    head_logits,
    init_dense_,
    with_dense_rows,
)
from widedp.models.rowinit import uniform_rows_


def shard_of(model: RecsysModel, rank: int, world: int) -> RowShard:
    """The ``RowShard`` of rank ``rank`` of ``world`` for ``model``'s tables (its MLP rows replicated)."""
    if min(model.sizes) < world:
        raise ValueError(f"every table needs >= {world} rows to shard over {world} ranks, got {model.sizes}")
    return RowShard(rank, world, tuple(model.table_offsets), tuple(model.sizes), model.num_dense_rows)


def draw_own_rows(model: RecsysModel, shard: RowShard, blocks: Sequence[Tensor]) -> Tensor:
    """Fill ``blocks`` (this rank's block of each table, in table order) with the rows a meta-device ``model`` would
    hold, drawn as ``RecsysModel`` draws its init from ``model.deferred``'s generator (every table's rows ~
    U(-init_scale, init_scale), then the MLP); returns the MLP's rows [A, D] on the deferred device."""
    init = model.deferred
    if init is None:
        raise ValueError("the model has no deferred initialisation (it was not built on the meta device)")
    gen = init.generator()
    for block, n, lo in zip(blocks, model.sizes, shard.lo):
        uniform_rows_(block.data, first=lo, num_rows=n, bound=model.init_scale, generator=gen)
    dense = torch.zeros(model.num_dense_rows, model.dim, dtype=model.dense.dtype)
    return init_dense_(dense, model.shapes, generator=gen).to(init.device)


class ShardedRecsys(nn.Module):
    """This rank's part of a ``RecsysModel``: its own row blocks in a weighted torchrec EBC (copied from ``model``,
    or, for a model built on the meta device, ``model.deferred``, drawn here by ``draw_own_rows``: the one-process
    model's rows, bit for bit, without the whole table), the dense rows replicated. ``local_tables()`` are adjacent
    (for ``widedp.dp.optim`` row optimizers over local ids)."""

    def __init__(self, model: RecsysModel, shard: RowShard) -> None:
        super().__init__()
        self.shard = shard
        self.features, self.dim, self.pooling = model.features, model.dim, model.pooling
        self.shapes = model.shapes
        deferred = model.deferred
        dev = model.dense.device if deferred is None else deferred.device
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=self.dim, num_embeddings=n, feature_names=[f],
                                       pooling=PoolingType.SUM) for f, n in zip(self.features, shard.own_sizes)],
            is_weighted=True, device=dev)
        blocks = [self.ebc.embedding_bags[f"t_{f}"].weight for f in self.features]
        if deferred is None:
            with torch.no_grad():
                for block, w, lo, hi in zip(blocks, model.tables(), shard.lo, shard.hi):
                    block.copy_(w[lo:hi])
            dense = model.dense.detach().clone()
        else:
            dense = draw_own_rows(model, shard, blocks)
        self.dense = nn.Parameter(dense)
        nf = len(self.features)
        self.register_buffer("pairs", None if model.pairs is None else torch.triu_indices(nf, nf, 1, device=dev),
                             persistent=False)
        self.register_buffer("row_offsets", torch.tensor(model.table_offsets, device=dev), persistent=False)
        off, lo, size, _ = shard.tensors(dev)
        self.register_buffer("lo", lo, persistent=False)
        self.register_buffer("own_size", size, persistent=False)

    def local_tables(self) -> list[tuple[int, Tensor]]:
        tabs = [self.ebc.embedding_bags[f"t_{f}"].weight for f in self.features]
        return [*zip(self.shard.own_offsets, tabs), (self.shard.num_own, self.dense)]

    def table_keys(self) -> list[str]:
        """The ``RecsysModel`` state-dict key of each of ``local_tables()`` (a checkpoint names a block by its
        table)."""
        return [*(f"ebc.embedding_bags.t_{f}.weight" for f in self.features), "dense"]

    def layers(self) -> list[tuple[Tensor, Tensor]]:
        return dense_layers(self.dense.detach().view(-1), self.shapes)

    def _own_entries(self, kjt: KeyedJaggedTensor) -> tuple[Tensor, Tensor, Tensor]:
        """Per KJT entry: local id in its table's own block (clamped), own mask, segment (feature·B + sample)."""
        lengths, values = kjt.lengths(), kjt.values()
        B, Fn = kjt.stride(), len(self.features)
        seg = torch.repeat_interleave(torch.arange(Fn * B, device=values.device), lengths, output_size=values.numel())
        feat = torch.div(seg, B, rounding_mode="floor")
        size = self.own_size.index_select(0, feat)
        local = values - self.lo.index_select(0, feat)
        own = (local >= 0) & (local < size)
        return torch.minimum(local.clamp_min(0), size - 1), own, seg

    @torch.no_grad()
    def pooled(self, kjt: KeyedJaggedTensor) -> Tensor:
        """[B, F, D] full pooled embeddings: own partial sums, all_reduced."""
        if kjt.stride() == 0:  # the same (empty) batch on every rank: no collective needed
            return self.dense.new_zeros(0, len(self.features), self.dim)
        local, own, seg = self._own_entries(kjt)
        w = own.to(self.dense.dtype)
        if self.pooling == "mean":
            w = w * kjt.lengths().clamp_min(1).to(w.dtype).reciprocal().index_select(0, seg)
        lkjt = KeyedJaggedTensor(keys=kjt.keys(), values=local, weights=w.float(), lengths=kjt.lengths(),
                                 stride=kjt.stride(), length_per_key=kjt.length_per_key(),
                                 offset_per_key=kjt.offset_per_key())
        part = self.ebc(lkjt).values().view(-1, len(self.features), self.dim).to(self.dense.dtype)
        dist.all_reduce(part)
        return part

    def logits(self, batch: RecsysBatch, *, zero_features: Sequence[str] = ()) -> Tensor:
        """[B] logits (the same on every rank; a collective), as ``RecsysModel.logits``."""
        e = self.pooled(batch.kjt)
        if zero_features:
            keep = torch.tensor([f not in zero_features for f in self.features], dtype=e.dtype, device=e.device)
            e = e * keep.view(1, -1, 1)
        return head_logits(e, self.layers(), self.pairs)

    def forward(self, batch: RecsysBatch) -> Tensor:
        """[B] per-sample loss (same on every rank)."""
        return F.binary_cross_entropy_with_logits(self.logits(batch), batch.labels, reduction="none")

    @torch.inference_mode()
    def eval_metrics(self, split: Any, *, batch_size: int, max_samples: int = 0, zero_features: Sequence[str] = ()
                     ) -> dict[str, float]:
        """``RecsysModel.eval_metrics`` on every rank at once (a collective): the task's final metrics of the
        sharded model, no table gathered."""
        n = len(split) if not max_samples else min(max_samples, len(split))
        logits, labels = [], []
        for start in range(0, n, batch_size):
            b = split.batch(torch.arange(start, min(n, start + batch_size), device=self.dense.device))
            logits.append(self.logits(b, zero_features=zero_features).cpu())
            labels.append(b.labels.cpu())
        if not logits:
            return binary_metrics(torch.zeros(0), torch.zeros(0))
        return binary_metrics(torch.cat(logits), torch.cat(labels))

    @torch.no_grad()
    def per_sample_row_grads(self, batch: RecsysBatch) -> tuple[Tensor, PerSampleRowsWithDense]:
        """loss [B] (the same on every rank) and the per-sample gradients of this rank's OWN embedding rows then
        every sample's A MLP rows (global ids, row space R_emb + A, ``always_rows`` A: the replicated rows that
        ``widedp.dp.layout.RowBlocks`` splits by samples), as ``RecsysModel.per_sample_row_grads`` lays them out."""
        B = len(batch)
        e = self.pooled(batch.kjt)
        loss, g_e, g_dense = head_grads(e, batch.labels, self.layers(), self.pairs)
        values, rows, sample = entry_grads(batch.kjt, g_e, self.row_offsets, mean=self.pooling == "mean")
        _, own, _ = self._own_entries(batch.kjt)
        own_idx = own.nonzero().squeeze(1)
        R = self.shard.num_rows
        emb = coalesce(values.index_select(0, own_idx), rows.index_select(0, own_idx), sample.index_select(0, own_idx),
                       B, R)
        A = self.shard.num_dense_rows
        g_dense = F.pad(g_dense, (0, A * self.dim - g_dense.shape[1])).view(B, A, self.dim)
        return loss, with_dense_rows(emb, g_dense, first_row=R, num_rows=R + A)
