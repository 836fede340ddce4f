"""Secret-sharer canaries (paper Sec. 6.5): formulas on hand-made scores, the batched scorers against a per-phrase
reference, chi-square on known histograms, and end to end: a non-private CBOW trained on a tiny text with heavily
repeated canaries memorises them while control phrases stay uniform."""

import dataclasses
import itertools
import json
import math
import shutil

import numpy as np
import pytest
import torch

from widedp.cli import main
from widedp.config import load_config
from widedp.data_prep.cbow import prepare_cbow
from widedp.eval.canary import (
    PhraseRanks,
    make_scorer,
    phrase_ranks,
    rank_histogram,
    ranks_from_scores,
    sample_phrases,
    uniformity,
)
from widedp.eval.canary_runs import canary_sample_count, clean_stream
from widedp.models.cbow import CBOW

WORDS = ["".join(p) for p in itertools.product("abcdefg", repeat=2)][:30]
NC, NUM, CANDIDATES, BINS = 20, 60, 500, 10


def _write_corpus(tmp, *, vocab=30, sentences=600, seed=0):
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS[:vocab], size=rng.integers(8, 13))) for _ in range(sentences)]
    (tmp / "corpus.txt").write_text("\n".join(lines) + "\n")
    cfg = tmp / "tiny.yaml"
    cfg.write_text(
        f'data: {{preset: custom, corpus: "text:{tmp}/corpus.txt", vocab_size: {vocab}, window: 2, negatives: 4,\n'
        f'       sample_shape: pair, splits: [0.5, 0.2, 0.2], remove_stopwords: false, cache_dir: "{tmp}/cache"}}\n'
        "model: {dim: 16, tied: true, sparse: false}\n"
        "train: {epochs: 6, batch_size: 64, optimizer: adam, lr: 0.01, seed: 0, device: cpu, log_every: 100000}\n")
    return cfg


def _one_line_error(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("widedp: error:") and needle in err, err


# --------------------------------------------------------------------------------------------------- formulas


def test_rank_position_exposure_on_hand_made_scores():
    # column 0 = the phrase's P; ties count toward the rank (P_j >= P_0)
    scores = torch.tensor([[2.0, 1.0, 3.0, 2.0, 5.0],    # >= 2.0: 3.0, 2.0, 5.0 -> 3
                           [0.5, 1.0, 3.0, 2.0, 5.0],    # every candidate less likely -> 4 (memorised)
                           [9.0, 1.0, 3.0, 2.0, 5.0]])   # every candidate more likely -> 0
    rank = ranks_from_scores(scores)
    assert rank.tolist() == [3, 4, 0]
    r = PhraseRanks(scores[:, 0].double(), rank, num_candidates=4)
    assert r.position.tolist() == [2, 1, 5]  # 1 = lowest perplexity among the 4 candidates and the phrase
    expected = [math.log2(4) - math.log2(2), math.log2(4), math.log2(4) - math.log2(5)]
    assert r.exposure.tolist() == pytest.approx(expected, abs=1e-12)
    assert r.exposure.tolist() == pytest.approx([1.0, 2.0, 2.0 - math.log2(5)], abs=1e-12)


def test_rank_histogram_bins_and_exact_uniform_expectation():
    counts, expected = rank_histogram(torch.arange(11), num_candidates=10, bins=3)  # ranks 0..10, once each
    assert counts.tolist() == [4, 4, 3]  # bin = rank * 3 // 11
    assert expected.tolist() == pytest.approx([4, 4, 3])


def test_chi2_uniform_vs_skewed():
    rng = np.random.default_rng(0)
    flat = np.repeat(np.arange(0, 1000, 50), 50)  # 1000 ranks spread evenly over 0..999 (|R| = 999)
    u = uniformity(flat, 999, 20)
    assert u["chi2"] < 1e-9 and u["p_value"] > 0.999
    null = uniformity(rng.integers(0, 1000, 1000), 999, 20)
    assert null["p_value"] > 0.01 and null["chi2_distance"] == pytest.approx(null["chi2"] / 1000)
    skewed = uniformity(np.minimum(999, rng.integers(500, 1400, 1000)), 999, 20)  # mass in the top half
    assert skewed["p_value"] < 1e-10 and skewed["chi2_distance"] > 0.5


# --------------------------------------------------------------------------------------------------- scoring


def _model(vocab=7, dim=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = CBOW(vocab, dim, tied=False, sparse=False, generator=g)
    with torch.no_grad():
        m.input.weight.normal_(0, 1.0, generator=g)
        m.output.weight.normal_(0, 1.0, generator=g)
    return m


@pytest.mark.parametrize("method", ["factorized", "log_prob"])
def test_scorers_match_a_per_phrase_reference(method):
    m = _model()
    g = torch.Generator().manual_seed(1)
    p = torch.stack([torch.randint(7, (4, 1), generator=g).expand(4, 9), torch.randint(7, (4, 9), generator=g),
                     torch.randint(7, (4, 9), generator=g)], 2)  # [4, 9, 3], c0 shared within a row
    with torch.no_grad():
        got = make_scorer(m, method)(p)
        ref = torch.empty(4, 9, dtype=torch.float64)
        for i, j in itertools.product(range(4), range(9)):
            c0, c1, c2 = p[i, j].tolist()
            lp1 = m.log_prob(torch.tensor([[c0]]))[0, c1]
            lp2 = m.log_prob(torch.tensor([[c0, c1]]))[0, c2]
            ref[i, j] = -(lp1 + lp2)
    torch.testing.assert_close(got.double(), ref, atol=2e-5, rtol=0)


def test_candidates_law_and_ranks_same_for_both_methods():
    m = _model(vocab=4)
    phrases = sample_phrases(4, 12, generator=torch.Generator().manual_seed(0))
    assert (phrases[:, 1] != phrases[:, 2]).all() and len({tuple(p) for p in phrases.tolist()}) == 12
    a = phrase_ranks(m, phrases, num_candidates=3000, generator=torch.Generator().manual_seed(5), method="factorized")
    b = phrase_ranks(m, phrases, num_candidates=3000, generator=torch.Generator().manual_seed(5), method="log_prob")
    assert torch.equal(a.rank, b.rank)
    # V=4: 12 ordered pairs (c1' != c2'), each drawn w.p. 1/12, so rank / |R| ~ share of pairs with P >= P(c)
    with torch.no_grad():
        for (c0, c1, c2), rank in zip(phrases.tolist(), a.rank.tolist()):
            pairs = [(x, y) for x in range(4) for y in range(4) if x != y]
            table = make_scorer(m, "factorized")(torch.tensor([[[c0, x, y] for x, y in pairs]]))[0]
            share = float((table >= table[pairs.index((c1, c2))]).double().mean())
            assert rank / 3000 == pytest.approx(share, abs=0.04)


def test_null_model_ranks_are_uniform():
    m = _model(vocab=50, dim=8)
    phrases = sample_phrases(50, 400, generator=torch.Generator().manual_seed(3))
    r = phrase_ranks(m, phrases, num_candidates=1000, generator=torch.Generator().manual_seed(4))
    u = uniformity(r.rank, 1000, 10)
    assert u["p_value"] > 0.01
    assert float(r.exposure.mean()) == pytest.approx(1 / math.log(2), abs=0.3)  # log2(e) bits for unseen phrases


# ------------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("canary")
    cfg = _write_corpus(tmp)
    out = tmp / "out"
    rc = main(["canary", str(cfg), "--nc", str(NC), "--num-canaries", str(NUM), "--num-candidates", str(CANDIDATES),
               "--bins", str(BINS), "--out", str(out), "--no-progress"])
    assert rc == 0
    return tmp, cfg, out


def test_canary_memorised_controls_uniform(trained, capsys):
    tmp, _, out = trained
    report = json.loads((out / "canary.json").read_text())
    (run,) = report["runs"]
    assert run["n_c"] == NC and run["label"] == "tiny" and not run["private"]
    can, ctl = run["canaries"], run["controls"]
    assert len(can["rank"]) == NUM == len(ctl["rank"])
    assert can["p_value"] < 0.01 and can["histogram"][-1] > NUM / 4  # ranks pile up at the top
    assert can["exposure"]["mean"] > 2.8 and can["exposure"]["max"] > 6
    assert ctl["p_value"] > 0.01 and 1.0 < ctl["exposure"]["mean"] < 1.9
    assert (out / "canary_ranks.png").stat().st_size > 5000
    assert report["table"][0]["canaries"]["p_value"] == can["p_value"]

    run_dir = out / "tiny" / f"nc{NC}"
    info = json.loads((run_dir / "canaries.json").read_text())
    assert len(info["canaries"]) == NUM and len(info["inserted"]) == NUM * NC
    assert not {tuple(p) for p in info["canaries"]} & {tuple(p) for p in info["controls"]}

    # the saved run evaluates to the same ranks through --runs
    capsys.readouterr()
    again = tmp / "again"
    assert main(["canary", "--runs", str(run_dir), str(run_dir), "--num-candidates", str(CANDIDATES), "--bins",
                 str(BINS), "--out", str(again), "--no-plot"]) == 0
    assert "tiny#2" in capsys.readouterr().out
    runs = json.loads((again / "canary.json").read_text())["runs"]
    assert [r["label"] for r in runs] == ["tiny", "tiny#2"]
    for rerun in runs:
        assert rerun["canaries"]["rank"] == can["rank"] and rerun["controls"]["rank"] == ctl["rank"]


def test_dp_run_with_canaries(trained, tmp_path):
    _, cfg, _ = trained
    dp = "dp={clip1: 1.0, clip2: null, noise_multiplier: 1.0, delta: 1.0e-5, accountant: rdp, selection: {name: all}}"
    assert main(["canary", str(cfg), "--nc", "3", "--num-canaries", "10", "--num-candidates", "100", "--bins", "5",
                 "--set", dp, "--set", "train.max_steps=30", "--out", str(tmp_path), "--no-plot"]) == 0
    (run,) = json.loads((tmp_path / "canary.json").read_text())["runs"]
    assert run["private"] and run["epsilon"] > 0 and len(run["canaries"]["rank"]) == 10
    # the same folder with another config: the finished run (and its spent budget) is kept unless --overwrite
    run_dir = tmp_path / "tiny" / "nc3"
    spent = (run_dir / "checkpoint.pt").read_bytes()
    again = ["canary", str(cfg), "--nc", "3", "--num-canaries", "10", "--num-candidates", "100", "--bins", "5",
             "--set", dp, "--set", "train.max_steps=20", "--out", str(tmp_path), "--no-plot"]
    assert main(again) == 2 and (run_dir / "checkpoint.pt").read_bytes() == spent
    assert main([*again, "--overwrite"]) == 0 and (run_dir / "checkpoint.pt").read_bytes() != spent


def test_train_split_is_clean_size_plus_every_canary_sample(trained):
    _, cfg_path, out = trained
    info = json.loads((out / "tiny" / f"nc{NC}" / "canaries.json").read_text())
    cfg = load_config(cfg_path).data
    vocab, _, _ = clean_stream(cfg)
    ids = [np.array([vocab.index(w) for w in p]) for p in info["canaries"]]
    m, total, inserted = canary_sample_count(cfg, ids, NC, info["insert_seed"])
    assert m == info["canary_samples"] and inserted.tolist() == info["inserted"]
    assert info["splits"][0] == info["clean_train_samples"] + m
    n = total - m  # clean samples, split at rate 0.5 (Binomial)
    assert abs(info["clean_train_samples"] - 0.5 * n) <= 4 * np.sqrt(n / 4)
    # m is exactly prepare_cbow's count: with a clean rate of ~0 the train split is the canary samples alone
    kw = {"phrases": info["canaries"], "repeats": NC, "insert_seed": info["insert_seed"]}
    assert len(prepare_cbow(dataclasses.replace(cfg, splits=(1e-12, 0.0, 0.0), cache_dir=""), **kw).train) == m


def test_bad_inputs_one_line_errors(trained, tmp_path, capsys):
    _, cfg, out = trained
    run_dir = out / "tiny" / f"nc{NC}"
    _one_line_error(capsys, ["canary", str(cfg), "--nc", "3", "0", "--out", str(tmp_path / "x")], "--nc")
    _one_line_error(capsys, ["canary", str(cfg), "--nc", "-2", "--out", str(tmp_path / "x")], "--nc")
    small = _write_corpus(tmp_path, vocab=2, sentences=50)
    _one_line_error(capsys, ["canary", str(small), "--nc", "3", "--out", str(tmp_path / "x")], "at least 3 words")
    no_model = tmp_path / "no_model"
    shutil.copytree(run_dir, no_model)
    (no_model / "checkpoint.pt").unlink()
    _one_line_error(capsys, ["canary", "--runs", str(no_model), "--out", str(tmp_path / "x")], "checkpoint.pt")
    no_canaries = tmp_path / "no_canaries"
    shutil.copytree(run_dir, no_canaries)
    (no_canaries / "canaries.json").unlink()
    _one_line_error(capsys, ["canary", "--runs", str(no_canaries), "--out", str(tmp_path / "x")], "canaries.json")
    _one_line_error(capsys, ["canary", "--runs", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")],
                    "no such run directory")
    _one_line_error(capsys, ["canary", "--out", str(tmp_path / "x")], "CONFIG")
    _one_line_error(capsys, ["canary", "--runs", str(run_dir), "--num-candidates", "0", "--out", str(tmp_path / "x")],
                    "--num-candidates")
    assert not (tmp_path / "x").exists()


def test_plain_resume_of_a_canary_run_is_refused(tmp_path, capsys):
    from widedp.cli import main as cli_main

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("train: {epochs: 1}\n")
    (run / "canaries.json").write_text("{}")
    (run / "checkpoint.pt").write_bytes(b"")
    assert cli_main(["train", "--resume", str(run)]) == 2
    assert "trained with canaries" in capsys.readouterr().err
