"""Training on several processes: samples/s of ``widedp train --nproc N`` for N = 1 and 2, measured in the same run.

    .venv/bin/python bench/bench_distributed.py                      # V = 1e6 item rows, 2 rounds of N = 1, 2
    .venv/bin/python bench/bench_distributed.py --items 1e5 --steps 60 --rounds 1   # quicker
    .venv/bin/python bench/bench_distributed.py --device cuda --procs 1 2           # NCCL: one GPU per process

The job: the recommender (``task: recsys``) on synthetic power-law interactions with an item table of ``--items``
rows (plus 1e4 users, 50 tags, 24 contexts; D=16, MLP 32-16), DP-sparse with the exponential mechanism (k = b =
1000 rows per step) and lazy Adam, ``--steps`` steps, 1 torch thread per process. Each case is the real command
(``python -m widedp train CONFIG --nproc N``, torch elastic + gloo on CPU, NCCL on CUDA) in its own subprocess;
cases alternate (1, 2, 1, 2, ...) so that load from other processes hits both alike. Rate = median of the logged
interval rates (samples/s over the training steps: evaluation and checkpoints excluded), first interval dropped.
The ratio is N = 2 over N = 1 of the same run. Writes ``bench/out/bench_distributed.json``.

What to expect: every rank sees the whole Poisson batch and does the redundant parts (sampling, the MLP head, the
dense rows' clip), and each step adds ~6 small collectives, so on one 2-core machine the 2-process run is NOT
faster; the point is the scaling path (tables larger than one process's memory, more machines or GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"

CONFIG = """
task: recsys
data: {{preset: synthetic, num_users: 10000, num_items: {items}, num_interactions: 200000, cache_dir: "{cache}"}}
model: {{dim: 16, hidden: [32, 16]}}
train: {{epochs: 1, batch_size: 1000, optimizer: lazy_adam, lr: 0.01, log_every: 10, max_steps: {steps},
        eval_max_samples: 2000, seed: 0, device: {device}}}
dp: {{clip1: 3.0, clip2: 1.0, noise_multiplier: 1.0, allow_large_delta: true,  # δ 1e-5 >= 1/N (160K): timings only
     selection: {{name: exponential, k: 1000, epsilon: 0.05, score_clip: 0.05}}}}
"""


def run_case(cfg: Path, out: Path, nproc: int) -> dict:
    """One ``widedp train --nproc N`` in a subprocess: its interval rates, summary and wall time."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "widedp", "train", str(cfg), "--out", str(out), "--nproc", str(nproc),
                           "--no-progress"], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"nproc": nproc, "failed": (proc.stderr.strip().splitlines() or ["?"])[-1], "wall_s": wall}
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in recs if r.get("kind") == "interval"][1:]
    summary = json.loads((out / "summary.json").read_text())
    return {"nproc": nproc, "samples_per_s": statistics.median(rates), "interval_rates": rates,
            "summary_samples_per_s": summary["samples_per_s"], "steps": summary["steps"],
            "valid_loss": summary["valid_loss"], "epsilon": summary["dp"]["epsilon"], "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=float, default=1e6, help="rows of the item table (V)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    items = int(args.items)
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
        cfg = Path(tmp) / "recsys_dist.yaml"
        cfg.write_text(CONFIG.format(items=items, steps=args.steps, device=args.device, cache=Path(tmp) / "cache"))
        cases = []
        for rnd in range(args.rounds):
            for n in args.procs:
                case = run_case(cfg, Path(tmp) / f"n{n}-r{rnd}", n)
                cases.append({"round": rnd, **case})
                rate = case.get("samples_per_s")
                print(f"round {rnd}  nproc {n}: " + (f"{rate:,.0f} samples/s (wall {case['wall_s']:.1f} s)"
                                                      if rate else f"FAILED: {case['failed']}"), flush=True)
    medians = {n: statistics.median([c["samples_per_s"] for c in cases if c["nproc"] == n and "samples_per_s" in c])
               for n in args.procs if any(c["nproc"] == n and "samples_per_s" in c for c in cases)}
    base = medians.get(args.procs[0])
    ratios = {n: r / base for n, r in medians.items()} if base else {}
    for n, r in medians.items():
        print(f"nproc {n}: {r:,.0f} samples/s" + (f"  ({ratios[n]:.2f}x nproc {args.procs[0]})" if ratios else ""))
    result = {"job": {"items": items, "dim": 16, "batch_size": 1000, "k": 1000, "steps": args.steps,
                      "device": args.device, "selection": "exponential", "optimizer": "lazy_adam"},
              "machine": {"cpus": os.cpu_count(), "loadavg_after": os.getloadavg(), "torch": torch.__version__,
                          "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
              "median_samples_per_s": medians, "ratio_to_first": ratios, "cases": cases}
    path = OUT / "bench_distributed.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
