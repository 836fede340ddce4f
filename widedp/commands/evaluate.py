"""``widedp eval RUN|RELEASE [--out FILE] [--words W ...] [--k K]``: word-vector quality of a CBOW run or release.

The vectors are the CBOW input (context) embedding table, ``input.weight`` (the one table of a tied model): what
``widedp export --format word2vec`` releases. From a run directory they come from ``checkpoint.pt`` and
``vocab.json``; from a release folder from ``vectors.txt`` (word2vec text) or ``model.pt`` + ``vocab.json``. Reported
(``widedp.eval.similarity``): Spearman's ρ (and Pearson's r) with WordSim-353 and SimLex-999 over the pairs whose
two words are in the vocabulary, that share of pairs, and the nearest neighbours of a few frequent words. Written
to ``eval.json`` in that directory (or ``--out``) and printed briefly.

Privacy: the figures are a function of the vectors and of public benchmark pairs only (post-processing): they cost
nothing beyond the vectors' own statement, which eval.json repeats (a run that has not finished has none yet).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import widedp
from widedp.commands.export import run_weights
from widedp.errors import ConfigError
from widedp.eval import similarity as sim
from widedp.extras import MissingExtraError
from widedp.run import rundir
from widedp.run.checkpoint import read_json, write_json

EVAL_FILE = "eval.json"
VECTORS = "the CBOW input (context) embeddings, input.weight (what widedp export --format word2vec releases)"
METHOD = ("cosine similarity of each pair with both words in the vocabulary (matched case-insensitively), Spearman's "
          "rho and Pearson's r against the human scores (scipy), as gensim's KeyedVectors.evaluate_word_pairs; pairs "
          "with a word outside the vocabulary are left out and counted; the pair files are gensim's bundled copies")
NOTE = ("computed from the vectors and public benchmark pairs only (post-processing): no privacy cost beyond the "
        "vectors' own statement")


@dataclass(frozen=True)
class WordVectors:
    """words: [V] in row order; vectors: [V, D] float32; kind: where they came from; privacy: the statement (None:
    a run that has not finished)."""

    words: list[str]
    vectors: np.ndarray
    kind: str
    privacy: dict[str, Any] | None


def load_word_vectors(path: Path) -> WordVectors:
    """The CBOW input vectors of a run directory or a release folder (``ConfigError`` naming what is missing)."""
    if not path.is_dir():
        raise ConfigError(f"{path}: not a directory (give a run directory or a widedp export release)")
    if (path / "vectors.txt").is_file():
        return WordVectors(*_word2vec(path / "vectors.txt"), "release (word2vec)", _statement(path / "privacy.json"))
    if (path / "model.pt").is_file():
        state = _load_state(path / "model.pt")
        return WordVectors(*_input_table(path, _vocab(path), state), "release (torch)",
                           _statement(path / "privacy.json"))
    if not rundir.holds_run(path):
        raise ConfigError(f"{path}: neither a widedp run directory (checkpoint.pt) nor a release (vectors.txt or "
                          "model.pt)")
    weights = run_weights(path)  # (a run on several processes keeps them in a DCP checkpoint)
    state = {"input.weight": weights.read("input.weight")} if "input.weight" in weights.specs else {}
    summary = read_json(path / "summary.json") if (path / "summary.json").is_file() else None
    privacy = summary.get("privacy") if isinstance(summary, dict) else None
    return WordVectors(*_input_table(path, _vocab(path), state), "run", privacy if isinstance(privacy, dict) else None)


def _vocab(path: Path) -> list[str]:
    vocab = read_json(path / "vocab.json") if (path / "vocab.json").is_file() else None
    if not isinstance(vocab, list) or not all(isinstance(w, str) for w in vocab):
        raise ConfigError(f"{path}: no word list in vocab.json (widedp eval needs a CBOW run or release)")
    return vocab


def _load_state(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a tampered or truncated file must not become a traceback
        raise ConfigError(f"{path}: cannot be loaded safely ({type(e).__name__})") from None


def _input_table(path: Path, vocab: list[str], state: Any) -> tuple[list[str], np.ndarray]:
    weight = state.get("input.weight") if isinstance(state, dict) else None
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ConfigError(f"{path}: no CBOW input embeddings (input.weight); widedp eval needs a CBOW run or release")
    if weight.shape[0] < len(vocab):
        raise ConfigError(f"{path}: the embedding table has {weight.shape[0]} rows for {len(vocab)} words")
    return vocab, weight[: len(vocab)].detach().to("cpu", torch.float32).numpy()


def _word2vec(path: Path) -> tuple[list[str], np.ndarray]:
    """A word2vec text file: ``V D``, then ``word x_1 ... x_D`` per line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({type(e).__name__})") from None
    head = lines[0].split() if lines else []
    if len(head) != 2 or not all(x.isdigit() for x in head):
        raise ConfigError(f"{path}: line 1: expected 'V D' (a word2vec text file)")
    v, d = map(int, head)
    if len(lines) - 1 < v:
        raise ConfigError(f"{path}: {len(lines) - 1} vector line(s) for V={v}")
    words, values = [], []
    for i, line in enumerate(lines[1: v + 1], start=2):
        parts = line.split()
        if len(parts) != d + 1:
            raise ConfigError(f"{path}: line {i}: expected a word and {d} numbers")
        words.append(parts[0])
        values.extend(parts[1:])
    try:
        vectors = np.asarray(values, dtype=np.float32).reshape(v, d)
    except ValueError:
        raise ConfigError(f"{path}: a vector holds something that is not a number") from None
    return words, vectors


def _statement(path: Path) -> dict[str, Any] | None:
    doc = read_json(path) if path.is_file() else None
    return doc if isinstance(doc, dict) else None


def evaluate(path: Path, *, out: Path | None = None, probes: list[str] | None = None, k: int = 5) -> dict[str, Any]:
    """Score the vectors of ``path`` (a run directory or a release), write the report to ``out`` (default
    ``path/eval.json``) and return it."""
    if k < 1:
        raise ConfigError(f"--k: must be >= 1, got {k}")
    wv = load_word_vectors(path)
    scores = sim.word_similarity(wv.words, wv.vectors)
    chosen = probes if probes else sim.default_probes(wv.words)
    missing = [w for w in chosen if w not in wv.words]
    if probes and missing:
        raise ConfigError(f"--words: {missing[0]!r} is not in the vocabulary (V={len(wv.words)})")
    report = {"source": str(path), "kind": wv.kind, "vectors": VECTORS, "vocab_size": len(wv.words),
              "dim": int(wv.vectors.shape[1]), "word_similarity": scores,
              "neighbours": [{"word": w, "nearest": near}  # a list: eval.json's keys are sorted
                             for w, near in sim.neighbours(wv.words, wv.vectors, chosen, k=k).items()],
              "method": METHOD, "note": NOTE,
              "privacy": (wv.privacy or {}).get("text"), "widedp_version": widedp.__version__}
    target = out if out is not None else path / EVAL_FILE
    if target.is_dir():
        raise ConfigError(f"--out {target}: a directory; give the file to write (e.g. {target / EVAL_FILE})")
    write_json(target, report)
    return report


def format_report(report: dict[str, Any]) -> str:
    """A few lines: ρ per benchmark with its coverage, then the neighbours."""
    lines = []
    for s in report["word_similarity"].values():
        rho = "–" if s["spearman"] is None else f"{s['spearman']:.3f}"
        ci = "" if s.get("spearman_ci95") is None else " [{:.2f}, {:.2f}]".format(*s["spearman_ci95"])
        share = "" if s["share_in_vocab"] is None else f", {100 * s['share_in_vocab']:.1f}%"
        lines.append(f"{s['name']:<12s} Spearman rho {rho:>6s}{ci:<15s} ({s['in_vocab']} of {s['pairs']} pairs in "
                     f"the vocabulary{share})")
    for entry in report["neighbours"]:
        lines.append(f"  {entry['word']}: " + ", ".join(f"{n} {c:.2f}" for n, c in entry["nearest"]))
    return "\n".join(lines)


#: what ``run_similarity`` says once when gensim is missing
_NOTED: set[str] = set()


def run_similarity(run_dir: Path) -> dict[str, float | None] | None:
    """Spearman ρ and the in-vocabulary share per benchmark of a run's input vectors (``widedp compare``'s
    columns): ``{"wordsim353": ρ, "wordsim353_in_vocab": share, ...}``; None when the run is not a CBOW run, or
    (with a note on stderr, once) when gensim is not installed."""
    try:
        wv = load_word_vectors(run_dir)
        scores = sim.word_similarity(wv.words, wv.vectors)
    except MissingExtraError as e:
        if "gensim" not in _NOTED:
            _NOTED.add("gensim")
            print(f"widedp: note: word-similarity columns left out: {e}", file=sys.stderr)
        return None
    except ConfigError:  # not a CBOW run (no word list or no input table)
        return None
    out: dict[str, float | None] = {}
    for key, s in scores.items():
        out[key], out[f"{key}_in_vocab"] = s["spearman"], s["share_in_vocab"]
    return out
