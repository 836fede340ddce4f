"""Where the sentence/document frontier stands (bench/frontier_sentence.py, bench/frontier_sentence_lanes.sh): every
cell of its sweep files, finished (valid/test loss, ε), under way (step of steps, last checkpoint) or not started;
whether each lane runs; then the table of the finished cells (bench/frontier_results.py).

    .venv/bin/python bench/frontier_sentence_status.py [--json docs/frontier_sentence.json \
        --png docs/frontier_sentence.png]

To continue after this session, a crash or a reboot: ``bash bench/frontier_sentence_lanes.sh start`` (finished cells
are reused, checkpointed ones resume). To add a cell or a seed: edit bench/frontier_sentence.py (``SEEDS``),
regenerate the configs, start the lanes again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import frontier_results
from frontier_sentence import ROOT

OUT = ROOT / "bench" / "out" / "frontier_sentence"
LANES = {"1": ["frontier_sentence_v10k_eps8", "frontier_sentence_v10k_seeds"],
         "2": ["frontier_sentence_v1k", "frontier_document_v10k", "frontier_sentence_v10k"]}


def setting(stem: str) -> str:
    """The folder of a sweep file's cells under ``OUT`` (as bench/frontier_sentence_lanes.sh names it)."""
    return "doc" if "document" in stem else "v1k" if "v1k" in stem else "v10k"


def lane_state(n: str) -> str:
    pid_file = OUT / f"lane{n}.pid"
    if not pid_file.is_file():
        return "never started"
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, 0)
    except OSError:
        return f"not running (pid {pid} gone)"
    return f"running (pid {pid})"


def cell_state(d: Path) -> str:
    if (d / "summary.json").is_file():
        s = json.loads((d / "summary.json").read_text())
        eps = (s.get("dp") or {}).get("epsilon")
        return (f"finished: valid {s['valid_loss']:.4f}, test {s['test_loss']:.4f}"
                + (f", ε {eps:.3f}" if eps is not None else ", non-private") + f", {s['wall_s'] / 60:.0f} min")
    metrics = d / "metrics.jsonl"
    if not metrics.is_file():
        return "not started"
    total, step = None, 0
    for line in metrics.read_text().splitlines():
        m = json.loads(line) if line.strip() else {}
        total = m.get("total_steps", total)
        step = m.get("step", step)
    return f"step {step} of {total}" + (" (checkpointed)" if (d / "checkpoint.pt").is_file() else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path)
    a = ap.parse_args()
    for n, stems in LANES.items():
        print(f"lane {n}: {lane_state(n)}")
        for stem in stems:
            sweep = yaml.safe_load((ROOT / "configs" / f"{stem}.yaml").read_text())
            print(f"  configs/{stem}.yaml")
            for r in sweep["runs"]:
                for seed in r.get("seeds", [0]):
                    d = OUT / setting(stem) / r["name"] / f"seed{seed}"
                    print(f"    {r['name']:<36} seed {seed}: {cell_state(d)}")
    outs = [OUT / s for s in ("v10k", "v1k", "doc") if (OUT / s).is_dir()]
    if not outs:
        return
    cells, _ = frontier_results.collect(outs)
    cells = frontier_results.merge_seeds(cells)
    if cells:
        print()
        print(frontier_results.markdown(cells))
    if a.json:
        a.json.write_text(json.dumps({"cells": cells}, indent=1) + "\n")
    if a.png and cells:
        frontier_results.plot(cells, a.png)


if __name__ == "__main__":
    main()
