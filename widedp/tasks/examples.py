"""A user's model and data as ``task: module`` names them (``configs/module_example.yaml``): a tiny recommender on
synthetic interactions, written as any PyTorch user would write it.

    data.factory:  widedp.tasks.examples:interactions     -> (train, valid, test) lists of items
    data.collate:  widedp.tasks.examples:collate          -> items -> {"user", "items", "offsets", "label"}
    model.factory: widedp.tasks.examples:BagRecommender   -> nn.Embedding (users) + nn.EmbeddingBag (the item bag)
    model.loss:    widedp.tasks.examples:bce_loss         -> [B] per-sample BCE
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def interactions(*, num_users: int = 50, num_items: int = 100, num_interactions: int = 20000, bag: int = 3,
                 dim: int = 4, seed: int = 0, splits: tuple[float, float] = (0.8, 0.1)) -> tuple[list, list, list]:
    """Synthetic interactions: each item ``{"user": u, "items": [i, ...] (1 to ``bag`` items, popular ones more
    often), "label": 0. | 1.}``, label ~ Bernoulli(sigmoid(mean_i (b_i + <p_u, q_i> / sqrt(dim)))) for hidden item
    biases b and factors p, q; split train / valid / test."""
    g = torch.Generator().manual_seed(seed)
    p, q = torch.randn(num_users, dim, generator=g), torch.randn(num_items, dim, generator=g)
    bias = 2 * torch.randn(num_items, generator=g)
    n = num_interactions
    users = torch.randint(num_users, (n,), generator=g)
    sizes = torch.randint(1, bag + 1, (n,), generator=g)
    pop = torch.arange(1, num_items + 1, dtype=torch.float64).pow(-0.8)  # a few popular items, a long tail
    items = torch.multinomial(pop, n * bag, replacement=True, generator=g).view(n, bag)
    mask = (torch.arange(bag) < sizes.unsqueeze(1)).to(p.dtype)  # [n, bag]: the first sizes[j] items are the bag
    mean_bias = (bias[items] * mask).sum(1) / sizes
    mean_q = (q[items] * mask.unsqueeze(2)).sum(1) / sizes.unsqueeze(1)
    logit = mean_bias + (p[users] * mean_q).sum(1) / dim**0.5
    label = (torch.rand(n, generator=g) < torch.sigmoid(logit)).tolist()
    out = [{"user": u, "items": it[:k], "label": float(y)}
           for u, it, k, y in zip(users.tolist(), items.tolist(), sizes.tolist(), label)]
    a, b = int(splits[0] * n), int((splits[0] + splits[1]) * n)
    return out[:a], out[a:b], out[b:]


def collate(items: list[dict[str, Any]]) -> dict[str, Tensor]:
    """Items -> a batch: users [B], the bags' items flat [N] with their ``offsets`` [B], labels [B]."""
    lengths = torch.tensor([len(it["items"]) for it in items])
    return {"user": torch.tensor([it["user"] for it in items]),
            "items": torch.tensor([i for it in items for i in it["items"]], dtype=torch.long),
            "offsets": torch.cumsum(lengths, 0) - lengths,
            "label": torch.tensor([it["label"] for it in items])}


class BagRecommender(nn.Module):
    """A user row and the mean of the item rows, concatenated, through a small MLP: one logit per sample."""

    def __init__(self, *, num_users: int = 50, num_items: int = 100, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.users = nn.Embedding(num_users, dim)
        self.items = nn.EmbeddingBag(num_items, dim, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        with torch.no_grad():
            self.users.weight.mul_(0.1)
            self.items.weight.mul_(0.1)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        h = torch.cat([self.users(batch["user"]), self.items(batch["items"], batch["offsets"])], 1)
        return self.mlp(h).squeeze(1)


def bce_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """[B] per-sample binary cross-entropy (reduction="none": the DP step clips each sample's gradient)."""
    return F.binary_cross_entropy_with_logits(model(batch), batch["label"], reduction="none")
