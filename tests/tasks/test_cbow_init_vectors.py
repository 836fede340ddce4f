"""``model.init_vectors`` through the CBOW task: the build's rows (untied, tied, any data.vocabulary), the statement
of the run, ``widedp epsilon`` and the export, resume (never re-initialised; the file's sha256 checked), and the
one-line refusals (several processes, a file changed before a resume)."""

import json

import numpy as np
import pytest
import torch
import yaml
from snapshots import train_with_snapshot
from tiny_corpus import data_section

from widedp.cli import main
from widedp.config import load_config
from widedp.distributed import ranks
from widedp.errors import ConfigError
from widedp.models import init_vectors as iv
from widedp.run.train import train
from widedp.tasks.cbow import TASK

gensim = pytest.importorskip("gensim")
torch.set_num_threads(1)
DIM = 8


def _vectors(tmp_path, *, words=("w1", "w3", "w4", "w9", "other"), binary=False, scale=1.0):
    from gensim.models import KeyedVectors

    kv = KeyedVectors(vector_size=DIM)
    rng = np.random.default_rng(5)
    kv.add_vectors(list(words), (scale * rng.standard_normal((len(words), DIM))).astype(np.float32))
    path = tmp_path / ("vectors.bin" if binary else "vectors.txt")
    kv.save_word2vec_format(str(path), binary=binary)
    return path, kv


def _config(tmp_path, vectors, *, tied=False, output="zeros", vocabulary="", dp=True, extra_train=""):
    """A tiny DP (or non-private: sparse Adam) CBOW run over ``tiny_corpus`` warm-started from ``vectors``."""
    cfg = tmp_path / "c.yaml"
    optimizer = "lazy_adam" if dp else "sparse_adam"
    out_key = f", init_output: {output}" if output != "zeros" else ""
    dp_section = ("dp: {clip1: 1.0, clip2: null, noise_multiplier: 1.0, rng: reproducible, sampling_rate: 0.01, "
                  "selection: {name: all}}" if dp else "")
    cfg.write_text(f"""
{data_section(tmp_path, lines=400, extra=vocabulary)}
model: {{dim: {DIM}, tied: {str(tied).lower()}, init_vectors: "{vectors}"{out_key}}}
train: {{epochs: 1, max_steps: 40, batch_size: 10, optimizer: {optimizer}, lr: 0.01, log_every: 10,
        eval_max_samples: 50{extra_train}}}
{dp_section}
""")
    return cfg


@pytest.mark.parametrize("tied,output,vocab_kind", [(False, "zeros", "top"), (False, "vectors", "file"),
                                                    (True, "zeros", "file")])
def test_build_starts_found_rows_from_the_file(tmp_path, tied, output, vocab_kind):
    path, kv = _vectors(tmp_path)
    vocabulary = ""
    if vocab_kind == "file":
        (tmp_path / "words.txt").write_text("".join(f"w{i}\n" for i in (9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 10)))
        vocabulary = f', vocabulary: "file:{tmp_path / "words.txt"}"'
    cfg = load_config(_config(tmp_path, path, tied=tied, output=output, vocabulary=vocabulary))
    out = tmp_path / "run"
    out.mkdir()
    model = TASK.build(cfg, out, device=torch.device("cpu")).model
    vocab = json.loads((out / "vocab.json").read_text())
    found = [i for i, w in enumerate(vocab) if w in kv.key_to_index]
    assert len(found) == 4
    for i in found:
        assert torch.equal(model.input.weight[i], torch.tensor(kv[vocab[i]]))
        if not tied:
            want = torch.tensor(kv[vocab[i]]) if output == "vectors" else torch.zeros(DIM)
            assert torch.equal(model.output.weight[i], want)
    others = [i for i in range(len(vocab)) if i not in found]
    assert model.input.weight[others].abs().max() <= 0.5 / DIM  # the default U(-a, a) init
    rec = json.loads((out / iv.RECORD_FILE).read_text())
    assert rec == {"path": str(path), "sha256": iv.file_sha256(str(path)), "file_words": 5, "found": 4,
                   "vocab_size": len(vocab), "output": output}


def test_run_statement_epsilon_and_export_name_the_vectors(tmp_path, capsys):
    path, _ = _vectors(tmp_path, binary=True)
    cfg = _config(tmp_path, path)
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(run), "--no-progress"]) == 0
    line = iv.statement_line(str(path))
    summary = json.loads((run / "summary.json").read_text())
    assert line in summary["privacy"]["includes"] and line in summary["privacy"]["text"]
    assert "assumed public" in line and iv.file_sha256(str(path)) in line
    capsys.readouterr()
    assert main(["epsilon", str(cfg)]) == 0
    assert line in capsys.readouterr().out
    assert main(["export", str(run), "--format", "word2vec", "--out", str(tmp_path / "rel")]) == 0
    assert line in json.loads((tmp_path / "rel" / "privacy.json").read_text())["includes"]


def test_a_non_private_run_is_warm_started_too(tmp_path):
    path, _ = _vectors(tmp_path)
    cfg = load_config(_config(tmp_path, path, dp=False))
    summary = train(cfg, tmp_path / "np", progress=False)
    assert summary["steps"] > 0 and json.loads((tmp_path / "np" / iv.RECORD_FILE).read_text())["found"] == 4


def test_resume_does_not_reinitialise_and_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    path, _ = _vectors(tmp_path)
    cfg = load_config(_config(tmp_path, path, extra_train=", checkpoint_every: 20"))
    run, snap = tmp_path / "run", tmp_path / "snap"
    full = train_with_snapshot(cfg, run, snap, step=20, monkeypatch=monkeypatch)
    record = (snap / iv.RECORD_FILE).read_text()

    def no_load(*a, **k):
        raise AssertionError("a resumed run read the vectors again")

    monkeypatch.setattr(iv, "load_init_vectors", no_load)
    assert main(["train", "--resume", str(snap), "--no-progress"]) == 0
    a = torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(snap / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    resumed = json.loads((snap / "summary.json").read_text())
    assert resumed["privacy"]["text"] == full["privacy"]["text"] and (snap / iv.RECORD_FILE).read_text() == record


def test_resume_refuses_a_changed_file(tmp_path, monkeypatch, capsys):
    path, _ = _vectors(tmp_path)
    cfg = load_config(_config(tmp_path, path, extra_train=", checkpoint_every: 20"))
    run, snap = tmp_path / "run", tmp_path / "snap"
    train_with_snapshot(cfg, run, snap, step=20, monkeypatch=monkeypatch)
    _vectors(tmp_path, scale=2.0)  # the same path, other vectors
    capsys.readouterr()
    assert main(["train", "--resume", str(snap), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"model.init_vectors: {path} changed since the run started" in err


def test_several_processes_are_refused(tmp_path, monkeypatch):
    path, _ = _vectors(tmp_path)
    cfg = load_config(_config(tmp_path, path))
    monkeypatch.setattr(ranks, "world", lambda: 2)
    (tmp_path / "run").mkdir()
    with pytest.raises(ConfigError, match=r"^model.init_vectors: a warm start trains on one process only"):
        TASK.build(cfg, tmp_path / "run", device=torch.device("cpu"))


def test_bad_files_fail_the_run_in_one_line(tmp_path, capsys):
    path, _ = _vectors(tmp_path)
    raw = yaml.safe_load(_config(tmp_path, path).read_text())
    for vectors, model_dim, needle in ((tmp_path / "none.txt", DIM, "no such file"),
                                       (path, DIM * 2, f"holds vectors of dim {DIM}; model.dim is {DIM * 2}")):
        raw["model"].update(init_vectors=str(vectors), dim=model_dim)
        (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
        capsys.readouterr()
        assert main(["train", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / f"r{model_dim}"),
                     "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"model.init_vectors: {vectors}" in err and needle in err
