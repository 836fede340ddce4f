"""GLM gradients vs autograd, the data builder on a tiny synthetic corpus, config errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from widedp.config import config_from_dict
from widedp.config.glm import GLMDataConfig
from widedp.data_prep.brown_glm import build_glm_data, chunk, chunk_keys, document_keys, prepare_glm
from widedp.data_prep.splits import assign
from widedp.errors import ConfigError
from widedp.models import glm
from widedp.tasks.glm import to_rows


def _rows(seed: int = 0, n: int = 12, d: int = 9, k: int = 4) -> glm.LabeledCSR:
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(n, d, generator=g, dtype=torch.float64) * (torch.rand(n, d, generator=g) < 0.4)
    dense[:, -1] = 1.0
    dense = dense / dense.norm(dim=1, keepdim=True)
    csr = dense.to_sparse_csr()
    return glm.LabeledCSR.from_csr(csr.crow_indices(), csr.col_indices(), csr.values(),
                                   torch.randint(0, k, (n,), generator=g), num_features=d, num_classes=k,
                                   dtype=torch.float64)


def test_per_sample_gradients_match_autograd():
    data = _rows()
    w = torch.randn(9, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    loss, r = glm.residuals(w, data)
    dense = data.x.to_dense()
    for i in range(len(data)):
        wi = w.clone().requires_grad_(True)
        li = torch.nn.functional.cross_entropy((dense[i] @ wi)[None], data.y[i:i + 1])
        (gi,) = torch.autograd.grad(li, wi)
        assert torch.allclose(loss[i], li.detach())
        assert torch.allclose(torch.outer(dense[i], r[i]), gi, atol=1e-12)
        # sparsity: rows of features the sample does not use are exactly zero
        assert torch.all(gi[dense[i] == 0] == 0)
    x_norms = data.row_norms(2.0)
    norms = glm.grad_norms(data, r, x_norms)
    assert torch.allclose(norms, torch.stack([torch.outer(dense[i], r[i]).norm() for i in range(len(data))]))
    assert torch.all(norms <= glm.LIPSCHITZ_L2 + 1e-12)
    total = glm.weighted_grad_sum(data, r)
    assert torch.allclose(total, sum(torch.outer(dense[i], r[i]) for i in range(len(data))))
    sub = data.rows(torch.tensor([3, 0, 7]))
    assert torch.equal(sub.x.to_dense(), dense[[3, 0, 7]]) and torch.equal(sub.y, data.y[[3, 0, 7]])


DOCS = {
    "sport": "ball goal team match win player coach score ball goal team",
    "food": "bread cheese soup salad bread dinner cook taste cheese soup",
    "tech": "computer code data network code chip software data server",
}


def _corpus(tmp_path, docs_per_label: int = 6, extra_test_word: bool = True):
    lines = []
    for lab, text in DOCS.items():
        for j in range(docs_per_label):
            lines.append(f"{lab}\t{text} {text} unique{lab}{chr(97 + j)}")
    path = tmp_path / "corpus.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_builder_tiny_corpus(tmp_path):
    path = _corpus(tmp_path)
    cfg = GLMDataConfig(preset="custom", corpus=f"text:{path}", chunk_tokens=8, min_chunk_tokens=4, vocab_size=28,
                        splits=(0.5, 0.17, 0.33), cache_dir=str(tmp_path / "cache"), remove_stopwords=False)
    data = prepare_glm(cfg)
    assert data.classes == ["food", "sport", "tech"] and data.has_bias and data.num_features == 29
    # vocabulary from the training split only: per-document unique words of valid/test documents never appear
    assert len(data.valid) > 0 and len(data.test) > 0
    assert any(w.startswith("unique") for w in data.vocab)  # training documents' own words are in it
    docs, labels = [], []
    for line in path.read_text().splitlines():
        lab, text = line.split("\t")
        docs.append(text.split())
        labels.append(lab)
    which = assign(document_keys(docs, labels, None, seed=cfg.seed), cfg.splits)
    held_out_unique = {d[-1] for d, s in zip(docs, which) if s != 0}
    assert held_out_unique and not (held_out_unique & set(data.vocab))
    # rows: unit L2 norm, last column = bias
    for split in (data.train, data.valid, data.test):
        rows = to_rows(split, num_features=data.num_features, num_classes=3, dtype=torch.float64)
        assert torch.allclose(rows.row_norms(2.0), torch.ones(len(rows), dtype=torch.float64))
        assert len(split) and set(split.labels.tolist()) <= {0, 1, 2}
        assert np.all(split.indices[split.indptr[1:] - 1] == 28)
    # cached: a second call reads the same arrays
    again = prepare_glm(cfg)
    assert np.array_equal(again.train.values, data.train.values) and again.vocab == data.vocab
    # l1 normalisation
    l1 = build_glm_data(docs, labels, GLMDataConfig(**{**cfg.__dict__, "norm": "l1", "cache_dir": ""}))
    rows = to_rows(l1.train, num_features=l1.num_features, num_classes=3, dtype=torch.float64)
    assert torch.allclose(rows.row_norms(1.0), torch.ones(len(rows), dtype=torch.float64))


def test_chunking_and_split():
    ids = np.arange(23)
    assert [len(c) for c in chunk(ids, 10, 5)] == [10, 10]
    assert [len(c) for c in chunk(ids, 10, 3)] == [10, 10, 3]
    assert [len(c) for c in chunk(ids, 0, 1)] == [23]


def test_adding_or_removing_a_unit_moves_no_other_record(tmp_path):
    """Record-local GLM splits: one document (whole-document units) or one chunk (split_by: chunk) added or removed
    leaves every other record's split as it was (the stratified, seeded shuffle moved ~100 chunks)."""
    rng = np.random.default_rng(0)
    docs = [list(rng.choice(["a", "b", "c", "d", "e"], 6)) for _ in range(300)]
    labels = [str(x) for x in rng.integers(0, 3, 300)]
    names = [f"f{i:03d}" for i in range(300)]

    def split_of(keys):
        return assign(keys, (0.6, 0.2, 0.2))

    for drop in (0, 150, 299):
        keep = [i for i in range(300) if i != drop]
        for by_name in (names, None):
            full = split_of(document_keys(docs, labels, by_name, seed=3))
            less = split_of(document_keys([docs[i] for i in keep], [labels[i] for i in keep],
                                          None if by_name is None else [names[i] for i in keep], seed=3))
            assert np.array_equal(full[keep], less)
        full = split_of(chunk_keys(docs, labels, seed=3))
        less = split_of(chunk_keys([docs[i] for i in keep], [labels[i] for i in keep], seed=3))
        assert np.array_equal(full[keep], less)
    # a chunk added to a named document keeps its key: the document's chunks stay where they were
    assert document_keys(docs, labels, names, seed=3)[7] == document_keys(
        [docs[7] + ["f"]], [labels[7]], [names[7]], seed=3)[0]


@pytest.mark.parametrize("algo, msg", [
    ({"name": "dpsgd", "radius": 1.0}, "algorithm.radius: not a key of algorithm 'dpsgd'"),
    ({"name": "dp_agd"}, "algorithm.epsilon: algorithm 'dp_agd' needs a target epsilon"),
    ({"name": "nonprivate", "epsilon": 1.0}, "algorithm.epsilon: the nonprivate algorithm takes no epsilon"),
    ({"name": "frank_wolfe", "epsilon": 1.0, "noise": "cauchy"}, "algorithm.noise: expected one of"),
    ({"name": "sgd"}, "algorithm.name: expected one of"),
    ({"name": "numeric_sparse", "epsilon": 1.0, "release_share": 1.5}, "algorithm.release_share: must be in (0, 1)"),
    ({"name": "frank_wolfe", "epsilon": 1.0, "step": 1.5}, "algorithm.step: Frank-Wolfe's step is a convex weight"),
])
def test_config_errors_are_one_line(algo, msg):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"task": "glm", "algorithm": algo})
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_data_config_errors():
    with pytest.raises(ConfigError, match="data.corpus: file not found"):
        config_from_dict({"task": "glm", "data": {"corpus": "text:/nonexistent.tsv"}})
    with pytest.raises(ConfigError, match="data.splits"):
        config_from_dict({"task": "glm", "data": {"splits": [0.9, 0.2, 0.1]}})
    cfg = config_from_dict({"task": "glm", "algorithm": {"name": "dpsgd", "epsilon": 2}})
    assert cfg.algorithm.get("clip") == 1.0 and cfg.data.vocab_size == 2000 and math.isclose(cfg.algorithm.epsilon, 2)
