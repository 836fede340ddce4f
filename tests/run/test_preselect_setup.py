"""``dp.preselect`` in training (widedp.run.preselect_setup, drawn in the DP engine's setup): charged once as a
prefix and composed by hand, rows outside the kept set bit-identical after training, resume equal to an uninterrupted
run, the secret seed, the restricted per-sample rows and the per-unit contributions against brute force. The
pre-selection's output law is tests/dp/selection/test_preselect.py's."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
from snapshots import train_with_snapshot
from tiny_corpus import data_section

import widedp.run.train as train_mod
from widedp import accounting
from widedp.cli import main
from widedp.config import load_config
from widedp.dp import rng, units, vocab
from widedp.dp.rowgrads import PerSampleRows
from widedp.dp.selection.preselect import preselect_step
from widedp.errors import ConfigError
from widedp.run import plan, preselect_setup
from widedp.tasks.cbow import build_cbow

PRE = "preselect: {rows: 10, sigma: 2.0, threshold_sigmas: 1.0}"


def _config(tmp_path, *, steps=100, ckpt_every=0, dp_extra="", selection="{name: all}", engine="", data_extra=""):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
{data_section(tmp_path, words=13, extra=data_extra)}
model: {{dim: 8, tied: false}}
train: {{epochs: {steps // 100 + 1}, max_steps: {steps}, batch_size: 10, optimizer: lazy_adam, lr: 0.01,
        log_every: 25, checkpoint_every: {ckpt_every}, eval_max_samples: 50, seed: 3}}
dp:
  clip1: 1.0
  clip2: 1.0
  noise_multiplier: 1.0
  accountant: rdp
  {PRE}
  {dp_extra}
  {engine}
  selection: {selection}
""")
    return cfg


def _kept(run):
    return json.loads((run / rng.PRIVATE_DIR / preselect_setup.PRESELECT_FILE).read_text())["kept"]


def test_prefix_charged_once_and_epsilon_by_hand(tmp_path, capsys):
    cfg_path = _config(tmp_path, dp_extra="target_epsilon: 6.0\n  calibrate: noise_multiplier")
    out = tmp_path / "run"
    assert main(["train", str(cfg_path), "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    ledger = accounting.Ledger.from_json(summary["dp"]["ledger"])
    pre = preselect_step(load_config(cfg_path).dp.preselect)
    assert ledger.runs[0] == (pre, 1) and sum(c for s, c in ledger.runs if s == pre) == 1
    assert accounting.Ledger.from_json(json.loads((out / "spent.json").read_text())).runs == ledger.runs
    train_runs = ledger.runs[1:]
    assert sum(c for _, c in train_runs) == summary["steps"] == 100
    by_hand = accounting.compose_epsilon([(pre, 1), *train_runs], delta=1e-5, accountant="rdp")
    assert summary["dp"]["epsilon"] == pytest.approx(by_hand, rel=1e-12)
    assert 0.99 * 6.0 <= by_hand <= 6.0  # calibration solved sigma for the prefix AND the steps
    training_only = accounting.compose_epsilon(train_runs, delta=1e-5, accountant="rdp")
    assert by_hand > training_only + 0.1
    capsys.readouterr()
    assert main(["epsilon", str(cfg_path)]) == 0  # widedp epsilon: the same figure, the prefix included
    rep = json.loads(capsys.readouterr().out)
    assert rep["epsilon"] == pytest.approx(by_hand, rel=1e-9) and rep["preselect"]["rows"] == 10
    assert rep["epsilon_training_only"] == pytest.approx(training_only, rel=1e-9)
    assert "pre-selection" in summary["privacy"]["text"]


@pytest.mark.parametrize("selection", ["{name: all}", "{name: gaussian_threshold, sigma: 2.0, threshold_sigmas: 0.5}"])
def test_rows_outside_the_kept_set_never_move(tmp_path, selection):
    cfg_path = _config(tmp_path, selection=selection)
    out = tmp_path / "run"
    assert main(["train", str(cfg_path), "--out", str(out), "--no-progress"]) == 0
    kept = _kept(out)
    assert 0 < len(kept) <= 10 and kept == sorted(kept)
    _, init = build_cbow(load_config(cfg_path), tmp_path, device=torch.device("cpu"))
    final = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    before = torch.cat([init.input.weight.detach(), init.output.weight.detach()])  # row r < V: input, else output
    after = torch.cat([final["input.weight"], final["output.weight"]])
    outside = sorted(set(range(before.shape[0])) - set(kept))
    assert torch.equal(after[outside], before[outside])  # bit-identical
    assert not torch.equal(after[kept], before[kept])
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["rows_selected"] <= len(kept) for m in metrics if m["kind"] == "interval")


def test_resume_equals_uninterrupted_and_needs_the_kept_rows(tmp_path, monkeypatch):
    cfg = load_config(_config(tmp_path, steps=200, ckpt_every=60))
    run, snap = tmp_path / "run", tmp_path / "snap"
    full = train_with_snapshot(cfg, run, snap, step=60, monkeypatch=monkeypatch)
    lost = tmp_path / "lost"
    shutil.copytree(snap, lost)
    resumed = train_mod.train(cfg, snap, resume=True, progress=False)
    a = torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(snap / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert full["dp"]["ledger"] == resumed["dp"]["ledger"] and _kept(run) == _kept(snap)
    (lost / rng.PRIVATE_DIR / preselect_setup.PRESELECT_FILE).unlink()
    with pytest.raises(ConfigError, match="pre-selected rows are lost"):
        train_mod.train(cfg, lost, resume=True, progress=False)


def test_drawn_from_the_secret_noise_seed(tmp_path):
    s = 123456789
    seeds = {preselect_setup.preselect_seed(s), vocab.vocab_seed(s), s}
    assert len(seeds) == 3 and preselect_setup.preselect_seed(s) < 2**62
    cfg = load_config(_config(tmp_path))
    cfg = type(cfg)(**{**cfg.__dict__, "dp": type(cfg.dp)(**{**cfg.dp.__dict__, "preselect": type(cfg.dp.preselect)(
        rows=10, sigma=200.0, threshold=-1e9)})})  # noise-dominated: the draw is the seed's
    splits, model = build_cbow(cfg, tmp_path, device=torch.device("cpu"))
    kept = []
    for i, noise_seed in enumerate((1, 2, 1)):
        out = tmp_path / f"r{i}"
        out.mkdir()
        pre = preselect_setup.setup(cfg, out, model=model, split=splits["train"], grouped=None,
                                    noise_seed=noise_seed, resume=False)
        kept.append(pre.rows.tolist())
        assert (out / rng.PRIVATE_DIR / preselect_setup.PRESELECT_FILE).stat().st_mode & 0o077 == 0
    assert kept[0] == kept[2] and kept[0] != kept[1]


def _batch(samples, num_rows, dim=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *np.cumsum([len(s) for s in samples])], dtype=torch.long)
    rows = torch.tensor([r for s in samples for r in s], dtype=torch.long)
    return PerSampleRows(torch.randn(rows.numel(), dim, generator=gen, dtype=torch.float64), rows, offsets, num_rows)


def test_restrict_grads_against_brute_force():
    rng_ = np.random.default_rng(0)
    samples = [sorted(rng_.choice(30, rng_.integers(0, 6), replace=False).tolist()) for _ in range(25)]
    g = _batch(samples, 30)
    kept = torch.tensor([1, 4, 5, 9, 17, 22, 28])
    pre = preselect_setup.Preselection(kept, 30, always=2)  # rows 28, 29 always stay
    r = preselect_setup.restrict_grads(g, pre)
    keep = set(kept.tolist()) | {28, 29}
    j = 0
    for i, s in enumerate(samples):
        mine = [(k, g.values[g.offsets[i] + t]) for t, k in enumerate(s) if k in keep]
        assert r.rows[r.offsets[i]:r.offsets[i + 1]].tolist() == [k for k, _ in mine]
        for t, (_, v) in enumerate(mine):
            assert torch.equal(r.values[j + t], v)
        j += len(mine)
    assert preselect_setup.restrict_grads(g, None) is g


def test_unit_contributions_against_brute_force(tmp_path):
    cfg = load_config(_config(tmp_path))
    splits, model = build_cbow(cfg, tmp_path, device=torch.device("cpu"))
    split = splits["train"]
    unit_of = np.arange(len(split)) // 7 % 40  # 40 units, samples interleaved
    grouped = units.group_units(unit_of, np.arange(len(split)), cap=20)
    ids, counts, num_rows, always = preselect_setup.train_contributions(model, split, grouped=grouped, chunk=64)
    _, g = model.per_sample_row_grads(split.batch(torch.arange(len(split))))
    ref = np.zeros(num_rows)
    for u in range(grouped.num_units):
        members = grouped.samples[grouped.offsets[u]:grouped.offsets[u + 1]].tolist()
        rows = set()
        for m in members:
            rows |= set(g.rows[g.offsets[m]:g.offsets[m + 1]].tolist())
        for r in rows:
            ref[r] += 1 / math.sqrt(len(rows))
    assert always == 0 and ids.tolist() == np.flatnonzero(ref).tolist()
    np.testing.assert_allclose(counts.numpy(), ref[ids.numpy()], rtol=1e-12)
    ids1, counts1, _, _ = preselect_setup.train_contributions(model, split, grouped=None, chunk=64)
    assert counts1.sum().item() == pytest.approx(
        sum(math.sqrt(int(n)) for n in g.lengths()), rel=1e-12)  # per sample: sum of 1/sqrt(r) over r rows


def test_opacus_engine_is_refused(tmp_path, capsys):
    cfg = _config(tmp_path, engine="engine: opacus")
    assert main(["train", str(cfg), "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dp.preselect" in err[0]


def test_selection_calibration_of_gaussian_threshold_includes_the_prefix(tmp_path):
    cfg = load_config(_config(tmp_path, selection="{name: gaussian_threshold, sigma: 2.0, threshold_sigmas: 0.5}",
                              dp_extra="target_epsilon: 6.0\n  calibrate: selection_epsilon"))
    rb = plan.prefix_of(cfg)
    assert rb.entries == (preselect_step(cfg.dp.preselect),) and not rb.vocabulary
    dp = plan.calibrated(cfg.dp, steps=plan.total_steps(cfg, 1000), batch_size=10, num_rows=26, n=1000, prefix=rb)
    assert dp.selection.sigma != 2.0 and dp.selection.threshold_sigmas == 0.5
    step = plan.step_spend(dp, num_rows=26, batch_size=10, n=1000)
    eps = accounting.compose_epsilon([(rb.entries[0], 1), (step, 100)], delta=1e-5, accountant="rdp")
    assert 0.99 * 6.0 <= eps <= 6.0


def test_after_a_dp_vocabulary_with_sentence_units(tmp_path, capsys):
    """Both prefixes: the vocabulary (drawn by the task's build) first, then the pre-selection over the units; the
    run's, ``widedp epsilon``'s and a hand composition's epsilon agree, and the statement names both."""
    cfg_path = _config(tmp_path, data_extra=", privacy_unit: sentence, max_samples_per_unit: 3, vocabulary: dp, "
                                            "vocab_dp: {noise_multiplier: 2.0, max_words_per_unit: 6}")
    cfg = load_config(cfg_path)
    out = tmp_path / "run"
    assert main(["train", str(cfg_path), "--out", str(out), "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (out / vocab.RELEASE_FILE).is_file() and summary["units"]["privacy_unit"] == "sentence"
    voc, pre = plan.vocabulary_spend(cfg.data.vocab_dp), preselect_step(cfg.dp.preselect)
    ledger = accounting.Ledger.from_json(summary["dp"]["ledger"])
    assert list(ledger.runs[:2]) == [(voc, 1), (pre, 1)] and ledger.steps == summary["steps"] + 2
    d_tau = cfg.data.vocab_dp.delta
    by_hand = accounting.compose_epsilon(ledger.runs, delta=1e-5 - d_tau, accountant="rdp") - math.log1p(-d_tau)
    assert summary["dp"]["epsilon"] == pytest.approx(by_hand, rel=1e-12)
    text = summary["privacy"]["text"]
    assert "includes: the DP vocabulary" in text and "; the one-shot row pre-selection" in text
    capsys.readouterr()
    assert main(["epsilon", str(cfg_path)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["vocabulary"]["epsilon_alone"] == pytest.approx(
        accounting.compose_epsilon([(voc, 1)], delta=1e-5 - d_tau, accountant="rdp") - math.log1p(-d_tau), rel=1e-9)
    assert rep["preselect"]["epsilon_alone"] == pytest.approx(
        accounting.compose_epsilon([(pre, 1)], delta=1e-5, accountant="rdp"), rel=1e-9)
    # (widedp epsilon counts units with the top-V vocabulary: here every word is frequent, so the DP one is the same)
    assert rep["n_units"] == summary["units"]["n_units"] and rep["epsilon"] == pytest.approx(by_hand, rel=1e-9)
    assert "pre-selection" in rep["privacy"] and "DP vocabulary" in rep["privacy"]


def test_recsys_dense_rows_stay_in_and_rows_outside_never_move(tmp_path):
    """Any task the loop trains: a recommender's always-selected dense rows are neither pre-selected nor dropped."""
    from widedp.config import config_from_dict
    from widedp.run.train import train
    from widedp.tasks import get_task

    cfg = config_from_dict({
        "task": "recsys",
        "data": {"num_users": 30, "num_items": 60, "num_interactions": 3000, "num_tags": 10, "cache_dir": "",
                 "splits": [0.7, 0.15, 0.15]},
        "model": {"dim": 4, "hidden": [8]},
        "train": {"epochs": 1, "batch_size": 200, "optimizer": "lazy_adam", "lr": 0.02, "log_every": 5,
                  "device": "cpu"},
        "dp": {"clip1": 2.0, "clip2": 1.0, "noise_multiplier": 0.8, "selection": {"name": "all"},
               "preselect": {"rows": 25, "sigma": 2.0, "threshold_sigmas": 1.0}}})
    out = tmp_path / "run"
    summary = train(cfg, out, progress=False)
    (tmp_path / "b").mkdir()
    init = get_task("recsys").build(cfg, tmp_path / "b", device=torch.device("cpu")).model
    final = get_task("recsys").build(cfg, tmp_path / "b", device=torch.device("cpu")).model
    final.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=True)["model"])
    before, after = (torch.cat([w.detach() for _, w in m.row_tables()]) for m in (init, final))
    record = json.loads((out / rng.PRIVATE_DIR / preselect_setup.PRESELECT_FILE).read_text())
    kept, r_emb = record["kept"], init.num_rows
    assert record["always_rows"] == init.num_dense_rows > 0 and 0 < len(kept) <= 25 and max(kept) < r_emb
    outside = sorted(set(range(r_emb)) - set(kept))
    assert torch.equal(after[outside], before[outside])  # bit-identical
    assert not torch.equal(after[kept], before[kept]) and not torch.equal(after[r_emb:], before[r_emb:])
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert {m["rows_selected"] for m in metrics if m["kind"] == "interval"} == {len(kept) + init.num_dense_rows}
    assert "pre-selection" in summary["privacy"]["text"]


def test_table_rows_split_the_kept_rows_per_table(tmp_path):
    from dataclasses import replace

    from widedp.config.selection import PreselectConfig

    cfg = load_config(_config(tmp_path))
    old_hash = cfg.hash()
    assert replace(cfg, dp=replace(cfg.dp, preselect=replace(cfg.dp.preselect, table_rows=None))).hash() == old_hash
    cfg = replace(cfg, dp=replace(cfg.dp, preselect=PreselectConfig(rows=10, sigma=2.0, threshold=-1e9,
                                                                    table_rows=(3, 7))))
    assert cfg.hash() != old_hash
    splits, model = build_cbow(cfg, tmp_path, device=torch.device("cpu"))
    pre = preselect_setup.setup(cfg, tmp_path, model=model, split=splits["train"], grouped=None, noise_seed=5,
                                resume=False)
    kept = pre.rows.tolist()
    assert len([r for r in kept if r < 13]) == 3 and len([r for r in kept if r >= 13]) == 7
