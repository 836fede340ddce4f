"""What a run asks of the machine and of its data, beyond the one-line refusals of test_cli_errors.py: absurd thread
counts clamped with a warning, empty valid/test splits reported as null (valid JSON, never a bare NaN), a large δ
accepted only when allowed (and still printed), and a new run that fails on any error leaving nothing that blocks
the fixed rerun."""

import json
import math

import pytest
import tiny_corpus
import torch

from widedp import resources
from widedp.cli import main
from widedp.config import config_from_dict
from widedp.errors import ConfigError
from widedp.tasks import cbow

WORDS, GOOD = tiny_corpus.text(), tiny_corpus.GOOD_CONFIG


def _argv(tmp, *sets, out="run"):
    (tmp / "corpus.txt").write_text(WORDS)
    (tmp / "good.yaml").write_text(GOOD.format(corpus=tmp / "corpus.txt", cache=tmp / "cache"))
    return ["train", str(tmp / "good.yaml"), "--out", str(tmp / out), "--no-progress",
            *[x for s in sets for x in ("--set", s)]]


def _strict_json(path):
    def refuse(c):
        raise AssertionError(f"{path}: bare {c}")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_absurd_thread_counts_are_clamped_with_a_warning(tmp_path, capsys):
    before = torch.get_num_threads()
    try:
        assert main(_argv(tmp_path, "train.threads=100000", "train.max_steps=2")) == 0
        assert torch.get_num_threads() <= (resources.os.cpu_count() or 1)
    finally:
        torch.set_num_threads(before)
    assert "widedp: warning: train.threads: 100,000 is more than this machine's" in capsys.readouterr().err


def test_empty_valid_and_test_splits_are_null_with_a_notice(tmp_path, capsys):
    assert main(_argv(tmp_path, "data.splits=[1.0,0.0,0.0]", "train.max_steps=3", "train.keep_best=true")) == 0
    err = capsys.readouterr().err
    assert ("widedp: warning: data.splits: the valid and test splits are empty: valid_loss and test_loss will be "
            "null") in err
    summary = _strict_json(tmp_path / "run" / "summary.json")
    assert summary["valid_loss"] is None and summary["test_loss"] is None and summary["initial_valid_loss"] is None
    assert math.isfinite(summary["train_loss"])
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c} in metrics.jsonl"))


def test_a_large_delta_runs_only_when_allowed_and_is_printed(tmp_path, capsys):
    assert main(_argv(tmp_path, "dp.delta=0.5", "train.max_steps=2")) == 2
    assert "dp.allow_large_delta: true" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert main(_argv(tmp_path, "dp.delta=0.5", "dp.allow_large_delta=true", "train.max_steps=2")) == 0
    assert "δ=0.5" in _strict_json(tmp_path / "run" / "summary.json")["privacy"]["text"]


def test_allow_large_delta_is_not_part_of_the_hash(tmp_path):
    raw = {"dp": {"selection": {"name": "all"}}}
    allowed = {"dp": {"selection": {"name": "all"}, "allow_large_delta": True}}
    assert config_from_dict(raw).hash() == config_from_dict(allowed).hash()


def test_a_new_run_failing_on_any_error_leaves_nothing_that_blocks_the_rerun(tmp_path, monkeypatch, capsys):
    def broken(*a, **k):
        raise RuntimeError("a bug in the build")

    monkeypatch.setattr(cbow, "CBOW", broken)
    with pytest.raises(RuntimeError):
        main(_argv(tmp_path, "train.max_steps=2"))
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()
    assert main(_argv(tmp_path, "train.max_steps=2")) == 0  # no --overwrite needed


def test_tables_larger_than_free_memory_are_refused_naming_model_dim(monkeypatch):
    monkeypatch.setattr(resources, "available_bytes", lambda device="cpu": 2**30)
    resources.check_tables_fit(2000, 100)  # 2000 x 100 floats with their state: a few MiB
    with pytest.raises(ConfigError, match=r"^model\.dim: 1,000,000 over 2,000 rows needs about 37\.3 GiB .* more than "
                                          r"the 1\.0 GiB free on cpu"):
        resources.check_tables_fit(2000, 1_000_000)


@pytest.mark.slow
def test_the_shipped_pair_level_job_allows_its_delta_explicitly(brown_cache, capsys):
    """δ = 1e-5 on the pair-level job's 199,584 pairs is not below 1/N: refused (exit 2, one line) once the config's
    explicit dp.allow_large_delta is taken away; a δ below 1/N needs no opt-out."""
    cfg, cache = "configs/brown_cbow_sparse_exp.yaml", f"data.cache_dir={brown_cache}"
    assert main(["epsilon", cfg, "--set", cache, "--set", "dp.allow_large_delta=false"]) == 2
    assert capsys.readouterr().err == (
        "widedp: error: dp.delta: 1e-05 is not below 1/N = 5.01e-06 (N = 199,584 training pairs): publishing each "
        "pair in the clear with probability δ meets it (about 2.0 of them); lower it, or set dp.allow_large_delta: "
        "true\n")
    assert main(["epsilon", cfg, "--set", cache, "--set", "dp.allow_large_delta=false", "--set", "dp.delta=1e-6"]) == 0
    assert json.loads(capsys.readouterr().out)["delta"] == 1e-6
