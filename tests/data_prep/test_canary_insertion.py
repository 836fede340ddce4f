"""Canary phrases inserted into the training text (the secret-sharer test's data side)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from prep_helpers import (
    WORDS,
    all_splits,
    random_text,
    tiny_cfg,
)

from widedp.data_prep.cbow import CBOWData, Split, prepare_cbow
from widedp.data_prep.samples import insert_phrases
from widedp.errors import ConfigError

# ------------------------------------------------------------------------------------------------------ canaries


def test_insert_phrases_matches_list_insertion() -> None:
    tokens, sent = np.array([10, 11, 12, 13]), np.array([0, 0, 1, 1])
    phrases = [np.array([7, 8]), np.array([9])]
    new, new_sent, is_can, ins = insert_phrases(tokens, sent, phrases, 3, np.random.default_rng(4))
    assert ins.shape == (6, 2) and np.bincount(ins[:, 0]).tolist() == [3, 3]
    ref: list[tuple[int, int, bool]] = []
    for i in range(len(tokens) + 1):
        for j in ins[ins[:, 1] == i, 0]:
            s = int(sent[min(i, len(tokens) - 1)])
            ref += [(int(w), s, True) for w in phrases[j]]
        if i < len(tokens):
            ref.append((int(tokens[i]), int(sent[i]), False))
    assert list(zip(new.tolist(), new_sent.tolist(), is_can.tolist())) == ref


@pytest.mark.parametrize("shape", ["pair", "bag"])
def test_canaries_land_in_train(tmp_path: Path, shape: str) -> None:
    rng = np.random.default_rng(3)
    text = random_text(rng, 300, WORDS, np.full(20, 1 / 20)) + "zebra\n"  # zebra: in vocab, in no clean window
    kw = dict(vocab_size=21, window=2, negatives=2, sample_shape=shape, splits=(0.5, 0.2, 0.2))
    clean = prepare_cbow(tiny_cfg(tmp_path, text, **kw))
    phrases, repeats = [["zebra", "qa"], ["qb", "qc", "qd"]], 7
    d = prepare_cbow(tiny_cfg(tmp_path, text, **kw), phrases=phrases, repeats=repeats, insert_seed=11)
    assert d.vocab == clean.vocab and d.vocab[-1] == "zebra"
    assert d.inserted is not None and d.inserted.shape == (14, 2)
    assert np.bincount(d.inserted[:, 0]).tolist() == [repeats, repeats]  # each phrase `repeats` times
    total, n_zebra, m = _reference_counts(_sentence_ids(text, d.vocab), d, phrases, window=2, shape=shape)
    n = total - m  # clean samples: split at the rates, every canary sample on top of train
    sizes = np.array([len(s) for s in all_splits(d)]) - [m, 0, 0]
    rates = np.array([0.5, 0.2, 0.2])
    assert (np.abs(sizes - rates * n) <= 4 * np.sqrt(n * rates * (1 - rates))).all(), (sizes, n, m)

    zebra = d.vocab.index("zebra")

    def touches_zebra(s: Split) -> np.ndarray:
        return (s.target == zebra) | (s.context == zebra).any(axis=1)

    assert d.total_samples == total
    assert not touches_zebra(d.valid).any() and not touches_zebra(d.test).any()
    assert touches_zebra(d.train).sum() == n_zebra > 0  # every sample of an inserted zebra is in train
    if shape == "bag":
        assert (d.train.target == zebra).sum() == repeats  # one zebra token per insertion


def _sentence_ids(text: str, vocab: list[str]) -> list[list[int]]:
    index = {w: i for i, w in enumerate(vocab)}
    return [[index[w] for w in line.split() if w in index] for line in text.splitlines()]


def _reference_counts(
    sents: list[list[int]], d: CBOWData, phrases: list[list[str]], *, window: int, shape: str
) -> tuple[int, int, int]:
    """Naive loops over the stream rebuilt from ``d.inserted``: (all samples, samples touching an inserted zebra,
    samples touching any inserted token)."""
    assert d.inserted is not None
    index = {w: i for i, w in enumerate(d.vocab)}
    zebra = index["zebra"]
    flat = [(w, s) for s, line in enumerate(sents) for w in line]
    stream: list[tuple[int, int]] = []
    inserted: set[int] = set()
    for i in range(len(flat) + 1):
        for j in d.inserted[d.inserted[:, 1] == i, 0]:
            inserted.update(range(len(stream), len(stream) + len(phrases[j])))
            stream += [(index[w], flat[min(i, len(flat) - 1)][1]) for w in phrases[j]]
        if i < len(flat):
            stream.append(flat[i])
    total = n_zebra = n_canary = 0
    for t, (wt, st) in enumerate(stream):
        ctx = [c for c in range(t - window, t + window + 1) if c != t and 0 <= c < len(stream) and stream[c][1] == st]
        if shape == "pair":
            total += len(ctx)
            n_zebra += sum(wt == zebra or stream[c][0] == zebra for c in ctx)
            n_canary += sum(t in inserted or c in inserted for c in ctx)
        elif ctx:
            total += 1
            n_zebra += wt == zebra or any(stream[c][0] == zebra for c in ctx)
            n_canary += t in inserted or any(c in inserted for c in ctx)
    return total, n_zebra, n_canary


def test_canary_word_not_in_vocab(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="phrases\\[1\\]: 'mat' is not in the vocabulary"):
        prepare_cbow(tiny_cfg(tmp_path), phrases=[["cat"], ["dog", "mat"]], repeats=1)
