"""widedp.run.trainers: the step objects the one loop drives share one protocol; make_trainer picks by the config."""

import inspect

import torch

from widedp.config import config_from_dict
from widedp.run.trainers import Trainer, make_trainer
from widedp.run.trainers.opacus_baseline import OpacusTrainer
from widedp.run.trainers.plain import NonPrivateTrainer
from widedp.run.trainers.sharded import ShardedDPTrainer
from widedp.run.trainers.sparse import SparseDPTrainer


def test_engines_implement_the_protocol():
    methods = {n for n, v in inspect.getmembers(Trainer, inspect.isfunction) if not n.startswith("_")}
    assert {"setup", "sample", "step", "state_dict", "load_state_dict", "report"} <= methods
    for cls in (NonPrivateTrainer, SparseDPTrainer, OpacusTrainer, ShardedDPTrainer):
        missing = [m for m in methods if not callable(getattr(cls, m, None))]
        assert not missing, (cls.__name__, missing)


def test_make_engine_follows_the_config(tmp_path):
    cpu = torch.device("cpu")
    dp = {"clip1": 1.0, "clip2": None, "noise_multiplier": 1.0, "rng": "reproducible", "selection": {"name": "all"}}
    plain = config_from_dict({"train": {"optimizer": "sgd"}})
    assert type(make_trainer(plain, tmp_path / "a", device=cpu, resumed=False)) is NonPrivateTrainer
    sparse = config_from_dict({"train": {"optimizer": "sgd"}, "dp": dp})
    trainer = make_trainer(sparse, tmp_path / "b", device=cpu, resumed=False)
    assert type(trainer) is SparseDPTrainer and trainer.prefix_seed is None  # nothing released before the steps
    opacus = config_from_dict({"train": {"optimizer": "sgd"}, "dp": {**dp, "engine": "opacus"}})
    assert type(make_trainer(opacus, tmp_path / "c", device=cpu, resumed=False)) is OpacusTrainer
