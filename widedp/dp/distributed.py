"""The recommender's DP step over several processes: tables row-sharded across ranks, plain torch.distributed.

Layout: every table is cut into ``world`` contiguous row blocks; rank r owns block r of each table (its "own rows",
enumerated table by table: the local row space [0, n_own)), and the dense (MLP) rows are replicated, their noise
drawn by rank 0. The batch (a Poisson sample drawn with the same seed everywhere) is the same on every rank.

Why plain collectives and not torchrec's sharding: torchrec 1.8's ``EmbeddingBagCollectionSharder`` offers no
row-wise sharding when the compute device is CPU (its planner raises "No available sharding type" for
``row_wise`` and allows only data_parallel / table_wise / column_wise there), and its sharded tables are fused TBE
kernels that expose no per-parameter gradients (torchrec #1614), while the DP step needs the pooled-output
gradients, per-row ownership for the selection and in-place updates of the local shards. So each rank keeps a
torchrec ``EmbeddingBagCollection`` of its own blocks (weighted SUM bags: weight 0 for rows it does not own, 1/|bag|
for MEAN) and the ranks talk through all_reduce / all_gather / broadcast (gloo on CPU, NCCL on CUDA).

One step (``ShardedRecsys.per_sample_rows`` then ``distributed_dp_step``):
1. partial pooled embeddings from own rows -> all_reduce(SUM): every rank has the full pooled [B, F, D];
2. the head (closed form, ``widedp.models.recsys.head_grads``) runs on every rank: identical loss, pooled
   gradients and per-sample MLP gradients everywhere (redundant MLP compute, no communication);
3. per-sample rows of OWN rows only; the MLP rows of samples [rB/W, (r+1)B/W) only (rank r of W: the MLP work is
   split by samples); each sample's norm (``widedp.dp.clipping.SampleNorms``: scale = all_reduce(MAX) of the parts'
   scales, sumsq = all_reduce(the parts)) is its FULL gradient's across shards, so the S1 clip, and the zeroing of
   a sample with a NaN or an inf in any shard, match the single process;
4. selection over the embedding rows. Exponential mechanism: each rank perturbs its own rows' scores with Gumbel
   keys from its own generator (its untouched rows through the order-statistics trick over its own rows), keeps
   its local top k, all_gathers the k candidates; the top k of the union is the top k of independent Gumbel keys
   on all rows, i.e. exactly the single-process Gumbel top-k law. Other mechanisms: the (touched, score) pairs
   are all_gathered and every rank runs the same selector with a generator seeded identically on all ranks (the
   same selection as a single process with that seed). Count and contribution scores are exact per shard (each
   row has one owner); a contribution's normaliser |rows_j| is all_reduced over the shards first;
5. the MLP rows' ĝ (each rank's samples' clipped sum) and Δ̂'s squared norm are all_reduced in one call; the S2
   clip uses that norm; each selected row's noise is drawn once, by its owner (rank 0 for the MLP rows, broadcast
   so the replicas stay equal); the spend is the single-process ``StepSpend``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from widedp.dp.clipping import SampleNorms, aggregate, clip_per_sample, restrict, sample_scale, sample_sumsq
from widedp.dp.noise import exponential, gaussian_noise, gumbel, noisy, sensitivity
from widedp.dp.optim import RowOptimizer
from widedp.dp.rowgrads import PerSampleRows, SparseRows, coalesce
from widedp.dp.selection import ExponentialSelector, SelectionContext, Selector, sample_distinct
from widedp.dp.selection.scores import sample_row_counts, selection_scores
from widedp.dp.spend import StepSpend
from widedp.dp.step import dp_step_spend
from widedp.models.recsys import RecsysBatch, RecsysModel, dense_layers, entry_grads, head_grads, head_logits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world_size: int, *, port: int, backend: str | None = None) -> None:
    """gloo on CPU, NCCL when CUDA is available (unless ``backend``), rendezvous on 127.0.0.1:port."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, rank=rank, world_size=world_size)


@dataclass(frozen=True)
class RowShard:
    """Rank ``rank`` of ``world`` owns rows [lo[t], hi[t]) of table t (global rows offsets[t] + r)."""

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

    def _tensors(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        t = torch.tensor([self.offsets, self.lo, self.own_sizes, self.own_offsets], device=device)
        return t[0], t[1], t[2], t[3]

    def is_own(self, rows: Tensor) -> Tensor:
        """[n] bool: global embedding row is owned by this rank."""
        off, lo, size, _ = self._tensors(rows.device)
        t = torch.searchsorted(off, rows, right=True) - 1
        r = rows - off.index_select(0, t) - lo.index_select(0, t)
        return (r >= 0) & (r < size.index_select(0, t))

    def to_local(self, rows: Tensor) -> Tensor:
        """Global ids of own rows (or dense rows >= R_emb) -> the local row space [0, n_own + A)."""
        off, lo, _, loc = self._tensors(rows.device)
        dense = rows >= self.num_rows
        t = torch.searchsorted(off, rows.clamp(max=self.num_rows - 1), right=True) - 1
        emb = rows - off.index_select(0, t) - lo.index_select(0, t) + loc.index_select(0, t)
        return torch.where(dense, rows - self.num_rows + self.num_own, emb)

    def own_to_global(self, local: Tensor) -> Tensor:
        """Local own-row ids [0, n_own) -> global ids."""
        off, lo, _, loc = self._tensors(local.device)
        t = torch.searchsorted(loc, local, right=True) - 1
        return local - loc.index_select(0, t) + off.index_select(0, t) + lo.index_select(0, t)


def shard_of(model: RecsysModel, rank: int, world: int) -> RowShard:
    if min(model.sizes) < world:
        raise ValueError(f"every table needs >= {world} rows to shard over {world} ranks, got {model.sizes}")
    return RowShard(rank, world, tuple(model.table_offsets), tuple(model.sizes), model.num_dense_rows)


class ShardedRecsys(nn.Module):
    """This rank's part of a ``RecsysModel``: its own row blocks in a weighted torchrec EBC, the dense rows
    replicated. ``local_tables()`` are adjacent (for ``widedp.dp.optim`` row optimizers over local ids)."""

    def __init__(self, model: RecsysModel, shard: RowShard) -> None:
        super().__init__()
        self.shard = shard
        self.features, self.dim, self.pooling = model.features, model.dim, model.pooling
        self.shapes = model.shapes
        dev = model.dense.device
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=self.dim, num_embeddings=n, feature_names=[f],
                                       pooling=PoolingType.SUM) for f, n in zip(self.features, shard.own_sizes)],
            is_weighted=True, device=dev)
        with torch.no_grad():
            for f, w, lo, hi in zip(self.features, model.tables(), shard.lo, shard.hi):
                self.ebc.embedding_bags[f"t_{f}"].weight.copy_(w[lo:hi])
        self.dense = nn.Parameter(model.dense.detach().clone())
        self.register_buffer("pairs", model.pairs, persistent=False)
        self.register_buffer("row_offsets", model.row_offsets, persistent=False)
        off, lo, size, _ = shard._tensors(dev)
        self.register_buffer("lo", lo, persistent=False)
        self.register_buffer("own_size", size, persistent=False)

    def local_tables(self) -> list[tuple[int, Tensor]]:
        tabs = [self.ebc.embedding_bags[f"t_{f}"].weight for f in self.features]
        return [*zip(self.shard.own_offsets, tabs), (self.shard.num_own, self.dense)]

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

    def forward(self, batch: RecsysBatch) -> Tensor:
        """[B] per-sample loss (same on every rank)."""
        logit = head_logits(self.pooled(batch.kjt), self.layers(), self.pairs)
        return torch.nn.functional.binary_cross_entropy_with_logits(logit, batch.labels, reduction="none")

    @torch.no_grad()
    def per_sample_rows(self, batch: RecsysBatch) -> tuple[Tensor, PerSampleRows, Tensor]:
        """loss [B]; per-sample gradients of OWN embedding rows (global ids, row space R_emb); MLP grads [B, A, D]."""
        B = len(batch)
        e = self.pooled(batch.kjt)
        loss, g_e, g_dense = head_grads(e, batch.labels, self.layers(), self.pairs)
        values, rows, sample = entry_grads(batch.kjt, g_e, self.row_offsets, mean=self.pooling == "mean")
        _, own, _ = self._own_entries(batch.kjt)
        own_idx = own.nonzero().squeeze(1)
        emb = coalesce(values.index_select(0, own_idx), rows.index_select(0, own_idx), sample.index_select(0, own_idx),
                       B, self.shard.num_rows)
        A = self.shard.num_dense_rows
        g_dense = torch.nn.functional.pad(g_dense, (0, A * self.dim - g_dense.shape[1])).view(B, A, self.dim)
        return loss, emb, g_dense


# ------------------------------------------------------------------------------------------------------- the step


@dataclass(frozen=True)
class DistStepResult:
    """grad: this rank's noisy update, global ids (own selected embedding rows, then the A dense rows);
    selected: [k + A] every selected global row (the same on every rank); spend: the single-process StepSpend."""

    grad: SparseRows
    selected: Tensor
    spend: StepSpend
    nonfinite: Tensor  # 0-dim: samples zeroed for a NaN or an inf (``widedp.dp.step.StepStats.nonfinite``)


def _all_gather_var(t: Tensor) -> Tensor:
    """Concatenation over ranks of 1-D/2-D tensors whose first dim differs by rank."""
    world = dist.get_world_size()
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    sizes_l = [int(s) for s in sizes]
    pad = t.new_zeros((max(sizes_l), *t.shape[1:]))
    pad[: t.shape[0]] = t
    out = [torch.zeros_like(pad) for _ in range(world)]
    dist.all_gather(out, pad)
    return torch.cat([o[:s] for o, s in zip(out, sizes_l)])


def sharded_gumbel_topk(touched: Tensor, logits: Tensor, shard: RowShard, *, k: int,
                        generator: torch.Generator) -> Tensor:
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
    dist.all_gather(all_keys, cand_keys)
    dist.all_gather(all_ids, cand_ids)
    return torch.cat(all_ids).index_select(0, torch.cat(all_keys).topk(k).indices)


def distributed_dp_step(local: PerSampleRows, g_dense: Tensor, shard: RowShard, *, batch_size: float,
                        sampling_rate: float, clip1: float, clip2: float | None, noise_multiplier: float,
                        selector: Selector, ctx: SelectionContext, generator: torch.Generator,
                        shared_generator: torch.Generator, noise: str = "gaussian") -> DistStepResult:
    """``widedp.dp.step.dp_step`` (with the dense rows always selected) over row-sharded tables (module docstring).

    Args:
        local: this rank's per-sample gradients of its own embedding rows (num_rows = R_emb).
        g_dense: [B, A, D] per-sample MLP gradients (identical on every rank).
        generator: this rank's own (Gumbel keys of own rows, noise of own rows; rank 0: MLP noise).
        shared_generator: seeded identically on every rank (data-independent and gathered selections).
        noise: ``gaussian`` | ``secure`` (``widedp.dp.noise.snapped_release`` on each rank's own rows and, on rank 0,
            the MLP rows, broadcast; one grid for the whole release: d = (selected + MLP rows)·D, as in one process).
    """
    R, A, D = shard.num_rows, shard.num_dense_rows, g_dense.shape[2]
    B, dev = g_dense.shape[0], g_dense.device
    # The MLP rows are the same on every rank: rank r takes samples [lo, hi) of them (one flat row per sample)
    # into the norms and the clipped sum, so each sample's MLP part is counted once and the work is split.
    lo, hi = B * shard.rank // shard.world, B * (shard.rank + 1) // shard.world
    dense = PerSampleRows(g_dense[lo:hi].reshape(hi - lo, A * D), torch.zeros(hi - lo, dtype=torch.long, device=dev),
                          torch.arange(hi - lo + 1, device=dev), 1)
    scale = sample_scale(local)  # [B]; +inf: a non-finite entry
    if A:
        scale[lo:hi] = torch.maximum(scale[lo:hi], sample_scale(dense))
    dist.all_reduce(scale, op=dist.ReduceOp.MAX)
    sumsq = sample_sumsq(local, scale)  # [B] own parts
    if A:
        sumsq[lo:hi] += sample_sumsq(dense, scale[lo:hi])
    dist.all_reduce(sumsq)
    norms = SampleNorms(scale, sumsq)
    clipped, clip = clip_per_sample(local, clip1=clip1, norms=norms)
    touched, ghat = aggregate(clipped, batch_size=batch_size)
    ghat_dense = g_dense.new_zeros(A, D)  # this rank's samples' part until the all_reduce below
    if A:
        mine = clip_per_sample(dense, clip1=clip1, norms=SampleNorms(scale[lo:hi], sumsq[lo:hi]))[0]
        ghat_dense = mine.values.sum(0).view(A, D) / batch_size

    kind = selector.score_kind
    sample_rows = None
    if kind == "contribution":  # each sample's distinct rows over every shard
        sample_rows = sample_row_counts(local, touched)
        dist.all_reduce(sample_rows)
    scores, score_sens = selection_scores(kind, local, touched, ghat, score_clip=selector.score_clip, clip1=clip1,
                                          batch_size=batch_size, sample_rows=sample_rows)
    if isinstance(selector, ExponentialSelector):
        sel = sharded_gumbel_topk(touched, scores * selector.key_scale(score_sens), shard, k=selector.k,
                                  generator=generator)
    else:
        all_touched = _all_gather_var(touched)
        all_scores = _all_gather_var(scores) if kind != "none" else scores
        order = torch.argsort(all_touched)
        all_touched = all_touched.index_select(0, order)
        if kind != "none":
            all_scores = all_scores.index_select(0, order)
        sel = selector.select(all_touched, all_scores, selectable_rows=R, score_sensitivity=score_sens, ctx=ctx,
                              generator=shared_generator)
    own_sel = sel.index_select(0, shard.is_own(sel).nonzero().squeeze(1))
    delta, _ = restrict(touched, ghat, own_sel)
    parts = torch.cat([delta.square().sum().reshape(1).to(ghat_dense.dtype), ghat_dense.reshape(-1)])
    dist.all_reduce(parts)  # Δ̂'s squared norm over the shards, and the MLP rows' ĝ over the samples
    sq2, ghat_dense = parts[:1], parts[1:].view(A, D)
    d2 = sensitivity(clip1=clip1, clip2=clip2, batch_size=batch_size)
    if clip2 is not None:
        f2 = ((sq2 + ghat_dense.square().sum()).sqrt() / clip2).clamp_(min=1.0).reciprocal_()
        delta, ghat_dense = delta * f2, ghat_dense * f2
    std, dim = noise_multiplier * d2, (sel.numel() + A) * D  # dim: every coordinate the step releases
    delta = noisy(delta, std=std, sensitivity=d2, noise=noise, generator=generator, released_dim=dim)
    dense = _noisy_dense(ghat_dense, std=std, sensitivity=d2, noise=noise, generator=generator, rank=shard.rank,
                         released_dim=dim, dtype=delta.dtype)
    dense_ids = torch.arange(R, R + A, device=sel.device)
    grad = SparseRows(torch.cat([own_sel, dense_ids]), torch.cat([delta, dense]), R + A)
    spend = dp_step_spend(selector, sampling_rate=sampling_rate, noise_multiplier=noise_multiplier, clip1=clip1,
                          clip2=clip2, batch_size=batch_size, noise=noise)
    return DistStepResult(grad, torch.cat([sel, dense_ids]), spend, clip.nonfinite.sum())


def _noisy_dense(ghat_dense: Tensor, *, std: float, sensitivity: float, noise: str, generator: torch.Generator,
                 rank: int, released_dim: int, dtype: torch.dtype) -> Tensor:
    """[A, D] the MLP rows' released values, equal on every rank: ``gaussian``: ĝ + rank 0's noise (``dtype``),
    broadcast (the replicas' ĝ are equal); ``secure``: rank 0's ``snapped_release`` of ĝ, broadcast."""
    if noise == "secure":
        out = torch.zeros_like(ghat_dense)
        if rank == 0:
            out = noisy(ghat_dense, std=std, sensitivity=sensitivity, noise=noise, generator=generator,
                        released_dim=released_dim)
        dist.broadcast(out, src=0)
        return out
    dense_noise = torch.zeros_like(ghat_dense, dtype=dtype)
    if rank == 0:
        dense_noise = gaussian_noise(ghat_dense.shape, std=std, generator=generator, device=ghat_dense.device,
                                     dtype=dtype)
    dist.broadcast(dense_noise, src=0)
    return ghat_dense + dense_noise


def apply_update(model: ShardedRecsys, optimizer: RowOptimizer, grad: SparseRows) -> None:
    """Apply this rank's update (global ids) through a row optimizer over ``model.local_tables()``."""
    optimizer.step(SparseRows(model.shard.to_local(grad.rows), grad.values, model.shard.num_own + grad.num_rows
                              - model.shard.num_rows))
