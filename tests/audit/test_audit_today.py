"""Regression tests of the defects an audit found in model.init_vectors and data.user_feature: false (each failed
before its fix)."""


import numpy as np
import pytest
import torch
from tiny_corpus import data_section

from widedp.cli import main
from widedp.config import config_from_dict
from widedp.errors import ConfigError
from widedp.models import init_vectors as iv
from widedp.models.cbow import CBOW
from widedp.tasks.recsys import RecsysTask

gensim = pytest.importorskip("gensim")
DIM = 4
VOCAB = ["w0", "w1", "w2"]


def _vectors(path, *, scale=1.0):
    """A word2vec text file with vectors for w1 and w2 (dim ``DIM``)."""
    from gensim.models import KeyedVectors

    kv = KeyedVectors(vector_size=DIM)
    kv.add_vectors(["w1", "w2"], (scale * np.arange(2 * DIM, dtype=np.float32).reshape(2, DIM)))
    kv.save_word2vec_format(str(path), binary=False)
    return path


def _model():
    return CBOW(len(VOCAB), DIM, tied=True, generator=torch.Generator().manual_seed(0))


def test_resume_without_the_record_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    path = _vectors(tmp_path / "v.txt")
    iv.warm_start(_model(), VOCAB, out, path=str(path), output="zeros", resumed=False)
    (out / iv.RECORD_FILE).unlink()
    _vectors(path, scale=2.0)  # another file at the same path
    with pytest.raises(ConfigError, match=r"^model\.init_vectors"):
        iv.warm_start(_model(), VOCAB, out, path=str(path), output="zeros", resumed=True)


def test_damaged_record_is_a_one_line_error(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    path = _vectors(tmp_path / "v.txt")
    (out / iv.RECORD_FILE).write_text('{"path": "/tmp/au')
    with pytest.raises(ConfigError, match=r"^model\.init_vectors"):
        iv.warm_start(_model(), VOCAB, out, path=str(path), output="zeros", resumed=True)


def test_a_directory_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^model\.init_vectors: "):
        iv.statement_line(str(tmp_path))


def test_a_home_relative_path_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _vectors(tmp_path / "v.txt")
    init = iv.load_init_vectors("~/v.txt", VOCAB, dim=DIM)
    assert init.rows.tolist() == [1, 2]


def test_a_missing_vectors_file_is_refused_before_the_dp_vocabulary(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
{data_section(tmp_path, words=13, extra=", privacy_unit: sentence, max_samples_per_unit: 3, vocabulary: dp, "
                                         "vocab_dp: {noise_multiplier: 2.0, max_words_per_unit: 6}")}
model: {{dim: 8, tied: false, init_vectors: "{tmp_path / 'missing.txt'}"}}
train: {{epochs: 1, max_steps: 5, batch_size: 10, optimizer: lazy_adam, lr: 0.01, eval_max_samples: 50}}
dp: {{clip1: 1.0, clip2: null, noise_multiplier: 1.0, rng: reproducible, selection: {{name: all}}}}
""")
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 2
    assert "model.init_vectors" in capsys.readouterr().err
    assert not (out / "vocab_release.json").exists()  # nothing private drawn for a run that cannot start


def test_interaction_unit_without_a_user_table_names_no_user_ids(tmp_path):
    (tmp_path / "r.csv").write_text("userId,movieId,rating,timestamp\nu1,1,4,10\nu2,2,3,20\n")
    cfg = config_from_dict({"task": "recsys", "data": {"preset": "custom", "source": f"ratings:{tmp_path / 'r.csv'}",
                                                       "cache_dir": "", "user_feature": False}})
    facts = RecsysTask().privacy(cfg)
    assert facts.not_covered and not [g for g in facts.not_covered if "user and item id" in g or "distinct users" in g]
