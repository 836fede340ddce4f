"""Record-local splits (``widedp.data_prep.splits``): adjacent corpora / datasets give adjacent training splits.

The property the privacy statement needs: adding or removing one unit (pair, sentence, document, interaction, user)
of the raw data changes the training split by that unit's records only — every other record keeps its split, its
stored negatives and its unit. A positional split (a seeded permutation cut into sizes) fails all of these.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
from prep_helpers import WORDS, tiny_cfg

from widedp.config.recsys import RecsysDataConfig
from widedp.data_prep.cbow import CBOWData, Split, prepare_cbow
from widedp.data_prep.interactions import prepare_interactions
from widedp.data_prep.splits import assign, blob_keys, occurrence, row_keys, uniform

# ------------------------------------------------------------------------------------------------- the keys


def test_occurrence_counts_equal_records_before_each() -> None:
    assert occurrence(np.array([5, 3, 5, 5, 3, 9])).tolist() == [0, 0, 1, 2, 1, 0]
    assert occurrence(np.zeros(0, np.int64)).tolist() == []


def test_row_keys_depend_on_content_and_copy_index_only() -> None:
    a = np.array([1, 2, 1, 3, 1])
    b = np.array([7, 7, 7, 8, 7])
    k = row_keys([a, b], seed=0, purpose="t")
    assert len(set(k.tolist())) == 5  # three copies of (1, 7): three keys
    # a record inserted anywhere: the others keep their keys as a multiset (copies are interchangeable)
    k2 = row_keys([np.r_[a[:2], 4, a[2:]], np.r_[b[:2], 7, b[2:]]], seed=0, purpose="t")
    assert collections.Counter(k.tolist()) - collections.Counter(k2.tolist()) == collections.Counter()
    k3 = row_keys([np.r_[1, a], np.r_[7, b]], seed=0, purpose="t")  # one more copy of (1, 7)
    assert len(collections.Counter(k3.tolist()) - collections.Counter(k.tolist())) == 1
    assert not np.array_equal(k, row_keys([a, b], seed=1, purpose="t"))
    assert row_keys([np.zeros(0, np.int64), np.zeros((0, 3))], seed=0, purpose="t").shape == (0,)
    # strings by value, floats by value (-0.0 is 0.0)
    s = row_keys([np.array(["u1", "u2"], dtype=object), np.array([4.0, -0.0])], seed=0, purpose="t")
    t = row_keys([np.array(["u2", "u1"], dtype=object), np.array([0.0, 4.0])], seed=0, purpose="t")
    assert s.tolist() == t[::-1].tolist()


def test_blob_keys_count_equal_blobs() -> None:
    k = blob_keys([b"ab", b"c", b"ab"], seed=0, purpose="t")
    assert len(set(k.tolist())) == 3
    assert blob_keys([b"c", b"ab"], seed=0, purpose="t")[1] == k[0]


def test_assignment_is_uniform_at_the_rates() -> None:
    keys = row_keys([np.arange(200_000)], seed=5, purpose="t")
    u = uniform(keys)
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.005
    which = assign(keys, (0.5, 0.2, 0.2))
    freq = np.array([(which == i).mean() for i in (0, 1, 2, -1)])
    sd = np.sqrt(freq * (1 - freq) / len(keys))
    assert (np.abs(freq - [0.5, 0.2, 0.2, 0.1]) < 4 * sd + 1e-12).all(), freq


# ----------------------------------------------------------------------------------------- CBOW: adjacent corpora


def _corpus(rng: np.random.Generator, docs: int = 24, lines: int = 5) -> list[list[str]]:
    """Documents of lines of words qa..qt (Zipf-ish, so that equal pairs and sentences occur)."""
    p = 1.0 / np.arange(1, len(WORDS) + 1)
    p /= p.sum()
    return [[" ".join(rng.choice(WORDS, size=rng.integers(2, 9), p=p)) for _ in range(lines)] for _ in range(docs)]


def _text(docs: list[list[str]]) -> str:
    return "\n\n".join("\n".join(d) for d in docs) + "\n"


def _records(d: CBOWData, split: Split, unit: str) -> collections.Counter:
    """The split as a multiset: per-sample records (``pair``) or per-unit sorted tuples of records."""
    recs = [(t, tuple(c), tuple(n)) for t, c, n in zip(split.target.tolist(), split.context.tolist(),
                                                      split.negatives.tolist())]
    if unit == "pair":
        return collections.Counter(recs)
    ids = getattr(d.train, unit)
    groups: dict[int, list] = collections.defaultdict(list)
    for i, r in zip(ids.tolist(), recs):
        groups[i].append(r)
    return collections.Counter(tuple(sorted(g)) for g in groups.values())


def _prep(tmp_path: Path, docs: list[list[str]], vocab_file: Path, unit: str, shape: str, name: str) -> CBOWData:
    sub = tmp_path / name
    sub.mkdir(exist_ok=True)
    return prepare_cbow(tiny_cfg(sub, _text(docs), vocab_size=20, window=2, negatives=3, sample_shape=shape,
                                 splits=(0.5, 0.25, 0.25), privacy_unit=unit, vocabulary=f"file:{vocab_file}",
                                 remove_stopwords=False, seed=7))


@pytest.mark.parametrize("shape", ["pair", "bag"])
@pytest.mark.parametrize("unit", ["pair", "sentence", "document"])
def test_adding_or_removing_a_unit_changes_only_its_own_records(tmp_path: Path, unit: str, shape: str) -> None:
    rng = np.random.default_rng(1)
    docs = _corpus(rng)
    vocab_file = tmp_path / "vocab.txt"  # public: the same for both corpora
    vocab_file.write_text("".join(f"{w} {100 - i}\n" for i, w in enumerate(WORDS)))
    # the neighbour: one unit more in the middle (a pair: a two-word sentence = two pairs, both directions)
    new_line = "qa qb" if unit == "pair" else "qc qa qd qb qa qc"
    bigger = [list(d) for d in docs]
    if unit == "document":
        bigger.insert(11, [new_line, "qa qe qf"])
    else:
        bigger[11].insert(2, new_line)
    a = _prep(tmp_path, docs, vocab_file, unit, shape, "a")
    b = _prep(tmp_path, bigger, vocab_file, unit, shape, "b")
    for name in ("train", "valid", "test"):
        ra = _records(a, getattr(a, name), unit if name == "train" else "pair")
        rb = _records(b, getattr(b, name), unit if name == "train" else "pair")
        assert ra - rb == collections.Counter(), name  # nothing of the smaller corpus moved or changed
        extra = rb - ra
        if name == "train" and unit != "pair":
            assert sum(extra.values()) <= 1  # at most the new unit
            for group in extra:  # ... made of the new unit's words only
                assert {a_ for t, c, _ in group for a_ in (t, *c) if a_ >= 0} <= {0, 1, 2, 3, 4, 5}
        else:
            assert sum(extra.values()) <= (2 if unit == "pair" else 20), name  # "qa qb": two samples
    # the new unit's samples are all there, over the three splits (it was not dropped)
    n_new = sum(len(getattr(b, s)) - len(getattr(a, s)) for s in ("train", "valid", "test"))
    assert n_new == b.total_samples - a.total_samples > 0


def test_a_positional_split_would_fail_the_neighbour_check(tmp_path: Path) -> None:
    """Negative control for the test above: a seeded permutation cut into sizes moves many records."""
    rng = np.random.default_rng(1)
    n = 2000
    perm_a = np.random.default_rng(0).permutation(n)
    perm_b = np.random.default_rng(0).permutation(n + 1)  # one record more (index n)
    train_a, train_b = set(perm_a[: n // 2].tolist()), set(perm_b[: n // 2].tolist()) - {n}
    assert len(train_a ^ train_b) > 100
    keys = row_keys([rng.integers(0, 50, n + 1)], seed=0, purpose="t")
    wa, wb = assign(keys[:n], (0.5, 0.5, 0.0)), assign(keys, (0.5, 0.5, 0.0))
    assert np.array_equal(wa, wb[:n])  # record-local: the first n keep theirs


def test_canaries_as_own_units_leave_the_clean_split_alone(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    docs = _corpus(rng)
    vocab_file = tmp_path / "vocab.txt"
    vocab_file.write_text("".join(f"{w} {100 - i}\n" for i, w in enumerate(WORDS)))
    cfg = tiny_cfg(tmp_path, _text(docs), vocab_size=20, window=2, negatives=3, splits=(0.5, 0.25, 0.25),
                   privacy_unit="sentence", vocabulary=f"file:{vocab_file}", remove_stopwords=False)
    clean = prepare_cbow(cfg)
    d = prepare_cbow(cfg, phrases=[["qa", "qt", "qs"]], repeats=5, insert_seed=3)
    for name in ("valid", "test"):
        assert _records(clean, getattr(clean, name), "pair") == _records(d, getattr(d, name), "pair")
    extra = _records(d, d.train, "pair") - _records(clean, clean.train, "pair")
    assert _records(clean, clean.train, "pair") - _records(d, d.train, "pair") == collections.Counter()
    assert sum(extra.values()) == 5 * 6  # 5 insertions x the 6 ordered pairs of a 3-word phrase (window 2)


# ---------------------------------------------------------------------------------------- recommender: adjacent data


def _ratings(path: Path, rows: list[tuple[int, int, int, int]]) -> str:
    path.write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in rows))
    return f"ratings:{path}"


def _raw_records(data, split_name: str) -> collections.Counter:
    s = getattr(data, split_name)
    users = [data.ids["user"][u] for u in s.features["user"][:, 0].tolist()]
    items = [data.ids["item"][i] for i in s.features["item"][:, 0].tolist()]
    return collections.Counter(zip(users, items, s.label.tolist()))


@pytest.mark.parametrize("what", ["interaction", "user"])
def test_recsys_adding_an_interaction_or_a_user_changes_only_its_records(tmp_path: Path, what: str) -> None:
    rng = np.random.default_rng(4)
    rows = [(int(u), int(i), int(r), int(t)) for u, i, r, t in zip(
        rng.integers(1, 60, 3000), rng.integers(1, 80, 3000), rng.integers(1, 6, 3000), rng.integers(0, 10, 3000))]
    new = [(999, 5, 4, 3), (999, 7, 2, 1), (999, 5, 4, 3)] if what == "user" else [(3, 1000, 5, 2)]
    bigger = rows[:1500] + new + rows[1500:]  # new raw ids: every other id is renumbered
    a = prepare_interactions(RecsysDataConfig(source=_ratings(tmp_path / "a.dat", rows), splits=(0.6, 0.2, 0.2),
                                              cache_dir=""))
    b = prepare_interactions(RecsysDataConfig(source=_ratings(tmp_path / "b.dat", bigger), splits=(0.6, 0.2, 0.2),
                                              cache_dir=""))
    for name in ("train", "valid", "test"):
        ra, rb = _raw_records(a, name), _raw_records(b, name)
        assert ra - rb == collections.Counter(), name
        assert {r[:2] for r in rb - ra} <= {r[:2] for r in new}
    total_extra = sum(len(getattr(b, s)) - len(getattr(a, s)) for s in ("train", "valid", "test"))
    assert total_extra == len(new)


def test_recsys_hashed_ids_make_the_encoded_records_local_too(tmp_path: Path) -> None:
    """data.id_buckets: a raw id's row is a function of the id alone, so a new user or item renumbers nothing: the
    other records keep their encoded features (not only their raw fields), and the tables have the fixed size B."""
    from widedp.config import config_from_dict
    from widedp.data_prep.interactions import id_bucket
    from widedp.tasks import loop_task
    from widedp.tasks.recsys import IDS_NOT_COVERED

    rng = np.random.default_rng(5)
    rows = [(int(u), int(i), int(r), int(t)) for u, i, r, t in zip(
        rng.integers(1, 60, 2000), rng.integers(1, 80, 2000), rng.integers(1, 6, 2000), rng.integers(0, 10, 2000))]
    bigger = rows[:700] + [(999, 5, 4, 3), (3, 1000, 5, 2)] + rows[700:]
    kw = dict(splits=(0.6, 0.2, 0.2), cache_dir="", id_buckets=64)
    a = prepare_interactions(RecsysDataConfig(source=_ratings(tmp_path / "a.dat", rows), **kw))
    b = prepare_interactions(RecsysDataConfig(source=_ratings(tmp_path / "b.dat", bigger), **kw))
    assert a.cardinality["user"] == a.cardinality["item"] == 64 and a.ids["user"] == {"hashed": 64}

    def encoded(d, name):
        s = getattr(d, name)
        return collections.Counter(zip(s.features["user"][:, 0].tolist(), s.features["item"][:, 0].tolist(),
                                       s.features["hour"][:, 0].tolist(), s.label.tolist()))

    for name in ("train", "valid", "test"):
        assert encoded(a, name) - encoded(b, name) == collections.Counter(), name
    u = a.train.features["user"][:, 0]
    assert ((u >= 0) & (u < 64)).all() and id_bucket(999, 64) == id_bucket(999.0, 64) == id_bucket("999", 64)
    dp = {"clip1": 1.0, "noise_multiplier": 1.0, "selection": {"name": "all"}}
    for buckets, listed in ((0, True), (64, False)):
        cfg = config_from_dict({"task": "recsys", "data": {"source": f"ratings:{tmp_path / 'a.dat'}",
                                                           "id_buckets": buckets}, "dp": dp})
        assert (IDS_NOT_COVERED in loop_task("recsys").privacy(cfg).not_covered) == listed
