"""``data.user_feature: false``: interactions without a user table, still grouped by user for user-level DP."""

import json

import numpy as np
import pytest
import torch

from widedp.cli import main
from widedp.config import config_from_dict
from widedp.config.recsys import RecsysDataConfig
from widedp.data_prep.interactions import RecsysSplit, prepare_interactions
from widedp.errors import ConfigError
from widedp.tasks.recsys import NO_USER_TABLE_IDS_NOT_COVERED, RELEASED_MODEL, RecsysTask


def _ratings(path, *, users=30, n=600, seed=2):
    """A headed ratings CSV with string user ids (``user-0007``: a release holding one is found by a byte search)."""
    rng = np.random.default_rng(seed)
    rows = zip(rng.integers(0, users, n), rng.integers(1, 50, n), rng.integers(1, 6, n), rng.integers(0, 10**6, n))
    path.write_text("userId,movieId,rating,timestamp\n" + "".join(f"user-{u:04d},{i},{r},{t}\n" for u, i, r, t in rows))
    return path


def _data(path, *, user_feature, buckets=0):
    return prepare_interactions(RecsysDataConfig(preset="custom", source=f"ratings:{path}", cache_dir="",
                                                 user_feature=user_feature, id_buckets=buckets))


@pytest.mark.parametrize("buckets", [0, 8])
def test_no_user_feature_keeps_splits_and_groups_by_raw_user(tmp_path, buckets):
    """Without the user feature the splits hold the same interactions (the split is keyed on raw fields), no user
    table or user ids remain, and each interaction's user numbers the raw users (not hashed buckets)."""
    path = _ratings(tmp_path / "r.csv")
    full, bare = _data(path, user_feature=True, buckets=buckets), _data(path, user_feature=False, buckets=buckets)
    assert "user" not in bare.cardinality and "user" not in bare.ids and list(bare.cardinality) == ["item", "hour"]
    assert bare.cardinality == {k: v for k, v in full.cardinality.items() if k != "user"}
    raw_users = {line.split(",")[0] for line in path.read_text().splitlines()[1:]}
    for s in ("train", "valid", "test"):
        a, b = getattr(full, s), getattr(bare, s)
        assert np.array_equal(a.label, b.label) and np.array_equal(a.features["item"], b.features["item"])
        assert "user" not in b.features and b.user is not None
        ref = a.user if buckets else a.features["user"][:, 0]
        assert np.array_equal(b.user, ref)  # the same grouping the user feature (or the raw ids) gave
    assert len(np.unique(np.concatenate([bare.train.user, bare.valid.user, bare.test.user]))) == len(raw_users)


def test_user_units_without_a_user_table(tmp_path):
    """``RecsysTask.units`` groups by the raw user when the model has no user feature; with neither, one error."""
    path = _ratings(tmp_path / "r.csv")
    cfg = config_from_dict({"task": "recsys", "data": {"preset": "custom", "source": f"ratings:{path}", "cache_dir": "",
                                                       "privacy_unit": "user", "user_feature": False,
                                                       "max_samples_per_unit": 5}})
    split = RecsysSplit(prepare_interactions(cfg.data).train, "cpu")
    units = RecsysTask().units(cfg, split, device="cpu")
    users = split.user
    assert units.num_units == len(np.unique(users))
    for j in range(units.num_units):
        idx = units.samples[units.offsets[j]:units.offsets[j + 1]].numpy()
        assert len(np.unique(users[idx])) == 1 and 1 <= len(idx) <= 5
    split.user = None
    with pytest.raises(ConfigError, match="needs a 'user' feature"):
        RecsysTask().units(cfg, split, device="cpu")


def test_bad_value_is_one_line_and_default_hash_unchanged():
    with pytest.raises(ConfigError, match=r"^data\.user_feature: expected true/false, got 3$"):
        config_from_dict({"task": "recsys", "data": {"user_feature": 3}})
    d = RecsysDataConfig()
    assert "user_feature" not in RecsysDataConfig.hash_view({"user_feature": True})
    assert RecsysDataConfig.hash_view({"user_feature": False}) == {"user_feature": False}
    assert d.cache_key() != RecsysDataConfig(user_feature=False).cache_key()


def test_user_level_run_without_a_user_table_releases_the_whole_model(tmp_path, capsys):
    """privacy_unit user + user_feature false: the release is the whole model (nothing withheld, no user id), the
    metrics score it, and the statement's gap names the item ids only."""
    run, rel = tmp_path / "run", tmp_path / "rel"
    sets = [f"data.source=ratings:{_ratings(tmp_path / 'r.csv')}", "data.preset=custom", "data.privacy_unit=user",
            "data.user_feature=false", f"data.cache_dir={tmp_path / 'c'}", "train.epochs=1", "train.batch_size=10",
            "dp.selection.k=20", "dp.rng=reproducible"]
    argv = ["train", "configs/recsys_synthetic_sparse_exp.yaml", "--out", str(run), "--no-progress"]
    assert main([*argv, *[x for s in sets for x in ("--set", s)]]) == 0
    capsys.readouterr()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["metrics_model"] == RELEASED_MODEL and "release_test_auc" not in summary
    assert NO_USER_TABLE_IDS_NOT_COVERED in summary["privacy"]["not_covered"]
    start = json.loads((run / "metrics.jsonl").read_text().splitlines()[2])
    assert start["kind"] == "start" and start["n_units"] == 30
    assert main(["export", str(run), "--format", "torch", "--out", str(rel)]) == 0
    ids = json.loads((rel / "ids.json").read_text())
    state = torch.load(rel / "model.pt", weights_only=True)
    assert ids["features"] == ["item", "hour"] and "withheld" not in ids
    assert not [k for k in state if "t_user" in k] and b"user-" not in b"".join(p.read_bytes() for p in rel.iterdir())
