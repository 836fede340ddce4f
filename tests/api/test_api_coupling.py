"""widedp.api.coupling: samples coupled through a batch statistic that sends no gradient between them, a
mean-reduced backward on the ``optimizer.step()`` loop, buffers that learn from the batch — each refused on the first
batch with one line, before anything is spent; no false alarm on ordinary per-sample models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from api_toys import CollectionModel, TorchrecMLP, bce_loss, collate_kjt, interactions
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchrec import PoolingType

from widedp.api import PrivacyEngine, UnsupportedModelError
from widedp.errors import ConfigError

SEL = {"name": "exponential", "k": 3, "epsilon": 0.5, "score_clip": 0.1}


def data(n: int = 40, seed: int = 0) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(ids [3], a dense feature [2], label) items."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 11, (3,), generator=g), 3 * torch.randn(2, generator=g) + 5,
             torch.tensor(float(i % 2))) for i in range(n)]


def collate(items):
    return tuple(torch.stack(c) for c in zip(*items))


def collate_standardised(items):
    """A collate_fn that standardises the dense feature over the batch."""
    ids, x, y = collate(items)
    return ids, (x - x.mean(0)) / (x.std(0) + 1e-3), y


class Model(nn.Module):
    """EmbeddingBag over the ids + the dense feature -> Linear -> one logit; ``standardise`` the feature over the
    batch inside forward; optional ``extra`` layers (dropout, LayerNorm) before the head."""

    def __init__(self, *, standardise: bool = False, extra: nn.Module | None = None) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(11, 4, mode="mean")
        self.extra = extra if extra is not None else nn.Identity()
        self.head = nn.Linear(6, 1)
        self.standardise = standardise

    def forward(self, ids: Tensor, x: Tensor) -> Tensor:
        if self.standardise:
            x = (x - x.mean(0)) / (x.std(0) + 1e-3)
        return self.head(self.extra(torch.cat([self.bag(ids), x], 1))).squeeze(1)


def bce(model: nn.Module):
    return lambda b: F.binary_cross_entropy_with_logits(model(b[0], b[1]), b[2], reduction="none")


def over_detached_mean(model: nn.Module):
    """Each loss divided by the batch's (detached) mean loss: no gradient between samples, yet coupled."""
    def loss(b):
        ell = bce(model)(b)
        return ell / ell.mean().detach()
    return loss


def private(model: nn.Module, *, collate_fn=collate, n: int = 40, batch_size: int = 10, **kw):
    eng = PrivacyEngine(selection=SEL, clip1=1.0, clip2=None, noise_multiplier=1.0)
    _, opt, loader = eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      DataLoader(data(n), batch_size=batch_size, collate_fn=collate_fn), epochs=1,
                                      **kw)
    return eng, opt, loader


COUPLED = {
    "standardised-input": (lambda: Model(standardise=True), bce, collate, "head: a sample's input to this layer"),
    "detached-mean-loss": (Model, over_detached_mean, collate, "no gradient flows between them"),
    "collate-standardises": (Model, bce, collate_standardised, "head: a sample's input to this layer"),
}


@pytest.mark.parametrize("case", COUPLED)
def test_coupled_samples_are_refused_on_the_first_step(case):
    make, loss_of, collate_fn, message = COUPLED[case]
    torch.manual_seed(0)
    model = make()
    eng, _, loader = private(model, collate_fn=collate_fn)
    batch = next(iter(loader))
    with pytest.raises(UnsupportedModelError, match=message) as e:
        eng.step(batch, loss_of(model))
    assert "\n" not in str(e.value) and "samples" in str(e.value)
    assert eng.steps == eng.ledger.steps == 0


@pytest.mark.parametrize("case", COUPLED)
def test_the_optimizer_step_loop_runs_the_same_check(case):
    make, loss_of, collate_fn, message = COUPLED[case]
    torch.manual_seed(0)
    model = make()
    eng, opt, loader = private(model, collate_fn=collate_fn, loss_fn=loss_of(model))
    batch = next(iter(loader))
    loss_of(model)(batch).sum().backward()
    with pytest.raises(UnsupportedModelError, match=message):
        opt.step()
    assert eng.steps == eng.ledger.steps == 0


def test_the_optimizer_step_loop_needs_loss_fn():
    torch.manual_seed(0)
    model = Model()
    eng, opt, loader = private(model)
    batch = next(iter(loader))
    bce(model)(batch).sum().backward()
    with pytest.raises(RuntimeError, match=r"pass make_private\(\.\.\., loss_fn=") as e:
        opt.step()
    assert "\n" not in str(e.value) and eng.steps == eng.ledger.steps == 0


@pytest.mark.parametrize(("declared", "ran", "refused"), [
    ("sum", "mean", "the backward ran on loss.mean()"), ("mean", "sum", "the backward ran on loss.sum()"),
    ("sum", "sum", None), ("mean", "mean", None)])
def test_a_backward_of_the_other_reduction_is_refused(declared, ran, refused):
    torch.manual_seed(0)
    model = Model(extra=nn.Dropout(0.3))  # the user's pass has dropout on, the check's off: no false alarm
    eng, opt, loader = private(model, loss_fn=bce(model), loss_reduction=declared)
    for batch in loader:
        loss = bce(model)(batch)
        (loss.mean() if ran == "mean" else loss.sum()).backward()
        if refused is None:
            opt.step()
            continue
        with pytest.raises(ConfigError, match=refused) as e:
            opt.step()
        assert "\n" not in str(e.value) and eng.steps == eng.ledger.steps == 0
        return
    assert eng.steps == eng.total_steps == 4 and eng._reduction_checked


class FunctionalDropout(nn.Module):
    """Dropout written in the container's forward (random in training mode: the check then uses eval mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Model()

    def forward(self, ids: Tensor, x: Tensor) -> Tensor:
        return self.inner(ids, F.dropout(x, 0.5, self.training))


class Shared(nn.Module):
    """One table looked up twice per sample (two id fields): a shared table."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.head = nn.Linear(8, 1)

    def forward(self, ids: Tensor, x: Tensor) -> Tensor:
        return self.head(torch.cat([self.emb(ids[:, 0]), self.emb(ids[:, 1])], 1)).squeeze(1)


PER_SAMPLE = {
    "dropout": lambda: Model(extra=nn.Dropout(0.5)),
    "functional-dropout": FunctionalDropout,
    "layer-norm": lambda: Model(extra=nn.LayerNorm(6)),
    "shared-table": Shared,
}


@pytest.mark.parametrize("case", PER_SAMPLE)
@pytest.mark.filterwarnings("error::UserWarning")
def test_no_false_alarm_on_per_sample_models(case):
    torch.manual_seed(0)
    model = PER_SAMPLE[case]()
    eng, _, loader = private(model)
    for batch in loader:
        eng.step(batch, bce(model))
    assert eng.steps == 4 and eng._checked


@pytest.mark.parametrize("kind", ["ebc", "ec", "weighted-kjt"])
@pytest.mark.filterwarnings("error::UserWarning")
def test_no_false_alarm_on_torchrec(kind):
    torch.manual_seed(0)
    model = {"ebc": TorchrecMLP, "ec": CollectionModel,
             "weighted-kjt": lambda: TorchrecMLP(PoolingType.SUM, weighted=True)}[kind]()
    eng = PrivacyEngine(selection=SEL, clip1=1.0, clip2=None, noise_multiplier=1.0)
    _, opt, loader = eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                      DataLoader(interactions(40), batch_size=10, collate_fn=collate_kjt), epochs=1,
                                      loss_fn=bce_loss(model))
    for kjt, labels in loader:
        bce_loss(model)((kjt, labels)).sum().backward()
        opt.step()
    assert eng.steps == 4 and eng._checked and eng._reduction_checked


def test_a_random_collate_fn_is_a_warning_not_a_refusal():
    def noisy(items):
        ids, x, y = collate(items)
        return ids, x + torch.randn_like(x), y

    model = Model()
    eng, _, loader = private(model, collate_fn=noisy)
    with pytest.warns(UserWarning, match="could not check that samples do not interact"):
        eng.step(next(iter(loader)), bce(model))
    assert eng.steps == 1


# ------------------------------------------------------------------------------------------------------- buffers


class RunningMean(nn.Module):
    """Normalises its input by a running mean it updates in training mode (``reassign``: by a new tensor)."""

    def __init__(self, reassign: bool = False) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(6))
        self.reassign = reassign

    def forward(self, h: Tensor) -> Tensor:
        if self.training:
            new = 0.9 * self.mean + 0.1 * h.detach().mean(0)
            if self.reassign:
                self.mean = new
            else:
                self.mean.copy_(new)
        return h - self.mean


class Fixed(nn.Module):
    """A constant buffer, read only."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.full((6,), 0.5))

    def forward(self, h: Tensor) -> Tensor:
        return h - self.shift


@pytest.mark.parametrize("reassign", [False, True])
def test_a_buffer_that_learns_from_the_batch_is_refused(reassign):
    torch.manual_seed(0)
    model = Model(extra=RunningMean(reassign))
    eng, _, loader = private(model)
    with pytest.raises(UnsupportedModelError, match="extra.mean: the forward wrote into this buffer") as e:
        eng.step(next(iter(loader)), bce(model))
    assert "\n" not in str(e.value) and eng.steps == eng.ledger.steps == 0


def test_fixed_buffers_and_eval_mode_statistics_pass():
    torch.manual_seed(0)
    model = Model(extra=nn.Sequential(Fixed(), nn.BatchNorm1d(6, affine=False).eval()))
    eng, _, loader = private(model)
    for batch in loader:
        eng.step(batch, bce(model))
    before = model.extra[1].running_mean.clone()
    model.extra[1].running_mean.add_(1.0)  # between steps (e.g. load_state_dict at resume): not the forward
    assert eng.steps == 4 and not torch.equal(before, model.extra[1].running_mean)
    model.eval()
    model(*collate(data(3))[:2])  # evaluation writes nothing either; and is not recorded
