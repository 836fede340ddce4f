"""Budget stop, crash safety and resume: nothing spent is forgotten, nothing counted twice."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from tiny_corpus import data_section

from widedp import accounting
from widedp.cli import main


def _config(tmp_path, *, steps: int, extra_dp: str = "", ckpt_every: int = 0):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
{data_section(tmp_path, lines=400)}
model: {{dim: 16, tied: false}}
train: {{epochs: {steps // 100 + 1}, max_steps: {steps}, batch_size: 10, optimizer: lazy_adam, lr: 0.01,
        log_every: 25, checkpoint_every: {ckpt_every}, eval_max_samples: 50}}
dp:
  clip1: 1.0
  clip2: 1.0
  noise_multiplier: 1.0
  {extra_dp}
  selection: {{name: exponential, k: 4, epsilon: 0.5, score_clip: 0.1}}
""")
    return cfg


def test_budget_stop_saves_and_stays_within_target(tmp_path, capsys):
    cfg = _config(tmp_path, steps=2000, extra_dp="target_epsilon: 2.0\n  accountant: rdp")
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    assert "would exceed dp.target_epsilon" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    dp = summary["dp"]
    assert dp["stopped_by_budget"] and 0 < summary["steps"] < 2000 and summary["steps"] == dp["budget_steps"]
    assert dp["epsilon"] <= 2.0
    ledger = accounting.Ledger.from_json(dp["ledger"])
    one_more = accounting.Ledger.from_json(dp["ledger"])
    one_more.add(ledger.runs[-1][0])
    assert accounting.epsilon(one_more, delta=1e-5, accountant="rdp") > 2.0  # the next step would exceed it
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == summary["steps"] and ckpt["ledger"] == dp["ledger"]


def test_infeasible_target_is_refused(tmp_path, capsys):
    cfg = _config(tmp_path, steps=200, extra_dp="target_epsilon: 0.001\n  calibrate: noise_multiplier")
    assert main(["train", str(cfg), "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("widedp: error:") and len(err.strip().splitlines()) == 1


def _train_proc(*args):
    return subprocess.Popen([sys.executable, "-m", "widedp.cli", "train", *args, "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_kill_9_then_resume_matches_uninterrupted_run(tmp_path):
    cfg = _config(tmp_path, steps=1500, ckpt_every=200, extra_dp="rng: reproducible")  # the reference repeats it
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    proc = _train_proc(str(cfg), "--out", str(crashed))
    deadline = time.time() + 120
    while not (crashed / "checkpoint.pt").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.3)
    assert proc.poll() is None, "the run finished before it could be killed: make it longer"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(crashed / "checkpoint.pt", weights_only=True)["step"]
    assert 0 < killed_at < 1500
    journal = accounting.Ledger.from_json(json.loads((crashed / "spent.json").read_text()))
    assert journal.steps >= killed_at  # the journal covers at least what the checkpoint holds

    r = _train_proc("--resume", str(crashed))
    assert r.wait(timeout=300) == 0, r.stderr.read()
    assert _train_proc(str(cfg), "--out", str(ref)).wait(timeout=300) == 0

    a = json.loads((ref / "summary.json").read_text())
    b = json.loads((crashed / "summary.json").read_text())
    assert a["steps"] == b["steps"] == 1500
    # metrics: what was logged after the checkpoint is logged once, by the resumed run
    logged = [json.loads(x) for x in (crashed / "metrics.jsonl").read_text().splitlines()]
    intervals = [r["step"] for r in logged if r["kind"] == "interval"]
    assert intervals == sorted(set(intervals)) and intervals[-1] == 1500
    assert a["dp"]["ledger"] == b["dp"]["ledger"]  # nothing forgotten, nothing counted twice
    assert a["dp"]["epsilon"] == b["dp"]["epsilon"]
    ma = torch.load(ref / "checkpoint.pt", weights_only=True)["model"]
    mb = torch.load(crashed / "checkpoint.pt", weights_only=True)["model"]
    for k in ma:  # resumed runs replay the lost steps exactly (their generator states are in private/)
        assert torch.equal(ma[k], mb[k]), k


def test_unreplayable_resume_keeps_journaled_steps():
    from widedp.dp.spend import ExponentialSpend, GaussianSpend, StepSpend
    from widedp.run.journal import resumed_ledger

    step = StepSpend(0.01, (GaussianSpend(1.0, 0.1), ExponentialSpend(0.5, 4)))
    ckpt, journal = accounting.Ledger(), accounting.Ledger()
    ckpt.add(step, count=200)
    journal.add(step, count=250)
    assert resumed_ledger(ckpt, journal, replayable=True).steps == 200  # exact replay releases nothing new
    assert resumed_ledger(ckpt, journal, replayable=False).steps == 250  # fresh randomness: lost steps stay spent


def test_reproducible_runs_repeat_and_secure_runs_do_not(tmp_path):
    def final_weights(name: str, extra: str = ""):
        d = tmp_path / name
        d.mkdir()
        cfg = _config(d, steps=100, extra_dp=extra)
        assert main(["train", str(cfg), "--out", str(d / "run"), "--no-progress"]) == 0
        return torch.load(d / "run" / "checkpoint.pt", weights_only=True)["model"]

    a, b = final_weights("a", "rng: reproducible"), final_weights("b", "rng: reproducible")
    assert all(torch.equal(a[k], b[k]) for k in a)
    s1, s2 = final_weights("s1"), final_weights("s2")  # secure by default
    assert any(not torch.equal(s1[k], s2[k]) for k in s1)
    assert any(not torch.equal(a[k], s1[k]) for k in a)


def test_resume_refuses_a_different_training_split(tmp_path, capsys):
    """A checkpoint records the training-set size; a resume whose prepared split differs (e.g. a checkpoint from
    before the record-local split) is refused in one line instead of training on other data."""
    from widedp.run.checkpoint import CHECKPOINT

    cfg = _config(tmp_path, steps=20, ckpt_every=10)
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress", "--set", "train.max_steps=10"]) == 0
    (out / "summary.json").unlink()  # (a finished run is not resumed at all)
    state = torch.load(out / CHECKPOINT, weights_only=True)
    n = state["n_train"]
    for tamper, says in (({**state, "n_train": n + 1}, f"{n + 1:,} examples then, {n:,} now"),
                         ({k: v for k, v in state.items() if k != "n_train"}, "predates widedp recording it")):
        torch.save(tamper, out / CHECKPOINT)
        capsys.readouterr()
        assert main(["train", "--resume", str(out), "--no-progress"]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "training split is not the one this run trained on" in err[0] and says in err[0]
