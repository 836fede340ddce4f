"""``data.negatives_pool``: each DP step's negatives come from a pool drawn without the data; its rows are public."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from tiny_corpus import data_section

from widedp.cli import main
from widedp.tasks.cbow import NegativePool, SplitTensors

V = 12
COUNTS = torch.tensor([float(40 - 3 * i) for i in range(V)])
PROBS = COUNTS.pow(0.75) / COUNTS.pow(0.75).sum()


def test_pool_depends_on_seed_and_step_only():
    pool = NegativePool.of(PROBS.double().numpy(), 50, row_offset=V, device="cpu")
    t1, t2 = torch.zeros(30, dtype=torch.long), torch.randint(V, (7,), generator=torch.Generator().manual_seed(0))
    _, p1 = pool.draw(t1, 4, seed=9, step=3)
    _, p2 = pool.draw(t2, 4, seed=9, step=3)  # another batch, same step: the same public rows
    n1, p3 = pool.draw(t1, 4, seed=9, step=4)
    n2, _ = pool.draw(t1, 4, seed=9, step=4)
    assert torch.equal(p1, p2)
    small = NegativePool.of(PROBS.double().numpy(), 6, row_offset=V, device="cpu")  # 6 of 12 words: sets differ
    assert len({tuple(small.draw(t1, 4, seed=9, step=s)[1].tolist()) for s in range(6)}) > 1
    assert not torch.equal(pool.draw(t1, 4, seed=9, step=3)[0], n1)  # step 3's negatives differ from step 4's
    assert torch.equal(n1, n2)  # a resumed run redraws a lost step's negatives exactly
    assert p1.min() >= V and torch.equal(p1, p1.unique())  # output rows of an untied model, sorted


def test_negatives_follow_unigram_075_and_avoid_the_target():
    """χ² of the negatives of a rare target against unigram^0.75 (the move-to-next rule touches only its rare
    collisions), over many steps; no negative equals its target (9 pool neighbours in a row would have to)."""
    pool = NegativePool.of(PROBS.double().numpy(), 64, row_offset=0, device="cpu")
    counts = np.zeros(V)
    same = 0
    for step in range(4000):  # one pick per step: picks of one step share a pool (correlated, same marginal)
        target = torch.full((1 + step % 2,), V - 1)
        neg, public = pool.draw(target, 1, seed=1, step=step)
        assert torch.isin(neg, public).all()  # every negative is a pool row
        same += int((neg == target.unsqueeze(1)).sum())
        counts[int(neg[0, 0])] += 1
    keep = np.arange(V) != V - 1
    p = PROBS.double().numpy()[keep]
    expected = p / p.sum() * counts[keep].sum()
    assert stats.chisquare(counts[keep], expected).pvalue > 1e-3
    assert same == 0
    # negative control: uniform negatives are far from unigram^0.75 on this many draws
    assert stats.chisquare(np.full(keep.sum(), counts[keep].sum() / keep.sum()), expected).pvalue < 1e-6


def test_split_batch_at_uses_the_pool_only_when_set():
    t = torch.arange(6)
    split = SplitTensors(t % V, (t + 1).view(-1, 1) % V, torch.zeros(6, 3, dtype=torch.long))
    b, public = split.batch_at(t[:4], seed=0, step=0)
    assert public is None and torch.equal(b.negatives, split.negatives[:4])
    pool = NegativePool.of(PROBS.double().numpy(), 10, row_offset=0, device="cpu")
    pooled = SplitTensors(split.target, split.context, split.negatives, pool=pool)
    b, public = pooled.batch_at(t[:4], seed=0, step=0)
    assert public is not None and b.negatives.shape == (4, 3) and torch.isin(b.negatives, public).all()


def _config(tmp_path, extra_data: str, selection: str, dp: bool = True) -> str:
    cfg = tmp_path / "c.yaml"
    dp_section = f"""
dp: {{clip1: 1.0, clip2: 1.0, noise_multiplier: 0.5, rng: reproducible, selection: {selection}}}""" if dp else ""
    cfg.write_text(f"""
{data_section(tmp_path, lines=300, extra=extra_data)}
model: {{dim: 8, tied: false}}
train: {{epochs: 3, batch_size: 20, optimizer: lazy_adam, lr: 0.02, log_every: 50, eval_max_samples: 100}}{dp_section}
""")
    return str(cfg)


@pytest.mark.parametrize("selection", ["{name: gaussian_threshold, sigma: 2.0}", "{name: all}"])
def test_a_pooled_run_learns_and_noises_the_pool(tmp_path, selection):
    cfg = _config(tmp_path, ", negatives_pool: 6", selection)
    out = tmp_path / "run"
    assert main(["train", cfg, "--out", str(out), "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["valid_loss"] < s["initial_valid_loss"] - 0.05, (s["valid_loss"], s["initial_valid_loss"])
    rows = [json.loads(line)["rows_selected"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "rows_selected" in line]
    assert rows and min(rows) >= 1


def test_pool_is_refused_outside_widedp_dp(tmp_path, capsys):
    cfg = _config(tmp_path, ", negatives_pool: 6", "{name: all}", dp=False)
    assert main(["train", cfg, "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    assert "data.negatives_pool" in capsys.readouterr().err


def test_pool_is_refused_with_preselect(tmp_path, capsys):
    cfg = _config(tmp_path, ", negatives_pool: 6", "{name: all}")
    path = Path(cfg)
    path.write_text(path.read_text().replace("selection: {name: all}", "selection: {name: all}, preselect: {rows: 5}"))
    assert main(["train", cfg, "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    assert "data.negatives_pool: not with dp.preselect" in capsys.readouterr().err
