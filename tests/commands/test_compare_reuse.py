"""``widedp compare`` reuses a run directory only when the config hash it recorded is the run's: finished
-> reused, checkpointed -> resumed, another config -> refused (or rerun with --overwrite), crashed before its first
checkpoint -> restarted; figures carry ε, δ and the unit, and named panels overlay runs."""

import json

import pytest

from widedp.cli import main
from widedp.commands.compare import load_sweep, plan
from widedp.errors import ConfigError

WORDS = "".join(f"w{i % 11} w{(i * 3) % 11} w{(i * 5) % 11} w{(i + 1) % 11} w{(i * 7) % 11}\n" for i in range(300))


@pytest.fixture
def sweep(tmp_path):
    (tmp_path / "corpus.txt").write_text(WORDS)
    (tmp_path / "base.yaml").write_text(f"""
data: {{preset: custom, corpus: "text:{tmp_path / 'corpus.txt'}", vocab_size: 11, remove_stopwords: false,
       alpha_only: false, splits: [600, 100, 100], cache_dir: "{tmp_path / 'cache'}"}}
model: {{dim: 8, tied: false}}
train: {{epochs: 2, batch_size: 20, optimizer: lazy_adam, lr: 0.01, log_every: 15, eval_max_samples: 50}}
dp: {{clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, selection: {{name: uniform, k: 4}}}}
""")
    p = tmp_path / "sweep.yaml"
    p.write_text("runs:\n  - {name: uni, config: base.yaml}\n"
                 "  - {name: exp, config: base.yaml, set: {dp.selection: {name: exponential, k: 4, epsilon: 0.1}}}\n"
                 "panels: {'same ε': [uni, exp]}\n")
    return p


def _compare(sweep, out, *extra):
    return main(["compare", str(sweep), "--out", str(out), "--no-progress", *extra])


def _stamps(out):
    return {p: p.stat().st_mtime_ns for p in sorted(out.glob("*/seed0/*")) if p.is_file()}


def test_reuse_refuse_overwrite_restart_resume(sweep, tmp_path, capsys):
    out = tmp_path / "out"
    assert _compare(sweep, out) == 0
    err = capsys.readouterr().err
    assert err.count(": training") == 2
    assert (out / "curves.png").stat().st_size > 10_000
    # the same sweep again: both runs reused, nothing written in them
    before = _stamps(out)
    assert _compare(sweep, out) == 0
    assert capsys.readouterr().err.count("reusing it (finished, same config)") == 2
    assert _stamps(out) == before
    # another config into the same --out: refused in one line, before anything trains
    assert _compare(sweep, out, "--set", "train.lr=0.02") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds a run of another config" in err and "--overwrite" in err
    assert str(out / "uni" / "seed0") in err
    assert _stamps(out) == before
    # --overwrite reruns both with the new config
    assert _compare(sweep, out, "--set", "train.lr=0.02", "--overwrite") == 0
    assert capsys.readouterr().err.count("rerunning it (--overwrite") == 2
    cfg = load_sweep(sweep, ["train.lr=0.02"]).runs[0].config(0)
    assert json.loads((out / "uni" / "seed0" / "summary.json").read_text())["config_hash"] == cfg.hash()
    # a run that stopped before its first checkpoint (run files, no checkpoint): restarted from scratch
    d = out / "uni" / "seed0"
    (d / "checkpoint.pt").unlink()
    (d / "summary.json").unlink()
    assert plan(d, cfg) == "restart"
    # a checkpointed, unfinished run of the same config: resumed
    (out / "exp" / "seed0" / "summary.json").unlink()
    exp_cfg = load_sweep(sweep, ["train.lr=0.02"]).runs[1].config(0)
    assert plan(out / "exp" / "seed0", exp_cfg) == "resume"
    assert _compare(sweep, out, "--set", "train.lr=0.02") == 0
    err = capsys.readouterr().err
    assert "restarting it" in err and "resuming it from its checkpoint" in err
    kinds = [json.loads(x)["kind"] for x in (d / "metrics.jsonl").read_text().splitlines()]
    assert kinds.count("start") == 1
    # a finished run whose checkpoint is gone: not "reused" (then a missing-file error), rerun with --overwrite
    (d / "checkpoint.pt").unlink()
    with pytest.raises(ConfigError, match="a finished run whose checkpoint.pt is gone; .* --overwrite"):
        plan(d, cfg)
    assert plan(d, cfg, overwrite=True) == "rerun"


def test_results_carry_the_privacy_and_panels_group_runs(sweep, tmp_path):
    out = tmp_path / "out"
    assert _compare(sweep, out) == 0
    sw = load_sweep(sweep)
    assert sw.groups == (("same ε", ("uni", "exp")),) and sw.panels == ("uni", "exp")
    rows = json.loads((out / "results.json").read_text())["rows"]
    for r in rows:
        assert r["delta"] == 1e-5 and r["unit"] == "(target, context) pair" and "ε=" in r["privacy"]
    from widedp.commands.compare_plots import privacy_label

    s = json.loads((out / "uni" / "seed0" / "summary.json").read_text())
    label = privacy_label([s])
    assert label.startswith("ε=") and "δ=1e-05 per (target, context) pair" in label
    assert privacy_label([{"privacy": {"epsilon": None}}]) == "non-private"


@pytest.mark.parametrize("panels,needle", [
    ("panels: {a: uni}\n", "panels.a: expected a non-empty list"),
    ("panels: {a: [nope]}\n", "'nope' is not a run name"),
    ("panels: 3\n", "panels: expected a list"),
])
def test_bad_panels(sweep, panels, needle):
    from widedp.errors import ConfigError

    text = sweep.read_text().split("panels:")[0] + panels
    sweep.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_sweep(sweep)


def test_base_configs_are_read_strictly(sweep, tmp_path, capsys):
    base = tmp_path / "base.yaml"
    base.write_text(base.read_text() + "model: {dim: 4}\n")
    assert _compare(sweep, tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert "model: duplicate key" in err and len(err.splitlines()) == 1
    base.write_text(base.read_text().replace("model: {dim: 4}\n", "").replace("dp: {", "dp:\n#{"))
    assert _compare(sweep, tmp_path / "out") == 2
    assert "dp: is present but empty" in capsys.readouterr().err


def test_keep_going_skips_a_failing_run_and_reports_it(sweep, tmp_path, capsys):
    """An infeasible target ε in the middle of a sweep: without --keep-going the sweep stops there (exit 2, one
    line); with it the later runs still train, results cover them, and the exit status is 2 naming the failure."""
    text = sweep.read_text().replace(
        "  - {name: exp,",
        "  - {name: bad, config: base.yaml, set: {dp.target_epsilon: 0.0001, dp.calibrate: noise_multiplier,"
        " dp.selection: {name: exponential, k: 4, epsilon: 0.5}}}\n  - {name: exp,")
    text = text.replace("[uni, exp]", "[uni, bad, exp]")
    sweep.write_text(text)
    out = tmp_path / "o"
    assert _compare(sweep, out) == 2
    assert not (out / "exp" / "seed0" / "summary.json").exists()  # stopped at 'bad'
    capsys.readouterr()
    assert _compare(sweep, out, "--keep-going") == 2
    err = capsys.readouterr().err
    assert "bad seed 0: FAILED" in err and "1 run(s) failed" in err and "bad (seed0)" in err
    assert (out / "exp" / "seed0" / "summary.json").exists()
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["uni", "exp"]
