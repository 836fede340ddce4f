import pytest

from widedp.config import (
    Config,
    ExponentialSelectionConfig,
    UniformSelectionConfig,
    config_from_dict,
    load_config,
)
from widedp.errors import ConfigError


def test_defaults_and_preset():
    cfg = config_from_dict({})
    assert cfg.data.vocab_size == 1000 and cfg.data.splits == (0.20425, 0.10212, 0.20425)
    assert cfg.dp is None
    assert config_from_dict(cfg.to_dict()) == cfg  # to_dict writes dp: null for non-private
    cfg = config_from_dict({"data": {"preset": "brown_10k"}})
    assert cfg.data.vocab_size == 10_000


def test_selection_is_one_key():
    cfg = config_from_dict({"dp": {"selection": {"name": "uniform", "k": 5}}})
    assert isinstance(cfg.dp.selection, UniformSelectionConfig)
    cfg = config_from_dict({"dp": {"selection": {"name": "exponential", "k": 5, "epsilon": 0.3}}})
    assert isinstance(cfg.dp.selection, ExponentialSelectionConfig) and cfg.dp.selection.epsilon == 0.3


def test_round_trip_and_hash():
    cfg = config_from_dict({"dp": {"selection": {"name": "exponential", "gamma": 0.01}}, "train": {"epochs": 2}})
    again = config_from_dict(cfg.to_dict())
    assert again == cfg and again.hash() == cfg.hash()
    assert Config().hash() != cfg.hash()
    # keys added later hash only when set, so runs recorded before them keep their hash
    import hashlib
    import json

    d = cfg.to_dict()
    d["data"] = type(cfg.data).hash_view(d["data"])
    d["model"] = type(cfg.model).hash_view(d["model"])  # (model.init_vectors / init_output: only when set)
    del d["dp"]["sampling_rate"], d["dp"]["noise"]  # (dp.noise: only when not the default gaussian)
    del d["dp"]["allow_large_delta"]  # (never: a guard's opt-out changes no computation)
    del d["dp"]["max_batch_size"]  # (only when set)
    assert cfg.hash() == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]
    fixed = config_from_dict({**cfg.to_dict(), "dp": {**cfg.to_dict()["dp"], "sampling_rate": 0.01}})
    assert fixed.hash() != cfg.hash()
    bounded = config_from_dict({**cfg.to_dict(), "dp": {**cfg.to_dict()["dp"], "max_batch_size": "auto"}})
    assert bounded.hash() != cfg.hash() and config_from_dict(bounded.to_dict()) == bounded


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"trian": {}}, "trian: unknown key"),
        ({"train": {"epocs": 3}}, "train.epocs: unknown key"),
        ({"train": {"epochs": "three"}}, "train.epochs: expected an integer"),
        ({"train": {"epochs": -1}}, "train.epochs: must be > 0"),
        ({"train": {"lr": True}}, "train.lr: expected a number"),
        ({"model": {"dim": 0}}, "model.dim: must be > 0"),
        ({"model": {"tied": "yes"}}, "model.tied: expected true/false"),
        ({"data": {"vocab_size": -5}}, "data.vocab_size: must be > 0"),
        ({"data": {"negatives": -1}}, "data.negatives: must be >= 0"),
        ({"data": {"splits": [1, 2]}}, "data.splits: need 3"),
        ({"data": {"splits": [-1, 2, 3]}}, "data.splits: sizes must be >= 0"),
        ({"data": {"preset": "nope"}}, "data.preset: unknown preset"),
        ({"data": {"sample_shape": "tree"}}, "data.sample_shape: expected one of"),
        ({"data": {"corpus": "text:/no/such/file.txt"}}, "file not found: /no/such/file.txt"),
        ({"dp": {"selection": {"name": "magic"}}}, "dp.selection.name"),
        ({"dp": {"sampling_rate": 1.5, "selection": {"name": "all"}}}, "dp.sampling_rate: must be in (0, 1]"),
        ({"dp": {"sampling_rate": 0, "selection": {"name": "all"}}}, "dp.sampling_rate: must be in (0, 1]"),
        ({"dp": {"selection": {"name": "exponential"}}}, "exactly one of k or gamma"),
        ({"dp": {"selection": {"name": "uniform", "k": 3, "gamma": 0.1}}}, "exactly one of k or gamma"),
        ({"dp": {"selection": {"name": "exponential", "k": 1, "bogus": 1}}}, "dp.selection.bogus: unknown key"),
        ({"dp": {"clip1": 0, "selection": {"name": "all"}}}, "dp.clip1: must be > 0"),
        ({"dp": {"delta": 2, "selection": {"name": "all"}}}, "dp.delta"),
        ({"dp": {"calibrate": "noise_multiplier", "selection": {"name": "all"}}}, "needs dp.target_epsilon"),
        ({"dp": {"target_epsilon": 3, "calibrate": "selection_epsilon", "selection": {"name": "all"}}},
         "a selection with a privacy parameter"),
        # wrong section types used to be tracebacks (TypeError / ValueError) or silently the defaults
        ({"data": [1, 2]}, "data: expected a mapping, got list [1, 2]"),
        ({"data": "brown"}, "data: expected a mapping, got str 'brown'"),
        ({"task": ["cbow"]}, "task: expected one of cbow, recsys, glm, module, got ['cbow']"),
        ({"task": None}, "task: expected one of"),
        ({"dp": {"selection": {"name": ["exponential"]}}}, "dp.selection.name: expected one of"),
        ({"dp": {"selection": "all"}}, "dp.selection: expected a mapping, got str 'all'"),
        ({"dp": 1}, "dp: expected a mapping, got int 1"),
        ({"dp": {"clip1": "abc"}}, "dp.selection: not given, and the default (dp.selection: give exactly one of k or "
                                   "gamma) fails; dp: has only clip1"),
        ({"train": 5}, "train: expected a mapping, got int 5"),
        ({"train": False}, "train: expected a mapping, got bool False"),
        ({"task": "glm", "algorithm": []}, "algorithm: expected a mapping, got list []"),
        ({"data": {"preset": {"a": 1}}}, "data.preset: unknown preset {'a': 1}"),
        ({"train": {"lr": float("nan")}}, "train.lr: expected a finite number, got nan"),
        ({"train": {"lr": 10**400}}, "train.lr: expected a finite number"),
        ({"train": {"epochs": "x" * 10_000}}, "train.epochs: expected an integer, got 'xxxxxxxxxx"),
        ({("a", 1): 1}, "('a', 1): unknown key"),
        ({"data": {"corpus": "text:~no_such_user_widedp/x.txt"}}, "data: invalid value (RuntimeError"),
        # a present-but-empty dp.selection: (keys all commented out); dp: null is refused by load_config
        ({"dp": {"selection": None}}, "dp.selection: is present but empty"),
    ],
)
def test_errors_name_the_key(raw, needle):
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_load_config_files_and_overrides(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)
    good = tmp_path / "good.yaml"
    good.write_text("train:\n  epochs: 2\n")
    cfg = load_config(good, ["train.epochs=5", "dp.selection.name=all", "dp.noise_multiplier=0.7"])
    assert cfg.train.epochs == 5 and cfg.dp.noise_multiplier == 0.7 and cfg.dp.selection.name == "all"
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(good, ["train.epochs"])


def test_errors_are_short_and_raw_is_not_modified():
    raw = {"train": {"epochs": list(range(10_000))}, "dp": {"selection": {"name": "all"}}}
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert len(str(e.value)) < 200
    assert raw == {"train": {"epochs": list(range(10_000))}, "dp": {"selection": {"name": "all"}}}
    with pytest.raises(ConfigError, match="config: expected a mapping, got list"):
        config_from_dict([("train", {})])  # type: ignore[arg-type]
