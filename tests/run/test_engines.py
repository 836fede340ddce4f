"""widedp.run.engines: the step objects the one loop drives share one protocol; make_engine picks by the config."""

import inspect

import torch

from widedp.config import config_from_dict
from widedp.run.engines import Engine, make_engine
from widedp.run.engines.opacus_baseline import OpacusEngine
from widedp.run.engines.plain import NonPrivateEngine
from widedp.run.engines.sharded import ShardedDPEngine
from widedp.run.engines.sparse import SparseDPEngine


def test_engines_implement_the_protocol():
    methods = {n for n, v in inspect.getmembers(Engine, inspect.isfunction) if not n.startswith("_")}
    assert {"setup", "sample", "step", "state_dict", "load_state_dict", "report"} <= methods
    for cls in (NonPrivateEngine, SparseDPEngine, OpacusEngine, ShardedDPEngine):
        missing = [m for m in methods if not callable(getattr(cls, m, None))]
        assert not missing, (cls.__name__, missing)


def test_make_engine_follows_the_config(tmp_path):
    cpu = torch.device("cpu")
    dp = {"clip1": 1.0, "clip2": None, "noise_multiplier": 1.0, "rng": "reproducible", "selection": {"name": "all"}}
    plain = config_from_dict({"train": {"optimizer": "sgd"}})
    assert type(make_engine(plain, tmp_path / "a", device=cpu, resumed=False)) is NonPrivateEngine
    sparse = config_from_dict({"train": {"optimizer": "sgd"}, "dp": dp})
    engine = make_engine(sparse, tmp_path / "b", device=cpu, resumed=False)
    assert type(engine) is SparseDPEngine and engine.prefix_seed is None  # nothing released before the steps
    opacus = config_from_dict({"train": {"optimizer": "sgd"}, "dp": {**dp, "engine": "opacus"}})
    assert type(make_engine(opacus, tmp_path / "c", device=cpu, resumed=False)) is OpacusEngine
