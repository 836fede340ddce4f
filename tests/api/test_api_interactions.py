"""widedp.api refuses what one backward cannot split into per-sample gradients: samples that interact (a batch
statistic, in-batch negatives, a batch-level loss term, a lookup that is not one row per sample), batch normalisation
in training mode, layers torch.func cannot vmap; a weight-normalised Linear is exact; padding rows stay fixed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from api_toys import brute_force, token_data
from torch import Tensor, nn
from torch.utils.data import DataLoader

from widedp.api import PrivacyEngine, UnsupportedModelError

SEL = {"name": "exponential", "k": 3, "epsilon": 0.5, "score_clip": 0.1}


def private(model: nn.Module, *, n: int = 24, batch_size: int = 4) -> tuple[PrivacyEngine, list, DataLoader]:
    eng = PrivacyEngine(selection=SEL, clip1=1.0, clip2=None, noise_multiplier=1.0)
    data = token_data(n)
    _, _, loader = eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                    DataLoader(data, batch_size=batch_size, collate_fn=collate), epochs=1)
    return eng, data, loader


def collate(items):
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


def ce(m: nn.Module, b) -> Tensor:
    return F.cross_entropy(m(b[0]), b[1], reduction="none")


class Pooled(nn.Module):
    """Token embeddings [B, T] (padding 0) -> mean over T -> ``mix`` (a function of the whole batch) -> Linear."""

    def __init__(self, mix=None, head: nn.Module | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 4, padding_idx=0)
        self.head = head if head is not None else nn.Linear(4, 3)
        self.mix = mix

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids).mean(1)
        return self.head(h if self.mix is None else self.mix(h))


class BatchStd(nn.Module):
    """A leaf layer with a parameter that standardises over the batch (unbiased std: NaN per-sample gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(4))

    def forward(self, h: Tensor) -> Tensor:
        return self.g * (h - h.mean(0)) / (h.std(0) + 1e-3)


class TwoTower(nn.Module):
    """In-batch negatives: sample j's logits are its user against every item of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.user, self.item = nn.Embedding(13, 4), nn.Embedding(13, 4)

    def forward(self, ids: Tensor) -> Tensor:
        return self.user(ids[:, 0]) @ self.item(ids[:, 1]).T


class Positions(nn.Module):
    """A positional table looked up with arange(T) and broadcast over the batch: its rows are positions."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(13, 4), nn.Embedding(5, 4), nn.Linear(4, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head((self.tok(ids) + self.pos(torch.arange(ids.shape[1]))).mean(1))


@pytest.mark.parametrize("model,loss", [
    (lambda: Pooled(lambda h: h - h.mean(0)), ce),  # a batch statistic
    (lambda: Pooled(lambda h: torch.softmax(h @ h.T, 1) @ h), ce),  # attention across the batch
    (lambda: Pooled(head=nn.Sequential(BatchStd(), nn.Linear(4, 3))), ce),
    (Pooled, lambda m, b: ce(m, b) + m(b[0]).mean(0).square().sum()),  # a batch-level loss term
    (TwoTower, lambda m, b: F.cross_entropy(m(b[0]), torch.arange(len(b[0])), reduction="none")),
    (Positions, ce),  # B == T == 5: rows of the positional lookup pass for samples
], ids=["standardise", "attention", "leaf-batch-std", "batch-term", "in-batch-negatives", "positions"])
def test_samples_that_interact_are_refused(model, loss):
    torch.manual_seed(0)
    m = model()
    eng, data, _ = private(m)
    with pytest.raises(UnsupportedModelError, match="samples interact|do not add up|take the batch first"):
        eng.per_sample_grads(collate(data[:5]), lambda b: loss(m, b))


def test_per_sample_models_pass_the_interaction_check():
    """No false alarm for in-place ops on outputs or dropout; the gradients still equal brute force."""
    torch.manual_seed(1)
    model = Pooled(head=nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 3))).double()
    twin = Pooled(head=nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 3))).double()
    twin.load_state_dict(model.state_dict())
    eng, data, _ = private(model)
    _, g = eng.per_sample_grads(collate(data[:6]), lambda b: ce(model, b))
    torch.testing.assert_close(g.to_dense(), brute_force(twin, eng.layout, data[:6], collate, ce))
    drop = Pooled(head=nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 3)))
    eng, data, _ = private(drop)
    eng.per_sample_grads(collate(data[:6]), lambda b: ce(drop, b))


def test_weight_normalised_linear_equals_brute_force():
    """Its weight is computed (weight_g, weight_v): the closed form for nn.Linear does not apply; torch.func does."""
    with pytest.warns(FutureWarning):
        model, twin = (Pooled(head=nn.utils.weight_norm(nn.Linear(4, 3))).double() for _ in range(2))
    twin.load_state_dict(model.state_dict())
    eng, data, _ = private(model)
    _, g = eng.per_sample_grads(collate(data[:6]), lambda b: ce(model, b))
    torch.testing.assert_close(g.to_dense(), brute_force(twin, eng.layout, data[:6], collate, ce))


def test_batch_norm_in_training_mode_and_random_layers_are_refused():
    model = Pooled(head=nn.Sequential(nn.BatchNorm1d(4, affine=False), nn.Linear(4, 3)))  # no parameters of its own
    eng, data, _ = private(model)
    with pytest.raises(UnsupportedModelError, match="batch normalisation in training mode"):
        eng.per_sample_grads(collate(data[:4]), lambda b: ce(model, b))
    model.head[0].eval()  # fixed statistics: per sample
    eng.per_sample_grads(collate(data[:4]), lambda b: ce(model, b))

    class DropLeaf(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, h: Tensor) -> Tensor:
            return F.dropout(h * self.w, 0.5, self.training)

    model = Pooled(head=nn.Sequential(DropLeaf(), nn.Linear(4, 3)))
    eng, data, _ = private(model)
    with pytest.raises(UnsupportedModelError, match="DropLeaf: torch.func cannot compute its per-sample gradients"):
        eng.per_sample_grads(collate(data[:4]), lambda b: ce(model, b))


def test_padding_rows_stay_fixed_under_dp_noise():
    torch.manual_seed(2)
    model = Pooled()
    before = model.emb.weight.detach().clone()
    eng, _, loader = private(model, n=40)
    for batch in loader:
        eng.step(batch, lambda b: ce(model, b))
    assert eng.steps == 10 and not torch.equal(model.emb.weight[1:], before[1:])
    assert torch.equal(model.emb.weight[0], before[0])  # torch keeps the padding row; so does the DP update


def test_a_non_finite_sample_is_no_interaction():
    """A sample whose loss is NaN (its gradient too) is the step's to zero, not a reason to refuse the model."""
    torch.manual_seed(3)
    model = Pooled()
    eng, data, _ = private(model)

    first = data[0][0]

    def nan_first(b):  # NaN for the sample equal to data[0] (a function of the sample, not of its position)
        hit = (b[0] == first).all(1)
        return ce(model, b) * torch.where(hit, float("nan"), 1.0)

    loss, g = eng.per_sample_grads(collate(data[:5]), nan_first)
    assert loss[0].isnan() and loss[1:].isfinite().all() and eng._capture.independence_checked
