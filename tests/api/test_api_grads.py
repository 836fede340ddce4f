"""widedp.api: per-sample row gradients of users' models from one backward pass equal brute-force autograd (one
sample at a time), the generic path equals the built-in recommender's closed form, and bad ids / unsupported models
stop with a clear error."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from api_toys import (
    BagModel,
    CollectionModel,
    GenericRecsys,
    SequenceModel,
    TorchrecMLP,
    bce_loss,
    brute_force,
    collate_kjt,
    interactions,
    token_data,
)
from torch import nn
from torch.utils.data import DataLoader
from torchrec import PoolingType

from widedp.api import IdOutOfRangeError, PrivacyEngine, UnsupportedModelError

SEL = {"name": "exponential", "k": 3, "epsilon": 0.5, "score_clip": 0.1}


def private(model: nn.Module, data, collate, *, batch_size: int = 4) -> PrivacyEngine:
    eng = PrivacyEngine(selection=SEL, clip1=1.0, clip2=None, noise_multiplier=1.0)
    eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader(data, batch_size=batch_size, collate_fn=collate), epochs=1)
    return eng


def check_rows(g, layout) -> None:
    """Rows unique and sorted within each sample; every sample's A dense rows last."""
    a = layout.always_rows
    for j in range(g.batch_size):
        r = g.rows[g.offsets[j] : g.offsets[j + 1]]
        assert torch.all(r[1:] > r[:-1])
        assert torch.equal(r[-a:], torch.arange(layout.table_rows, layout.num_rows))


# ------------------------------------------------------------------------------------------ (a) torchrec EBC + MLP


@pytest.mark.parametrize("pooling,weighted", [(PoolingType.MEAN, False), (PoolingType.SUM, True)])
def test_torchrec_ebc_mlp_equals_brute_force(pooling, weighted):
    torch.manual_seed(0)
    model = TorchrecMLP(pooling, weighted)
    ref = copy.deepcopy(model)
    data = interactions(40)
    items = data[:8]
    assert any(len(set(it["tags"])) < 3 for it in items), "want a bag with a repeated tag"
    eng = private(model, data, collate_kjt)
    assert [t.name for t in eng.layout.tables] == ["ebc.embedding_bags.t_user", "ebc.embedding_bags.t_item",
                                                   "ebc.embedding_bags.t_tags"]
    assert eng.layout.dim == 4 and eng.layout.table_rows == 21
    loss, g = eng.per_sample_grads(collate_kjt(items), bce_loss(model))
    check_rows(g, eng.layout)
    expected = brute_force(ref, eng.layout, items, collate_kjt, lambda m, b: bce_loss(m)(b))
    torch.testing.assert_close(g.to_dense().double(), expected, rtol=1e-5, atol=1e-6)
    assert expected[:, :21].abs().amax() > 1e-3 and loss.shape == (8,)
    assert all(t.weight.requires_grad and t.weight.grad is None for t in eng.layout.tables)


def test_torchrec_embedding_collection_equals_brute_force():
    torch.manual_seed(1)
    model = CollectionModel()
    ref = copy.deepcopy(model)
    data = interactions(20, seed=3)
    eng = private(model, data, collate_kjt)
    loss, g = eng.per_sample_grads(collate_kjt(data[:6]), bce_loss(model))
    expected = brute_force(ref, eng.layout, data[:6], collate_kjt, lambda m, b: bce_loss(m)(b))
    torch.testing.assert_close(g.to_dense().double(), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- (b) nn.EmbeddingBag with repeated ids


def bag_items(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 11, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g),
             torch.rand(4, generator=g), int(torch.randint(3, (1,), generator=g))) for _ in range(n)]


def as_2d(items):  # fixed-length bags: the first 3 ids of each (repeated ids on purpose)
    ids = torch.stack([torch.cat([it[0], it[0], it[0]])[:3] for it in items])
    return {"ids": ids}, torch.tensor([it[2] for it in items])


def as_offsets(items, *, weighted: bool = False):
    ids = torch.cat([it[0] for it in items])
    offsets = torch.tensor([0] + [len(it[0]) for it in items[:-1]]).cumsum(0)
    x = {"ids": ids, "offsets": offsets}
    if weighted:
        x["psw"] = torch.cat([it[1][: len(it[0])] for it in items]).double()
    return x, torch.tensor([it[2] for it in items])


@pytest.mark.parametrize("mode,collate,padding", [
    ("mean", as_2d, None), ("mean", as_offsets, None), ("mean", as_offsets, 3),
    ("sum", lambda items: as_offsets(items, weighted=True), None), ("sum", as_2d, 5)])
def test_embedding_bag_equals_brute_force(mode, collate, padding):
    torch.manual_seed(2)
    model = BagModel(mode, padding).double()
    ref = copy.deepcopy(model)
    items = bag_items(30)
    items[0] = (torch.tensor([3, 3, 7]), items[0][1], 1)  # a repeated id (and the padding id 3 when padded)

    def loss(m, b):
        return F.cross_entropy(m(**b[0]), b[1], reduction="none")

    eng = private(model, items, collate)
    _, g = eng.per_sample_grads(collate(items[:7]), lambda b: loss(model, b))
    check_rows(g, eng.layout)
    torch.testing.assert_close(g.to_dense(), brute_force(ref, eng.layout, items[:7], collate, loss))


# ------------------------------------------------------------------------------------- (c) nn.Embedding sequences


def collate_tokens(items):
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


def seq_loss(m, b):
    return F.cross_entropy(m(b[0]), b[1], reduction="none")


def test_sequence_model_equals_brute_force():
    torch.manual_seed(3)
    model = SequenceModel().double()
    ref = copy.deepcopy(model)
    data = token_data(30)
    eng = private(model, data, collate_tokens)
    assert [t.name for t in eng.layout.tables] == ["tok", "pos"]
    assert [n for n, _ in eng.layout.dense] == ["norm.weight", "norm.bias", "mix.weight", "mix.bias", "out.weight",
                                                "out.bias"]
    _, g = eng.per_sample_grads(collate_tokens(data[:6]), lambda b: seq_loss(model, b))
    expected = brute_force(ref, eng.layout, data[:6], collate_tokens, seq_loss)
    torch.testing.assert_close(g.to_dense(), expected)
    assert expected[:, 0].abs().max() == 0  # the padding row gets no gradient


# ------------------------------------------------------------------------------- generic path == built-in fast path


@pytest.mark.parametrize("pooling", ["mean", "sum"])
def test_generic_path_equals_recsys_fast_path(pooling):
    from widedp.config.recsys import RecsysDataConfig
    from widedp.data_prep.interactions import RecsysSplit, prepare_interactions
    from widedp.models.recsys import RecsysModel

    data = prepare_interactions(RecsysDataConfig(num_users=7, num_items=9, num_interactions=300, num_tags=5,
                                                 tags_per_item=3, context_cardinality=4, cache_dir=""))
    split = RecsysSplit(data.train, "cpu")
    rm = RecsysModel(data.cardinality, dim=4, hidden=(5, 3), pooling=pooling, init_scale=0.5,
                     generator=torch.Generator().manual_seed(0))
    model = GenericRecsys(rm)
    eng = private(model, range(len(split)), lambda i: split.batch(torch.tensor(i)))
    assert eng.layout.table_rows == rm.num_rows and eng.layout.always_rows == rm.num_dense_rows
    batch = split.batch(torch.arange(16))
    with torch.inference_mode():
        fast_loss, fast = rm.per_sample_row_grads(batch)
    loss, g = eng.per_sample_grads(batch, lambda b: F.binary_cross_entropy_with_logits(model(b.kjt), b.labels,
                                                                                         reduction="none"))
    torch.testing.assert_close(loss, fast_loss)
    assert torch.equal(g.rows, fast.rows) and torch.equal(g.offsets, fast.offsets) and g.num_rows == fast.num_rows
    torch.testing.assert_close(g.values, fast.values, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------- clear errors


def test_ids_out_of_range_are_a_clear_error():
    model = TorchrecMLP()
    data = interactions(10)
    eng = private(model, data, collate_kjt)
    bad = copy.deepcopy(data[:3])
    bad[1]["item"] = [9]  # the second table has 9 rows: id 9 would be dropped silently or crash elsewhere
    with pytest.raises(IdOutOfRangeError, match=r"ebc.embedding_bags.t_item: id 9 .* 9 rows \[0, 9\)"):
        eng.per_sample_grads(collate_kjt(bad), bce_loss(model))
    with torch.no_grad(), pytest.raises(IdOutOfRangeError):  # also outside training (evaluation)
        model(collate_kjt(bad)[0])
    seq = SequenceModel()
    eng = private(seq, token_data(10), collate_tokens)
    with pytest.raises(IdOutOfRangeError, match="tok: id -1"):
        seq(torch.tensor([[1, -1, 2, 0, 0]]))
    bag = BagModel()
    eng = private(bag, bag_items(10), as_offsets)
    with pytest.raises(IdOutOfRangeError, match="bag: id 11"):
        bag(torch.tensor([1, 11]), torch.tensor([0, 1]))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 3)
        self.proj = nn.Linear(3, 3)

    def forward(self, ids):
        return self.proj(self.emb(ids)) @ self.emb.weight.t()  # reads the table outside its lookup


def test_unsupported_models_are_refused_clearly():
    data = token_data(8, vocab=6)
    with pytest.raises(UnsupportedModelError, match="batch normalisation"):
        private(nn.Sequential(nn.Embedding(5, 3), nn.BatchNorm1d(3)), data, collate_tokens)
    with pytest.raises(UnsupportedModelError, match="no trainable nn.Embedding"):
        private(nn.Sequential(nn.Linear(3, 3)), data, collate_tokens)

    class Composite(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.w = nn.Embedding(6, 3), nn.Parameter(torch.zeros(3))

        def forward(self, ids):
            return (self.emb(ids) * self.w).sum((1, 2))

    with pytest.raises(UnsupportedModelError, match=r"has parameters of its own and trainable sub-modules \['emb'\]"):
        private(Composite(), data, collate_tokens)
    tied = _Tied()
    eng = private(tied, data, collate_tokens)
    with pytest.raises(UnsupportedModelError, match="emb: the table's weight was read outside its lookup"):
        eng.per_sample_grads(collate_tokens(data[:2]), lambda b: tied(b[0]).sum((1, 2)))
    with pytest.raises(ValueError, match=r"\[B\] per-sample losses"):
        eng.per_sample_grads(collate_tokens(data[:2]), lambda b: tied.emb(b[0]).sum())
    emb, proj = nn.Embedding(6, 3), nn.Linear(3, 3)
    eng = private(nn.Sequential(emb, proj), data, collate_tokens)
    # a weight read outside its module, a loss term that is not per sample: caught by the sum check
    for wrong, param in [(lambda b: (proj(emb(b[0])) @ proj.weight).sum((1, 2)), "1.weight"),
                         (lambda b: proj(emb(b[0])).sum((1, 2)) + proj.bias.square().sum(), "1.bias")]:
        with pytest.raises(UnsupportedModelError, match=f"{param}: its per-sample gradients do not add up"):
            eng.per_sample_grads(collate_tokens(data[:3]), wrong)
