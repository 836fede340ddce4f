"""Training on several processes: peak memory per process and samples/s of ``widedp train --nproc N``.

    nice -n 10 .venv/bin/python bench/bench_distributed.py                      # N = 1, 2, 3; V = 1e6 and 4e6
    nice -n 10 .venv/bin/python bench/bench_distributed.py --items 1e6 --procs 1 2 --steps 30   # quicker
    .venv/bin/python bench/bench_distributed.py --device cuda --procs 1 2                       # NCCL: a GPU each

The job: the recommender (``task: recsys``) on synthetic power-law interactions with an item table of V rows
(``--items``; plus 1e4 users, 50 tags, 24 contexts), D = 64, MLP 32-16, DP-sparse with the exponential mechanism
(k = b = 1000 rows per step) and lazy Adam (two moments and a step count per row), ``--steps`` steps, 1 torch thread
per process. Every table is cut into row blocks (``widedp.dp.layout.RowBlocks``). Each case is the real command
(``python -m widedp train CONFIG --nproc N``: torch elastic, gloo on CPU, NCCL on CUDA) in a fresh wrapper process.

Memory: the peak RSS of the largest process of the case, exact: the wrapper's ``getrusage(RUSAGE_CHILDREN)
.ru_maxrss`` once the run ended (Linux keeps, over every reaped descendant, the largest peak: the ranks and the
launcher); each rank's ``VmHWM`` (/proc, polled every 0.2 s: a lower bound) is recorded too. The figure reported is
that peak above a tiny-table baseline of the same N (V = 1000 items, same users, data and job), against the target
1.2 x (tables + optimizer state above the baseline's) / N. Its data preparation's O(V) arrays count too.

Speed: the median of the logged interval rates (samples/s over training steps; evaluation and checkpoints excluded),
the first interval dropped. Every rank sees the whole Poisson batch and repeats the sampling and the MLP head, and
each step adds small collectives, so several processes on one small machine are not faster; 3 processes on 2 cores
measure memory, not speed. Writes ``bench/out/bench_distributed.json`` (and, ``--save-docs``,
docs/bench_distributed.json).
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
DOCS = ROOT / "docs" / "bench_distributed.json"
USERS, TAGS, CONTEXTS, DIM, BASE_ITEMS = 10_000, 50, 24, 64, 1000

CONFIG = """
task: recsys
data: {{preset: synthetic, num_users: {users}, num_items: {items}, num_interactions: 200000, cache_dir: "{cache}"}}
model: {{dim: {dim}, hidden: [32, 16]}}
train: {{epochs: 1, batch_size: 1000, optimizer: lazy_adam, lr: 0.01, log_every: 10, max_steps: {steps},
        eval_max_samples: 2000, seed: 0, device: {device}}}
dp: {{clip1: 3.0, clip2: 1.0, noise_multiplier: 1.0, allow_large_delta: true,  # δ 1e-5 >= 1/N (160K): timings only
     selection: {{name: exponential, k: 1000, epsilon: 0.05, score_clip: 0.05}}}}
"""

#: runs the command of its arguments; writes {"rc", "maxrss_kib"} (RUSAGE_CHILDREN: the largest peak RSS of every
#: reaped descendant) to the file named by its first argument
WRAPPER = """
import json, resource, subprocess, sys
rc = subprocess.run(sys.argv[2:]).returncode
json.dump({"rc": rc, "maxrss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}, open(sys.argv[1], "w"))
"""


def table_rows(items: int) -> int:
    return USERS + items + TAGS + CONTEXTS


def state_bytes(items: int) -> int:
    """Bytes of the tables and lazy Adam's state: per row D float32 weights, 2 D float32 moments, an int64 step."""
    return table_rows(items) * (3 * DIM * 4 + 8)


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def rank_peaks(root: int, peaks: dict[int, int]) -> None:
    """Update ``peaks`` (rank -> KiB) with the VmHWM of every descendant of ``root`` that is a rank (RANK= set by
    torch elastic; ``--nproc 1`` trains in the launched process itself: rank 0 when no descendant has RANK)."""
    kids, todo = _children(), [root]
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        rank = next((int(v[5:]) for v in env if v.startswith(b"RANK=")), None)
        hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), None)
        if hwm is not None and (rank is not None or pid in kids.get(root, [])):
            key = -1 if rank is None else rank  # -1: the launched process (the launcher, or the rank of N = 1)
            peaks[key] = max(peaks.get(key, 0), hwm)


def run_case(cfg: Path, out: Path, nproc: int) -> dict:
    """One ``widedp train --nproc N`` under the wrapper: rates, exact peak RSS, polled per-rank peaks, wall time."""
    report = out.parent / f"{out.name}.rss.json"
    cmd = [sys.executable, "-c", WRAPPER, str(report), sys.executable, "-m", "widedp", "train", str(cfg), "--out",
           str(out), "--nproc", str(nproc), "--no-progress"]
    t0, peaks = time.perf_counter(), {}
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}) as proc:
        while proc.poll() is None:
            rank_peaks(proc.pid, peaks)
            time.sleep(0.2)
        stderr = proc.stderr.read()
    wall = time.perf_counter() - t0
    rss = json.loads(report.read_text()) if report.is_file() else {"rc": proc.returncode, "maxrss_kib": None}
    if nproc == 1 and -1 in peaks:  # --nproc 1 trains in the launched process
        peaks[0] = peaks.pop(-1)
    mem = {"peak_rss_mib": rss["maxrss_kib"] / 1024 if rss["maxrss_kib"] else None,
           "rank_peak_rss_mib_polled": {r: kib / 1024 for r, kib in sorted(peaks.items()) if r >= 0},
           "launcher_peak_rss_mib_polled": peaks[-1] / 1024 if -1 in peaks else None}
    if rss["rc"] != 0:
        return {"nproc": nproc, "failed": (stderr.strip().splitlines() or ["?"])[-1], "wall_s": wall, **mem}
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in recs if r.get("kind") == "interval"][1:]
    summary = json.loads((out / "summary.json").read_text())
    return {"nproc": nproc, "samples_per_s": statistics.median(rates) if rates else None, "interval_rates": rates,
            "steps": summary["steps"], "valid_loss": summary["valid_loss"], "epsilon": summary["dp"]["epsilon"],
            "wall_s": wall, **mem}


def prepare(cfg: Path) -> None:
    """Fill the config's data cache once, before any measured case (every case then reads the same cache)."""
    from widedp.config import load_config
    from widedp.data_prep.interactions import prepare_interactions

    prepare_interactions(load_config(cfg).data)


def memory_rows(cases: list[dict], items: list[int], procs: list[int]) -> list[dict]:
    """Per (V, N): the median peak RSS, the same above the baseline of that N, the target and the rate."""
    def med(v: int, n: int, key: str) -> float | None:
        got = [c[key] for c in cases if c["items"] == v and c["nproc"] == n and c.get(key) is not None]
        return statistics.median(got) if got else None

    rows = []
    for v in items:
        for n in procs:
            peak, base = med(v, n, "peak_rss_mib"), med(BASE_ITEMS, n, "peak_rss_mib")
            above = None if peak is None or base is None else peak - base
            state = (state_bytes(v) - state_bytes(BASE_ITEMS)) / 2**20
            target = 1.2 * state / n
            rows.append({"items": v, "nproc": n, "peak_rss_mib": peak, "baseline_peak_rss_mib": base,
                         "above_baseline_mib": above, "state_above_baseline_mib": state,
                         "ideal_mib": state / n, "target_mib": target,
                         "ratio_to_ideal": None if above is None else above / (state / n),
                         "meets_target": None if above is None else above <= target,
                         "samples_per_s": med(v, n, "samples_per_s")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=float, nargs="+", default=[1e6, 4e6], help="rows of the item table (V)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--save-docs", action="store_true", help=f"also write {DOCS.relative_to(ROOT)}")
    args = ap.parse_args()
    items = [BASE_ITEMS] + [int(v) for v in args.items]
    OUT.mkdir(parents=True, exist_ok=True)
    cases = []
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
        for v in items:
            cfg = Path(tmp) / f"recsys_v{v}.yaml"
            cfg.write_text(CONFIG.format(users=USERS, items=v, dim=DIM, steps=args.steps, device=args.device,
                                         cache=Path(tmp) / "cache"))
            prepare(cfg)
            for rnd in range(args.rounds):
                for n in args.procs:
                    case = {"items": v, "round": rnd, **run_case(cfg, Path(tmp) / f"v{v}-n{n}-r{rnd}", n)}
                    cases.append(case)
                    print(f"V {v:>9,}  nproc {n}  round {rnd}: peak RSS {case['peak_rss_mib'] or 0:,.0f} MiB, "
                          + (f"{case['samples_per_s']:,.0f} samples/s" if case.get("samples_per_s")
                             else f"FAILED: {case.get('failed')}") + f" (wall {case['wall_s']:.0f} s)", flush=True)
    rows = memory_rows(cases, items[1:], args.procs)
    for r in rows:
        above = r["above_baseline_mib"]
        print(f"V {r['items']:>9,}  N {r['nproc']}: above baseline "
              + ("?" if above is None else f"{above:,.0f} MiB") + f" (ideal {r['ideal_mib']:,.0f}, target "
              f"{r['target_mib']:,.0f} MiB: {'met' if r['meets_target'] else 'NOT met'}), "
              f"{r['samples_per_s'] or 0:,.0f} samples/s")
    result = {"job": {"items": items[1:], "baseline_items": BASE_ITEMS, "users": USERS, "dim": DIM,
                      "batch_size": 1000, "k": 1000, "steps": args.steps, "device": args.device,
                      "selection": "exponential", "optimizer": "lazy_adam", "procs": args.procs},
              "machine": {"cpus": os.cpu_count(), "loadavg_after": os.getloadavg(), "torch": torch.__version__,
                          "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
              "rows": rows, "cases": cases}
    for path in (OUT / "bench_distributed.json", *((DOCS,) if args.save_docs else ())):
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
