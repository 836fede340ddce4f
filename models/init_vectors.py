"""A public warm start: a CBOW's initial rows from word vectors in word2vec format (``model.init_vectors``).

The file is read with gensim's ``KeyedVectors.load_word2vec_format`` (the ``eval`` extra), as text or binary: the
format is told from the file itself (the line after the header parses as a word and floats: text; otherwise binary).
Each vocabulary word with a vector in the file (matched exactly, case included, as gensim's
``intersect_word2vec_format`` does) gets that vector as its input (context) row; the other rows keep the CBOW's
default init. The untied output table keeps word2vec's zeros (``model.init_output: zeros``, as gensim's
``intersect_word2vec_format`` leaves ``syn1neg``) or takes the same vectors on the found words' rows
(``model.init_output: vectors``); a tied model's one table takes the vectors.

The vectors are ASSUMED PUBLIC (the user's assertion, like ``data.vocabulary: file:PATH``): the run's statement names
the file and its sha256 (``statement_line``); nothing private is spent on them, and ε does not cover them if they were
derived from private data. The init is applied only to a new run (step 0); a resumed run's checkpoint holds the
weights, and its file must still have the sha256 the run started with (``RUN/init_vectors.json``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from widedp.errors import ConfigError
from widedp.extras import needs
from widedp.run.checkpoint import write_json

KEY = "model.init_vectors"
#: what a run directory records of its warm start
RECORD_FILE = "init_vectors.json"
OUTPUT_INITS = ("zeros", "vectors")


@dataclass(frozen=True)
class InitVectors:
    """The rows a file gives a vocabulary. rows: [F] int64 vocabulary ids found, ascending; vectors: [F, D] float32
    (row i of ``vectors`` is vocabulary word ``rows[i]``); file_words: the words in the file."""

    path: str
    sha256: str
    rows: Tensor
    vectors: Tensor
    file_words: int

    @property
    def found(self) -> int:
        return int(self.rows.numel())

    def record(self, *, vocab_size: int, output: str) -> dict[str, Any]:
        """What ``RUN/init_vectors.json`` keeps (no vectors)."""
        return {"path": self.path, "sha256": self.sha256, "file_words": self.file_words, "found": self.found,
                "vocab_size": vocab_size, "output": output}


def file_sha256(path: str) -> str:
    """sha256 (hex) of the file at ``path`` (one-line ``ConfigError`` naming the key when it cannot be read)."""
    check_file(path)
    full = Path(path).expanduser()
    try:
        st = os.stat(full)
        return _sha256(str(full.resolve()), st.st_size, st.st_mtime_ns)
    except OSError as e:
        raise ConfigError(f"{KEY}: {path}: cannot read it ({e.strerror or type(e).__name__})") from None


@cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """(``size`` and ``mtime_ns`` key the cache: a file rewritten in place is hashed again.)"""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def statement_line(path: str) -> str:
    """What a run's statement says of its initial vectors (among what ε "includes", as a public vocabulary)."""
    return (f"the initial word vectors: {KEY}: {path} (sha256 {file_sha256(path)}), assumed public: nothing private "
            "spent on them; not covered by ε if derived from private data")


def is_binary(path: str) -> bool:
    """Whether a word2vec file is binary: its second line is not ``word f1 ... fD`` in UTF-8."""
    with open(Path(path).expanduser(), "rb") as f:
        f.readline()
        line = f.readline(1 << 20)
    try:
        parts = line.decode("utf-8").split()
        [float(x) for x in parts[1:]]
    except (UnicodeDecodeError, ValueError):
        return True
    return len(parts) < 2


def check_file(path: str, *, dim: int | None = None) -> None:
    """One-line ``ConfigError`` unless ``path`` (``~`` expanded) is a readable file whose word2vec header (``COUNT
    DIM``, text and binary alike) says ``dim`` vectors: checked before anything of the run is drawn or written (a DP
    vocabulary is drawn before the vectors are read)."""
    full = Path(path).expanduser()
    if full.is_dir():
        raise ConfigError(f"{KEY}: {path}: is a directory, not a word2vec file")
    if not full.is_file():
        raise ConfigError(f"{KEY}: {path}: no such file")
    try:
        with open(full, "rb") as f:
            header = f.readline(256).split()
    except OSError as e:
        raise ConfigError(f"{KEY}: {path}: cannot read it ({e.strerror or type(e).__name__})") from None
    if len(header) != 2 or not all(x.isdigit() for x in header):
        raise ConfigError(f"{KEY}: {path}: not a word2vec text or binary file (its first line is not 'COUNT DIM')")
    if dim is not None and int(header[1]) != dim:
        raise ConfigError(f"{KEY}: {path} holds vectors of dim {int(header[1])}; model.dim is {dim}")


def read_vectors(path: str) -> Any:
    """gensim ``KeyedVectors`` of the word2vec file ``path`` (text or binary, ``is_binary``)."""
    check_file(path)
    with needs("eval", f"{KEY} (word2vec-format vectors)"):
        from gensim.models import KeyedVectors
    try:
        return KeyedVectors.load_word2vec_format(str(Path(path).expanduser()), binary=is_binary(path))
    except (OSError, ValueError, UnicodeDecodeError, EOFError, IndexError) as e:
        raise ConfigError(f"{KEY}: {path}: not a word2vec text or binary file ({type(e).__name__}: {e})"
                          .splitlines()[0]) from None


def load_init_vectors(path: str, vocab: list[str], *, dim: int) -> InitVectors:
    """The vectors of ``path`` for the words of ``vocab`` (row i = ``vocab[i]``); one-line ``ConfigError`` when the
    file is missing or unreadable, its dim is not ``dim`` (``model.dim``), a found vector is not finite, or no
    vocabulary word is in it."""
    kv = read_vectors(path)
    if kv.vector_size != dim:
        raise ConfigError(f"{KEY}: {path} holds vectors of dim {kv.vector_size}; model.dim is {dim}")
    rows = [i for i, w in enumerate(vocab) if w in kv.key_to_index]
    if not rows:
        raise ConfigError(f"{KEY}: {path}: none of the {len(vocab):,} vocabulary words has a vector in it "
                          f"({len(kv):,} words; matched exactly, case included)")
    vectors = np.stack([kv[vocab[i]] for i in rows]).astype(np.float32)
    bad = ~np.isfinite(vectors).all(axis=1)
    if bad.any():
        raise ConfigError(f"{KEY}: {path}: the vector of {vocab[rows[int(np.argmax(bad))]]!r} is not finite")
    return InitVectors(path, file_sha256(path), torch.tensor(rows, dtype=torch.long), torch.from_numpy(vectors),
                       len(kv))


def apply_(model: Any, init: InitVectors, *, output: str) -> None:
    """Copy ``init``'s vectors into ``model``'s (a ``CBOW``) input rows ``init.rows``; with ``output: vectors`` into
    the untied output table's same rows too (``zeros``: it keeps its init)."""
    if output not in OUTPUT_INITS:
        raise ValueError(f"output: expected one of {OUTPUT_INITS}, got {output!r}")
    tables = [model.input.weight]
    if output == "vectors" and model.output is not None:
        tables.append(model.output.weight)
    with torch.no_grad():
        for w in tables:
            w.index_copy_(0, init.rows.to(w.device), init.vectors.to(w.device, w.dtype))


def warm_start(model: Any, vocab: list[str], out: Path, *, path: str, output: str, resumed: bool) -> None:
    """``model.init_vectors`` for a run in ``out``: a new run loads and applies the vectors and records them in
    ``out/init_vectors.json``; a resumed run (its checkpoint holds the weights) only checks that the file still has
    the sha256 recorded, so that its statement names the vectors it started from."""
    record_file = out / RECORD_FILE
    if resumed:
        was, now = _recorded_sha256(record_file), file_sha256(path)
        if was != now:
            raise ConfigError(f"{KEY}: {path} changed since the run started (sha256 {was} then, {now} now); restore "
                              "it or start a new run")
        return
    init = load_init_vectors(path, vocab, dim=model.dim)
    apply_(model, init, output=output)
    write_json(record_file, init.record(vocab_size=len(vocab), output=output))


def _recorded_sha256(record_file: Path) -> str:
    """The sha256 a run recorded of its vectors; a missing or damaged record is a one-line error (without it the
    statement could name a file the run did not start from)."""
    try:
        sha = json.loads(record_file.read_text()).get("sha256")
    except FileNotFoundError:
        raise ConfigError(f"{KEY}: {record_file} is missing: the run's record of the vectors it started from; "
                          "restore it from a copy of the run directory, or start a new run") from None
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{KEY}: {record_file} is damaged ({type(e).__name__}); restore it from a copy of the run "
                          "directory, or start a new run") from None
    if not isinstance(sha, str):
        raise ConfigError(f"{KEY}: {record_file} names no sha256; restore it or start a new run")
    return sha
