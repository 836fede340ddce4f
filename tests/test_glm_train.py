"""End to end: `widedp train` of tiny glm configs (every algorithm) on a synthetic corpus."""

from __future__ import annotations

import json

import pytest
import yaml

from widedp.cli import main
from widedp.config import config_from_dict
from widedp.errors import ConfigError
from widedp.train import train

WORDS = {"sport": "ball goal team match win player coach score", "food": "bread cheese soup salad dinner cook taste",
         "tech": "computer code data network chip software server"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import random

    rng = random.Random(0)
    lines = []
    for lab, text in WORDS.items():
        vocab = text.split() + ["common", "shared", "words", "everywhere"]
        for _ in range(12):
            lines.append(f"{lab}\t" + " ".join(rng.choice(vocab) for _ in range(40)))
    path = tmp_path_factory.mktemp("glm") / "corpus.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


def _raw(corpus, tmp_path, algo):
    return {"task": "glm", "data": {"preset": "custom", "corpus": f"text:{corpus}", "chunk_tokens": 10,
                                    "min_chunk_tokens": 5, "vocab_size": 20, "remove_stopwords": False,
                                    "cache_dir": str(tmp_path / "cache")},
            "train": {"seed": 0}, "algorithm": algo}


def test_widedp_train_cli_end_to_end(corpus, tmp_path, capsys):
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(yaml.safe_dump(_raw(corpus, tmp_path, {"name": "dpsgd", "epsilon": 8.0, "iterations": 30,
                                                                "lr": 4.0})))
    out = tmp_path / "run"
    assert main(["train", str(cfg_path), "--out", str(out), "--no-progress"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    s = json.loads((out / "summary.json").read_text())
    assert printed["epsilon"] == s["dp"]["epsilon"] <= 8.0 and s["dp"]["epsilon"] > 7.5
    assert s["test_accuracy"] > 0.6  # 3 well-separated classes
    for f in ("config.yaml", "metrics.jsonl", "checkpoint.pt", "loss.png", "accuracy.png", "vocab.json"):
        assert (out / f).is_file(), f
    kinds = [json.loads(x)["kind"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert kinds[0] == "start" and kinds[-1] == "end" and "interval" in kinds
    assert s["dp"]["ledger"]["runs"][0]["count"] == 30


@pytest.mark.parametrize("algo", [
    {"name": "nonprivate"},
    {"name": "dp_agd", "epsilon": 4.0, "iterations": 10},
    {"name": "frank_wolfe", "epsilon": 4.0, "iterations": 5, "radius": 2.0},
    {"name": "output_perturbation", "epsilon": 4.0, "l2_reg": 0.05},
    {"name": "output_perturbation", "epsilon": 4.0, "l2_reg": 0.05, "mechanism": "laplace"},
    {"name": "sparse_mean_gd", "epsilon": 4.0, "iterations": 5},
    {"name": "sparse_mean_gd", "epsilon": 4.0, "iterations": 2, "estimator": "l1_recovery", "block_size": 64},
    {"name": "numeric_sparse", "epsilon": 4.0, "iterations": 5, "batch_size": 20, "cutoff": 10,
     "accountant": "rdp"},
    {"name": "dpsgd", "epsilon": 4.0, "iterations": 5, "batch_size": 20},
])
def test_every_algorithm_runs(corpus, tmp_path, algo):
    s = train(config_from_dict(_raw(corpus, tmp_path, algo)), tmp_path / "run", progress=False)
    assert 0 <= s["test_accuracy"] <= 1
    if algo["name"] != "nonprivate":
        assert 0 < s["dp"]["epsilon"] <= algo["epsilon"] * 1.0001


def test_dp_section_is_rejected(corpus, tmp_path):
    dp = {"noise_multiplier": 1.0, "selection": {"name": "all"}}
    raw = _raw(corpus, tmp_path, {"name": "nonprivate"}) | {"dp": dp}
    with pytest.raises(ConfigError, match="^dp: task glm takes its privacy parameters in algorithm"):
        train(config_from_dict(raw), tmp_path / "run", progress=False)
