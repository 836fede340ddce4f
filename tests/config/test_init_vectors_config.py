"""``model.init_vectors`` / ``model.init_output`` in ModelConfig: one-line refusals, and a config hash that the two
keys change only when set (the checkpoints of earlier runs still resume)."""

import pytest

from widedp.config import config_from_dict
from widedp.errors import ConfigError


def _cfg(**model):
    return config_from_dict({"model": {"dim": 8, "tied": False, **model}, "train": {"epochs": 1}})


@pytest.mark.parametrize("model,needle", [
    ({"init_output": "vectors"}, "model.init_output: vectors needs model.init_vectors"),
    ({"init_vectors": "v.txt", "init_output": "vectors", "tied": True}, "model.init_output: vectors applies to untied"),
    ({"init_vectors": " "}, "model.init_vectors: an empty path"),
    ({"init_vectors": "v.txt", "init_output": "copy"}, "model.init_output: expected one of zeros, vectors"),
    ({"init_vectors": 3}, "model.init_vectors"),
    ({"init_vector": "v.txt"}, "init_vector"),
])
def test_bad_values_are_one_line_errors(model, needle):
    with pytest.raises(ConfigError) as e:
        _cfg(**model)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_hash_changes_only_when_the_keys_are_set():
    base = _cfg().hash()
    assert _cfg(init_output="zeros").hash() == base  # the default, written out
    warm = _cfg(init_vectors="v.txt").hash()
    assert warm != base and _cfg(init_vectors="v.txt", init_output="vectors").hash() != warm
    assert "init_vectors" in _cfg().to_dict()["model"]  # config.yaml still writes every key
