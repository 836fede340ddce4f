"""widedp.models.init_vectors: word2vec text and binary files read into a CBOW's rows by word, and one-line errors
for a missing file, a wrong dim, no word found, a non-finite vector and a file that is not word2vec."""

import numpy as np
import pytest
import torch

from widedp.errors import ConfigError
from widedp.models.cbow import CBOW
from widedp.models.init_vectors import apply_, file_sha256, is_binary, load_init_vectors, statement_line

gensim = pytest.importorskip("gensim")
DIM = 4


def _write(path, words, vectors, *, binary):
    """A word2vec file of ``words`` and ``vectors`` [n, D], written by gensim itself."""
    from gensim.models import KeyedVectors

    kv = KeyedVectors(vector_size=vectors.shape[1])
    kv.add_vectors(list(words), vectors.astype(np.float32))
    kv.save_word2vec_format(str(path), binary=binary)
    return path


def _file_vectors(n=5, dim=DIM):
    return np.arange(n * dim, dtype=np.float32).reshape(n, dim) / 7 - 1


@pytest.mark.parametrize("binary", [False, True])
def test_rows_are_mapped_by_word(tmp_path, binary):
    file_words = ["cat", "dog", "Sun", "tree", "zebra"]
    vecs = _file_vectors()
    path = _write(tmp_path / ("v.bin" if binary else "v.txt"), file_words, vecs, binary=binary)
    assert is_binary(str(path)) == binary
    vocab = ["the", "tree", "dog", "sun", "cat"]  # "sun" is not "Sun": matched exactly
    init = load_init_vectors(str(path), vocab, dim=DIM)
    assert init.rows.tolist() == [1, 2, 4] and init.found == 3 and init.file_words == 5
    for row, word in zip(init.rows.tolist(), ["tree", "dog", "cat"]):
        assert torch.equal(init.vectors[init.rows.tolist().index(row)], torch.from_numpy(vecs[file_words.index(word)]))
    assert init.sha256 == file_sha256(str(path)) and len(init.sha256) == 64


@pytest.mark.parametrize("tied,output", [(False, "zeros"), (False, "vectors"), (True, "zeros")])
def test_apply_sets_found_rows_and_keeps_the_others(tmp_path, tied, output):
    vocab = ["the", "tree", "dog", "sun", "cat"]
    path = _write(tmp_path / "v.txt", ["cat", "dog", "tree"], _file_vectors(3), binary=False)
    init = load_init_vectors(str(path), vocab, dim=DIM)
    model = CBOW(len(vocab), DIM, tied=tied, generator=torch.Generator().manual_seed(3))
    cold = CBOW(len(vocab), DIM, tied=tied, generator=torch.Generator().manual_seed(3))
    apply_(model, init, output=output)
    found = init.rows.tolist()
    other = [i for i in range(len(vocab)) if i not in found]
    assert torch.equal(model.input.weight[init.rows], init.vectors)
    assert torch.equal(model.input.weight[other], cold.input.weight[other])
    if not tied:
        want = init.vectors if output == "vectors" else torch.zeros(len(found), DIM)
        assert torch.equal(model.output.weight[init.rows], want)
        assert torch.equal(model.output.weight[other], torch.zeros(len(other), DIM))


def test_errors_are_one_line_naming_the_key_and_path(tmp_path):
    path = _write(tmp_path / "v.txt", ["cat", "dog"], _file_vectors(2), binary=False)
    cases = {
        "missing": (str(tmp_path / "nope.txt"), ["cat"], DIM, "no such file"),
        "dim": (str(path), ["cat"], DIM + 1, f"holds vectors of dim {DIM}; model.dim is {DIM + 1}"),
        "none found": (str(path), ["CAT", "bird"], DIM, "none of the 2 vocabulary words"),
    }
    garbage = tmp_path / "garbage.txt"
    garbage.write_text("hello world\nthis is not a word2vec file\n")
    cases["not word2vec"] = (str(garbage), ["cat"], DIM, "not a word2vec text or binary file")
    for name, (p, vocab, dim, needle) in cases.items():
        with pytest.raises(ConfigError) as e:
            load_init_vectors(p, vocab, dim=dim)
        msg = str(e.value)
        assert msg.startswith(f"model.init_vectors: {p}") and needle in msg and "\n" not in msg, name


def test_a_non_finite_vector_is_refused(tmp_path):
    vecs = _file_vectors(2)
    vecs[1, 2] = np.nan
    path = _write(tmp_path / "v.bin", ["cat", "dog"], vecs, binary=True)
    with pytest.raises(ConfigError, match="the vector of 'dog' is not finite"):
        load_init_vectors(str(path), ["cat", "dog"], dim=DIM)


def test_statement_line_names_the_file_its_hash_and_the_assumption(tmp_path):
    path = _write(tmp_path / "v.txt", ["cat"], _file_vectors(1), binary=False)
    line = statement_line(str(path))
    assert f"model.init_vectors: {path}" in line and file_sha256(str(path)) in line
    assert "assumed public" in line and "not covered by ε if derived from private data" in line
    path.write_text(path.read_text().replace("cat", "dog"))  # rewritten in place: hashed again
    assert file_sha256(str(path)) not in line


def test_without_gensim_the_error_names_the_extra(tmp_path, monkeypatch):
    from widedp.extras import MissingExtraError

    path = _write(tmp_path / "v.txt", ["cat"], _file_vectors(1), binary=False)
    monkeypatch.setitem(__import__("sys").modules, "gensim.models", None)  # import gensim.models fails
    with pytest.raises(MissingExtraError, match=r"^model.init_vectors .* pip install 'widedp\[eval\]'$"):
        load_init_vectors(str(path), ["cat"], dim=DIM)
