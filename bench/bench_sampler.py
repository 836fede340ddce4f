"""Poisson batch sampling: the O(m) sampler vs the previous permutation-redraw one, measured in the same run.

    .venv/bin/python bench/bench_sampler.py                    # n=200K and n=1.5M at b=1000, JSON to bench/out/
    .venv/bin/python bench/bench_sampler.py --steps 4096 --cases 200000:1000
    NLTK_DATA=../shared/nltk_data .venv/bin/python bench/bench_sampler.py --job 300   # + the default job, 300 steps

Each (implementation, n, b) runs in its own subprocess (1 torch thread), so peak RSS is that process's ru_maxrss:
it draws ``--steps`` consecutive batches (whole chunks of 1024 steps) and reports ms/step (wall time of the draws,
chunk draws included, over the steps), the peak RSS over the process's RSS before the first draw, and the bytes of
tensor storage one chunk's batches keep alive. ``old`` is the sampler before the fused step: a step whose i.i.d. ids
collide was redrawn as ``randperm(n)[:m]``, a slice that keeps the whole n-long permutation alive.
``--job STEPS`` also runs the README's default job (``widedp train configs/brown_cbow_sparse_exp.yaml``: n=200K,
b=1000) for STEPS steps with each sampler (``widedp.run.trainers.sparse.PoissonSampler`` replaced by the old one),
in its own subprocess: peak RSS, the process's CPU seconds (user + system) and the summary's training samples/s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


class OldPoissonSampler:
    """The pre-issue-17 ``widedp.dp.sampling.PoissonSampler`` (verbatim but for the name), the baseline."""

    def __init__(self, n: int, *, sampling_rate: float, seed: int, device: torch.device | str = "cpu") -> None:
        from widedp.dp.sampling import _gen

        self._gen = _gen
        self.n, self.q, self.seed = n, sampling_rate, seed
        self.device = torch.device(device)
        self._chunk_id = -1
        self._batches: list[torch.Tensor] = []

    def batch(self, step: int) -> torch.Tensor:
        chunk, pos = divmod(step, 1024)
        if chunk != self._chunk_id:
            self._batches = self._draw_chunk(chunk)
            self._chunk_id = chunk
        return self._batches[pos]

    def _draw_chunk(self, chunk: int) -> list[torch.Tensor]:
        g = self._gen(self.seed, chunk, self.device)
        counts = torch.binomial(torch.full((1024,), float(self.n)), torch.full((1024,), self.q), generator=g)
        counts = counts.long()
        ids = torch.randint(self.n, (int(counts.sum()),), generator=g)
        parts = list(torch.split(ids, counts.tolist()))
        for i, p in enumerate(parts):
            if p.numel() > 1 and torch.unique(p).numel() < p.numel():
                parts[i] = torch.randperm(self.n, generator=g)[: p.numel()]
        return [p.to(self.device, non_blocking=True) for p in parts]


def one_case(impl: str, n: int, b: int, steps: int) -> dict:
    """Runs inside a subprocess."""
    from widedp.dp.sampling import PoissonSampler

    cls = OldPoissonSampler if impl == "old" else PoissonSampler
    sampler = cls(n, sampling_rate=b / n, seed=0)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sizes = 0
    t0 = time.perf_counter()
    for t in range(steps):
        sizes += sampler.batch(t).numel()
    sec = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    live = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in sampler._batches}
    return {"impl": impl, "n": n, "b": b, "steps": steps, "ms_per_step": sec / steps * 1e3,
            "mean_batch": sizes / steps, "peak_rss_mb": peak / 2**20, "rss_before_mb": rss0 / 2**20,
            "peak_rss_increase_mb": (peak - rss0) / 2**20, "chunk_storage_mb": sum(live.values()) / 2**20}


def one_job(impl: str, steps: int, out: str) -> dict:
    """Runs inside a subprocess: the default job through the CLI, for ``steps`` steps."""
    from widedp.cli import main as cli_main
    from widedp.run.trainers import sparse as engine

    if impl == "old":
        engine.PoissonSampler = OldPoissonSampler  # type: ignore[misc]
    t0 = time.perf_counter()
    rc = cli_main(["train", str(ROOT / "configs" / "brown_cbow_sparse_exp.yaml"), "--out", out, "--overwrite",
                   "--no-progress", "--set", f"train.max_steps={steps}", "--set", f"data.cache_dir={OUT / 'cache'}"])
    summary = json.loads((Path(out) / "summary.json").read_text()) if rc == 0 else {}
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"impl": impl, "job": "brown_cbow_sparse_exp", "steps": steps, "rc": rc,
            "wall_s": time.perf_counter() - t0, "cpu_s": ru.ru_utime + ru.ru_stime,
            "samples_per_s": summary.get("samples_per_s"),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["200000:1000", "1500000:1000"], metavar="N:B")
    ap.add_argument("--steps", type=int, default=2048, help="steps per measure (a multiple of 1024: whole chunks)")
    ap.add_argument("--job", type=int, default=0, metavar="STEPS", help="also the default job for STEPS steps")
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--one-job", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.one:
        impl, n, b, s = args.one
        print(json.dumps(one_case(impl, int(n), int(b), int(s))))
        return
    if args.one_job:
        impl, s, out = args.one_job
        print(json.dumps(one_job(impl, int(s), out)))
        return
    rows, ratios = [], {}
    for case in args.cases:
        n, b = (int(float(x)) for x in case.split(":"))
        by = {}
        for impl in ("old", "new"):
            cmd = [sys.executable, __file__, "--one", impl, str(n), str(b), str(args.steps)]
            r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            row = (json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0
                   else {"impl": impl, "n": n, "b": b, "error": r.stderr.strip().splitlines()[-1:]})
            rows.append(row)
            by[impl] = row
            print(json.dumps(row), flush=True)
        if all("ms_per_step" in by[i] for i in by):
            ratios[f"n={n},b={b}"] = {
                "speedup_old_over_new": by["old"]["ms_per_step"] / by["new"]["ms_per_step"],
                "peak_rss_increase_old_over_new": by["old"]["peak_rss_increase_mb"]
                / max(by["new"]["peak_rss_increase_mb"], 1e-9),
                "peak_rss_saved_mb": by["old"]["peak_rss_mb"] - by["new"]["peak_rss_mb"]}
    if args.job:
        OUT.mkdir(parents=True, exist_ok=True)
        job = {}
        for impl in ("old", "new"):
            cmd = [sys.executable, __file__, "--one-job", impl, str(args.job), str(OUT / f"job_{impl}")]
            r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            job[impl] = (json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0
                         else {"impl": impl, "error": (r.stderr.strip().splitlines() or [""])[-1]})
            rows.append(job[impl])
            print(json.dumps(job[impl]), flush=True)
        if all(j.get("rc") == 0 for j in job.values()):
            ratios["default_job"] = {"peak_rss_saved_mb": job["old"]["peak_rss_mb"] - job["new"]["peak_rss_mb"],
                                     "cpu_s_old_over_new": job["old"]["cpu_s"] / job["new"]["cpu_s"],
                                     "samples_per_s_new_over_old": job["new"]["samples_per_s"]
                                     / job["old"]["samples_per_s"]}
    out = {"torch": torch.__version__, "threads": 1, "steps": args.steps, "rows": rows, "ratios": ratios}
    print(json.dumps(ratios, indent=2))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_sampler.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {OUT / 'bench_sampler.json'}")


if __name__ == "__main__":
    main()
