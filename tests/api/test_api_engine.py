"""widedp.api.PrivacyEngine end to end: a short DP run learns, resume equals an uninterrupted run, ε (and the
calibrated σ and budget) equal the CLI's for the same settings, the budget stop, empty Poisson batches, secrets never
in state_dict, optimizer mapping."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os

import pytest
import torch
import torch.nn.functional as F
import yaml
from api_toys import BagModel, GenericRecsys, TorchrecMLP, bce_loss, collate_kjt, interactions
from torch import nn
from torch.utils.data import DataLoader

from widedp import accounting
from widedp.api import BudgetExhausted, PrivacyEngine
from widedp.dp.spend import ExponentialSpend, GaussianSpend, StepSpend
from widedp.errors import ConfigError

SEL = {"name": "exponential", "k": 6, "epsilon": 0.2, "score_clip": 0.1}


def engine(**kw) -> PrivacyEngine:
    base = dict(selection=SEL, clip1=1.0, clip2=1.0, noise_multiplier=0.6, accountant="rdp")
    return PrivacyEngine(**{**base, **kw})


# ----------------------------------------------------------------------------------------------------- learning


def ce_of(model):
    """batch (ids, labels) -> [B] cross-entropy losses of ``model``."""
    return lambda b: F.cross_entropy(model(b[0]), b[1], reduction="none")


def collate_pairs(items):
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def test_short_dp_run_learns():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2000, 1), generator=g)
    y = (ids[:, 0] < 50).long()  # the id decides the class
    model = nn.Sequential(nn.EmbeddingBag(100, 8, mode="mean"), nn.Linear(8, 2))
    eng = engine(selection={"name": "exponential", "k": 60, "epsilon": 0.1, "score_clip": 0.05})
    model, opt, loader = eng.make_private(model, torch.optim.Adam(model.parameters(), lr=0.05),
                                          DataLoader(list(zip(ids, y)), batch_size=100, collate_fn=collate_pairs),
                                          loss_fn=ce_of(model), epochs=3)

    def full_loss() -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model(ids), y))

    before = full_loss()
    for _ in range(3):
        for x, t in loader:
            loss = F.cross_entropy(model(x), t, reduction="none")
            loss.sum().backward()
            opt.step()
    assert eng.steps == eng.total_steps == 60 and eng.ledger.steps == 60
    assert full_loss() < before - 0.3, (before, full_loss())  # measured: 0.81 -> 0.33
    st = eng.statement()
    assert st.private and st.unit == "training example" and "RDP accountant" in st.text
    assert 0 < st.epsilon == eng.epsilon() < 20


# ------------------------------------------------------------------------------------------------ step protocols


def _bag_run(protocol: str, *, steps: int = 6):
    torch.manual_seed(1)
    model = BagModel("mean")
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 11, (3,), generator=g), torch.tensor(int(torch.randint(3, (1,), generator=g))))
            for _ in range(60)]
    eng = engine(secure_rng=False, seed=5)
    model, opt, loader = eng.make_private(model, torch.optim.Adam(model.parameters(), lr=0.05),
                                          DataLoader(data, batch_size=10, collate_fn=collate_pairs), epochs=1,
                                          loss_fn=ce_of(model), loss_reduction="mean" if protocol == "mean" else "sum")
    for (x, t), _ in zip(loader, range(steps)):
        loss_fn = lambda b: F.cross_entropy(model(b[0]), b[1], reduction="none")  # noqa: E731
        if protocol == "explicit":
            eng.step((x, t), loss_fn)
        else:
            opt.zero_grad()
            loss = loss_fn((x, t))
            (loss.mean() if protocol == "mean" else loss.sum()).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()], eng


@pytest.mark.filterwarnings("ignore:PrivacyEngine")
def test_explicit_step_equals_optimizer_protocol():
    ref, eng = _bag_run("optimizer")
    explicit, _ = _bag_run("explicit")
    mean, _ = _bag_run("mean")
    assert all(torch.equal(a, b) for a, b in zip(ref, explicit))
    for a, b in zip(ref, mean):
        torch.testing.assert_close(a, b)
    assert eng.last_stats is not None and eng.last_stats.rows_selected == 6 + eng.layout.always_rows


# -------------------------------------------------------------------------------------------------------- resume


def _torchrec_setup(secure: bool):
    torch.manual_seed(2)
    model = TorchrecMLP()
    eng = engine(secure_rng=secure, seed=11)
    data = interactions(40, seed=4)
    model, opt, loader = eng.make_private(model, torch.optim.Adam(model.parameters(), lr=0.05),
                                          DataLoader(data, batch_size=8, collate_fn=collate_kjt),
                                          loss_fn=bce_loss(model), epochs=2)
    return model, opt, loader, eng


def _train(model, opt, loader, eng, *, until: int) -> None:
    while eng.steps < until:
        for kjt, labels in loader:
            bce_loss(model)((kjt, labels)).sum().backward()
            opt.step()
            if eng.steps >= until:
                return


@pytest.mark.filterwarnings("ignore:PrivacyEngine")
@pytest.mark.parametrize("secure", [False, True])
def test_resume_equals_uninterrupted(tmp_path, secure):
    model, opt, loader, eng = _torchrec_setup(secure)
    _train(model, opt, loader, eng, until=7)  # stops mid-epoch 2
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "engine": eng.state_dict()}, buf)
    eng.save_private(tmp_path)
    assert oct(os.stat(tmp_path / "private").st_mode & 0o777) == "0o700"
    blob = buf.getvalue()
    if secure:  # the secret seeds are nowhere in the checkpoint
        assert all(str(s).encode() not in blob and s.to_bytes(8, "little") not in blob
                   for s in (eng._seeds.sampling, eng._seeds.noise))
    _train(model, opt, loader, eng, until=10)  # the uninterrupted run goes on
    assert eng.steps == eng.total_steps == 10

    model2, opt2, loader2, eng2 = _torchrec_setup(secure)  # "a new process": fresh model, fresh secure seeds
    ckpt = torch.load(io.BytesIO(blob), weights_only=True)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    eng2.load_state_dict(ckpt["engine"])
    eng2.load_private(tmp_path)
    _train(model2, opt2, loader2, eng2, until=10)
    runs = [model2]
    if not secure:  # reproducible: a whole fresh run from the public seed is the same run
        model3, opt3, loader3, eng3 = _torchrec_setup(secure)
        _train(model3, opt3, loader3, eng3, until=10)
        runs.append(model3)
    for other in runs:
        for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
            assert torch.equal(a, b), name
    assert eng2.ledger == eng.ledger and eng2.epsilon() == eng.epsilon()


def test_load_checks_settings_and_private_state(tmp_path):
    _, _, _, eng = _torchrec_setup(True)
    state = eng.state_dict()
    _, _, _, other = _torchrec_setup(True)
    other._dp = dataclasses.replace(other._dp, clip1=2.0)
    with pytest.raises(ConfigError, match="other settings: clip1"):
        other.load_state_dict(state)
    with pytest.raises(ConfigError, match="no private state"):
        eng.load_private(tmp_path)


# ---------------------------------------------------------------------------------------- epsilon == the CLI's


def _recsys_cli(tmp_path, capsys, **dp):
    from widedp import cli

    cfg = {"task": "recsys",
           "data": {"num_users": 7, "num_items": 9, "num_interactions": 300, "num_tags": 5, "tags_per_item": 3,
                    "context_cardinality": 4, "splits": [0.8, 0.1, 0.1], "cache_dir": ""},
           "model": {"dim": 4, "hidden": [5]},
           "train": {"epochs": 2, "batch_size": 24, "optimizer": "lazy_adam", "lr": 0.01},
           "dp": {"clip1": 1.0, "clip2": 0.5, "delta": 1e-5, "accountant": "pld",
                  "selection": {"name": "exponential", "k": 5, "epsilon": 0.05, "score_clip": 0.1}, **dp}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli.main(["epsilon", str(path)]) == 0
    return cfg, json.loads(capsys.readouterr().out)


def _recsys_engine(cfg, **kw):
    from widedp.config.recsys import RecsysDataConfig
    from widedp.data_prep.interactions import RecsysSplit, prepare_interactions
    from widedp.models.recsys import RecsysModel

    data = prepare_interactions(RecsysDataConfig(**cfg["data"]))
    split = RecsysSplit(data.train, "cpu")
    model = GenericRecsys(RecsysModel(data.cardinality, dim=4, hidden=(5,)))
    dp = cfg["dp"]
    eng = PrivacyEngine(selection=dp["selection"], clip1=dp["clip1"], clip2=dp["clip2"], delta=dp["delta"], **kw)
    model, opt, loader = eng.make_private(model, torch.optim.Adam(model.parameters(), lr=0.01),
                                          DataLoader(range(len(split)), batch_size=24,
                                                     collate_fn=lambda i: split.batch(torch.tensor(i))),

                                          loss_fn=lambda b: F.binary_cross_entropy_with_logits(
                                              model(b.kjt), b.labels, reduction="none"),
                                          epochs=cfg["train"]["epochs"])
    return model, opt, loader, eng


def test_epsilon_equals_cli(tmp_path, capsys):
    cfg, rep = _recsys_cli(tmp_path, capsys, noise_multiplier=0.8)
    model, opt, loader, eng = _recsys_engine(cfg, noise_multiplier=0.8)
    assert (eng.n, eng.total_steps, eng.layout.table_rows) == (rep["n_train"], rep["steps"], 7 + 9 + 5 + 4)
    for _ in range(2):
        for b in loader:
            F.binary_cross_entropy_with_logits(model(b.kjt), b.labels, reduction="none").sum().backward()
            opt.step()
    assert eng.ledger.steps == rep["steps"] == 20
    assert eng.epsilon() == pytest.approx(rep["epsilon"], rel=1e-12)
    by_hand = StepSpend(24 / rep["n_train"], (GaussianSpend(0.8, min(1.0 / 24, 2 * 0.5)), ExponentialSpend(0.05, 5)))
    assert eng.epsilon() == pytest.approx(accounting.epsilon_for_step(by_hand, steps=20, delta=1e-5), rel=1e-12)
    assert f"ε={rep['epsilon']:.4g}" in eng.statement().text


def test_calibration_and_budget_equal_cli(tmp_path, capsys):
    cfg, rep = _recsys_cli(tmp_path, capsys, target_epsilon=4.0, calibrate="noise_multiplier")
    _, _, _, eng = _recsys_engine(cfg, target_epsilon=4.0)
    assert eng.noise_multiplier == pytest.approx(rep["noise_multiplier"], rel=1e-12)
    assert eng.budget_steps == rep["budget_steps"] >= 20 and rep["epsilon"] <= 4.0


def test_budget_stop():
    torch.manual_seed(3)
    eng = engine(selection={"name": "uniform", "k": 3}, target_epsilon=1.0, noise_multiplier=2.0)
    model = BagModel("sum")
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 11, (2,), generator=g), torch.tensor(1)) for _ in range(40)]
    model, opt, loader = eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          DataLoader(data, batch_size=4, collate_fn=collate_pairs),
                                          loss_fn=ce_of(model), epochs=5)
    assert 0 < eng.budget_steps == 11 < eng.total_steps == 50  # q = 0.1, sampled Gaussian σ=2 (RDP)
    for _ in range(5):
        for x, t in loader:
            F.cross_entropy(model(x), t, reduction="none").sum().backward()
            opt.step()
    assert eng.stopped_by_budget and eng.steps == eng.budget_steps and eng.epsilon() <= 1.0
    with pytest.raises(BudgetExhausted, match="target_epsilon=1.0"):
        eng.step((data[0][0][None], data[0][1][None]), lambda b: F.cross_entropy(model(b[0]), b[1], reduction="none"))


# ------------------------------------------------------------------------------------ sampling and randomness


def test_empty_poisson_batches_are_noise_only_steps():
    model = BagModel("mean")
    data = [(torch.tensor([1, 2]), torch.tensor(0))] * 50
    eng = engine()
    model, opt, loader = eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          DataLoader(data, batch_size=1, collate_fn=collate_pairs),
                                          loss_fn=ce_of(model), epochs=1)
    before = model.bag.weight.detach().clone()
    yielded = 0
    for x, t in loader:
        yielded += 1
        F.cross_entropy(model(x), t, reduction="none").sum().backward()
        opt.step()
    assert eng.steps == eng.ledger.steps == 50 > yielded  # q = 1/50: most batches are empty, all are steps
    assert not torch.equal(before, model.bag.weight)  # noise moved the selected rows
    other = BagModel()
    _, _, loader2 = engine().make_private(other, torch.optim.SGD(other.parameters(), lr=0.1),
                                          DataLoader(data, batch_size=25, collate_fn=collate_pairs),
                                          loss_fn=ce_of(other), epochs=1)
    batches = iter(loader2)
    next(batches)
    with pytest.raises(RuntimeError, match="not used for a DP step"):
        next(batches)


def test_a_step_takes_only_the_batch_the_poisson_loader_issued():
    """The ε assumes the loader's Poisson batches: a step on the user's own (shuffled, fixed-size) DataLoader, a
    second step on one batch, or a forward over part of a batch is refused before anything is spent."""
    data = [(torch.tensor([i % 10, (i + 1) % 10]), torch.tensor(i % 2)) for i in range(100)]
    dl = DataLoader(data, batch_size=10, shuffle=True, collate_fn=collate_pairs)
    model = BagModel()
    eng = engine()
    model, opt, loader = eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), dl,
    loss_fn=ce_of(model), epochs=1)

    def backward(x, t):
        F.cross_entropy(model(x), t, reduction="none").sum().backward()

    x, t = next(iter(dl))  # the user's DataLoader, not the loader make_private returned
    backward(x, t)
    with pytest.raises(RuntimeError, match="no batch from the loader that make_private returned"):
        opt.step()
    x, t = next(iter(loader))
    backward(x, t)
    opt.step()
    with pytest.raises(RuntimeError, match="no batch from the loader"):
        opt.step()  # a second step on the same batch
    batches = iter(loader)
    x, t = next(batches)
    backward(x[:-1], t[:-1])
    with pytest.raises(RuntimeError, match=rf"the step saw {len(t) - 1} samples, the loader's batch has {len(t)}"):
        opt.step()
    assert eng.steps == eng.ledger.steps == 1  # only the one legitimate step was taken and charged


def test_reproducible_mode_is_labelled_not_private():
    with pytest.warns(UserWarning, match="NOT private"):
        eng = engine(secure_rng=False, seed=3)
    model = BagModel()
    eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     DataLoader([(torch.tensor([1]), torch.tensor(0))] * 20, batch_size=5), epochs=1)
    st = eng.statement()
    assert not st.private and st.text.startswith("NOT PRIVATE (secure_rng=False")
    assert engine()._seeds.private and engine()._seeds.sampling != engine()._seeds.sampling


# ---------------------------------------------------------------------------------------------- optimizer mapping


def test_optimizer_mapping_and_scheduler():
    def names(opt, **kw):
        model = BagModel()
        eng = engine()
        eng.make_private(model, opt(model.parameters()), DataLoader([(torch.tensor([1]), 0)] * 20, batch_size=5),
                         epochs=1, **kw)
        return [type(o).__name__ for o in eng._updater.rows], eng

    assert names(lambda p: torch.optim.SGD(p, lr=0.1))[0] == ["RowSGD"]
    assert names(lambda p: torch.optim.Adam(p, lr=0.1))[0] == ["LazyAdam"]
    assert names(lambda p: torch.optim.RMSprop(p, lr=0.1), table_optimizer="adam")[0] == ["DenseAdam"]
    with pytest.raises(ConfigError, match="momentum"):
        names(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    with pytest.raises(ConfigError, match="RMSprop: no known table-row equivalent"):
        names(lambda p: torch.optim.RMSprop(p, lr=0.1))
    with pytest.raises(ConfigError, match=r"does not hold the trainable parameters \['head.weight'"):
        names(lambda p: torch.optim.SGD(list(p)[:1], lr=0.1))
    _, eng = names(lambda p: torch.optim.SGD(p, lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(eng._updater.optimizer, step_size=1, gamma=0.5)
    sched.step()
    eng.empty_step()
    assert eng._updater.rows[0].lr == 0.05
    copy.deepcopy(eng.state_dict())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_short_dp_run_on_cuda_learns_and_states_the_cpu_epsilon():
    """The same run as ``test_short_dp_run_learns`` with the model and data on CUDA."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2000, 1), generator=g).cuda()
    y = (ids[:, 0] < 50).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(100, 8, mode="mean"), nn.Linear(8, 2)).cuda()
    eng = engine(selection={"name": "exponential", "k": 60, "epsilon": 0.1, "score_clip": 0.05})
    model, opt, loader = eng.make_private(model, torch.optim.Adam(model.parameters(), lr=0.05),
                                          DataLoader(list(zip(ids, y)), batch_size=100, collate_fn=collate_pairs),
                                          loss_fn=ce_of(model), epochs=3)
    before = float(F.cross_entropy(model(ids), y))
    for _ in range(3):
        for x, t in loader:
            F.cross_entropy(model(x), t, reduction="none").sum().backward()
            opt.step()
    with torch.no_grad():
        after = float(F.cross_entropy(model(ids), y))
    assert eng.steps == 60 and after < before - 0.3, (before, after)
    cpu = engine(selection={"name": "exponential", "k": 60, "epsilon": 0.1, "score_clip": 0.05})
    m2 = nn.Sequential(nn.EmbeddingBag(100, 8, mode="mean"), nn.Linear(8, 2))
    m2, opt2, loader2 = cpu.make_private(m2, torch.optim.Adam(m2.parameters(), lr=0.05),
                                         DataLoader(list(zip(ids.cpu(), y.cpu())), batch_size=100,
                                                    collate_fn=collate_pairs), loss_fn=ce_of(m2), epochs=3)
    for _ in range(3):
        for x, t in loader2:
            F.cross_entropy(m2(x), t, reduction="none").sum().backward()
            opt2.step()
    assert cpu.steps == 60 and eng.epsilon() == pytest.approx(cpu.epsilon(), rel=1e-12)


def test_fixed_sampling_rate_leaves_the_data_size_out_of_the_statement():
    """PrivacyEngine(sampling_rate=q): q in every step's record, an epoch = round(1/q) steps, and the statement no
    longer lists the data's size; without it q = b/len(dataset) and the size is listed."""
    from widedp.accounting.statement import SIZE_NOT_COVERED

    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 11, (2,), generator=g), torch.tensor(1)) for _ in range(40)]
    for q in (None, 0.2):
        torch.manual_seed(3)
        eng = engine(selection={"name": "uniform", "k": 3}, noise_multiplier=2.0, sampling_rate=q)
        model = BagModel("sum")
        model, opt, loader = eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                              DataLoader(data, batch_size=4, collate_fn=collate_pairs), epochs=2)
        assert eng.sampling_rate == (0.1 if q is None else q)
        assert eng.total_steps == 2 * (10 if q is None else 5)
        assert (SIZE_NOT_COVERED in eng.statement().not_covered) == (q is None)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"clip1": 1.0, "noise_multiplier": 1.0}, 'PrivacyEngine: pass selection=, the row selection: {"name": "all"} '
                                                  "is DP-SGD"),
        ({"selection": {"name": "all"}, "noise_multiplier": 1.0}, "PrivacyEngine: pass clip1=, S1"),
    ],
)
def test_a_missing_required_argument_says_what_to_pass(kw, needle):
    with pytest.raises(TypeError) as e:
        PrivacyEngine(**kw)
    assert str(e.value).startswith(needle) and "\n" not in str(e.value)


def test_make_private_without_epochs_says_what_to_pass():
    model = nn.Embedding(10, 4)
    data = DataLoader([(torch.tensor([i % 10]), i % 2) for i in range(20)], batch_size=4, collate_fn=collate_pairs)
    eng = PrivacyEngine(selection={"name": "all"}, clip1=1.0, noise_multiplier=1.0)
    with pytest.raises(TypeError) as e:
        eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), data)
    assert str(e.value).startswith("make_private: pass epochs=, the planned run's length in epochs")
    assert eng._capture is None  # nothing hooked

