"""The documented library examples, run as the docs have them: the two ``python`` blocks of docs/own-model.md ("Use
your own model") and the short one on README's first screen."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from api_toys import interactions

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
OWN_MODEL = ROOT / "docs" / "own-model.md"  # README's "Use your own model" section moved here


def python_blocks(path: Path) -> list[str]:
    """The ``python`` code blocks of ``path``, in order."""
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def readme_examples() -> list[str]:
    """The ``python`` code blocks of docs/own-model.md ("Use your own model"), in order."""
    return python_blocks(OWN_MODEL)


def run_example(marker: str, page: Path = OWN_MODEL, **inputs: Any) -> dict[str, Any]:
    """Execute the one example of ``page`` containing ``marker`` with ``inputs`` as its globals; return its globals."""
    blocks = [b for b in python_blocks(page) if marker in b]
    assert len(blocks) == 1, f"{page.name} has {len(blocks)} python examples with {marker!r}"
    scope: dict[str, Any] = {"__name__": "readme_example", **inputs}
    exec(compile(blocks[0], f"{page.name} ({marker})", "exec"), scope)
    return scope


def test_readme_has_both_examples():
    assert len(readme_examples()) == 2


def test_torchrec_example_runs(capsys):
    pytest.importorskip("torchrec")
    torch.manual_seed(0)
    data = [{k: it[k] for k in ("user", "item", "tags", "label")} for it in interactions(160)]
    engine = run_example("EmbeddingBagCollection", dataset=data)["engine"]
    assert engine.steps == 20 and "training example [PLD accountant]" in capsys.readouterr().out


def test_embedding_bag_example_runs(tmp_path, capsys):
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (500, 1))
    data = list(zip(ids, (ids[:, 0] < 50).long()))
    engine = run_example("nn.EmbeddingBag(", dataset=data, run_dir=tmp_path)["engine"]
    assert engine.steps == 20 and engine.epsilon() <= 8.0
    assert (tmp_path / "private" / "seeds.json").is_file() and (tmp_path / "checkpoint.pt").is_file()
    out = capsys.readouterr().out
    assert "(ε=" in out and "training example [PLD accountant]" in out


def test_readme_first_screen_example_runs(capsys):
    """README's library-in-ten-lines block runs as written."""
    blocks = python_blocks(README)
    assert len(blocks) == 1 and len(blocks[0].strip().splitlines()) <= 10
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (500, 1))
    data = list(zip(ids, (ids[:, 0] < 50).long()))
    engine = run_example("make_private", page=README, dataset=data)["engine"]
    assert engine.steps > 0 and engine.epsilon() <= 8.0
    assert "training example [PLD accountant]" in capsys.readouterr().out
