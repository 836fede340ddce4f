"""The DP vocabulary (widedp.dp.vocab): unit-capped weighted counts, their sensitivity, the threshold's delta, the
Gaussian law of the release, and its secret, per-run randomness."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from scipy import stats

from widedp.config import DataConfig, VocabDPConfig
from widedp.data_prep.corpus import filter_sentences
from widedp.dp import vocab as vocab_dp
from widedp.errors import ConfigError


def _corpus(sentences, docs=None):
    return filter_sentences([s.split() for s in sentences], lowercase=True, alpha_only=False,
                            documents=None if docs is None else np.asarray(docs))


def test_weighted_counts_by_hand():
    c = _corpus(["a b a c", "b", "c d e f g"], docs=[0, 0, 1])
    w = dict(zip(c.words.tolist(), vocab_dp.unit_word_weights(c, unit="sentence", max_words=3)))
    # sentence 0: {a, b, c} -> 1/sqrt(3) each; sentence 1: {b} -> 1; sentence 2: first 3 distinct {c, d, e}
    s3 = 1 / np.sqrt(3)
    assert w == pytest.approx({"a": s3, "b": s3 + 1, "c": 2 * s3, "d": s3, "e": s3, "f": 0, "g": 0})
    wd = dict(zip(c.words.tolist(), vocab_dp.unit_word_weights(c, unit="document", max_words=3)))
    assert wd == pytest.approx({"a": s3, "b": s3, "c": 2 * s3, "d": s3, "e": s3, "f": 0, "g": 0})


def test_one_unit_moves_the_counts_by_l2_at_most_one():
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(30)]
    worst = 0.0
    for _ in range(200):
        sents = [" ".join(rng.choice(vocab, rng.integers(1, 15))) for _ in range(8)]
        extra = " ".join(rng.choice(vocab[: rng.integers(1, 30)], rng.integers(1, 40)))
        k = int(rng.integers(1, 12))
        full = _corpus(sents + [extra] + ["w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 " + " ".join(vocab)])
        less = _corpus(sents + ["w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 " + " ".join(vocab)])
        assert full.words.tolist() == less.words.tolist()
        a = vocab_dp.unit_word_weights(full, unit="sentence", max_words=k)
        b = vocab_dp.unit_word_weights(less, unit="sentence", max_words=k)
        worst = max(worst, float(np.linalg.norm(a - b)))
    assert worst == pytest.approx(1.0)  # every unit's vector has l2 norm exactly 1 (<= 1 is what is charged)


@pytest.mark.parametrize("sigma,k,delta", [(2.0, 1, 1e-6), (4.0, 32, 1e-6), (1.0, 8, 0.05)])
def test_threshold_is_the_smallest_with_its_delta(sigma, k, delta):
    tau = vocab_dp.threshold(sigma=sigma, max_words=k, delta=delta)
    assert vocab_dp.threshold_delta(tau, sigma=sigma, max_words=k) == pytest.approx(delta, rel=1e-6)
    assert vocab_dp.threshold_delta(tau - 0.01 * sigma, sigma=sigma, max_words=k) > delta
    if k == 1:  # one word of weight 1: P[1 + N(0, s^2) > tau] = delta
        assert tau == pytest.approx(1 + sigma * stats.norm.isf(delta))


def test_threshold_delta_matches_monte_carlo_for_a_unit_only_the_neighbour_has():
    """A unit whose n words nobody else has: P[any of them released] by simulation of the whole mechanism."""
    sigma, k, delta = 1.0, 4, 0.05
    tau = vocab_dp.threshold(sigma=sigma, max_words=k, delta=delta)
    base = ["a b c d e f g h"] * 40
    gen = torch.Generator().manual_seed(1)
    for n in (1, 4):
        c = _corpus(base + [" ".join(f"x{i}" for i in range(n))])
        counts = vocab_dp.unit_word_weights(c, unit="sentence", max_words=k)
        new = np.array([w.startswith("x") for w in c.words.tolist()])
        trials = 20000
        hits = sum(bool((vocab_dp.noisy_counts(counts, sigma=sigma, generator=gen)[new] > tau).any())
                   for _ in range(trials))
        exact = 1 - stats.norm.cdf((tau - 1 / np.sqrt(n)) / sigma) ** n
        assert exact <= delta * (1 + 1e-9)
        assert abs(hits / trials - exact) < 4 * np.sqrt(exact * (1 - exact) / trials)
    assert exact > 0.5 * delta  # the worst case n = k is near delta: tau is not loose by a factor 2


def test_noisy_counts_follow_their_gaussian_law():
    counts = np.r_[np.linspace(0.3, 50, 3000), np.zeros(5)]
    sigma = 3.0
    noisy = vocab_dp.noisy_counts(counts, sigma=sigma, generator=torch.Generator().manual_seed(7))
    assert np.isneginf(noisy[-5:]).all()  # absent words are never candidates
    z = (noisy[:-5] - counts[:-5]) / sigma
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert stats.kstest(z / 2, "norm").pvalue < 1e-6  # sigma off by 2 is caught
    assert stats.kstest((noisy[:-5] - counts[:-5]) / (sigma / 2), "norm").pvalue < 1e-6


def test_select_keeps_the_top_above_threshold():
    noisy = np.array([5.0, -np.inf, 9.0, 1.0, 7.0, 2.5])
    assert vocab_dp.select(noisy, tau=2.0, max_size=10).tolist() == [2, 4, 0, 5]
    assert vocab_dp.select(noisy, tau=2.0, max_size=2).tolist() == [2, 4]


def _data_cfg(tmp_path, **kw):
    text = "".join(f"w{i % 7} w{(i * 3) % 7} w{(i + 2) % 11}\n" for i in range(400))
    (tmp_path / "c.txt").write_text(text)
    return DataConfig(preset="custom", corpus=f"text:{tmp_path / 'c.txt'}", vocab_size=8, remove_stopwords=False,
                      alpha_only=False, splits=(200, 50, 50), cache_dir=str(tmp_path / "cache"),
                      privacy_unit="sentence", vocabulary="dp",
                      vocab_dp=VocabDPConfig(noise_multiplier=2.0, max_words_per_unit=3, delta=1e-6), **kw)


def test_run_release_is_per_run_secret_seeded_and_never_cached(tmp_path):
    cfg = _data_cfg(tmp_path)
    for d in ("run1", "run2", "run3"):
        (tmp_path / d).mkdir()
    r1 = vocab_dp.run_release(cfg, tmp_path / "run1", noise_seed=123)
    r2 = vocab_dp.run_release(cfg, tmp_path / "run2", noise_seed=123)
    r3 = vocab_dp.run_release(cfg, tmp_path / "run3", noise_seed=124)
    assert r1.words == r2.words and np.array_equal(r1.noisy_counts, r2.noisy_counts)  # same secret seed
    assert not np.array_equal(r1.noisy_counts, r3.noisy_counts)  # another run's seed: other noise
    assert len(r1.words) == 8 and list(r1.noisy_counts) == sorted(r1.noisy_counts, reverse=True)
    assert r1.mechanism["threshold"] < r1.noisy_counts.min()
    # a run directory's release is loaded, never drawn again (a resume cannot re-release)
    again = vocab_dp.run_release(cfg, tmp_path / "run1", noise_seed=999)
    assert again.words == r1.words and np.array_equal(again.noisy_counts, r1.noisy_counts)
    stored = json.loads((tmp_path / "run1" / vocab_dp.RELEASE_FILE).read_text())
    assert "123" not in json.dumps(stored) and str(vocab_dp.vocab_seed(123)) not in json.dumps(stored)
    # the shared cache holds the filtered corpus only, no vocabulary or prepared arrays
    assert [p.name.split("-")[0] for p in (tmp_path / "cache").iterdir()] == ["corpus"]
    # a different vocab_dp in the same run directory is refused
    other = dataclasses.replace(cfg, vocab_dp=VocabDPConfig(noise_multiplier=3.0))
    with pytest.raises(ConfigError, match="other data.vocab_dp"):
        vocab_dp.run_release(other, tmp_path / "run1", noise_seed=1)


def test_vocab_seed_is_a_62_bit_function_of_the_secret():
    s = {vocab_dp.vocab_seed(x) for x in range(1000)}
    assert len(s) == 1000 and max(s) < 2**62 and vocab_dp.vocab_seed(5) == vocab_dp.vocab_seed(5)
    assert vocab_dp.vocab_seed(5) != 5
