"""The recsys task: torchrec model, per-sample gradients, interaction data, configs, training through widedp.run.train,
and the ``always_rows`` extension of the DP step (dense MLP rows updated every step)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import stats

from widedp.commands.epsilon import epsilon_report
from widedp.config import (
    AllRowsConfig,
    ExponentialSelectionConfig,
    UniformSelectionConfig,
    config_from_dict,
)
from widedp.config.recsys import RecsysDataConfig, RecsysModelConfig
from widedp.data_prep.interactions import RecsysSplit, prepare_interactions
from widedp.dp.rowgrads import PerSampleRows, coalesce
from widedp.dp.selection import SelectionContext, make_selector
from widedp.dp.spend import ExponentialSpend
from widedp.dp.step import dp_step
from widedp.errors import ConfigError
from widedp.models.recsys import RecsysBatch, RecsysModel, make_kjt
from widedp.run.train import train
from widedp.tasks.recsys import build_model

CTX = SelectionContext(epoch=0, num_epochs=1)


def tiny_data(**kw):
    base = dict(num_users=7, num_items=9, num_interactions=300, num_tags=5, tags_per_item=3, context_cardinality=4,
                cache_dir="")
    return prepare_interactions(RecsysDataConfig(**{**base, **kw}))


def as_double(b: RecsysBatch) -> RecsysBatch:
    return RecsysBatch(b.kjt, b.labels.double())


# --------------------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("pooling,hidden,interaction", [("mean", (5, 3), True), ("sum", (), False),
                                                        ("sum", (4,), True)])
def test_per_sample_grads_match_brute_force(pooling, hidden, interaction):
    data = tiny_data()
    split = RecsysSplit(data.train, "cpu")
    gen = torch.Generator().manual_seed(1)
    model = RecsysModel(data.cardinality, dim=3, hidden=hidden, pooling=pooling, interaction=interaction,
                        init_scale=0.5, generator=gen).double()
    idx = torch.arange(12)
    batch = as_double(split.batch(idx))
    tags = batch.kjt.to_dict()["tags"].values().view(12, 3)
    assert any(len(set(t.tolist())) < 3 for t in tags), "want a bag with a repeated tag"
    with torch.inference_mode():
        loss, g = model.per_sample_row_grads(batch)
    assert g.num_rows == model.total_rows and g.always_rows == model.num_dense_rows
    assert torch.equal(g.rows[g.offsets[1] - g.always_rows : g.offsets[1]],
                       torch.arange(model.num_rows, model.total_rows))
    for j in range(12):  # rows unique and sorted within each sample
        r = g.rows[g.offsets[j] : g.offsets[j + 1]]
        assert torch.all(r[1:] > r[:-1])
    dense = g.to_dense()
    for j in range(12):
        model.zero_grad()
        lj = model(as_double(split.batch(idx[j : j + 1])))
        torch.testing.assert_close(lj, loss[j : j + 1], rtol=1e-6, atol=1e-7)
        lj.sum().backward()
        ref = torch.cat([w.grad for _, w in model.row_tables()])
        torch.testing.assert_close(dense[j], ref, rtol=1e-5, atol=1e-7)  # the EBC pools in float32
        assert ref.abs().max() > 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_per_sample_grads_and_dp_step_on_cuda_equal_cpu():
    """The recommender's closed-form gradients and a noise-free DP step on CUDA against the CPU."""
    data = tiny_data()
    model = RecsysModel(data.cardinality, dim=3, hidden=(5,), init_scale=0.5,
                        generator=torch.Generator().manual_seed(1))
    batch = RecsysSplit(data.train, "cpu").batch(torch.arange(32))
    out = []
    for dev in ("cpu", "cuda"):
        m = model.to(dev)
        with torch.inference_mode():
            loss, g = m.per_sample_row_grads(batch.to(dev))
            res = dp_step(g, batch_size=32.0, sampling_rate=0.1, clip1=0.5, clip2=1.0, noise_multiplier=0.0,
                          selector=make_selector(AllRowsConfig(), num_rows=g.num_rows - g.always_rows), ctx=CTX,
                          generator=torch.Generator(device=dev).manual_seed(0), always_rows=g.always_rows)
        out.append((loss.cpu(), g.rows.cpu(), g.offsets.cpu(), g.values.cpu(), res.grad.values.cpu()))
    (l0, r0, o0, v0, d0), (l1, r1, o1, v1, d1) = out
    assert torch.equal(r0, r1) and torch.equal(o0, o1)
    for a, b in ((l0, l1), (v0, v1), (d0, d1)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_empty_batch_and_row_tables_drive_lookups():
    data = tiny_data()
    split = RecsysSplit(data.train, "cpu")
    model = build_model(data.cardinality, RecsysModelConfig(dim=4, hidden=(5,)), seed=0)
    with torch.inference_mode():
        loss, g = model.per_sample_row_grads(split.batch(torch.zeros(0, dtype=torch.long)))
    assert loss.shape == (0,) and g.values.shape == (0, 4) and g.offsets.tolist() == [0]
    batch = split.batch(torch.arange(5))
    before = model(batch).detach()
    tables = model.row_tables()
    assert [off for off, _ in tables] == [0, 7, 16, 21, 25] and tables[-1][1].shape[0] == model.num_dense_rows
    item = int(batch.kjt.to_dict()["item"].values()[0])
    with torch.no_grad():
        tables[1][1][item] += 1.0  # an item row: the EBC's lookup must see it
    assert not torch.allclose(model(batch).detach()[0], before[0])
    mid = model.logits(batch).detach()
    with torch.no_grad():
        tables[-1][1].view(-1)[model.num_dense_params - 1] += 1.0  # the last layer's bias: a dense row
    torch.testing.assert_close(model.logits(batch).detach() - mid, torch.ones(5))


# -------------------------------------------------------------------------------------------------------- data


def test_synthetic_power_law_and_kjt_batches():
    cfg = RecsysDataConfig(num_users=50, num_items=200, num_interactions=20_000, cache_dir="")
    data = prepare_interactions(cfg)
    assert list(data.cardinality) == ["user", "item", "tags", "ctx0"]
    sizes = np.array([len(data.train), len(data.valid), len(data.test)])  # Binomial at 0.8 / 0.1 / 0.1
    assert (np.abs(sizes - [16_000, 2_000, 2_000]) <= 4 * np.sqrt(20_000 * np.array([0.16, 0.09, 0.09]))).all()
    items = data.train.features["item"][:, 0]
    counts = np.bincount(items, minlength=200)
    # P(i) ∝ 1/(i+1): item 0 about 10x item 9 and 100x item 99
    assert 6 < counts[0] / counts[9] < 15 and counts[:10].sum() > 20 * counts[100:110].sum()
    assert 0.2 < data.positive_rate < 0.8
    again = prepare_interactions(cfg)
    assert np.array_equal(again.train.label, data.train.label)
    split = RecsysSplit(data.train, "cpu")
    b = split.batch(torch.tensor([3, 0, 5]))
    assert b.kjt.keys() == ["user", "item", "tags", "ctx0"] and b.kjt.stride() == 3
    assert b.kjt.lengths().tolist() == [1] * 6 + [2] * 3 + [1] * 3
    assert b.kjt.to_dict()["item"].values().tolist() == items[[3, 0, 5]].tolist()
    assert b.labels.tolist() == data.train.label[[3, 0, 5]].tolist()


def test_ratings_loaders(tmp_path):
    dat = tmp_path / "ratings.dat"
    dat.write_text("10::500::5::978300760\n10::7::3::978302109\n3::500::4::978301968\n42::9::1::3600\n")
    cfg = RecsysDataConfig(source=f"ratings:{dat}", splits=(4, 0, 0), cache_dir=str(tmp_path / "c"))
    d = prepare_interactions(cfg)
    assert d.cardinality == {"user": 3, "item": 3, "hour": 24}
    order = np.argsort(d.train.features["user"][:, 0] * 10 + d.train.features["item"][:, 0])
    users, items = d.train.features["user"][order, 0], d.train.features["item"][order, 0]
    assert users.tolist() == [0, 1, 1, 2] and items.tolist() == [2, 0, 2, 1]  # 3<10<42; 7<9<500
    assert d.train.label[order].tolist() == [1, 0, 1, 0]  # rating >= 4
    assert sorted(d.train.features["hour"][:, 0].tolist()) == sorted([(t // 3600) % 24 for t in
                                                                      (978300760, 978302109, 978301968, 3600)])
    assert (tmp_path / "c").is_dir() and prepare_interactions(cfg).cardinality == d.cardinality  # from the cache
    csv = tmp_path / "ratings.csv"
    csv.write_text("userId,movieId,rating,timestamp\n1,31,2.5,1260759144\n1,1029,3.0,1260759179\n"
                   "2,31,4.5,1260759185\n")
    d2 = prepare_interactions(RecsysDataConfig(source=f"ratings:{csv}", splits=(3, 0, 0), cache_dir="",
                                               time_feature=False))
    assert d2.cardinality == {"user": 2, "item": 2} and sorted(d2.train.label.tolist()) == [0, 0, 1]
    bad = tmp_path / "bad.csv"
    bad.write_text("uid,iid,stars\n1,2,3\n")
    with pytest.raises(ConfigError, match=r"^data\.columns: column 'userId' not in"):
        prepare_interactions(RecsysDataConfig(source=f"ratings:{bad}", splits=(1, 0, 0), cache_dir=""))


def test_hf_saved_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"u": ["a", "b", "a"], "i": [5, 6, 6], "r": [5.0, 1.0, 4.0]}).save_to_disk(
        str(tmp_path / "ds"))
    d = prepare_interactions(RecsysDataConfig(source=f"hf:{tmp_path / 'ds'}", columns=("u", "i", "r", ""),
                                              splits=(3, 0, 0), cache_dir=""))
    assert d.cardinality == {"user": 2, "item": 2} and sorted(d.train.label.tolist()) == [0, 1, 1]


@pytest.mark.parametrize("raw,key", [
    ({"data": {"source": "csv:x"}}, "data.source"),
    ({"data": {"source": "ratings:/no/such/file.dat"}}, "data.source"),
    ({"data": {"num_users": 0}}, "data.num_users"),
    ({"data": {"splits": [0.9, 0.2, 0.1]}}, "data.splits"),
    ({"data": {"preset": "netflix"}}, "data.preset"),
    ({"data": {"colour": 1}}, "data.colour"),
    ({"model": {"hidden": [8, 0]}}, "model.hidden"),
    ({"model": {"pooling": "max"}}, "model.pooling"),
    ({"model": {"dim": -1}}, "model.dim"),
])
def test_config_errors_name_the_key(raw, key):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"task": "recsys", **raw})
    msg = str(e.value)
    assert msg.startswith(key + ":") and "\n" not in msg


# ---------------------------------------------------------------------------------------------- training


def tiny_cfg(dp: dict | None):
    raw = {"task": "recsys",
           "data": {"num_users": 30, "num_items": 60, "num_interactions": 6000, "num_tags": 10, "cache_dir": "",
                    "splits": [0.7, 0.15, 0.15]},
           "model": {"dim": 4, "hidden": [8]},
           "train": {"epochs": 3, "batch_size": 200, "optimizer": "lazy_adam", "lr": 0.02, "log_every": 5,
                     "device": "cpu", "eval_batch_size": 4096}}
    if dp is not None:
        raw["dp"] = {"clip1": 2.0, "clip2": 1.0, "noise_multiplier": 0.8, "delta": 1e-5, **dp}
    return config_from_dict(raw)


def test_dp_training_learns_and_spends(tmp_path):
    cfg = tiny_cfg({"selection": {"name": "exponential", "k": 40, "epsilon": 0.5, "score_clip": 0.05}})
    s = train(cfg, tmp_path / "run", progress=False)
    assert s["private"] and s["dp"]["epsilon"] > 0 and (tmp_path / "run" / "summary.json").is_file()
    assert s["steps"] == 3 * round(s["n_train"] / 200)
    # learns at least the base rate (the always-updated MLP rows): ln 2 - H(p) ~ 0.02 nats at p ~ 0.41
    assert s["valid_loss"] < s["initial_valid_loss"] - 0.01, (s["initial_valid_loss"], s["valid_loss"])
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    sel = [r["rows_selected"] for r in recs if r["kind"] == "interval"]
    model = build_model(json.loads((tmp_path / "run" / "features.json").read_text())["cardinality"], cfg.model,
                        seed=0)
    assert set(sel) == {40 + model.num_dense_rows}
    rep = epsilon_report(cfg)
    assert rep["n_train"] == s["n_train"] and rep["epsilon"] == pytest.approx(s["dp"]["epsilon"], rel=1e-6)
    assert abs(s["n_train"] - 4200) < 150  # 0.7 of 6,000 interactions (Binomial)


def test_nonprivate_training_and_optimizer_errors(tmp_path):
    cfg = tiny_cfg(None)
    cfg = config_from_dict({**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "optimizer": "adam", "lr": 0.01}})
    s = train(cfg, tmp_path / "np", progress=False)
    assert not s["private"] and s["valid_loss"] < s["initial_valid_loss"] - 0.02
    sparse = config_from_dict({**cfg.to_dict(), "model": {"dim": 4, "hidden": [8], "sparse": True},
                               "train": {**cfg.to_dict()["train"], "optimizer": "sgd", "lr": 0.5, "epochs": 1}})
    assert train(sparse, tmp_path / "sp", progress=False)["steps"] == 21
    bad = config_from_dict({**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "optimizer": "sparse_adam"},
                            "model": {"sparse": True}})
    with pytest.raises(ConfigError, match=r"^train\.optimizer: sparse_adam is not available for recsys"):
        train(bad, tmp_path / "bad", progress=False)


def test_shipped_configs_load():
    from widedp.config import load_config

    cfg = load_config("configs/recsys_synthetic_sparse_exp.yaml")
    assert cfg.task == "recsys" and cfg.dp.selection.name == "exponential"
    assert load_config("configs/recsys_synthetic_sparse_exp.yaml",
                       ["dp.selection={name: uniform, k: 100}"]).dp.selection.name == "uniform"
    assert load_config("configs/movielens_sparse_exp.yaml").data.source == "movielens100k"  # works out of the box
    with pytest.raises(ConfigError, match=r"^data\.source: file not found: data/ml-1m/ratings\.dat"):
        load_config("configs/movielens_sparse_exp.yaml", ["data.preset=movielens"])


# ------------------------------------------------------------------------------------- dp_step always_rows


def random_rows(seed: int, B: int, R: int, D: int, always: int = 0) -> PerSampleRows:
    g = torch.Generator().manual_seed(seed)
    n = 3 * B
    rows = torch.randint(R - always, (n,), generator=g)
    sample = torch.randint(B, (n,), generator=g)
    vals = torch.randn(n, D, generator=g)
    if always:
        rows = torch.cat([rows, torch.arange(R - always, R).repeat(B)])
        sample = torch.cat([sample, torch.arange(B).repeat_interleave(always)])
        vals = torch.cat([vals, 3 * torch.randn(B * always, D, generator=g)])
    return coalesce(vals, rows, sample, B, R)


def step(g, selector, seed, **kw):
    args = dict(batch_size=8, sampling_rate=0.1, clip1=1.0, clip2=0.5, noise_multiplier=0.7, selector=selector,
                ctx=CTX, generator=torch.Generator().manual_seed(seed))
    return dp_step(g, **{**args, **kw})


@pytest.mark.parametrize("sel_cfg", [ExponentialSelectionConfig(k=5, epsilon=1.0, score_clip=0.2),
                                     UniformSelectionConfig(k=5), AllRowsConfig()])
def test_always_rows_none_is_the_unchanged_step(sel_cfg):
    g = random_rows(0, B=8, R=40, D=3)
    sel = make_selector(sel_cfg, num_rows=40)
    a, b, c = step(g, sel, 3), step(g, sel, 3, always_rows=0), step(g, sel, 3, always_rows=None)
    for r in (b, c):
        assert torch.equal(a.selected, r.selected) and torch.equal(a.grad.values, r.grad.values)
        assert a.spend == r.spend


def test_always_rows_selected_free_and_noised():
    R, A, D = 400, 6, 4
    g = random_rows(1, B=8, R=R, D=D, always=A)  # the A tail rows carry the largest gradients
    sel = make_selector(ExponentialSelectionConfig(k=5, epsilon=1.0, score_clip=0.2), num_rows=R - A)
    picks, noise = [], []
    for seed in range(300):
        res = step(g, sel, seed, always_rows=A)
        quiet = step(g, sel, seed, always_rows=A, noise_multiplier=1e-12)  # same selection (drawn first), no noise
        assert torch.equal(res.selected[-A:], torch.arange(R - A, R)) and res.selected.numel() == 5 + A
        assert torch.equal(res.selected, quiet.selected)
        assert res.spend.parts[1] == ExponentialSpend(epsilon=1.0, picks=5)  # same as the step without A
        picks.append(res.selected[:-A])
        noise.append((res.grad.values[-A:] - quiet.grad.values[-A:]).flatten() / (0.7 * min(1.0 / 8, 2 * 0.5)))
    assert int(torch.cat(picks).max()) < R - A
    z = torch.cat(noise).numpy()
    assert stats.kstest(z, "norm").pvalue > 1e-3 and abs(z.std() - 1) < 0.05
    # negative control: without always_rows the dense rows are ordinary candidates, picked only now and then
    sel_all = make_selector(ExponentialSelectionConfig(k=5, epsilon=1.0, score_clip=0.2), num_rows=R)
    hits = sum(int((step(g, sel_all, s, always_rows=0).selected >= R - A).sum()) for s in range(50))
    assert 0 < hits < 50 * 2
    # PerSampleRowsWithDense carries A to the step (what widedp.run.trainers.sparse relies on)
    from widedp.models.recsys import PerSampleRowsWithDense

    gd = PerSampleRowsWithDense(g.values, g.rows, g.offsets, g.num_rows, always_rows=A)
    assert torch.equal(step(gd, sel, 5).selected, step(g, sel, 5, always_rows=A).selected)


def test_make_kjt_has_no_lazy_host_work():
    kjt = make_kjt(["a", "b"], [torch.tensor([[1], [2]]), torch.tensor([[3, 4], [5, 5]])])
    assert kjt.length_per_key() == [2, 4] and kjt.offset_per_key() == [0, 2, 6]
    assert kjt.to_dict()["b"].values().tolist() == [3, 4, 5, 5]
