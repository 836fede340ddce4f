"""DLRM-style recommender on a torchrec ``EmbeddingBagCollection``, with closed-form per-sample row gradients.

Features f = 1..F (``user``, ``item``, then extra categorical features), one table each, rows of dim D::

    e_f   = pool_{r in bag_f} W_f[r]                     SUM or MEAN pooling of the sample's bag (torchrec EBC)
    x0    = [e_1, ..., e_F, <e_f, e_g> for f < g]        concatenation + DLRM's pairwise dot-product interaction
    x_l+1 = relu(A_l x_l + c_l), logit = A_L x_L + c_L   the top MLP (``hidden`` sizes)
    loss  = BCE(sigmoid(logit), y) = softplus(logit) - y·logit

Row space seen by the DP step: table t's row r is global row ``offset[t] + r`` (tables in feature order), then the
MLP's parameters, flattened and cut into A = ceil(P / D) rows of width D, at [R_emb, R_emb + A). The MLP's weights
ARE those rows: ``self.dense`` [A, D] is the only dense parameter and the layers are views of it, so a row optimizer
updating ``row_tables()`` in place updates the MLP. ``num_rows`` is R_emb (the rows a selection mechanism ranges
over); every sample touches all A dense rows, and ``per_sample_row_grads`` returns a ``PerSampleRowsWithDense``
with ``always_rows = A``, which ``widedp.dp.step.dp_step`` selects every step besides the mechanism's picks
(data-independent: no selection budget; still clipped at S1 with the sample's embedding rows, and noised).

Per-sample gradients (fused / TBE tables expose no per-parameter grads, torchrec #1614): the gradient w.r.t. each
sample's pooled embeddings and the MLP is closed-form backprop through the head (no autograd, no host sync besides
the ``torch.unique`` of the coalesce); each looked-up row of a bag gets the bag's pooled gradient (times 1/|bag| for
MEAN), duplicate rows of a sample are summed (``widedp.dp.rowgrads.coalesce``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from widedp.dp.rowgrads import PerSampleRows, PerSampleRowsWithDense, coalesce
from widedp.models.rowinit import Deferred

Layers = list[tuple[Tensor, Tensor]]


class _FxTracingNotice(logging.Filter):
    """Drops torch's one notice "is_fx_tracing will return true for both fx.symbolic_trace and torch.export ...":
    torch.fx's ``ProxyableClassMeta.__call__`` (the metaclass of torchrec's KeyedJaggedTensor) calls the deprecated
    ``is_fx_tracing()`` on every KJT built, which logs it once per process. Nothing here traces; every other record
    of that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("is_fx_tracing will return true")


logging.getLogger("torch.fx._symbolic_trace").addFilter(_FxTracingNotice())


@dataclass(frozen=True)
class RecsysBatch:
    """kjt: one key per feature, in table order; labels: [B] float32 in {0, 1}."""

    kjt: KeyedJaggedTensor
    labels: Tensor

    def __len__(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device | str) -> RecsysBatch:
        return RecsysBatch(self.kjt.to(torch.device(device), non_blocking=True),
                           self.labels.to(device, non_blocking=True))


def make_kjt(names: Sequence[str], ids: Sequence[Tensor], weights: Tensor | None = None) -> KeyedJaggedTensor:
    """KJT of fixed-length bags: ids[f] [B, L_f] int64 -> key-major values, lengths L_f; no host sync (the
    per-key lengths are known from the shapes)."""
    B = ids[0].shape[0]
    dev = ids[0].device
    values = torch.cat([i.reshape(-1) for i in ids])
    lengths = torch.cat([torch.full((B,), i.shape[1], dtype=torch.long, device=dev) for i in ids])
    per_key = [B * i.shape[1] for i in ids]
    offsets = [0]
    for n in per_key:
        offsets.append(offsets[-1] + n)
    return KeyedJaggedTensor(keys=list(names), values=values, weights=weights, lengths=lengths, stride=B,
                             length_per_key=per_key, offset_per_key=offsets)


# ----------------------------------------------------------------------------------------------- the dense head


def layer_shapes(num_features: int, dim: int, hidden: Sequence[int], interaction: bool) -> list[tuple[int, int]]:
    """[(out, in)] of the top MLP's layers."""
    d_in = num_features * dim + (num_features * (num_features - 1) // 2 if interaction else 0)
    sizes = [d_in, *hidden, 1]
    return [(sizes[i + 1], sizes[i]) for i in range(len(sizes) - 1)]


def dense_layers(flat: Tensor, shapes: Sequence[tuple[int, int]]) -> Layers:
    """Views (A_l [out, in], c_l [out]) into the flat parameter vector (layer by layer: weight then bias)."""
    out, at = [], 0
    for o, i in shapes:
        out.append((flat[at : at + o * i].view(o, i), flat[at + o * i : at + o * i + o]))
        at += o * i + o
    return out


@torch.no_grad()
def init_dense_(dense: Tensor, shapes: Sequence[tuple[int, int]], *, generator: torch.Generator | None) -> Tensor:
    """The MLP's init in place over ``dense`` [A, D] (``dense_layers``' layout): each layer's weight then its bias
    ~ U(±1/sqrt(fan_in)), ``nn.Linear``'s default bounds; the padding stays as it is. Returns ``dense``."""
    for w, c in dense_layers(dense.view(-1), shapes):
        bound = 1.0 / math.sqrt(w.shape[1])
        w.uniform_(-bound, bound, generator=generator)
        c.uniform_(-bound, bound, generator=generator)
    return dense


def _features(e: Tensor, pairs: Tensor | None) -> Tensor:
    """e [B, F, D] -> x0 [B, F·D (+ F(F-1)/2)]."""
    x = e.flatten(1)
    if pairs is None:
        return x
    return torch.cat([x, (e.index_select(1, pairs[0]) * e.index_select(1, pairs[1])).sum(-1)], 1)


def head_logits(e: Tensor, layers: Layers, pairs: Tensor | None) -> Tensor:
    """[B] logits from the pooled embeddings e [B, F, D] (autograd-friendly)."""
    x = _features(e, pairs)
    for li, (w, c) in enumerate(layers):
        x = torch.addmm(c, x, w.t())
        if li < len(layers) - 1:
            x = x.relu()
    return x.squeeze(1)


def head_grads(e: Tensor, labels: Tensor, layers: Layers, pairs: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Closed-form per-sample BCE loss and gradients.

    Returns:
        loss [B]; g_e [B, F, D] d loss_j / d e_j; g_dense [B, P] d loss_j / d (flat MLP parameters).
    """
    B, Fn, D = e.shape
    xs = [_features(e, pairs)]
    for w, c in layers[:-1]:
        xs.append(torch.addmm(c, xs[-1], w.t()).relu_())
    w_last, c_last = layers[-1]
    logit = torch.addmm(c_last, xs[-1], w_last.t()).squeeze(1)
    loss = F.softplus(logit) - labels * logit
    g = (torch.sigmoid(logit) - labels).unsqueeze(1)  # [B, 1] d loss / d logit
    parts: list[Tensor] = []
    for li in range(len(layers) - 1, -1, -1):
        w, _ = layers[li]
        x = xs[li]
        parts.append(g)  # bias
        parts.append((g.unsqueeze(2) * x.unsqueeze(1)).flatten(1))  # weight: outer product [B, out·in]
        g = g @ w
        if li > 0:
            g = g * (x > 0)
    g_dense = torch.cat(parts[::-1], 1)  # weight, bias of layer 0, then layer 1, ...
    g_e = g[:, : Fn * D].reshape(B, Fn, D).clone()
    if pairs is not None:
        gp = g[:, Fn * D :].unsqueeze(2)  # [B, F(F-1)/2, 1]
        g_e.index_add_(1, pairs[0], gp * e.index_select(1, pairs[1]))
        g_e.index_add_(1, pairs[1], gp * e.index_select(1, pairs[0]))
    return loss, g_e, g_dense


def entry_grads(kjt: KeyedJaggedTensor, g_e: Tensor, row_offsets: Tensor, *, mean: bool
                ) -> tuple[Tensor, Tensor, Tensor]:
    """Scatter each bag's pooled gradient to the entries of the bag (no host sync).

    Args:
        kjt: keys in table order, stride B; g_e [B, F, D]; row_offsets [F] global row offset of each table.

    Returns:
        values [N, D] (the bag's gradient, / |bag| for MEAN), global rows [N], sample [N] of every KJT entry.
    """
    B, Fn, D = g_e.shape
    lengths = kjt.lengths()
    n = kjt.values().numel()
    seg = torch.repeat_interleave(torch.arange(Fn * B, device=lengths.device), lengths, output_size=n)
    feat = torch.div(seg, B, rounding_mode="floor")
    sample = seg - feat * B
    values = g_e.reshape(B * Fn, D).index_select(0, sample * Fn + feat)
    if mean:
        values = values * lengths.clamp_min(1).to(values.dtype).reciprocal().index_select(0, seg).unsqueeze(1)
    return values, kjt.values() + row_offsets.index_select(0, feat), sample


def with_dense_rows(emb: PerSampleRows, g_dense: Tensor, *, first_row: int, num_rows: int
                    ) -> PerSampleRowsWithDense:
    """Append every sample's A dense rows ([first_row, first_row + A), values g_dense [B, A, D]) after its
    embedding rows; the result has ``always_rows = A`` and rows still sorted within each sample."""
    B, A, D = g_dense.shape
    nnz = emb.values.shape[0]
    dev = emb.values.device
    ar = torch.arange(B + 1, device=dev) * A
    offsets = emb.offsets + ar
    lengths = emb.offsets.diff()
    pos_emb = torch.arange(nnz, device=dev) + torch.repeat_interleave(ar[:B], lengths, output_size=nnz)
    pos_dense = (offsets[1:] - A).unsqueeze(1) + torch.arange(A, device=dev)  # [B, A]
    values = emb.values.new_empty(nnz + B * A, D)
    values.index_copy_(0, pos_emb, emb.values).index_copy_(0, pos_dense.view(-1), g_dense.reshape(B * A, D))
    rows = emb.rows.new_empty(nnz + B * A)
    dense_ids = torch.arange(first_row, first_row + A, device=dev).expand(B, A).reshape(-1)
    rows.index_copy_(0, pos_emb, emb.rows).index_copy_(0, pos_dense.view(-1), dense_ids)
    return PerSampleRowsWithDense(values=values, rows=rows, offsets=offsets, num_rows=num_rows, always_rows=A)


# -------------------------------------------------------------------------------------------------- the metrics


def exact_auc(scores: Tensor, labels: Tensor) -> float:
    """ROC AUC = P(score of a random positive > that of a random negative) + 1/2 P(tie), exactly (Mann–Whitney U
    with mid-ranks for ties); NaN when a class is absent."""
    s = scores.detach().double().flatten()
    y = labels.detach().flatten() > 0.5
    n_pos = int(y.sum())
    n_neg = y.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inv, counts = torch.unique(s, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mid = ends - (counts.double() - 1) / 2  # 1-based average rank of each distinct score
    rank_sum = mid.index_select(0, inv)[y].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def binary_metrics(logits: Tensor, labels: Tensor) -> dict[str, float]:
    """``bce``: mean BCE (nats); ``auc``: ``exact_auc``; ``ne``: normalised entropy = bce / H(p), p the evaluated
    examples' positive rate (He et al. 2014; torchrec.metrics.ne's definition): < 1 beats predicting the base
    rate, NaN when p is 0 or 1."""
    z = logits.detach().double().flatten()
    y = labels.detach().double().flatten()
    if z.numel() == 0:
        return {"bce": float("nan"), "auc": float("nan"), "ne": float("nan")}
    bce = float(F.binary_cross_entropy_with_logits(z, y, reduction="mean"))
    p = float(y.mean())
    h = -(p * math.log(p) + (1 - p) * math.log(1 - p)) if 0 < p < 1 else float("nan")
    return {"bce": bce, "auc": exact_auc(z, y), "ne": bce / h}


# ---------------------------------------------------------------------------------------------------- the model


class RecsysModel(nn.Module):
    """The recommender of the module docstring.

    Args:
        cardinality: feature name -> table size, in table order (``user``, ``item``, ...).
        dim: D. hidden: MLP hidden sizes. pooling: ``sum`` | ``mean``. interaction: DLRM dot products.
        sparse: sparse table gradients under autograd (non-private SGD). init_scale: rows ~ U(-a, a).
        generator: init randomness (on ``device``); the MLP as ``nn.Linear``'s default U(±1/sqrt(fan_in)).
    """

    def __init__(self, cardinality: dict[str, int], *, dim: int, hidden: Sequence[int] = (32, 16),
                 pooling: str = "mean", interaction: bool = True, sparse: bool = False, init_scale: float = 0.05,
                 generator: torch.Generator | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.features = list(cardinality)
        self.sizes = [int(cardinality[f]) for f in self.features]
        self.dim, self.pooling, self.sparse = dim, pooling, sparse
        pool = PoolingType.MEAN if pooling == "mean" else PoolingType.SUM
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=n, feature_names=[f],
                                       pooling=pool) for f, n in zip(self.features, self.sizes)],
            device=device)
        offs = [0]
        for n in self.sizes:
            offs.append(offs[-1] + n)
        self.table_offsets = offs[:-1]
        self.num_rows = offs[-1]  # R_emb: the rows selection ranges over
        self.shapes = layer_shapes(len(self.features), dim, hidden, interaction)
        self.num_dense_params = sum(o * i + o for o, i in self.shapes)
        self.num_dense_rows = math.ceil(self.num_dense_params / dim)
        self.dense = nn.Parameter(torch.zeros(self.num_dense_rows, dim, device=device))
        nf = len(self.features)
        pairs = torch.triu_indices(nf, nf, 1, device=device) if interaction and nf > 1 else None
        self.register_buffer("pairs", pairs, persistent=False)
        self.register_buffer("row_offsets", torch.tensor(self.table_offsets, device=device), persistent=False)
        self.init_scale = init_scale
        #: built on the meta device for several processes: how each rank draws its own rows (``ShardedRecsys``)
        self.deferred: Deferred | None = None
        with torch.no_grad():
            for bag in self.ebc.embedding_bags.values():
                bag.sparse = sparse
                bag.weight.uniform_(-init_scale, init_scale, generator=generator)
        init_dense_(self.dense, self.shapes, generator=generator)

    @property
    def total_rows(self) -> int:
        """R_emb + A: the row space of ``row_tables()`` and of the per-sample gradients."""
        return self.num_rows + self.num_dense_rows

    def tables(self) -> list[Tensor]:
        """The EBC's table weights [n_t, D] in feature order (the tensors its lookups read)."""
        return [self.ebc.embedding_bags[f"t_{f}"].weight for f in self.features]

    def row_tables(self) -> list[tuple[int, Tensor]]:
        """[(global row offset, weight [n, D])]: every table, then the dense rows at R_emb."""
        return [*zip(self.table_offsets, self.tables()), (self.num_rows, self.dense)]

    def layers(self) -> Layers:
        return dense_layers(self.dense.view(-1), self.shapes)

    def pooled(self, kjt: KeyedJaggedTensor) -> Tensor:
        """[B, F, D] pooled embeddings (torchrec EBC lookup)."""
        if list(kjt.keys()) != self.features:
            raise ValueError(f"batch keys {kjt.keys()} != model features {self.features}")
        if kjt.stride() == 0:  # an empty Poisson batch: torchrec's KJT split fails on stride 0
            return self.dense.new_zeros(0, len(self.features), self.dim)
        # the EBC returns float32 whatever the tables' dtype: cast back (float64 models in tests)
        return self.ebc(kjt).values().view(-1, len(self.features), self.dim).to(self.dense.dtype)

    def logits(self, batch: RecsysBatch, *, zero_features: Sequence[str] = ()) -> Tensor:
        """[B] logits; ``zero_features``: features whose pooled embeddings are taken as zero (what a holder of the
        other tables alone can compute, e.g. a release without the user table)."""
        e = self.pooled(batch.kjt)
        if zero_features:
            keep = torch.tensor([f not in zero_features for f in self.features], dtype=e.dtype, device=e.device)
            e = e * keep.view(1, -1, 1)
        return head_logits(e, self.layers(), self.pairs)

    def forward(self, batch: RecsysBatch) -> Tensor:
        """[B] per-sample BCE loss."""
        return F.binary_cross_entropy_with_logits(self.logits(batch), batch.labels, reduction="none")

    @torch.inference_mode()
    def eval_metrics(self, split: Any, *, batch_size: int, max_samples: int = 0, zero_features: Sequence[str] = ()
                     ) -> dict[str, float]:
        """``binary_metrics`` (bce, auc, ne) over a split (``len()``, ``batch(idx)``) or its first ``max_samples``;
        ``zero_features`` as in ``logits``."""
        n = len(split) if not max_samples else min(max_samples, len(split))
        logits, labels = [], []
        for start in range(0, n, batch_size):
            b = split.batch(torch.arange(start, min(n, start + batch_size), device=self.dense.device))
            logits.append(self.logits(b, zero_features=zero_features).cpu())
            labels.append(b.labels.cpu())
        if not logits:
            return binary_metrics(torch.zeros(0), torch.zeros(0))
        return binary_metrics(torch.cat(logits), torch.cat(labels))

    def per_sample_row_grads(self, batch: RecsysBatch) -> tuple[Tensor, PerSampleRowsWithDense]:
        """Per-sample loss [B] and gradients over the row space (closed form; run under inference mode).

        Returns rows sorted by (sample, row), unique within a sample, every sample's A dense rows last. A NaN or an
        inf a sample looks up (a table row, the MLP) stays in that sample's loss and gradients: every op here is
        per sample, and ``dp_step`` zeroes such a sample.
        """
        B = len(batch)
        e = self.pooled(batch.kjt).detach()
        loss, g_e, g_dense = head_grads(e, batch.labels, [(w.detach(), c.detach()) for w, c in self.layers()],
                                        self.pairs)
        values, rows, sample = entry_grads(batch.kjt, g_e, self.row_offsets, mean=self.pooling == "mean")
        emb = coalesce(values, rows, sample, B, self.num_rows)
        A, D = self.num_dense_rows, self.dim
        g_dense = F.pad(g_dense, (0, A * D - self.num_dense_params)).view(B, A, D)
        return loss, with_dense_rows(emb, g_dense, first_row=self.num_rows, num_rows=self.total_rows)
