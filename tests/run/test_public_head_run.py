"""A public head in training (``dp.selection: public_top`` and ``gaussian_threshold``'s ``public_head``): the trainer
hands the model's tables to the selector, rows outside the head (and the negatives' pool) never move, and
``public_top`` spends what DP-SGD spends."""

import json

import pytest
import torch
from tiny_corpus import data_section

from widedp.cli import main
from widedp.config import load_config
from widedp.tasks.cbow import build_cbow

V, H = 13, 4


def _config(tmp_path, selection, *, data_extra=""):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
{data_section(tmp_path, words=V, extra=data_extra)}
model: {{dim: 8, tied: false}}
train: {{epochs: 1, max_steps: 60, batch_size: 10, optimizer: lazy_adam, lr: 0.01, log_every: 20,
        eval_max_samples: 50, seed: 3}}
dp: {{clip1: 1.0, clip2: null, noise_multiplier: 1.0, accountant: rdp, selection: {selection}}}
""")
    return cfg


def _rows(tmp_path, cfg_path, out):
    _, init = build_cbow(load_config(cfg_path), tmp_path, device=torch.device("cpu"))
    final = torch.load(out / "checkpoint.pt", weights_only=True)["model"]
    before = torch.cat([init.input.weight.detach(), init.output.weight.detach()])  # row r < V: input, else output
    return before, torch.cat([final["input.weight"], final["output.weight"]])


@pytest.mark.parametrize("selection", [
    f"{{name: public_top, rows_per_table: {H}}}",
    f"{{name: gaussian_threshold, sigma: 50.0, threshold: 1000.0, public_head: {H}}}"])
def test_only_the_head_moves(tmp_path, selection):
    """τ out of reach: the threshold picks nothing, so both selections update exactly the first H rows of each
    table (the context table's and the output table's)."""
    cfg_path = _config(tmp_path, selection)
    out = tmp_path / "run"
    assert main(["train", str(cfg_path), "--out", str(out), "--no-progress"]) == 0
    before, after = _rows(tmp_path, cfg_path, out)
    head = [*range(H), *range(V, V + H)]
    outside = sorted(set(range(2 * V)) - set(head))
    assert torch.equal(after[outside], before[outside])
    assert all(not torch.equal(after[r], before[r]) for r in head)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert {m["rows_selected"] for m in metrics if m["kind"] == "interval"} == {2.0 * H}


def test_public_top_spends_what_dp_sgd_spends(tmp_path):
    eps = []
    for name, sel in (("top", f"{{name: public_top, rows_per_table: {H}}}"), ("all", "{name: all}")):
        d = tmp_path / name
        d.mkdir()
        out = d / "run"
        assert main(["train", str(_config(d, sel)), "--out", str(out), "--no-progress"]) == 0
        eps.append(json.loads((out / "summary.json").read_text())["dp"]["epsilon"])
    assert eps[0] == pytest.approx(eps[1], rel=1e-12) and eps[0] > 0


def test_with_a_pool_the_pool_rows_move_too(tmp_path):
    """The negatives' pool is public for the step as well: head and pool rows may move, no other row does."""
    cfg_path = _config(tmp_path, "{name: public_top, rows_per_table: 2}",
                       data_extra=", negatives: 2, negatives_pool: 3")
    out = tmp_path / "run"
    assert main(["train", str(cfg_path), "--out", str(out), "--no-progress"]) == 0
    before, after = _rows(tmp_path, cfg_path, out)
    moved = {r for r in range(2 * V) if not torch.equal(after[r], before[r])}
    assert {0, 1, V, V + 1} <= moved
    assert all(r in (0, 1) or r >= V for r in moved)  # no context row outside the head: the pool is output rows
