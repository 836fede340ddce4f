"""The README's "Use your own model" examples, run as README has them (its two ``python`` blocks, executed)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from api_toys import interactions

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_examples() -> list[str]:
    """The ``python`` code blocks of README's "## Use your own model" section, in order."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Use your own model\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def run_example(marker: str, **inputs: Any) -> dict[str, Any]:
    """Execute the one README example containing ``marker`` with ``inputs`` as its globals; return its globals."""
    blocks = [b for b in readme_examples() if marker in b]
    assert len(blocks) == 1, f"README has {len(blocks)} 'Use your own model' examples with {marker!r}"
    scope: dict[str, Any] = {"__name__": "readme_example", **inputs}
    exec(compile(blocks[0], f"README.md ({marker})", "exec"), scope)
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
