"""The DP step with glibc malloc tuned (``widedp.allocator``, what the CLI does) vs glibc's defaults, same run.

    .venv/bin/python bench/bench_allocator.py                 # V=1e6, b=1024 and 4096; JSON to bench/out/
    .venv/bin/python bench/bench_allocator.py --vocab 1e6 --batch 1024 --steps 20

Each (b, allocator) runs ``bench/bench_step.py``'s vocab case (synthetic Zipf CBOW batches, D=128, k=1024 rows,
exponential selection, lazy Adam: ``dp_sparse_lazy_adam``) in its own subprocess on 1 thread, with
``WIDEDP_MALLOC=system`` (glibc's defaults) or ``tuned``: wall ms/step (median of 3 x ``--steps`` after a warm-up),
CPU ms/step (user + system: less sensitive than wall time to other processes on a shared machine), minor page faults
per timed step (``ru_minflt``) and the process's peak RSS. ``--rounds`` alternated pairs; the summary is the median
over rounds, and the ratios are system over tuned.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
STEP = ROOT / "bench" / "bench_step.py"


def run_case(vocab: int, batch: int, malloc: str, *, method: str, dim: int, k: int, steps: int) -> dict:
    cmd = [sys.executable, str(STEP), "--one", str(vocab), method, str(dim), str(batch), str(k), str(steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WIDEDP_MALLOC": malloc}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        return {"vocab": vocab, "batch": batch, "malloc": malloc, "error": why}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _summary(runs: list[dict]) -> dict:
    """Per measure, the median over rounds (wall and CPU ms/step, faults/step, peak RSS)."""
    keys = ("step_ms", "cpu_ms_per_step", "minflt_per_step", "peak_rss_gb")
    return {k: statistics.median(r[k] for r in runs) for k in keys} | {"step_ms_min": min(r["step_ms"] for r in runs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=float, default=1e6)
    ap.add_argument("--batch", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--method", default="dp_sparse_lazy_adam")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20, help="steps per timing (3 timings, after a warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="system / tuned subprocess pairs per batch size, alternated")
    args = ap.parse_args()
    rows, summary = [], {}
    for batch in args.batch:
        by: dict[str, list[dict]] = {"system": [], "tuned": []}
        for _ in range(args.rounds):
            for malloc in by:
                row = run_case(int(args.vocab), batch, malloc, method=args.method, dim=args.dim, k=args.k,
                               steps=args.steps)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if "error" in row:
                    print(f"FAILED b={batch} WIDEDP_MALLOC={malloc}: {row['error']}", flush=True)
                else:
                    by[malloc].append(row)
        if all(by.values()):
            s, t = _summary(by["system"]), _summary(by["tuned"])
            summary[f"b={batch}"] = {"system": s, "tuned": t, "wall_system_over_tuned": s["step_ms"] / t["step_ms"],
                                     "cpu_system_over_tuned": s["cpu_ms_per_step"] / t["cpu_ms_per_step"]}
    out = {"vocab": int(args.vocab), "method": args.method, "threads": 1, "rounds": args.rounds, "rows": rows,
           "medians": summary}
    print(json.dumps(summary, indent=2))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_allocator.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {OUT / 'bench_allocator.json'}")


if __name__ == "__main__":
    main()
