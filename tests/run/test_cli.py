"""End to end through the CLI: Brown smoke runs, config errors, export, epsilon."""

import json
import subprocess
import sys

import pytest

from widedp.cli import main

SMALL = ["data.splits=[20000,4000,4000]", "train.epochs=1", "train.log_every=100", "train.eval_max_samples=4000"]


def _sets(*pairs):
    out = []
    for p in pairs:
        out += ["--set", p]
    return out


@pytest.mark.slow
def test_nonprivate_brown_smoke(tmp_path, brown_cache, capsys):
    out = tmp_path / "run"
    rc = main(["train", "configs/brown_cbow_nonprivate.yaml", "--out", str(out), "--no-progress",
               *_sets(*SMALL, f"data.cache_dir={brown_cache}", "train.max_steps=380", "train.batch_size=50")])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    for key in ("train_loss", "valid_loss", "test_loss", "samples_per_s", "steps", "epochs", "config_hash"):
        assert key in summary
    assert summary["steps"] == 380  # < one epoch of the ~20,000 train pairs
    assert summary["valid_loss"] < summary["initial_valid_loss"]
    assert (out / "loss.png").stat().st_size > 1000
    assert (out / "checkpoint.pt").exists()
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in lines][:3] == ["notice", "start", "interval"]
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["steps"] == 380
    privacy = summary["privacy"]  # no ε, so no accountant named beside it
    assert privacy["epsilon"] is None and privacy["accountant"] is None and privacy["text"].startswith("NOT PRIVATE")


@pytest.mark.slow
@pytest.mark.parametrize("selection", ["exponential", "sparse_vector", "uniform", "random_sparsification", "all"])
def test_dp_brown_smoke_each_mechanism(tmp_path, brown_cache, selection):
    out = tmp_path / selection
    # the paper preset's 200K train pairs, one epoch = 200 Poisson steps of b=1000 (DP needs the data to learn)
    rc = main(["train", "configs/brown_cbow_sparse_exp.yaml", "--out", str(out), "--no-progress",
               *_sets(f"data.cache_dir={brown_cache}", "train.epochs=1", "train.log_every=50", "train.lr=0.01",
                      "train.eval_max_samples=5000", f"dp.selection={_selection(selection)}")])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dp"]["selection"] == selection
    assert summary["dp"]["epsilon"] > 0
    if selection == "exponential":  # the check: a short DP-sparse run lowers the validation loss
        assert summary["valid_loss"] < summary["initial_valid_loss"] - 0.005
    rec = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"interval"' in x]
    for key in ("rows_selected", "touched_share", "clipped1", "clipped2", "nonfinite_samples"):
        assert key in rec[0]
    assert "noise_norm" not in rec[0]


def _selection(name):
    return {
        "exponential": "{name: exponential, k: 500, epsilon: 0.05, score_clip: 0.05}",
        "sparse_vector": "{name: sparse_vector, epsilon: 0.05, cutoff: 500, threshold: 0.01}",
        "uniform": "{name: uniform, k: 500}",
        "random_sparsification": "{name: random_sparsification, final_rate: 0.5}",
        "all": "{name: all}",
    }[name]


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "widedp.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


def test_config_errors_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epocs: 3\n")
    r = _cli("train", str(bad), "--out", str(tmp_path / "r"))
    assert r.returncode == 2
    assert r.stderr.startswith("widedp: error: train.epocs: unknown key")
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = _cli("train", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and "config file not found" in r.stderr and "Traceback" not in r.stderr


def _text_config(tmp_path, text, **data):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    cfg = tmp_path / "c.yaml"
    extra = "".join(f"  {k}: {v}\n" for k, v in data.items())
    cfg.write_text(f"data:\n  preset: custom\n  corpus: text:{corpus}\n  cache_dir: {tmp_path / 'cache'}\n{extra}"
                   "train:\n  epochs: 1\n  batch_size: 4\n  optimizer: sgd\n  lr: 0.1\n")
    return cfg


@pytest.mark.parametrize(
    ("text", "data", "needle"),
    [
        ("apple banana cherry\n" * 20, {"vocab_size": 50, "splits": "[10, 5, 5]"}, "vocab_size"),
        ("the and of\n" * 5, {"vocab_size": 2, "splits": "[10, 5, 5]"}, "no tokens left"),
        ("apple banana cherry\n" * 20, {"vocab_size": 3, "splits": "[100000, 5, 5]"}, "splits"),
    ],
)
def test_data_errors(tmp_path, text, data, needle, capsys):
    cfg = _text_config(tmp_path, text, **data)
    rc = main(["train", str(cfg), "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in err and len(err.strip().splitlines()) == 1


def test_resume_requires_run_dir(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "not a widedp run directory" in capsys.readouterr().err


def test_export_word2vec_round_trip(tmp_path):
    text = "".join(f"w{i % 7} w{(i * 3) % 7} w{(i * 5) % 7} w{(i + 1) % 7}\n" for i in range(200))
    cfg = _text_config(tmp_path, text, vocab_size=7, splits="[300, 50, 50]", remove_stopwords="false",
                       alpha_only="false")
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run), "--no-progress"]) == 0
    assert main(["export", str(run), "--format", "word2vec", "--out", str(tmp_path / "rel")]) == 0
    out = tmp_path / "rel" / "vectors.txt"
    gensim = pytest.importorskip("gensim")
    kv = gensim.models.KeyedVectors.load_word2vec_format(str(out), binary=False)
    vocab = json.loads((run / "vocab.json").read_text())
    assert list(kv.index_to_key) == vocab and kv.vector_size == 100
    import torch

    state = torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    weight = next(v for k, v in state.items() if k.endswith("weight"))
    assert abs(kv[vocab[0]] - weight[0].numpy()).max() < 1e-5


def test_epsilon_command(capsys):
    rc = main(["epsilon", "configs/brown_cbow_dpsgd.yaml"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    for key in ("epsilon", "epsilon_rdp", "delta", "steps", "sampling_rate", "noise_multiplier", "adjacency",
                "parts"):
        assert key in rep
    # 20 epochs of n/b = ~200,000/1,000 Poisson steps (n Binomial); DP-SGD spends only the (subsampled) Gaussian
    assert rep["steps"] == 4000 and rep["sampling_rate"] == pytest.approx(5e-3, rel=0.01)
    assert rep["parts"]["selection"]["pld"] == 0 and rep["epsilon"] == pytest.approx(rep["parts"]["noise"]["pld"])
