"""``widedp compare``: the smoke sweep end to end on Brown, resume-safety, and one-line errors for bad sweeps."""

import json

import pytest

from widedp.cli import main
from widedp.commands.compare import load_sweep
from widedp.errors import ConfigError


@pytest.mark.slow
def test_smoke_sweep_end_to_end(tmp_path, brown_cache, capsys):
    out = tmp_path / "sweep"
    argv = ["compare", "configs/smoke_sweep.yaml", "--out", str(out), "--no-progress",
            "--set", f"data.cache_dir={brown_cache}"]
    assert main(argv) == 0
    for f in ("curves.png", "results.md", "results.json"):
        assert (out / f).stat().st_size > 200, f
    assert (out / "curves.png").stat().st_size > 10_000  # two drawn panels, not an empty canvas
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["non-private", "dp-sgd"]
    nonpriv, dpsgd = rows
    assert nonpriv["seeds"] == [0, 1] and dpsgd["seeds"] == [0]
    assert not nonpriv["private"] and nonpriv["epsilon"] is None
    assert dpsgd["private"] and dpsgd["selection"] == "all" and dpsgd["epsilon"]["mean"] > 0
    assert dpsgd["epsilon_rdp"]["mean"] == pytest.approx(dpsgd["epsilon"]["mean"])  # accountant: rdp in the sweep
    for r in rows:
        for k in ("train_loss", "valid_loss", "test_loss"):
            assert r[k]["mean"] is not None and r[k]["min"] <= r[k]["mean"] <= r[k]["max"]
        assert r["samples_per_s"]["mean"] > 0 and r["wall_s"]["mean"] > 0
    # two seeds really are two different runs (different init/batches), summarised as mean +- std
    s0, s1 = (json.loads((out / "non-private" / f"seed{k}" / "summary.json").read_text()) for k in (0, 1))
    assert s0["test_loss"] != s1["test_loss"]
    assert nonpriv["test_loss"]["mean"] == pytest.approx((s0["test_loss"] + s1["test_loss"]) / 2)
    assert nonpriv["test_loss"]["std"] > 0
    assert nonpriv["train_loss"]["mean"] < nonpriv["initial_valid_loss"]["mean"] - 0.5  # it trained
    md = (out / "results.md").read_text()
    assert "| non-private | 2 |" in md and "| dp-sgd | 1 |" in md
    # every ε of the table comes with its statement: δ, unit, accountant, what it does not cover
    dp_statement = json.loads((out / "dp-sgd" / "seed0" / "summary.json").read_text())["privacy"]["text"]
    assert f"- dp-sgd: {dp_statement}" in md and "δ=" in dp_statement and "- non-private: " in md
    printed = capsys.readouterr().out
    assert "| dp-sgd | 1 |" in printed
    # resume-safe: a second call trains nothing (summaries untouched) and rewrites the same table
    stamp = (out / "dp-sgd" / "seed0" / "summary.json").stat().st_mtime_ns
    assert main(argv) == 0
    assert (out / "dp-sgd" / "seed0" / "summary.json").stat().st_mtime_ns == stamp
    assert "widedp compare:" not in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text())["rows"] == rows


def _sweep(tmp_path, text):
    (tmp_path / "base.yaml").write_text("data: {preset: paper}\ntrain: {epochs: 1}\n")
    p = tmp_path / "sweep.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text,needle", [
    ("runs: []\n", "runs: expected a non-empty list"),
    ("- a\n- b\n", "expected a mapping with a 'runs' list"),
    ("runs: [{name: a, config: base.yaml}]\nextra: 1\n", "extra: unknown key"),
    ("runs: [{name: a, config: base.yaml, seed: [0]}]\n", "runs[0].seed: unknown key"),
    ("runs: [{name: a, config: base.yaml, seeds: [0, 0]}]\n", "runs[0].seeds: expected a list of distinct"),
    ("runs: [{name: a, config: base.yaml, seeds: 3}]\n", "runs[0].seeds"),
    ("runs: [{name: a/b, config: base.yaml}]\n", "runs[0].name: expected a folder-safe name"),
    ("runs: [{name: a, config: base.yaml}, {name: a, config: base.yaml}]\n", "runs[1].name: 'a' appears twice"),
    ("runs: [{name: a, config: nope.yaml}]\n", "runs[0].config: config file not found: nope.yaml"),
    ("runs: [{name: a, config: base.yaml, set: {train.epochz: 2}}]\n", "runs[0] (a): train.epochz: unknown key"),
    ("runs: [{name: a, config: base.yaml, set: {train.epochs: -1}}]\n", "train.epochs: must be > 0"),
    ("runs: [{name: a, config: base.yaml, set: [1]}]\n", "runs[0].set: expected a mapping"),
    ("runs: [{name: a, config: base.yaml}]\npanels: [b]\n", "panels: 'b' is not a run name"),
    ("runs: [{name: a, config: base.yaml\n", "invalid YAML"),
])
def test_bad_sweep_is_one_line_config_error(tmp_path, text, needle):
    p = _sweep(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_sweep(p)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    assert msg.startswith(str(p))


def test_bad_sweep_via_cli_exits_2_with_one_line(tmp_path, capsys):
    p = _sweep(tmp_path, "runs: [{name: a, config: base.yaml, seeds: [-1]}]\n")
    assert main(["compare", str(p), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("widedp: error:") and "runs[0].seeds" in err
    assert not (tmp_path / "o").exists()  # nothing ran
    assert main(["compare", str(tmp_path / "missing.yaml")]) == 2
    assert "sweep file not found" in capsys.readouterr().err


def test_overrides_order_and_seeds(tmp_path):
    p = _sweep(tmp_path, "set: {train.epochs: 2, train.lr: 0.5}\n"
                         "runs: [{name: a, config: base.yaml, set: {train.epochs: 3}, seeds: [4, 7]}]\n")
    run = load_sweep(p, ["train.lr=0.25"]).runs[0]
    cfg = run.config(7)
    assert (cfg.train.epochs, cfg.train.lr, cfg.train.seed) == (3, 0.25, 7)  # sweep set < run set < CLI --set
    assert run.seeds == (4, 7)


def test_shipped_sweeps_validate():
    for name in ("smoke_sweep", "paper_fig1", "honest_eps"):
        sweep = load_sweep(f"configs/{name}.yaml")
        assert sweep.runs
    fig1 = load_sweep("configs/paper_fig1.yaml")
    assert fig1.panels == ("non-private", "dp-sgd-0.32", "dp-sgd-0.5", "sparse-exponential", "sparse-vector",
                           "sparse-uniform")
    honest = load_sweep("configs/honest_eps.yaml")
    engines = set()
    for run in honest.runs:
        cfg = run.config(run.seeds[0])
        assert cfg.dp is not None and cfg.dp.calibrate == "noise_multiplier" and cfg.dp.delta == 1e-5
        assert cfg.dp.target_epsilon in (3, 8) and len(run.seeds) == 3
        engines.add((cfg.dp.engine, cfg.dp.selection.name))
    assert engines == {("widedp", "all"), ("opacus", "all"), ("widedp", "exponential"), ("widedp", "sparse_vector"),
                       ("widedp", "uniform")}


def test_paper_theorem3_column_is_labelled_and_never_the_epsilon(tmp_path):
    from widedp import accounting
    from widedp.commands.compare import PAPER_KEY, results_markdown, run_dir, summarize
    from widedp.dp.spend import ExponentialSpend, GaussianSpend, StepSpend

    assert PAPER_KEY == accounting.REFERENCE_KEY
    p = _sweep(tmp_path, "runs: [{name: dp, config: base.yaml}, {name: plain, config: base.yaml}]\n")
    sweep, out = load_sweep(p), tmp_path / "out"
    step = StepSpend(1e-4, (GaussianSpend(0.5), ExponentialSpend(0.2702, 100)))
    ledger = accounting.Ledger([(step, 200_000)])
    common = {"train_loss": 1.0, "valid_loss": 1.0, "test_loss": 1.0, "steps": 200_000}
    for name, dp in (("dp", {"epsilon": 7.79, "epsilon_rdp": 10.8, "delta": 1e-5, "accountant": "pld",
                             "ledger": ledger.to_json()}), ("plain", None)):
        d = run_dir(out, name, 0)
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({**common, "private": dp is not None, "dp": dp}))
    dp_row, plain_row = summarize(sweep, out)
    paper = accounting.paper_theorem3_reference(ledger.runs, 1e-5)["epsilon"]
    assert dp_row[PAPER_KEY]["mean"] == pytest.approx(paper) and dp_row["epsilon"]["mean"] == 7.79
    assert plain_row[PAPER_KEY] is None
    md = results_markdown([dp_row, plain_row], "t")
    assert "paper Thm 3 (NOT a bound)" in md and "NOT a valid DP bound" in md
    assert f"| 7.790 (pld) | 10.800 | {paper:.3f} |" in md
