"""``model.init_vectors`` run records and paths (``widedp.models.init_vectors``): a resume refuses a missing or
damaged record, a directory is a one-line error naming the key, and ``~`` is expanded."""

import numpy as np
import pytest
import torch

from widedp.errors import ConfigError
from widedp.models import init_vectors as iv
from widedp.models.cbow import CBOW

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
