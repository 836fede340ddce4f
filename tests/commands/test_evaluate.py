"""``widedp eval``: Spearman on WordSim-353 / SimLex-999 equal to gensim's evaluate_word_pairs, exact values on
hand-made vectors, a tiny trained run and its releases, one-line errors, and compare's word-similarity columns."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

from widedp.cli import main
from widedp.commands.evaluate import load_word_vectors, run_similarity
from widedp.errors import ConfigError
from widedp.eval import similarity as sim
from widedp.extras import MissingExtraError

gensim = pytest.importorskip("gensim")
from gensim.models import KeyedVectors  # noqa: E402
from gensim.test.utils import datapath  # noqa: E402

#: words of several WordSim-353 pairs (tiger-cat, book-paper, computer-keyboard, train-car, king-queen, bank-money)
#: and SimLex-999 pairs (happy-glad, fast-rapid, short-long)
BENCH_WORDS = ["tiger", "cat", "book", "paper", "computer", "keyboard", "train", "car", "king", "queen", "bank",
               "money", "happy", "glad", "fast", "rapid", "short", "long"]


def _pairs(gold):
    n = len(gold)
    return sim.PairSet("toy", tuple(f"x{i}" for i in range(n)), tuple(f"y{i}" for i in range(n)),
                       np.asarray(gold, dtype=np.float64))


def _angled(gold, sign):
    """x_i = e1, y_i at an angle decreasing (sign +1) or increasing (-1) with gold_i: cos(x_i, y_i) orders the
    pairs as gold does (or reversed). Returns (words, vectors)."""
    order = np.argsort(np.argsort(gold))  # rank of each pair
    theta = (order + 1) / (len(gold) + 1) * (math.pi / 2) * (1 if sign < 0 else -1) + (0 if sign < 0 else math.pi / 2)
    words = [f"x{i}" for i in range(len(gold))] + [f"Y{i}" for i in range(len(gold))]  # the lookup ignores case
    vectors = np.vstack([np.tile([1.0, 0.0], (len(gold), 1)), np.c_[np.cos(theta), np.sin(theta)]])
    return words, 3.0 * vectors  # norms do not matter


def test_spearman_exact_on_hand_made_vectors():
    gold = [7.1, 2.0, 9.5, 4.4, 0.3, 6.0]
    for sign, rho in ((1, 1.0), (-1, -1.0)):
        words, vectors = _angled(gold, sign)
        got = sim.pair_scores(words, vectors, _pairs(gold))
        assert got["spearman"] == pytest.approx(rho, abs=1e-12), sign
        assert got["in_vocab"] == got["pairs"] == 6 and got["share_in_vocab"] == 1.0
    # a pair with an unknown word is left out and counted; one pair swapped: rho = 1 - 6*2/(n(n^2-1)) exactly
    words, vectors = _angled(gold, 1)
    pairs = _pairs(gold + [5.0])
    got = sim.pair_scores(words, vectors, pairs)
    assert got["spearman"] == pytest.approx(1.0) and got["in_vocab"] == 6 and got["share_in_vocab"] == 6 / 7
    swapped = gold.copy()
    i, j = int(np.argsort(gold)[0]), int(np.argsort(gold)[1])  # the two lowest trade places
    swapped[i], swapped[j] = swapped[j], swapped[i]
    got = sim.pair_scores(words, vectors, _pairs(swapped))
    assert got["spearman"] == pytest.approx(1 - 6 * 2 / (6 * 35), abs=1e-12)
    # its interval: Fisher's z with variance 1.06 / (n - 3), by hand
    rho, n = got["spearman"], 6
    half = 1.959964 * math.sqrt(1.06 / (n - 3))
    assert got["spearman_ci95"] == pytest.approx([math.tanh(math.atanh(rho) - half), math.tanh(math.atanh(rho) + half)])
    assert got["spearman_ci95"][0] < rho < got["spearman_ci95"][1]
    assert sim.spearman_interval(0.0, 40) == pytest.approx([-0.3201, 0.3201], abs=1e-4)
    # fewer than two pairs in the vocabulary: no correlation, not a NaN
    assert sim.pair_scores(words[:1] + words[6:7], vectors[[0, 6]], _pairs(gold))["spearman"] is None


@pytest.mark.parametrize("key", list(sim.BENCHMARKS))
def test_equal_to_gensim_evaluate_word_pairs(key):
    pairs = sim.benchmark(key)
    words = sorted(set(pairs.first + pairs.second))
    rng = np.random.default_rng(0)
    keep = [w for w in words if rng.random() < 0.8]  # some pairs out of the vocabulary
    keep.insert(3, keep[10].upper())  # a case variant before its lower-case word: the first one is used
    vectors = rng.normal(size=(len(keep), 16)).astype(np.float32)
    kv = KeyedVectors(16)
    kv.add_vectors(keep, vectors)
    pearson, spearman, oov = kv.evaluate_word_pairs(datapath(sim.BENCHMARKS[key][1]))
    got = sim.pair_scores(keep, vectors, pairs)
    assert got["spearman"] == pytest.approx(spearman.statistic, abs=1e-6)
    assert got["pearson"] == pytest.approx(pearson.statistic, abs=1e-6)
    assert 1 - got["share_in_vocab"] == pytest.approx(oov / 100, abs=1e-12)
    assert got["pairs"] == {"wordsim353": 353, "simlex999": 999}[key]


def test_neighbours_brute_force():
    rng = np.random.default_rng(1)
    words = [f"w{i}" for i in range(30)]
    vectors = rng.normal(size=(30, 5))
    got = sim.neighbours(words, vectors, ["w3", "nope"], k=4)
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cos = {w: float(unit[i] @ unit[3]) for i, w in enumerate(words) if i != 3}
    expect = sorted(cos, key=lambda w: -cos[w])[:4]
    assert list(got) == ["w3"] and [w for w, _ in got["w3"]] == expect
    assert [c for _, c in got["w3"]] == [round(cos[w], 4) for w in expect]


def _config(tmp_path, *, lines=300):
    n = len(BENCH_WORDS)
    text = "".join(" ".join(BENCH_WORDS[(i * m + 1) % n] for m in (1, 5, 7, 11, 13)) + "\n" for i in range(lines))
    (tmp_path / "corpus.txt").write_text(text)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f'data: {{preset: custom, corpus: "text:{tmp_path / "corpus.txt"}", vocab_size: {n}, '
                   f'remove_stopwords: false, splits: [0.6, 0.2, 0.2], cache_dir: "{tmp_path / "cache"}"}}\n'
                   "model: {dim: 8, tied: false}\n"
                   "train: {epochs: 1, batch_size: 20, optimizer: lazy_adam, lr: 0.01, eval_max_samples: 50}\n"
                   "dp: {clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, selection: {name: uniform, k: 4}}\n")
    return cfg


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalrun")
    run = tmp / "run"
    assert main(["train", str(_config(tmp)), "--out", str(run), "--no-progress"]) == 0
    return run


def test_run_and_its_releases(tiny_run, tmp_path, capsys):
    capsys.readouterr()
    assert main(["eval", str(tiny_run), "--k", "3"]) == 0
    printed = capsys.readouterr().out
    rep = json.loads((tiny_run / "eval.json").read_text())
    assert "WordSim-353" in printed and f"wrote {tiny_run / 'eval.json'}" in printed
    ws = rep["word_similarity"]["wordsim353"]
    assert ws["in_vocab"] >= 6 and ws["share_in_vocab"] == ws["in_vocab"] / 353 and -1 <= ws["spearman"] <= 1
    assert rep["vocab_size"] == len(BENCH_WORDS) and rep["dim"] == 8 and rep["kind"] == "run"
    assert rep["privacy"].startswith("(ε=") and "input.weight" in rep["vectors"]
    assert len(rep["neighbours"]) == 8 and all(len(e["nearest"]) == 3 for e in rep["neighbours"])
    vocab = json.loads((tiny_run / "vocab.json").read_text())
    assert [e["word"] for e in rep["neighbours"]] == vocab[:8]  # the most frequent words (all in the benchmarks)
    # the run's vectors are its checkpoint's input table, in vocab.json's order
    import torch

    weight = torch.load(tiny_run / "checkpoint.pt", weights_only=True)["model"]["input.weight"].numpy()
    wv = load_word_vectors(tiny_run)
    assert wv.words == json.loads((tiny_run / "vocab.json").read_text()) and np.array_equal(wv.vectors, weight)
    # the word2vec release: the same figures as gensim's on its vectors.txt; the torch release: the run's exactly
    rel = tmp_path / "rel"
    assert main(["export", str(tiny_run), "--out", str(rel)]) == 0
    assert main(["eval", str(rel)]) == 0
    got = json.loads((rel / "eval.json").read_text())
    kv = KeyedVectors.load_word2vec_format(str(rel / "vectors.txt"))
    for key, (_, file) in sim.BENCHMARKS.items():
        _, spearman, oov = kv.evaluate_word_pairs(datapath(file))
        assert got["word_similarity"][key]["spearman"] == pytest.approx(spearman.statistic, abs=1e-6)
        assert got["word_similarity"][key]["share_in_vocab"] == pytest.approx(1 - oov / 100)
    assert got["kind"] == "release (word2vec)" and got["privacy"] == rep["privacy"]
    assert main(["export", str(tiny_run), "--out", str(rel), "--overwrite"]) == 0  # eval.json does not block it
    torch_rel = tmp_path / "rel_torch"
    assert main(["export", str(tiny_run), "--format", "torch", "--out", str(torch_rel)]) == 0
    out = tmp_path / "elsewhere.json"
    assert main(["eval", str(torch_rel), "--out", str(out), "--words", "king", "bank"]) == 0
    got = json.loads(out.read_text())
    assert got["word_similarity"] == rep["word_similarity"]
    assert [e["word"] for e in got["neighbours"]] == ["king", "bank"]
    assert not (torch_rel / "eval.json").exists()


def test_errors_are_one_line(tiny_run, tmp_path, capsys, monkeypatch):
    (tmp_path / "glm").mkdir()
    (tmp_path / "glm" / "config.yaml").write_text("task: glm\n")
    (tmp_path / "glm" / "vocab.json").write_text('{"vocab": ["a"], "classes": [0, 1]}')
    cases = [([str(tmp_path / "nope")], "not a directory"),
             ([str(tmp_path)], "neither a widedp run directory"),
             ([str(tmp_path / "glm")], "no checkpoint.pt"),
             ([str(tiny_run), "--words", "zebra"], "--words: 'zebra' is not in the vocabulary"),
             ([str(tiny_run), "--k", "0"], "--k: must be >= 1")]
    for argv, needle in cases:
        capsys.readouterr()
        assert main(["eval", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, (argv, err)
    sim.benchmark.cache_clear()
    monkeypatch.setitem(sys.modules, "gensim", None)
    monkeypatch.setitem(sys.modules, "gensim.test.utils", None)
    try:
        with pytest.raises(MissingExtraError, match=r"needs gensim.*pip install 'widedp\[eval\]'"):
            sim.benchmark("wordsim353")
        assert run_similarity(tiny_run) is None  # compare: the columns are left out, with a note
        assert "word-similarity columns left out" in capsys.readouterr().err
    finally:
        sim.benchmark.cache_clear()


def test_not_a_cbow_run_has_no_similarity(tmp_path):
    (tmp_path / "checkpoint.pt").write_bytes(b"")
    (tmp_path / "vocab.json").write_text('{"vocab": ["a"]}')
    assert run_similarity(tmp_path) is None
    with pytest.raises(ConfigError):
        load_word_vectors(tmp_path)


def test_compare_shows_word_similarity(tmp_path, capsys):
    _config(tmp_path)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("runs:\n  - {name: uni, config: cfg.yaml, seeds: [0, 1]}\n")
    out = tmp_path / "out"
    assert main(["compare", str(sweep), "--out", str(out), "--no-progress"]) == 0
    row = json.loads((out / "results.json").read_text())["rows"][0]
    per_seed = [run_similarity(out / "uni" / f"seed{s}") for s in (0, 1)]
    for key in sim.BENCHMARKS:
        values = [p[key] for p in per_seed]
        assert row[key]["mean"] == pytest.approx(sum(values) / 2) and row[key]["min"] == min(values)
        assert row[f"{key}_in_vocab"]["mean"] == per_seed[0][f"{key}_in_vocab"]
    md = (out / "results.md").read_text()
    assert "| test acc. | WS353 ρ | SimLex ρ | ε |" in md
    share = per_seed[0]["wordsim353_in_vocab"]
    assert f"({share:.0%} of pairs)" in md and "Spearman's ρ of the CBOW input vectors" in md
