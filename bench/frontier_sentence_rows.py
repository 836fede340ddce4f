"""How a privacy unit's rows spread over the vocabulary: what decides whether a per-step selection can find them.

    .venv/bin/python bench/frontier_sentence_rows.py configs/frontier_sentence_v10k_eps8.yaml

For the sweep's (or a config's) prepared training split, with each unit cut to its first m pairs as training does:
the share of target / context tokens among the first H words of the vocabulary (wordfreq's most frequent, its
public head), the distinct rows a unit touches (context rows in the input table, target rows in the output table;
negatives left out: with data.negatives_pool they are public rows), the rows outside the head per unit, and how many
units of an expected batch (q N) touch each row. Non-private statistics of the private data: for the docs, never
for a release.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from widedp.commands.compare import load_sweep
from widedp.config import Config, load_config
from widedp.data_prep.cbow import prepare_cbow


def first_pairs(cfg: Config) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(unit, target, context) of the train pairs each unit keeps (its first m in corpus order)."""
    tr = prepare_cbow(cfg.data).train
    unit = tr.sentence if cfg.data.privacy_unit == "sentence" else tr.document
    order = np.lexsort((tr.order, unit))
    u, t, c = unit[order], tr.target[order], tr.context[order][:, 0]
    first = np.r_[True, u[1:] != u[:-1]]
    starts = np.flatnonzero(first)
    rank = np.arange(len(u)) - np.repeat(starts, np.diff(np.r_[starts, len(u)]))
    keep = rank < cfg.data.max_samples_per_unit
    return u[keep], t[keep], c[keep]


def report(cfg: Config, heads: tuple[int, ...]) -> None:
    u, t, c = first_pairs(cfg)
    v = cfg.data.vocab_size
    _, u = np.unique(u, return_inverse=True)
    n = int(u.max()) + 1
    print(f"{cfg.data.privacy_unit}s with a train pair: {n:,}; train pairs kept: {len(u):,}; V = {v:,}")
    ct, cc = np.bincount(t, minlength=v), np.bincount(c, minlength=v)
    for h in heads:
        print(f"  H = {h:>5}: share of targets in the head {ct[:h].sum() / ct.sum():.3f}, "
              f"of contexts {cc[:h].sum() / cc.sum():.3f}")
    rows = np.unique(np.r_[u * (2 * v) + c, u * (2 * v) + v + t])  # (unit, row) pairs, rows of both tables
    unit_of, row = rows // (2 * v), rows % (2 * v)
    per = np.bincount(unit_of, minlength=n)
    print(f"  distinct rows per unit: mean {per.mean():.1f}, median {np.median(per):.0f}, 90th percentile "
          f"{np.percentile(per, 90):.0f}")
    q = cfg.dp.sampling_rate if cfg.dp is not None and cfg.dp.sampling_rate else cfg.train.batch_size / n
    units_per_row = np.bincount(row, minlength=2 * v)
    for h in (0, *heads):
        tail = (row % v) >= h
        per_tail = np.bincount(unit_of[tail], minlength=n)
        rest = np.r_[units_per_row[h:v], units_per_row[v + h:]]  # rows outside the head, both tables
        print(f"  outside the first {h:>5} rows of each table: {per_tail.mean():.1f} rows per unit (median "
              f"{np.median(per_tail):.0f}; units with none {(per_tail == 0).mean():.3f}); of these rows, expected "
              f"units per batch (q = {q:.4g}) >= 5: {(rest * q >= 5).mean():.3f}, >= 1: {(rest * q >= 1).mean():.3f}, "
              f"never touched: {(rest == 0).mean():.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", type=Path, help="a config, or a sweep (its first run's config)")
    ap.add_argument("--heads", type=int, nargs="+", default=[500, 1000, 2000, 5000])
    a = ap.parse_args()
    text = a.config.read_text(encoding="utf-8")
    cfg = load_sweep(a.config).runs[0].config(0) if "\nruns:" in text else load_config(a.config)
    report(cfg, tuple(a.heads))


if __name__ == "__main__":
    main()
