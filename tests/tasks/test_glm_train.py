"""End to end: `widedp train` of tiny glm configs (every algorithm) on a synthetic corpus."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from widedp.cli import main
from widedp.config import config_from_dict
from widedp.errors import ConfigError
from widedp.run.train import train

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
            "train": {"seed": 0}, "algorithm": {"rng": "reproducible", **algo}}  # deterministic unless asked


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
    assert kinds[:2] == ["notice", "start"] and kinds[-1] == "end" and "interval" in kinds
    assert s["dp"]["ledger"]["runs"][0]["count"] == 30
    p = s["privacy"]
    assert not s["private"] and not p["private"] and p["text"].startswith("NOT PRIVATE")  # reproducible rng
    assert p["epsilon"] == s["epsilon"] and p["adjacency"] == "add_remove"
    assert p["unit"].startswith("document chunk") and "5-10 consecutive filtered tokens" in p["unit"]
    assert p["accountant"] == "PLD" and p["delta"] == 1e-5
    assert any("vocabulary" in x for x in p["not_covered"]) and any("size n" in x for x in p["not_covered"])
    assert printed["privacy"] == p["text"] and not any("max_docs" in x for x in p["not_covered"])
    assert printed["notice"].startswith("the losses are NON-PRIVATE diagnostics")


def test_what_the_statement_does_not_cover(corpus, tmp_path):
    from widedp.config import config_from_dict
    from widedp.tasks.glm import not_covered

    raw = _raw(corpus, tmp_path, {"name": "dpsgd", "epsilon": 1.0})
    raw["data"]["max_docs"] = 7
    assert "data.max_docs: 7: the corpus is cut to its first 7 documents by position" in not_covered(
        config_from_dict(raw))
    # a text document's key is its whole text: with chunk units split by document, the statement says so
    assert any("a document's split key is its whole text" in x for x in not_covered(config_from_dict(raw)))
    raw["data"]["split_by"] = "chunk"
    assert not any("split key" in x for x in not_covered(config_from_dict(raw)))
    assert not any("split key" in x for x in not_covered(config_from_dict({"task": "glm", "algorithm": {
        "name": "dpsgd", "epsilon": 1.0}})))  # Brown: file ids


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
        assert s["privacy"]["epsilon"] == s["epsilon"] == s["dp"]["epsilon"]
    else:
        assert s["privacy"]["epsilon"] is None and not s["private"] and "dp" not in s
    if algo["name"] == "dp_agd":  # headline: the zCDP budget (adaptive budgets: no PLD figure is a guarantee)
        assert s["privacy"]["accountant"] == "zCDP" and s["dp"]["accountant"] == "zcdp"
        assert math.isclose(s["epsilon"], algo["epsilon"], rel_tol=1e-9) and s["dp"]["epsilon_rdp"] is None
        assert s["dp"]["rho_spent"] <= s["dp"]["rho"] * (1 + 1e-9)


def test_dp_section_is_rejected(corpus, tmp_path):
    dp = {"noise_multiplier": 1.0, "selection": {"name": "all"}}
    raw = _raw(corpus, tmp_path, {"name": "nonprivate"}) | {"dp": dp}
    with pytest.raises(ConfigError, match="^dp: task glm takes its privacy parameters in algorithm"):
        train(config_from_dict(raw), tmp_path / "run", progress=False)
    # a partial dp: (as --set dp.clip1=1 makes) is refused for what it is, not for a missing selection key
    with pytest.raises(ConfigError, match="^dp: task glm takes its privacy parameters in algorithm"):
        config_from_dict(raw | {"dp": {"clip1": 1.0}})


# ------------------------------------------------------------------------------------------- randomness secrecy


def _secret_patterns(seeds) -> list[bytes]:
    out = []
    for v in (seeds.sampling, seeds.noise):
        out += [str(v).encode(), v.to_bytes(8, "little"), v.to_bytes(8, "big")]
    return out


def _glm_run(corpus, tmp_path, name, **algo):
    raw = _raw(corpus, tmp_path, {"name": "dpsgd", "epsilon": 4.0, "iterations": 5, "batch_size": 20, **algo})
    return train(config_from_dict(raw), tmp_path / name, progress=False), tmp_path / name


def _w(run):
    return torch.load(run / "checkpoint.pt", weights_only=True)["w"]


def test_glm_rng_secure_by_default_secret_and_reproducible_repeats(corpus, tmp_path):
    from widedp.dp import rng

    raw = _raw(corpus, tmp_path, {"name": "dpsgd", "epsilon": 4.0})
    del raw["algorithm"]["rng"]
    assert config_from_dict(raw).algorithm.rng == "secure"  # the default
    s1, r1 = _glm_run(corpus, tmp_path, "s1", rng="secure")
    s2, r2 = _glm_run(corpus, tmp_path, "s2", rng="secure")
    assert not torch.equal(_w(r1), _w(r2))  # secret seeds: two runs of the same config draw different noise
    for run, s in ((r1, s1), (r2, s2)):
        assert s["private"] and s["privacy"]["private"] and s["dp"]["rng"] == "secure"
        seeds = rng.load_seeds(run)
        assert seeds is not None and seeds.mode == "secure"
        assert (run / "private" / "seeds.json").stat().st_mode & 0o777 == 0o600
        shareable = [p for p in run.rglob("*") if p.is_file() and "private" not in p.relative_to(run).parts]
        assert {p.name for p in shareable} >= {"config.yaml", "checkpoint.pt", "summary.json", "metrics.jsonl"}
        for p in shareable:
            data = p.read_bytes()
            for pat in _secret_patterns(seeds):
                assert pat not in data, (p.name, pat)
        ck = torch.load(run / "checkpoint.pt", weights_only=True)
        assert set(ck) == {"w", "history", "config_hash", "step"}  # no generator state
    q1, p1 = _glm_run(corpus, tmp_path, "q1", rng="reproducible")
    q2, p2 = _glm_run(corpus, tmp_path, "q2", rng="reproducible")
    assert torch.equal(_w(p1), _w(p2))
    assert not q1["private"] and not q1["privacy"]["private"] and q1["privacy"]["reason"] == rng.NOT_PRIVATE
    assert q1["privacy"]["text"].startswith("NOT PRIVATE")


def test_glm_resume_replays_the_secret_seeds_or_refuses(corpus, tmp_path):
    _, run = _glm_run(corpus, tmp_path, "r", rng="secure")
    w = _w(run)
    (run / "summary.json").unlink()  # an unfinished run: restarts from scratch with the saved seeds
    raw = _raw(corpus, tmp_path, {"name": "dpsgd", "epsilon": 4.0, "iterations": 5, "batch_size": 20,
                                  "rng": "secure"})
    train(config_from_dict(raw), run, resume=True, progress=False)
    assert torch.equal(_w(run), w)
    (run / "summary.json").unlink()
    for p in (run / "private").iterdir():
        p.unlink()
    with pytest.raises(ConfigError, match="cannot resume"):
        train(config_from_dict(raw), run, resume=True, progress=False)
