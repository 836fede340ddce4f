"""Small user-style models, datasets and a brute-force per-sample gradient for the ``widedp.api`` tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# a GPU image without torchrec (scripts/gpu_check.sh): the nn.Embedding* toys still work
with contextlib.suppress(ImportError):
    from torchrec import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        KeyedJaggedTensor,
        PoolingType,
    )

# ----------------------------------------------------------------------------------------------------- torchrec

FEATURES = {"user": 7, "item": 9, "tags": 5}


class TorchrecMLP(nn.Module):
    """EBC (user dim 4, item dim 3, tags dim 4: a narrower table) + a 2-layer MLP -> one logit per sample."""

    def __init__(self, pooling: PoolingType | None = None, weighted: bool = False) -> None:
        super().__init__()
        pooling = PoolingType.MEAN if pooling is None else pooling
        dims = {"user": 4, "item": 3, "tags": 4}
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dims[f], num_embeddings=n, feature_names=[f],
                               pooling=pooling) for f, n in FEATURES.items()], is_weighted=weighted)
        self.mlp = nn.Sequential(nn.Linear(sum(dims.values()), 6), nn.ReLU(), nn.Linear(6, 1))

    def forward(self, kjt: KeyedJaggedTensor) -> Tensor:
        return self.mlp(self.ebc(kjt).values()).squeeze(1)


def interactions(n: int, *, seed: int = 0, tags: int = 3) -> list[dict[str, Any]]:
    """n items {"user": [1], "item": [1], "tags": [tags] (repeats likely), "w": [tags] weights, "label"}."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        u, i = int(torch.randint(FEATURES["user"], (1,), generator=g)), int(torch.randint(9, (1,), generator=g))
        t = torch.randint(FEATURES["tags"], (tags,), generator=g).tolist()
        out.append({"user": [u], "item": [i], "tags": t, "w": torch.rand(tags, generator=g).tolist(),
                    "label": float((u + i) % 2)})
    return out


def collate_kjt(items: Sequence[dict[str, Any]]) -> tuple[KeyedJaggedTensor, Tensor]:
    """Items -> (KJT with keys user, item, tags (weights: 1 for user/item, "w" for tags), labels [B])."""
    keys = list(FEATURES)
    values = torch.tensor([v for f in keys for it in items for v in it[f]], dtype=torch.long)
    lengths = torch.tensor([len(it[f]) for f in keys for it in items], dtype=torch.long)
    weights = torch.tensor([w for f in keys for it in items for w in (it["w"] if f == "tags" else [1.0] * len(it[f]))])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths, weights=weights)
    return kjt, torch.tensor([it["label"] for it in items])


def bce_loss(model: nn.Module) -> Callable[[Any], Tensor]:
    return lambda b: F.binary_cross_entropy_with_logits(model(b[0]), b[1], reduction="none")


class CollectionModel(nn.Module):
    """torchrec EmbeddingCollection (per-id embeddings) summed per sample and feature, then a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name=f"t_{f}", embedding_dim=3, num_embeddings=n, feature_names=[f])
            for f, n in FEATURES.items()])
        self.out = nn.Linear(3 * len(FEATURES), 1)

    def forward(self, kjt: KeyedJaggedTensor) -> Tensor:
        jts = self.ec(kjt)
        pooled = [jts[f].to_padded_dense(desired_length=3).square().sum(1) for f in FEATURES]  # [B, 3] each
        return self.out(torch.cat(pooled, 1)).squeeze(1)


class _Head(nn.Module):
    """The built-in recommender's MLP as a user's leaf module over the same parameter (per-sample grads: torch.func)."""

    def __init__(self, rm) -> None:
        super().__init__()
        self.dense, self.shapes = rm.dense, rm.shapes
        self.register_buffer("pairs", rm.pairs)

    def forward(self, e):
        from widedp.models.recsys import dense_layers, head_logits

        return head_logits(e, dense_layers(self.dense.view(-1), self.shapes), self.pairs)


class GenericRecsys(nn.Module):
    """The built-in ``RecsysModel``'s very tensors (its EBC and dense rows) behind a plain user forward."""

    def __init__(self, rm) -> None:
        super().__init__()
        self.ebc, self.head, self.shape = rm.ebc, _Head(rm), (len(rm.features), rm.dim)

    def forward(self, kjt):
        return self.head(self.ebc(kjt).values().view(-1, *self.shape))


# ----------------------------------------------------------------------------------------------- plain nn tables


class BagModel(nn.Module):
    """nn.EmbeddingBag (mean, or sum with per_sample_weights) + Linear head; 2-D ids or 1-D ids with offsets."""

    def __init__(self, mode: str = "mean", padding_idx: int | None = None) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(11, 4, mode=mode, padding_idx=padding_idx)
        self.head = nn.Linear(4, 3)

    def forward(self, ids: Tensor, offsets: Tensor | None = None, psw: Tensor | None = None) -> Tensor:
        return self.head(torch.tanh(self.bag(ids, offsets, per_sample_weights=psw)))


class SequenceModel(nn.Module):
    """nn.Embedding over [B, T] token ids (padding 0) + positions, LayerNorm (torch.func), per-position Linear
    (3-D input), mean over time, Linear classifier."""

    def __init__(self, vocab: int = 13, dim: int = 4, classes: int = 3, length: int = 5) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=0)
        self.pos = nn.Embedding(length, dim)
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, 6)
        self.out = nn.Linear(6, classes)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.tok(ids)
        x += self.pos(torch.arange(ids.shape[1]).expand_as(ids))  # an in-place op on a lookup's output
        return self.out(torch.relu(self.mix(self.norm(x))).mean(1))


def token_data(n: int, *, seed: int = 0, length: int = 5, vocab: int = 13) -> list[tuple[Tensor, int]]:
    """(ids [T] with repeats and trailing padding 0, label = a function of the ids)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, vocab, (length,), generator=g)
        ids[int(torch.randint(3, length + 1, (1,), generator=g)):] = 0
        out.append((ids, int(ids[0]) % 3))
    return out


# -------------------------------------------------------------------------------------------------- brute force


def brute_force(ref: nn.Module, layout: Any, items: Sequence[Any], collate: Callable[[list[Any]], Any],
                loss: Callable[[nn.Module, Any], Tensor]) -> Tensor:
    """[B, R, D]: each item's gradient (plain autograd on ``ref``, a copy of the model made before make_private,
    one sample at a time) laid out as ``layout`` (tables at their offsets, zero-padded to D; dense parameters
    flattened into the last A rows)."""
    out = torch.zeros(len(items), layout.num_rows, layout.dim, dtype=torch.float64)
    for j, it in enumerate(items):
        ref.zero_grad(set_to_none=True)
        lj = loss(ref, collate([it]))
        assert lj.shape == (1,)
        lj.sum().backward()
        for t in layout.tables:
            w = ref.get_submodule(t.name).weight
            if w.grad is not None:
                out[j, t.offset : t.offset + t.num_rows, : t.dim] = w.grad.to_dense().double()
        flat = [ref.get_parameter(n).grad for n, _ in layout.dense]
        flat = torch.cat([torch.zeros(p.numel()) if g is None else g.reshape(-1).double()
                          for g, (_, p) in zip(flat, layout.dense)])
        out[j, layout.table_rows :] = F.pad(flat, (0, layout.always_rows * layout.dim - flat.numel())).view(
            layout.always_rows, layout.dim)
    return out
