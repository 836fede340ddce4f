"""widedp DP-sparse vs the Opacus DP-SGD baseline, measured in the same run (a benchmark, not a test).

    .venv/bin/python bench/bench_opacus.py                      # parts a and b, JSON to bench/out/bench_opacus.json
    .venv/bin/python bench/bench_opacus.py --part a --full-run  # + wall time of one whole 20-epoch paper run
    .venv/bin/python bench/bench_opacus.py --part b --mem-gb 8  # V=1e5 only

(a) Paper preset (Brown, V=1K, D=100, b=20, Adam): samples/s of training through ``widedp.run.train.train`` — widedp's
    DP step for each selection mechanism, and ``dp.engine: opacus`` (Opacus PrivacyEngine, Poisson sampling through
    its DPDataLoader, hooks on nn.Embedding). Throughput = median of the logged interval rates (evaluation excluded,
    sampling, step, optimizer and ledger included), the first interval dropped as warm-up. Ratios vs Opacus.
    ``--full-run``: the wall time of one whole 20-epoch sparse-exponential run (configs/paper_fig1.yaml).
(b) V=1e5, D=128, b=256 (synthetic Zipf pairs, 8 negatives, tied table): ms/step and peak RSS of widedp DP-sparse
    (exponential, k=256 rows, lazy Adam), widedp ``selection: all`` (DP-SGD, dense Adam), Opacus ghost clipping
    (nn.Embedding, grad_sample_mode="ghost", dense Adam) and Opacus hooks (dense per-sample grads, B*V*D*4 bytes =
    13 GB: expected OOM). Each case runs in its own subprocess under RLIMIT_AS = --mem-gb; peak RSS is its ru_maxrss.
Torch runs on 1 thread (notes/environment.md: steadier than 2 on the shared 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"

SELECTIONS: dict[str, dict[str, Any]] = {  # the paper's Table 1 at row level, as configs/brown_cbow_sparse_*.yaml
    "exponential": {"name": "exponential", "k": 100, "epsilon": 0.2702, "score_clip": 0.1},
    "sparse_vector": {"name": "sparse_vector", "epsilon": 0.1351, "threshold": 0.05, "cutoff": 100, "score_clip": 0.1},
    "uniform": {"name": "uniform", "k": 100},
    "all": {"name": "all"},
}


def _paper_cfg(selection: dict[str, Any] | None, *, engine: str = "widedp", steps: int, log_every: int,
               cache_dir: str | None, optimizer: str = "adam") -> Any:
    from widedp.config import config_from_dict

    raw: dict[str, Any] = {
        "data": {"preset": "paper", **({"cache_dir": cache_dir} if cache_dir else {})},
        "model": {"dim": 100, "tied": True, "sparse": False},
        "train": {"epochs": 20, "batch_size": 20, "optimizer": optimizer, "lr": 1e-3, "max_steps": steps,
                  "log_every": log_every, "eval_max_samples": 500, "threads": 1, "device": "cpu"},
    }
    if selection is not None:
        all_rows = selection["name"] == "all"
        raw["dp"] = {"clip1": 15.0, "clip2": None if all_rows else 1.0, "noise_multiplier": 0.5,
                     "delta": 1e-5, "accountant": "rdp", "selection": selection, "engine": engine,
                     "allow_large_delta": True}  # the paper's δ, not below 1/N for its 200K pairs: timings only
    return config_from_dict(raw)


def _rate(run_dir: Path) -> float:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in recs if r["kind"] == "interval"][1:]
    return statistics.median(rates)


def part_a(steps: int, log_every: int, cache_dir: str | None, full_run: bool) -> dict[str, Any]:
    from widedp.data_prep.cbow import prepare_cbow
    from widedp.run.train import train

    data = prepare_cbow(_paper_cfg(None, steps=1, log_every=1, cache_dir=cache_dir).data)
    # adam: dense moments (the paper's, updates all 100K parameters every step); lazy_adam: selected rows only
    cases: dict[str, tuple[dict[str, Any], str, str]] = {
        f"widedp-{k}": (v, "widedp", "adam") for k, v in SELECTIONS.items()
    }
    for k in ("exponential", "sparse_vector", "uniform"):
        cases[f"widedp-{k}-lazy_adam"] = (SELECTIONS[k], "widedp", "lazy_adam")
    cases["opacus-dpsgd"] = (SELECTIONS["all"], "opacus", "adam")
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (sel, engine, opt) in cases.items():
            n_steps = steps if engine == "widedp" else max(log_every * 4, steps // 10)
            cfg = _paper_cfg(sel, engine=engine, steps=n_steps, log_every=log_every if engine == "widedp"
                             else max(log_every // 10, 50), cache_dir=cache_dir, optimizer=opt)
            d = Path(tmp) / name
            s = train(cfg, d, progress=False, data=data)
            res[name] = {"samples_per_s": _rate(d), "ms_per_step": 1e3 * 20 / _rate(d), "steps": s["steps"]}
            print(f"  {name:34s} {res[name]['samples_per_s']:9.0f} samples/s  "
                  f"({res[name]['ms_per_step']:.3f} ms/step)", flush=True)
    base = res["opacus-dpsgd"]["samples_per_s"]
    for r in res.values():
        r["x_opacus"] = r["samples_per_s"] / base
    out: dict[str, Any] = {"cases": res}
    if full_run:
        from widedp.commands.compare import load_sweep

        sweep = load_sweep(ROOT / "configs" / "paper_fig1.yaml",
                           [f"data.cache_dir={cache_dir}"] if cache_dir else [])
        run = next(r for r in sweep.runs if r.name == "sparse-exponential")
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            s = train(run.config(run.seeds[0]), Path(tmp) / "full", progress=False, data=data)
            out["full_run"] = {"run": "paper_fig1.yaml sparse-exponential seed 0", "wall_s": time.perf_counter() - t0,
                               "train_wall_s": s["wall_s"], "steps": s["steps"], "test_loss": s["test_loss"],
                               "epsilon": s["dp"]["epsilon"], "epsilon_rdp": s["dp"]["epsilon_rdp"]}
        print(f"  full 20-epoch run: {out['full_run']['wall_s']:.0f} s", flush=True)
    return out


# --------------------------------------------------------------------------------------------- part b (children)


def _synthetic(V: int, n: int, seed: int = 0) -> Any:
    from widedp.data_prep.cbow import CBOWData, Split

    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, V + 1)
    p /= p.sum()

    def split(m: int) -> Split:
        return Split(rng.choice(V, m, p=p), rng.choice(V, (m, 1), p=p), rng.choice(V, (m, 8), p=p ** 0.75 /
                                                                                  (p ** 0.75).sum()))

    return CBOWData([f"w{i}" for i in range(V)], np.zeros(V, np.int64), split(n), split(256), split(256), n)


def _child(case: str, V: int, steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    b, D, n = 256, 128, 200_000
    data = _synthetic(V, n)
    if case.startswith("widedp"):
        from widedp.config import config_from_dict
        from widedp.run.train import train

        sel = {"name": "all"} if case == "widedp-all" else {"name": "exponential", "k": 256, "epsilon": 0.5,
                                                             "score_clip": 0.1}
        cfg = config_from_dict({
            "data": {"preset": "custom", "vocab_size": V},
            "model": {"dim": D, "tied": True, "sparse": False},
            "train": {"batch_size": b, "optimizer": "adam" if case == "widedp-all" else "lazy_adam",
                      "max_steps": steps, "log_every": max(steps // 4, 1),
                      "eval_max_samples": 256, "threads": 1, "device": "cpu"},
            "dp": {"clip1": 1.0, "clip2": None if case == "widedp-all" else 1.0, "noise_multiplier": 1.0,
                   "accountant": "rdp", "selection": sel},
        })
        with tempfile.TemporaryDirectory() as tmp:
            train(cfg, Path(tmp) / "r", progress=False, data=data)
            rate = _rate(Path(tmp) / "r")
        return {"ms_per_step": 1e3 * b / rate}
    return _opacus_child(case, data, V, D, b, steps)


def _opacus_child(case: str, data: Any, V: int, D: int, b: int, steps: int) -> dict[str, Any]:
    from opacus import PrivacyEngine
    from opacus.data_loader import DPDataLoader
    from torch.utils.data import DataLoader

    from widedp.models.cbow_opacus import OpacusCBOW, PerSampleLoss
    from widedp.run.trainers.opacus_baseline import as_is as _as_is
    from widedp.tasks.cbow import SplitDataset, SplitTensors

    ds = SplitDataset(SplitTensors.of(data.train, torch.device("cpu")))
    model = OpacusCBOW(V, D, tied=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mode = "ghost" if case == "opacus-ghost" else "hooks"
    made = PrivacyEngine(accountant="rdp").make_private(
        module=model, optimizer=opt, data_loader=DataLoader(ds, batch_size=b, collate_fn=_as_is),
        criterion=PerSampleLoss(), noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=True,
        grad_sample_mode=mode, loss_reduction="mean")
    gsm, dp_opt, crit = (made[0], made[1], made[2]) if mode == "ghost" else (made[0], made[1], None)
    loader = DPDataLoader(ds, sample_rate=b / len(ds), collate_fn=_as_is, generator=torch.Generator().manual_seed(0))
    it = iter(loader)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        target, context, negatives = next(it)
        dp_opt.zero_grad(set_to_none=True)
        loss = gsm(target, context, negatives)
        if crit is not None:
            crit(loss, None).backward()
        else:
            (loss.sum() / max(len(target), 1)).backward()
        dp_opt.step()
        times.append(time.perf_counter() - t0)
    return {"ms_per_step": 1e3 * statistics.median(times[max(1, steps // 5):])}


def part_b(V: int, steps: int, mem_gb: float) -> dict[str, Any]:
    res = {}
    for case in ("widedp-exponential", "widedp-all", "opacus-ghost", "opacus-hooks"):  # Opacus: dense Adam
        cmd = [sys.executable, __file__, "--child", case, "--vocab", str(V), "--steps", str(steps),
               "--mem-gb", str(mem_gb)]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("{")), None)
        if p.returncode == 0 and line:
            r = json.loads(line)
        else:
            tail = (p.stderr.strip().splitlines() or ["?"])[-1]
            oom = any(s in p.stderr for s in ("MemoryError", "can't allocate memory", "DefaultCPUAllocator",
                                              "std::bad_alloc", "Cannot allocate memory")) or p.returncode == -9
            r = {"status": "OOM" if oom else "error", "returncode": p.returncode, "error": tail[:300]}
        r["wall_s"] = time.perf_counter() - t0
        res[case] = r
        shown = (f"{r['ms_per_step']:8.1f} ms/step, peak RSS {r['peak_rss_mb']:7.0f} MB" if "ms_per_step" in r
                 else f"{r['status']}: {r['error'][:120]}")
        print(f"  {case:20s} {shown}", flush=True)
    return {"V": V, "D": 128, "b": 256, "mem_cap_gb": mem_gb, "cases": res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["a", "b", "both"], default="both")
    ap.add_argument("--steps", type=int, default=3000, help="(a) widedp steps per case; (b) steps per case")
    ap.add_argument("--log-every", type=int, default=500)
    ap.add_argument("--full-run", action="store_true", help="(a) also time one whole 20-epoch paper run")
    ap.add_argument("--vocab", type=float, default=1e5)
    ap.add_argument("--mem-gb", type=float, default=8.0)
    ap.add_argument("--cache-dir", default=None, help="data cache (default: the config's .cache/widedp)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.child:
        cap = int(args.mem_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        r = _child(args.child, int(args.vocab), args.steps)
        r["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(r))
        return
    result: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
                              "threads": 1, "command": " ".join(sys.argv)}
    if args.part in ("a", "both"):
        print("(a) paper preset V=1K D=100 b=20, samples/s:", flush=True)
        result["a"] = part_a(args.steps, args.log_every, args.cache_dir, args.full_run)
    if args.part in ("b", "both"):
        print(f"(b) V={int(args.vocab)} D=128 b=256, RLIMIT_AS={args.mem_gb:g} GB:", flush=True)
        result["b"] = part_b(int(args.vocab), min(args.steps, 60), args.mem_gb)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "bench_opacus.json"
    if path.is_file():  # keep the other part's figures from an earlier run
        result = {**json.loads(path.read_text()), **result}
    path.write_text(json.dumps(result, indent=2))
    if "a" in result:
        print("ratio vs Opacus DP-SGD (samples/s): " + ", ".join(
            f"{k} {v['x_opacus']:.1f}x" for k, v in result["a"]["cases"].items() if k != "opacus-dpsgd"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
