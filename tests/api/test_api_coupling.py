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
    assert eng.steps == eng.total_steps == 4 and eng._checks.replay_done


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
    assert eng.steps == 4 and eng._checks.coupling_done


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
    assert eng.steps == 4 and eng._checks.coupling_done and eng._checks.replay_done


def test_a_random_collate_fn_is_refused_unless_the_caller_opts_out():
    """Randomness other than dropout (here in collate_fn) makes sub-batches incomparable: refused; with
    check_independence=False the run goes on and its statement says the check was skipped."""
    def noisy(items):
        ids, x, y = collate(items)
        return ids, x + torch.randn_like(x), y

    model = Model()
    eng, _, loader = private(model, collate_fn=noisy)
    with pytest.raises(UnsupportedModelError, match="draws random numbers even with dropout off"):
        eng.step(next(iter(loader)), bce(model))
    model = Model()
    eng, _, loader = private(model, collate_fn=noisy, check_independence=False)
    for batch in loader:
        eng.step(batch, bce(model))
    assert eng.steps == 4 and "samples' independence not checked" in " ".join(eng.statement().not_covered)


def test_per_item_randomness_in_getitem_is_frozen_for_the_check():
    """Augmentation drawn in __getitem__ is per sample: the check fetches each item once, so it is no alarm."""
    class Augmented(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.items = data(40)

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i):
            ids, x, y = self.items[i]
            return ids, x + torch.randn_like(x), y

    model = Model()
    eng = PrivacyEngine(selection=SEL, clip1=1.0, clip2=None, noise_multiplier=1.0)
    _, _, loader = eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    DataLoader(Augmented(), batch_size=10, collate_fn=collate), epochs=1)
    for batch in loader:
        eng.step(batch, bce(model))
    assert eng.steps == 4


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


# ------------------------------------------------------------------------------- cases an outside audit found


class TrainOnlyStandardise(Model):
    """Standardises over the batch only in training mode, with functional dropout beside it."""

    def forward(self, ids: Tensor, x: Tensor) -> Tensor:
        if self.training:
            x = (x - x.mean(0)) / (x.std(0) + 1e-3)
        return self.head(F.dropout(torch.cat([self.bag(ids), x], 1), 0.1, self.training)).squeeze(1)


class RunningAttr(nn.Module):
    """A running mean kept as a plain attribute (not a buffer), updated in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = torch.zeros(6)

    def forward(self, h: Tensor) -> Tensor:
        if self.training:
            self.mu = 0.9 * self.mu + 0.1 * h.detach().mean(0)
        return h - self.mu


class DataBuffer(nn.Module):
    """A buffer written through ``.data`` (its version counter does not move)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mu", torch.zeros(6))

    def forward(self, h: Tensor) -> Tensor:
        if self.training:
            self.mu.data = 0.9 * self.mu + 0.1 * h.detach().mean(0)
        return h - self.mu


class OneFeatureStandardised(Model):
    """Feature 0 standardised over the batch, feature 1 raw (one item's is huge: its norm dwarfs the others')."""

    def forward(self, ids: Tensor, x: Tensor) -> Tensor:
        x = torch.cat([(x[:, :1] - x[:, :1].mean()) / (x[:, :1].std() + 1e-3), x[:, 1:]], 1)
        return self.head(torch.cat([self.bag(ids), x], 1)).squeeze(1)


class NoEpsStandardised(Model):
    """Standardised without an eps: a sub-batch whose feature is constant is all NaN."""

    def forward(self, ids: Tensor, x: Tensor) -> Tensor:
        return self.head(torch.cat([self.bag(ids), (x - x.mean(0)) / x.std(0)], 1)).squeeze(1)


def huge_one(items):
    ids, x, y = collate(items)
    x = x.clone()
    x[-1, 1] = -1000.0
    return ids, x, y


def sorted_binary(n=40):
    """Items whose dense feature is 0 for the first half of every 8, 1 for the rest (a dataset sorted by it)."""
    return [(ids, torch.full((2,), float(i % 8 >= 4)), y) for i, (ids, _, y) in enumerate(data(n))]


@pytest.mark.parametrize(("make", "collate_fn", "items", "message"), [
    (TrainOnlyStandardise, collate, None, "head: a sample's input"),
    (lambda: Model(extra=RunningAttr()), collate, None, "two identical passes"),
    (lambda: Model(extra=DataBuffer()), collate, None, "two identical passes"),
    (OneFeatureStandardised, huge_one, None, "head: a sample's input"),
    (NoEpsStandardised, collate, sorted_binary(), "samples|sub-batch"),
], ids=["train-only-statistic", "running-attribute", "buffer-via-data", "one-huge-sample", "nan-sub-batches"])
def test_audited_couplings_are_refused(make, collate_fn, items, message):
    torch.manual_seed(0)
    model = make()
    eng = PrivacyEngine(selection=SEL, clip1=1.0, clip2=None, noise_multiplier=1.0)
    _, _, loader = eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    DataLoader(items or data(40), batch_size=10, collate_fn=collate_fn), epochs=1)
    with pytest.raises(UnsupportedModelError, match=message):
        eng.step(next(iter(loader)), bce(model))
    assert eng.steps == eng.ledger.steps == 0


class Tokens(nn.Module):
    """Token ids padded to the batch's longest item (0 = padding), mean-pooled with or without a mask."""

    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.emb, self.head, self.masked = nn.Embedding(11, 4, padding_idx=0), nn.Linear(4, 1), masked

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids)
        if self.masked:
            mask = (ids != 0).unsqueeze(2).to(h.dtype)
            return self.head((h * mask).sum(1) / mask.sum(1).clamp_min(1)).squeeze(1)
        return self.head(h.mean(1)).squeeze(1)


def pad_to_longest(items):
    ids = nn.utils.rnn.pad_sequence([t for t, _ in items], batch_first=True)
    return ids, torch.stack([y for _, y in items])


@pytest.mark.parametrize("masked", [False, True])
def test_padding_to_the_longest_item_is_coupling_unless_masked(masked):
    g = torch.Generator().manual_seed(0)
    items = [(torch.randint(1, 11, (int(n),), generator=g), torch.tensor(float(i % 2)))
             for i, n in enumerate(torch.randint(1, 9, (40,), generator=g))]
    items[0] = (torch.randint(1, 11, (12,), generator=g), items[0][1])  # the longest, in the first half
    model = Tokens(masked)
    eng = PrivacyEngine(selection=SEL, clip1=1.0, clip2=None, noise_multiplier=1.0)
    _, _, loader = eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    DataLoader(items, batch_size=10, collate_fn=pad_to_longest), epochs=1)

    def loss(b):
        return F.binary_cross_entropy_with_logits(model(b[0]), b[1], reduction="none")

    if masked:
        for batch in loader:
            eng.step(batch, loss)
        assert eng.steps == 4
    else:
        with pytest.raises(UnsupportedModelError, match="changes with the other samples"):
            eng.step(next(iter(loader)), loss)


def test_a_batch_changed_between_the_loader_and_the_step_is_refused():
    def prep(b):
        ids, x, y = b
        return ids, (x - x.mean(0)) / (x.std(0) + 1e-3), y

    model = Model()
    eng, _, loader = private(model)
    with pytest.raises(UnsupportedModelError, match="engine.step: the step's per-sample gradients are not loss_fn's"):
        eng.step(prep(next(iter(loader))), bce(model))
    model = Model()
    eng, opt, loader = private(model, loss_fn=bce(model))
    bce(model)(prep(next(iter(loader)))).sum().backward()
    with pytest.raises(UnsupportedModelError, match=r"optimizer.step\(\): the step's per-sample gradients"):
        opt.step()
    assert eng.steps == eng.ledger.steps == 0


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_consistent_reduction_with_heavy_dropout_and_a_saturated_head_passes(reduction):
    """The reference replays the step's own dropout masks: no ratio heuristic, no false alarm."""
    for seed in range(6):
        torch.manual_seed(seed)
        model = Model(extra=nn.Dropout(0.5))
        with torch.no_grad():
            model.head.weight.mul_(30)
        eng, opt, loader = private(model, batch_size=4, loss_fn=bce(model), loss_reduction=reduction)
        batch = next(iter(loader))
        loss = bce(model)(batch)
        (loss.mean() if reduction == "mean" else loss.sum()).backward()
        opt.step()
        assert eng.steps >= 1 and eng._checks.replay_done  # (an empty Poisson batch before it is a step too)


def test_bfloat16_tables_pass_on_the_optimizer_step_loop():
    torch.manual_seed(0)
    model = Model()
    model.bag.to(torch.bfloat16)
    model.forward = lambda ids, x: model.head(torch.cat([model.bag(ids).float(), x], 1)).squeeze(1)
    eng, opt, loader = private(model, loss_fn=bce(model))
    for batch in loader:
        bce(model)(batch).sum().backward()
        opt.step()
    assert eng.steps == 4


# ------------------------------------------------------------------------------ cases a second audit found


class Gated(Model):
    """Mixup on 30% of batches: randomness the fixed seeds of the check might never trigger."""

    def forward(self, ids: Tensor, x: Tensor) -> Tensor:
        if torch.rand(()) < 0.3:
            x = 0.7 * x + 0.3 * x.flip(0)
        return super().forward(ids, x)


class GhostPairs(Model):
    """Ghost batch normalisation over virtual batches of 2 (the pairs of the batch)."""

    def forward(self, ids: Tensor, x: Tensor) -> Tensor:
        x = torch.cat([c - c.mean(0) for c in torch.split(x, 2)])
        return super().forward(ids, x)


class Above16(Model):
    """Standardises only batches of more than 16 samples."""

    def forward(self, ids: Tensor, x: Tensor) -> Tensor:
        if x.shape[0] > 16:
            x = (x - x.mean(0)) / (x.std(0) + 1e-3)
        return super().forward(ids, x)


@pytest.mark.parametrize(("make", "message"), [
    (Gated, "draws random numbers"), (GhostPairs, "changes with the other samples"),
    (Above16, "changes with the other samples")], ids=["gated-randomness", "ghost-pairs", "above-16"])
def test_couplings_the_fixed_partition_missed_are_refused(make, message):
    torch.manual_seed(0)
    model = make()
    eng, _, loader = private(model, batch_size=30)
    with pytest.raises(UnsupportedModelError, match=message):
        eng.step(next(iter(loader)), bce(model))
    assert eng.steps == eng.ledger.steps == 0


def test_a_batch_changed_in_place_after_the_loader_is_refused():
    model = Model()
    eng, opt, loader = private(model, loss_fn=bce(model))
    batch = next(iter(loader))
    batch[1].sub_(batch[1].mean(0)).div_(batch[1].std(0) + 1e-3)
    bce(model)(batch).sum().backward()
    with pytest.raises(UnsupportedModelError, match="changed in place before the step"):
        opt.step()
    assert eng.steps == eng.ledger.steps == 0


class PaddedItems(torch.utils.data.Dataset):
    """A dataset whose batched fetch pads to the longest item it fetches (a tokenizer's padding=True)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.items = [torch.randint(1, 11, (int(n),), generator=g) for n in torch.randint(1, 9, (40,), generator=g)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.__getitems__([i])[0]

    def __getitems__(self, idx):
        ids = nn.utils.rnn.pad_sequence([self.items[i] for i in idx], batch_first=True)
        return [(row, torch.tensor(float(i % 2))) for row, i in zip(ids, idx)]


def test_a_datasets_batched_fetch_is_checked_per_sub_batch():
    model = Tokens(masked=False)
    eng = PrivacyEngine(selection=SEL, clip1=1.0, clip2=None, noise_multiplier=1.0)
    stack = lambda items: (torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))  # noqa: E731
    _, _, loader = eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    DataLoader(PaddedItems(), batch_size=10, collate_fn=stack), epochs=1)
    with pytest.raises(UnsupportedModelError, match="changes with the other samples"):
        eng.step(next(iter(loader)), lambda b: F.binary_cross_entropy_with_logits(model(b[0]), b[1],
                                                                                  reduction="none"))


class BoundDropout(Model):
    """Dropout by a bound name and by torch.dropout, and an RReLU: all random in training mode."""

    def __init__(self) -> None:
        super().__init__(extra=nn.RReLU())

    def forward(self, ids: Tensor, x: Tensor) -> Tensor:
        from torch.nn.functional import dropout

        x = torch.dropout(dropout(x, 0.3, self.training), 0.2, self.training)
        return super().forward(ids, x)


@pytest.mark.filterwarnings("error::UserWarning")
def test_dropout_by_any_name_and_rrelu_are_no_alarm():
    torch.manual_seed(0)
    model = BoundDropout()
    eng, opt, loader = private(model, loss_fn=bce(model))
    for batch in loader:
        bce(model)(batch).sum().backward()
        opt.step()
    assert eng.steps == 4
