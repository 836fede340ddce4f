"""``task: module`` (widedp.tasks.module): a user's nn.Module and datasets, named by import path, trained by
``widedp train`` with the one loop: the run, ``--resume`` (equal to an uninterrupted run), ``widedp epsilon`` and the
PrivacyEngine (the same epsilon, and with a reproducible rng the same weights), and one-line errors."""

import json
from pathlib import Path

import pytest
import torch
from snapshots import train_with_snapshot
from torch.utils.data import DataLoader

import widedp
from widedp.cli import main
from widedp.config import load_config
from widedp.errors import ConfigError
from widedp.run.train import train
from widedp.tasks import examples as ex

torch.set_num_threads(1)
EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "module_example.yaml"
SMALL = ["data.kwargs.num_interactions=2500", "train.batch_size=100", "train.epochs=2", "train.log_every=8"]


def _config(tmp_path: Path, *sets: str) -> Path:
    """The shipped example, made small, written as a config file of its own."""
    cfg = load_config(EXAMPLE, [*SMALL, *sets])
    path = tmp_path / "module.yaml"
    import yaml

    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoint.pt", weights_only=True)["model"]


def test_train_from_the_cli_and_export(tmp_path, capsys):
    cfg = _config(tmp_path)
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run), "--no-progress"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == printed["steps"] == 2 * 20 and summary["n_train"] == 2000
    assert summary["dp"]["epsilon"] == printed["epsilon"] > 0 and summary["private"]
    assert summary["privacy"]["unit"].startswith("training example")
    # the checkpoint holds the user's module's own state_dict (no wrapper prefix); so does the release
    assert set(_weights(run)) == set(ex.BagRecommender(num_users=50, num_items=100, dim=8).state_dict())
    for f in ("metrics.jsonl", "loss.png", "config.yaml", "spent.json"):
        assert (run / f).is_file(), f
    assert main(["export", str(run), "--format", "torch", "--out", str(tmp_path / "rel")]) == 0
    assert set(torch.load(tmp_path / "rel" / "model.pt", weights_only=True)) == set(_weights(run))
    # non-private: autograd and torch Adam on the same module
    assert main(["train", str(cfg), "--out", str(tmp_path / "np"), "--no-progress", "--set", "dp=null",
                 "--set", "train.optimizer=adam", "--set", "train.lr=0.02"]) == 0
    np_summary = json.loads((tmp_path / "np" / "summary.json").read_text())
    assert "dp" not in np_summary and np_summary["valid_loss"] < np_summary["initial_valid_loss"]


def test_resume_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    """A copy of the run directory taken at its checkpoint of step 12 (a crash), resumed with `widedp train
    --resume`, ends with the uninterrupted run's weights and ledger (secret rng: its state is in private/)."""
    cfg = load_config(_config(tmp_path, "train.checkpoint_every=12"))
    run, snap = tmp_path / "run", tmp_path / "snap"
    full = train_with_snapshot(cfg, run, snap, step=12, monkeypatch=monkeypatch)
    assert torch.load(snap / "checkpoint.pt", weights_only=True)["step"] == 12
    assert main(["train", "--resume", str(snap), "--no-progress"]) == 0
    resumed = json.loads((snap / "summary.json").read_text())
    a, b = _weights(run), _weights(snap)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["dp"]["ledger"] == full["dp"]["ledger"] and resumed["steps"] == full["steps"] == 40


def _privacy_engine_run(cfg, *, noise_multiplier=None, target_epsilon=None):
    """The same model, data and settings through widedp.PrivacyEngine.make_private (reproducible rng)."""
    train_set, _, _ = ex.interactions(**cfg.data.kwargs)
    torch.manual_seed(cfg.train.seed)
    model = ex.BagRecommender(**cfg.model.kwargs)
    dp = cfg.dp
    with pytest.warns(UserWarning, match="NOT private"):
        engine = widedp.PrivacyEngine(selection=dp.selection, clip1=dp.clip1, clip2=dp.clip2,
                                      noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
                                      delta=dp.delta, secure_rng=False, seed=cfg.train.seed)
    model, opt, loader = engine.make_private(model, torch.optim.SGD(model.parameters(), lr=cfg.train.lr),
                                             DataLoader(train_set, batch_size=cfg.train.batch_size,
                                                        collate_fn=ex.collate), epochs=cfg.train.epochs,
                                             loss_fn=lambda b: ex.bce_loss(model, b))
    for _ in range(cfg.train.epochs):
        for batch in loader:
            opt.zero_grad()
            ex.bce_loss(model, batch).sum().backward()
            opt.step()
    return engine, model


def test_epsilon_equals_widedp_epsilon_and_the_privacy_engine(tmp_path, capsys):
    path = _config(tmp_path, "dp.rng=reproducible", "train.optimizer=sgd", "train.lr=0.5")
    cfg = load_config(path)
    summary = train(cfg, tmp_path / "run", progress=False)
    capsys.readouterr()
    assert main(["epsilon", str(path)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["epsilon"] == pytest.approx(summary["dp"]["epsilon"], rel=1e-9) and rep["steps"] == summary["steps"]
    assert rep["n_train"] == 2000 and rep["privacy"].startswith("NOT PRIVATE")
    engine, model = _privacy_engine_run(cfg, noise_multiplier=cfg.dp.noise_multiplier)
    assert engine.steps == summary["steps"]
    assert engine.epsilon() == pytest.approx(summary["dp"]["epsilon"], rel=1e-9)
    # the same seeds, batches, selection and noise: the CLI trains exactly what make_private trains
    theirs, ours = model.state_dict(), _weights(tmp_path / "run")
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)
    # calibration: the same sigma for the same target
    cal = load_config(path, ["dp.target_epsilon=3.0", "dp.calibrate=noise_multiplier", "train.epochs=1"])
    capsys.readouterr()
    assert main(["epsilon", str(path), "--set", "dp.target_epsilon=3.0", "--set", "dp.calibrate=noise_multiplier",
                 "--set", "train.epochs=1"]) == 0
    sigma = json.loads(capsys.readouterr().out)["noise_multiplier"]
    engine, _ = _privacy_engine_run(cal, target_epsilon=3.0)
    assert engine.noise_multiplier == pytest.approx(sigma, rel=1e-9) and sigma != cfg.dp.noise_multiplier


USER_CODE = '''
import torch
from torch import nn

def data(n=40):
    items = [(torch.tensor([i % 7]), torch.tensor(float(i % 2))) for i in range(n)]
    return items[:30], items[30:35], items[35:]

def not_a_model():
    return [1, 2]

def broken(**kw):
    raise ValueError("no such size")

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 2)
    def forward(self, batch):
        return self.emb(batch[0]).sum(-1)   # [B, 1]: not the [B] per-sample losses

def int_loss(model, batch):
    return model.emb(batch[0]).sum((1, 2)).long()

class Standardised(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(7, 2), nn.Linear(3, 1)
    def forward(self, batch):
        x = batch[0].float()
        x = (x - x.mean()) / (x.std() + 1e-3)   # a batch statistic: couples the samples, sends no gradient
        logit = self.out(torch.cat([self.emb(batch[0]).sum(1), x], 1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logit, batch[1], reduction="none")
'''


@pytest.mark.parametrize(("sets", "message"), [
    (["model.factory=nopkg_xyz.models:make"], "model.factory: cannot import 'nopkg_xyz.models'"),
    (["model.factory=user_mod:missing"], "model.factory: module 'user_mod' has no 'missing'"),
    (["model.factory=user_mod:not_a_model", "model.kwargs={}"],
     "model.factory: must return a torch.nn.Module, got list"),
    (["model.factory=user_mod:broken"], "model.factory: user_mod:broken(**model.kwargs) failed: ValueError"),
    (["data.factory=user_mod:not_a_model", "data.kwargs={}"],
     "data.factory: must return (train, valid, test) datasets"),
    (["data.factory=user_mod:data", "data.kwargs={}", "data.collate=null", "model.factory=user_mod:Tiny",
      "model.kwargs={}", "model.loss=null", "dp.selection.k=4", "train.batch_size=10"],
     "model.factory (its forward): must return the [B] per-sample losses"),
    (["model.factory=not a reference"], "model.factory: expected 'package.module:function'"),
    (["model.loss=user_mod:data"], "model.loss: user_mod:data(n=40) cannot be called as f(model, batch)"),
    (["data.collate=os:getcwd"], "data.collate: os:getcwd() cannot be called as f(items)"),
    (["data.factory=user_mod:data", "data.kwargs={}", "data.collate=null", "model.factory=user_mod:Tiny",
      "model.kwargs={}", "model.loss=user_mod:int_loss", "dp.selection.k=4", "train.batch_size=10"],
     "model.loss: must return floating-point per-sample losses, got torch.int64"),
    (["model.kwargs={1: 2}"], "model.kwargs: keys are keyword-argument names"),
    (["data.factory=user_mod:data", "data.kwargs={}", "data.collate=null", "model.factory=user_mod:Standardised",
      "model.kwargs={}", "model.loss=null", "dp.selection.k=4", "train.batch_size=10"],
     "model.factory: out: a sample's input to this layer changes with the other samples in its batch"),
    (["dp.engine=opacus", "dp.selection={name: all}", "dp.clip2=null", "train.optimizer=sgd"],
     "dp.engine: opacus is the DP-SGD baseline of task cbow"),
])
def test_errors_are_one_line_naming_the_key(tmp_path, monkeypatch, capsys, sets, message):
    (tmp_path / "user_mod.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _config(tmp_path)
    code = main(["train", str(cfg), "--out", str(tmp_path / "r"), "--no-progress",
                 *[x for s in sets for x in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("widedp: error: ") and message in err, err
    assert not (tmp_path / "r").exists()  # a new run that fails before it spent anything leaves nothing


def test_config_checks_without_importing(tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.collate: expected 'package.module:function'"):
        load_config(EXAMPLE, ["data.collate=collate"])
    cfg = load_config(EXAMPLE, ["model.factory=nopkg_xyz:make"])  # reading a config runs no user code
    assert cfg.model.factory == "nopkg_xyz:make" and cfg.task == "module"
