"""The CBOW of ``widedp.models.cbow`` built only from layers Opacus 1.6 handles correctly: the DP-SGD baseline.

Opacus computes wrong per-sample gradients for ``nn.EmbeddingBag`` (a repeated index inside one bag gives ~20% too
small gradients, ``mode='max'`` gives zeros, 2-D input fails), so this model uses ``nn.Embedding`` only: the context
mean is a masked mean of the embedded padded ``[B, C]`` context. Tied, ONE ``nn.Embedding`` call looks up context,
target and negative rows together (Opacus' per-sample gradient of ``nn.Embedding`` sums repeated indices with
``scatter_add``, so a row that appears as context and as negative gets the sum, as in ``CBOW``).

The parameter names (``input.weight``, ``output.weight`` when untied) equal ``CBOW``'s, so a ``state_dict`` of one
loads into the other: checkpoints, evaluation and export are shared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from widedp.models.cbow import CBOW


class OpacusCBOW(nn.Module):
    """CBOW with negative sampling on ``nn.Embedding`` tables; ``forward`` returns the per-sample loss [B].

    Same loss as ``CBOW.forward``: h = mean of the non-padding context input rows (0 when all are padding),
    loss = -log sigma(out[t] . h) - sum_i log sigma(-out[n_i] . h).
    """

    def __init__(self, vocab_size: int, dim: int, *, tied: bool = True) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.dim = dim
        self.tied = tied
        self.input = nn.Embedding(vocab_size, dim)
        self.output = None if tied else nn.Embedding(vocab_size, dim)

    @classmethod
    def from_cbow(cls, model: CBOW) -> OpacusCBOW:
        """A copy of ``model``'s weights (same init as a widedp run with the same seed)."""
        out = cls(model.vocab_size, model.dim, tied=model.tied)
        out.load_state_dict({k: v.detach().to_dense() for k, v in model.state_dict().items()})
        return out.to(model.input.weight.device)

    def forward(self, target: Tensor, context: Tensor, negatives: Tensor) -> Tensor:
        """target [B], context [B, C] (-1 pad), negatives [B, K] -> per-sample loss [B]."""
        C = context.shape[1]
        ctx = context.clamp_min(0)
        out_ids = torch.cat([target.unsqueeze(1), negatives], 1)  # [B, L]
        if self.output is None:
            e_all = self.input(torch.cat([ctx, out_ids], 1))  # [B, C + L, D], one call: one activation for Opacus
            e_ctx, e_out = e_all[:, :C], e_all[:, C:]
        else:
            e_ctx, e_out = self.input(ctx), self.output(out_ids)
        mask = (context >= 0).to(e_ctx.dtype)  # [B, C]; padding rows are multiplied by 0: no gradient reaches them
        h = (e_ctx * mask.unsqueeze(2)).sum(1) / mask.sum(1, keepdim=True).clamp_min(1)  # [B, D]
        scores = (e_out * h.unsqueeze(1)).sum(2)  # [B, L]
        return F.softplus(scores).sum(1) - scores[:, 0]


class PerSampleLoss(nn.Module):
    """A "criterion" for Opacus' ghost clipping: the model already returns per-sample losses [B].

    ``DPLossFastGradientClipping`` sets ``reduction`` to ``none`` to get them, then reduces them itself.
    """

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = reduction

    def forward(self, loss: Tensor, _target: Tensor | None = None) -> Tensor:
        if self.reduction == "none":
            return loss
        return loss.sum() if self.reduction == "sum" else loss.mean()
