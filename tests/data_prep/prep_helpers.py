"""Shared helpers of the data-prep tests: a tiny corpus and its config."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from widedp.config import DataConfig
from widedp.data_prep.cbow import CBOWData, Split

NLTK_DATA = Path(__file__).resolve().parents[3] / "shared" / "nltk_data"  # /work/shared/nltk_data

# After lowercase + alphabetic + stop words: [cat sat mat] [dog sat] [cat cat dog] [bird]
# counts cat 3, dog 2, sat 2, bird 1, mat 1 -> V=4: cat, dog, sat, bird (ties alphabetical); mat is OOV.
TINY = "The cat sat on the mat.\nthe dog sat\ncat cat dog 42 x1\nbird\n"
CAT, DOG, SAT, BIRD = 0, 1, 2, 3


def write_corpus(tmp_path: Path, text: str, name: str = "c.txt") -> str:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return f"text:{p}"


def tiny_cfg(tmp_path: Path, text: str = TINY, **kw: object) -> DataConfig:
    base: dict[str, object] = dict(preset="custom", corpus=write_corpus(tmp_path, text), vocab_size=4, window=1,
                                   negatives=2, splits=(1.0, 0.0, 0.0), cache_dir="")
    return DataConfig(**(base | kw))


def pairs_of(split: Split) -> list[tuple[int, ...]]:
    return sorted(zip(split.target.tolist(), map(tuple, split.context.tolist())))


def all_splits(d: CBOWData) -> list[Split]:
    return [d.train, d.valid, d.test]


WORDS = [f"q{chr(97 + i)}" for i in range(20)]  # qa..qt: no NLTK stop word among them


def random_text(rng: np.random.Generator, n_lines: int, words: list[str], p: np.ndarray) -> str:
    lines = [" ".join(rng.choice(words, size=rng.integers(1, 12), p=p)) for _ in range(n_lines)]
    return "\n".join(lines) + "\n"

