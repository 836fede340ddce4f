"""The documented library examples, run as the docs have them: the ``python`` blocks of docs/own-model.md ("Use your
own model"; its DistributedModelParallel one under torchrun on 2 gloo processes) and the short one on README's first
screen."""

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


def test_readme_has_the_examples():
    assert len(readme_examples()) == 3


def test_torchrec_example_runs(capsys):
    pytest.importorskip("torchrec")
    torch.manual_seed(0)
    data = [{k: it[k] for k in ("user", "item", "tags", "label")} for it in interactions(160)]
    engine = run_example("model = Recommender()", dataset=data)["engine"]
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


def test_dmp_example_runs_on_two_processes(tmp_path):
    """docs/own-model.md's DistributedModelParallel script under ``torchrun --nproc_per_node 2`` prints the ε a
    one-process engine spends on the same global batches (b = 2 x 8, the same number of steps)."""
    import subprocess
    import sys

    pytest.importorskip("torchrec")
    import widedp

    (block,) = [b for b in python_blocks(OWN_MODEL) if "DistributedModelParallel(" in b]
    items = [{k: it[k] for k in ("user", "item", "tags", "label")} for it in interactions(160)]
    script = tmp_path / "train.py"
    script.write_text(f"dataset = {items!r}\n" + block, encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = re.search(r"\(ε=([0-9.]+), δ=", proc.stdout)
    assert got, proc.stdout
    one = widedp.PrivacyEngine(selection={"name": "exponential", "k": 8, "epsilon": 0.05, "score_clip": 0.1},
                               clip1=1.0, clip2=1.0, noise_multiplier=1.0, delta=1e-5)
    # the one-process ledger of the same run: 2 epochs x 10 steps on Poisson(16/160) batches
    model = torch.nn.EmbeddingBag(10, 8)
    data = [(torch.tensor([i % 10]), 0.0) for i in range(160)]
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    _, opt, _ = one.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, epochs=2,
                                 check_independence=False)
    for _ in range(one.total_steps):
        one.empty_step()  # the spend of a step does not depend on the batch
    printed = got.group(1)
    assert abs(float(printed) - one.epsilon()) <= 10 ** -(len(printed.split(".")[-1])), (printed, one.epsilon())
