"""CBOW with negative sampling, and its closed-form per-sample row gradients.

For a sample (target t, context words c_1..c_m, negatives n_1..n_K)::

    h    = (1/m) * sum_j  in[c_j]                      mean of the context INPUT rows (-1 padding skipped)
    loss = -log sigma(out[t] . h) - sum_i log sigma(-out[n_i] . h)

(the standard word2vec CBOW negative-sampling loss; the paper's l(w_t, w_c, N) with h in place of e_c). With
``tied=True`` ``in`` and ``out`` are the same V x D table (the paper's model); otherwise two tables, and the row space
seen by DP code is [0, V) for input rows and [V, 2V) for output rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from widedp import native
from widedp.dp.rowgrads import PerSampleRows
from widedp.models.rowinit import Deferred


@dataclass(frozen=True)
class CBOWBatch:
    """A batch of B samples.

    Args:
        target: [B] int64 target word ids.
        context: [B, C] int64 context word ids, -1 = padding (pair samples: C = 1, no padding).
        negatives: [B, K] int64 negative word ids.
    """

    target: Tensor
    context: Tensor
    negatives: Tensor

    def to(self, device: torch.device | str) -> CBOWBatch:
        return CBOWBatch(
            target=self.target.to(device, non_blocking=True),
            context=self.context.to(device, non_blocking=True),
            negatives=self.negatives.to(device, non_blocking=True),
        )

    def __len__(self) -> int:
        return self.target.shape[0]


class CBOW(nn.Module):
    """CBOW with negative sampling.

    Tables: ``self.input`` is an ``nn.EmbeddingBag(V, D, mode="mean")`` (context rows); ``self.output`` is an
    ``nn.Embedding(V, D)`` (target and negative rows), or ``None`` when tied (output rows are ``self.input.weight``).

    Init (word2vec convention, scaled): input rows ~ U(-a, a) with a = init_scale / D (init_scale = 0.5 gives
    word2vec's U(-0.5/D, 0.5/D)); untied output rows are zeros. Tied, the single table is the uniform one — zeros
    would freeze it (every gradient is a multiple of h or of output rows). Small uniform rows train fine tied: the
    first updates are tiny with SGD (gradients are O(a)), Adam rescales them, and either breaks the symmetry.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        *,
        tied: bool = True,
        sparse: bool = True,
        init_scale: float = 0.5,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.dim = dim
        self.tied = tied
        self.sparse = sparse
        self.init_scale = init_scale
        #: built on the meta device for several processes: how each rank draws its own rows (``ShardedCBOW``)
        self.deferred: Deferred | None = None
        self.input = nn.EmbeddingBag(vocab_size, dim, mode="mean", sparse=sparse)
        self.output = None if tied else nn.Embedding(vocab_size, dim, sparse=sparse)
        self._const_cache: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}
        a = init_scale / dim
        with torch.no_grad():
            self.input.weight.uniform_(-a, a, generator=generator)
            if self.output is not None:
                self.output.weight.zero_()

    @property
    def num_rows(self) -> int:
        """Size of the row space: V if tied else 2V (input rows [0, V), output rows [V, 2V))."""
        return self.vocab_size if self.tied else 2 * self.vocab_size

    @property
    def out_weight(self) -> Tensor:
        """[V, D] the output table (the input table when tied)."""
        return self.input.weight if self.output is None else self.output.weight

    def row_tables(self) -> list[tuple[int, Tensor]]:
        """[(global row offset, weight [n, D])]: one entry when tied, two when untied."""
        if self.output is None:
            return [(0, self.input.weight)]
        return [(0, self.input.weight), (self.vocab_size, self.output.weight)]

    # ------------------------------------------------------------------------------------------------ autograd

    def _context_mean(self, context: Tensor) -> Tensor:
        """[B, C] (-1 pad) -> h [B, D] with autograd (sparse gradients when ``sparse``)."""
        if context.shape[1] == 1:
            return self.input(context)
        # mode="mean" cannot skip -1 entries; a "sum" bag weighted by mask / count is the same mean (0 if empty).
        mask = context >= 0
        w = mask.to(self.input.weight.dtype) / mask.sum(1, keepdim=True).clamp_min(1)
        return F.embedding_bag(
            context.clamp_min(0), self.input.weight, mode="sum", per_sample_weights=w, sparse=self.sparse
        )

    def forward(self, batch: CBOWBatch) -> Tensor:
        """[B] per-sample loss -log sigma(out[t].h) - sum_i log sigma(-out[n_i].h) (see the module docstring)."""
        h = self._context_mean(batch.context)
        idx = torch.cat([batch.target.unsqueeze(1), batch.negatives], 1)  # [B, 1 + K]
        e = F.embedding(idx, self.out_weight, sparse=self.sparse)  # [B, 1 + K, D]
        scores = torch.bmm(h.unsqueeze(1), e.transpose(1, 2)).squeeze(1)  # [B, 1 + K]
        _, sign, _ = self._constants(batch.context.shape[1], idx.shape[1], h)
        return F.softplus(scores * sign).sum(1)  # -log sigma(x) = softplus(-x); sign = (-1, +1, ..., +1)

    def log_prob(self, context: Tensor) -> Tensor:
        """context [B, C] (-1 pad) -> [B, V] log Pr(w | context) = log_softmax(h @ out^T)."""
        h = self._context_mean(context)
        return torch.log_softmax(h @ self.out_weight.t(), dim=1)

    # --------------------------------------------------------------------------------------------- closed form

    def per_sample_row_grads(self, batch: CBOWBatch, *, fused: bool | None = None) -> tuple[Tensor, PerSampleRows]:
        """Per-sample loss [B] and gradients over the row space, in closed form (no autograd).

        With s_t = sigma(out[t].h) - 1 and s_n = sigma(out[n].h): d/d out[t] = s_t h, d/d out[n] = s_n h,
        d/dh = s_t out[t] + sum_n s_n out[n], and each of the m context rows gets (1/m) d/dh. Duplicate rows of a
        sample (repeated negatives or context ids; a negative equal to a context word when tied) are summed. Run
        it under ``torch.inference_mode()`` for speed; the returned tensors do not require grad. A NaN or an inf in
        a row a sample uses stays in that sample's loss and gradients (every op is per sample); ``dp_step`` zeroes
        such a sample.

        ``fused``: the whole computation as one native CPU call (``widedp.native.cbow_row_grads``; None: when
        available; False: these PyTorch ops, the reference): the same rows and offsets, values within 1e-6.

        Returns:
            loss [B]; PerSampleRows with rows sorted by (sample, row), unique within each sample.
        """
        w_in = self.input.weight.detach()
        w_out = w_in if self.output is None else self.output.weight.detach()
        ctx = batch.context
        B, C = ctx.shape
        D = w_in.shape[1]
        R = self.num_rows
        if native.use(fused, w_in, w_out, ctx):
            out_ids = torch.cat([batch.target.unsqueeze(1), batch.negatives], 1)
            loss, values, rows, offsets = native.cbow_row_grads(w_in, w_out, ctx, out_ids, num_rows=R,
                                                                out_shift=R - self.vocab_size)
            return loss, PerSampleRows(values=values, rows=rows, offsets=offsets, num_rows=R)
        out_ids = torch.cat([batch.target.unsqueeze(1), batch.negatives], 1)  # [B, L], L = 1 + K
        L = out_ids.shape[1]
        onehot, sign, shift = self._constants(C, L, w_in)
        e = w_out.index_select(0, out_ids.view(-1)).view(B, L, D)  # [B, L, D]
        if C == 1:
            ctx_ids = ctx
            h = w_in.index_select(0, ctx.reshape(-1))  # [B, D]
        else:
            mask = ctx >= 0
            wts = mask.to(w_in.dtype) / mask.sum(1, keepdim=True).clamp_min(1)  # [B, C] 1/m, 0 for padding
            h = F.embedding_bag(ctx.clamp_min(0), w_in, mode="sum", per_sample_weights=wts)
            # padding gets a zero gradient on the sample's target output row: it merges away in the coalesce
            ctx_ids = torch.where(mask, ctx, out_ids[:, :1] + (R - self.vocab_size))
        scores = torch.bmm(h.unsqueeze(1), e.transpose(1, 2)).squeeze(1)  # [B, L]; 4x faster than bmm(e, h)
        loss = F.softplus(scores * sign).sum(1)  # sign = (-1, +1, ..., +1)
        s = torch.sigmoid(scores).sub_(onehot)  # (s_t, s_n1, ..., s_nK)
        gh = torch.bmm(s.unsqueeze(1), e)  # [B, 1, D] dloss/dh
        ctx_vals = gh if C == 1 else wts.unsqueeze(2) * gh  # [B, C, D]
        values = torch.cat([ctx_vals, s.unsqueeze(2) * h.unsqueeze(1)], 1).view(-1, D)  # [B (C + L), D]
        # coalesce (as widedp.dp.rowgrads.coalesce, fewer ops): unique (sample, global row) keys, sorted
        bounds = torch.arange(0, (B + 1) * R, R, device=ctx.device)  # sample j owns keys [j R, (j + 1) R)
        keys = (torch.cat([ctx_ids, out_ids], 1) + shift).add_(bounds[:B].unsqueeze(1)).view(-1)
        uniq, inv = torch.unique(keys, return_inverse=True)
        summed = values.new_zeros(uniq.shape[0], D).index_add_(0, inv, values)
        offsets = torch.searchsorted(uniq, bounds)
        return loss, PerSampleRows(values=summed, rows=uniq.remainder(R), offsets=offsets, num_rows=R)

    def _constants(self, C: int, L: int, like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Cached (onehot [L], sign [L], global row shift [C + L]) for a sample shape: saves ~20 us a call."""
        key = (C, L, like.dtype, like.device)
        found = self._const_cache.get(key)
        if found is None:
            with torch.inference_mode(False):  # usable outside inference mode too
                onehot = torch.zeros(L, dtype=like.dtype, device=like.device)
                onehot[0] = 1
                shift = torch.zeros(C + L, dtype=torch.long, device=like.device)
                shift[C:] = self.num_rows - self.vocab_size  # output rows live at V + id when untied
                found = (onehot, 1 - 2 * onehot, shift)
            self._const_cache[key] = found
        return found
