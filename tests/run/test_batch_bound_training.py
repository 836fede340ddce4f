"""``widedp train`` with ``dp.max_batch_size``: every step's batch is the plain Poisson batch cut to B, the cut steps
are counted in metrics.jsonl and summary.json, the statement names the bound, a resume replays the same batches,
and a bad or too-small bound is one line through the CLI."""

import json

import pytest
import torch
from snapshots import train_with_snapshot
from tiny_corpus import data_section

import widedp.dp.sampling as sampling_mod
from widedp.cli import main
from widedp.config import load_config
from widedp.dp.sampling import PoissonSampler
from widedp.run.train import train

BOUND = 12  # batch_size 10: a Poisson batch of more than 12 pairs about one step in five


def _config(tmp_path, bound="null"):
    cfg = tmp_path / f"c-{bound}.yaml"
    cfg.write_text(f"""
{data_section(tmp_path, lines=400)}
model: {{dim: 8, tied: false}}
train: {{epochs: 1, max_steps: 60, batch_size: 10, optimizer: lazy_adam, lr: 0.01, log_every: 20,
        checkpoint_every: 20, eval_max_samples: 50}}
dp: {{clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, rng: reproducible, max_batch_size: {bound},
     selection: {{name: uniform, k: 4}}}}
""")
    return cfg


@pytest.fixture()
def batches(monkeypatch):
    """{step: batch} of the sampler's draws in the current run (cleared by the test between runs)."""
    seen: dict[int, torch.Tensor] = {}
    orig = PoissonSampler.batch

    def batch(self, step):
        out = orig(self, step)
        seen[step] = out.clone()
        return out

    monkeypatch.setattr(PoissonSampler, "batch", batch)
    return seen


def test_bounded_run_cuts_counts_and_replays(tmp_path, monkeypatch, batches):
    train(load_config(_config(tmp_path)), tmp_path / "plain", progress=False)
    plain = dict(batches)
    batches.clear()
    # the wiring, not the figure: a B this close to b is refused for its δ_B (next test), so δ_B is zeroed here
    monkeypatch.setattr(sampling_mod, "truncation_delta", lambda **kw: 0.0)
    cfg = load_config(_config(tmp_path, BOUND))
    run, snap = tmp_path / "run", tmp_path / "snap"
    full = train_with_snapshot(cfg, run, snap, step=20, monkeypatch=monkeypatch)
    cut = sum(plain[t].numel() > BOUND for t in range(60))
    assert 3 <= cut <= 30 and sorted(batches) == sorted(plain)
    for t, b in batches.items():
        assert torch.equal(b, plain[t][:BOUND])  # the plain batch where it fits, its first B otherwise
    assert full["dp"]["truncated_steps"] == cut and full["dp"]["max_batch_size"] == BOUND
    assert full["dp"]["delta_batch"] == 0.0 and "epsilon_bar" in full["dp"]
    assert "batches of at most 12 pairs (truncated Poisson; δ_B=0 of δ)" in full["privacy"]["text"]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["truncated_steps"] for r in lines if r.get("kind") == "interval") == cut
    assert not any("truncated_steps" in json.loads(x) for x in (tmp_path / "plain/metrics.jsonl").read_text()
                   .splitlines())  # null: as before
    batches.clear()
    resumed = train(cfg, snap, resume=True, progress=False)
    assert sorted(batches) == list(range(20, 60)) and all(torch.equal(batches[t], plain[t][:BOUND]) for t in batches)
    assert resumed["dp"]["truncated_steps"] == cut and resumed["dp"]["ledger"] == full["dp"]["ledger"]


@pytest.mark.parametrize(("value", "needle"), [
    ("0", "dp.max_batch_size: expected a positive integer, auto or null, got 0"),
    ("lots", "dp.max_batch_size: expected a positive integer, auto or null, got 'lots'"),
    ("12", "dp.max_batch_size: 12 units per batch spends δ_B="),
])
def test_bad_or_too_small_bound_is_one_line(tmp_path, capsys, value, needle):
    cfg = _config(tmp_path)
    rc = main(["train", str(cfg), "--out", str(tmp_path / "out"), "--no-progress", "--set",
               f"dp.max_batch_size={value}"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and needle in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert main(["epsilon", str(cfg), "--set", f"dp.max_batch_size={value}"]) != 0
    assert needle in capsys.readouterr().err


def test_resume_refuses_an_auto_bound_that_resolves_otherwise(tmp_path, monkeypatch, capsys):
    """``auto`` is worked out again on resume; should it come out other than the B the run's steps so far were cut to
    (another widedp or accountant version), δ_B would be charged for a B they did not have: one line, exit 2."""
    cfg = load_config(_config(tmp_path, "auto"))
    run, snap = tmp_path / "run", tmp_path / "snap"
    full = train_with_snapshot(cfg, run, snap, step=20, monkeypatch=monkeypatch)
    started = full["dp"]["max_batch_size"]
    assert torch.load(snap / "checkpoint.pt", weights_only=True)["max_batch_size"] == started
    monkeypatch.setattr(sampling_mod, "smallest_bound", lambda **kw: started + 1)
    assert main(["train", "--resume", str(snap), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("widedp: error: dp.max_batch_size: the run's batches so far were cut "
                                               f"to {started:,} units, but auto now resolves to {started + 1:,}"), err
