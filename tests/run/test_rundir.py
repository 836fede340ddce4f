"""A run directory is never clobbered silently and never written by two processes at once."""

import json

from tiny_corpus import data_section

from widedp.cli import main
from widedp.run import rundir


def _config(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
{data_section(tmp_path)}
model: {{dim: 8, tied: false}}
train: {{epochs: 1, batch_size: 10, optimizer: lazy_adam, lr: 0.01, log_every: 25, eval_max_samples: 50}}
dp: {{clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, selection: {{name: uniform, k: 4}}}}
""")
    return cfg


def test_second_train_into_a_run_is_refused_and_changes_nothing(tmp_path, capsys):
    cfg, out = _config(tmp_path), tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume" in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_overwrite_replaces_the_run(tmp_path):
    cfg, out = _config(tmp_path), tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    assert main(["train", str(cfg), "--out", str(out), "--no-progress", "--overwrite"]) == 0
    kinds = [json.loads(x)["kind"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert kinds.count("start") == 1  # one run's metrics, not two appended


def test_a_locked_run_directory_is_refused(tmp_path, capsys):
    cfg, out = _config(tmp_path), tmp_path / "run"
    with rundir.locked(out):  # as another widedp process holding it would
        assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 2
    assert "another widedp process" in capsys.readouterr().err
    assert not rundir.holds_run(out)
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0  # released


def test_an_out_dir_that_cannot_be_created_is_one_line(tmp_path, capsys):
    cfg = _config(tmp_path)
    (tmp_path / "afile").write_text("x")
    assert main(["train", str(cfg), "--out", str(tmp_path / "afile" / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot create the run directory" in err and len(err.strip().splitlines()) == 1
