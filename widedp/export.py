"""``widedp export RUN_DIR --format word2vec``: the input (context) embeddings in word2vec text format.

gensim reads the output with ``KeyedVectors.load_word2vec_format(path, binary=False)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from widedp.checkpoint import load_checkpoint
from widedp.errors import ConfigError


def export_word2vec(run_dir: Path, out: Path) -> Path:
    """Write ``V D`` then one ``word v1 ... vD`` line per vocabulary word; returns the path written."""
    vocab_path = run_dir / "vocab.json"
    if not vocab_path.is_file():
        raise ConfigError(f"{run_dir}: no vocab.json (not a widedp CBOW run directory)")
    vocab = json.loads(vocab_path.read_text())
    state = load_checkpoint(run_dir)["model"]
    if "input.weight" not in state:
        raise ConfigError(f"{run_dir}: the checkpoint holds no CBOW input table (input.weight)")
    weight = state["input.weight"].to(torch.float32)  # the context (input) embeddings, word2vec's usual vectors
    if weight.shape[0] < len(vocab):
        raise ConfigError(f"{run_dir}: embedding table has {weight.shape[0]} rows for {len(vocab)} words")
    lines = [f"{len(vocab)} {weight.shape[1]}"]
    for word, row in zip(vocab, weight.tolist()):
        lines.append(word + " " + " ".join(f"{x:.6g}" for x in row))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out
