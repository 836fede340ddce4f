"""A whole ``widedp train`` job's speed on each device, in the same run (a benchmark, not a test).

    .venv/bin/python bench/job_speed.py configs/brown_cbow_sparse_exp.yaml --devices cpu cuda --steps 400
    .venv/bin/python bench/job_speed.py configs/brown_cbow_sentence_wordfreq.yaml --devices cpu --steps 40  # here

Each (config, device) trains the config from scratch for ``--steps`` steps (``train.max_steps``; with
``dp.target_epsilon`` the σ calibrated for those steps differs from the full job's, which changes no step's cost),
logging every ``--log-every`` steps. The CPU run uses one torch thread (``train.threads: 1``), the baseline the GPU
is compared against. Its speed is the median samples/s (training samples, e.g. pairs, per second: the log lines'
figure; a window holds any evaluation and checkpoint in it, as the job does) of the logged windows after the
first (the first holds start-up: Triton's compilation, the allocator's warm-up); the whole run's figure
(``summary.json``'s, which includes that start-up) is written beside it. JSON to ``--out`` (default
``bench/out/job_speed.json``): one row per (config, device) and, for every config run on both, ``cuda_over_cpu``.
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

ROOT = Path(__file__).resolve().parents[1]


def run_job(config: str, device: str, *, steps: int, log_every: int, timeout: float) -> dict:
    """Train ``config`` on ``device`` for ``steps`` steps in a subprocess; its speed (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="widedp-job-") as tmp:
        out = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "widedp", "train", config, "--out", str(out), "--no-progress",
               "--set", f"train.device={device}", "--set", f"train.max_steps={steps}",
               "--set", f"train.log_every={log_every}", "--set", f"train.checkpoint_every={steps}"]
        if device == "cpu":
            cmd += ["--set", "train.threads=1"]
        t0 = time.perf_counter()
        env = {**os.environ, "OMP_NUM_THREADS": "1"} if device == "cpu" else dict(os.environ)
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"config": config, "device": device, "error": f"timed out after {timeout:g} s"}
        row: dict = {"config": config, "device": device, "steps": steps, "wall_s": time.perf_counter() - t0}
        if r.returncode != 0:
            return row | {"error": (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]}
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        windows = [x["samples_per_s"] for x in lines if x.get("kind") == "interval"]
        summary = json.loads((out / "summary.json").read_text())
        steady = windows[1:] or windows
        return row | {"samples_per_s": statistics.median(steady) if steady else None, "windows": len(windows),
                      "samples_per_s_whole_run": summary.get("samples_per_s"), "train_s": summary.get("train_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--devices", nargs="+", default=["cpu"], choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per (config, device)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "job_speed.json"))
    args = ap.parse_args()
    rows = []
    for config in args.configs:
        for device in args.devices:
            rows.append(run_job(config, device, steps=args.steps, log_every=args.log_every, timeout=args.timeout))
            print(json.dumps(rows[-1]), flush=True)
    ratios = {}
    for config in args.configs:
        by = {r["device"]: r.get("samples_per_s") for r in rows if r["config"] == config}
        if by.get("cpu") and by.get("cuda"):
            ratios[config] = by["cuda"] / by["cpu"]
    out = {"rows": rows, "cuda_over_cpu": ratios, "steps": args.steps, "log_every": args.log_every,
           "python": sys.version.split()[0]}
    try:
        import torch

        out |= {"torch": torch.__version__,
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    except ImportError:  # pragma: no cover
        pass
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({"cuda_over_cpu": ratios}))


if __name__ == "__main__":
    main()
