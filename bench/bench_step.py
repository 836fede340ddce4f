"""DP-sparse step cost vs non-private training, measured in the same run (a benchmark, not a test).

    .venv/bin/python bench/bench_step.py                 # both parts, JSON to bench/out/bench_step.json
    .venv/bin/python bench/bench_step.py --part paper    # 1. paper preset (V=1K, D=100, b=20): samples/s
    .venv/bin/python bench/bench_step.py --part vocab --vocab 1e4 1e5 1e6 1e7   # 2. step time + peak RSS vs V
    .venv/bin/python bench/bench_step.py --part vocab --device cuda --vocab 1e5 1e6 1e7 --batch 8192  # 2. on a GPU

Part 1 runs the training inner loop (sampling, per-sample row grads, DP step, optimizer, ledger) on the Brown
paper-preset data; ratios are against non-private training of the same model with dense Adam and with SparseAdam
(the non-private sparse step), every selection measured in the same run (``sparse_vector`` is the O(U + c) method,
``sparse_vector_brute`` the O(R) reference).
Part 2 runs each (V, method) in its own subprocess (peak RSS = that process's ru_maxrss) on synthetic Zipf batches
(b=1024 pairs, 8 negatives, D=128, k=1024 rows), against EmbeddingBag(sparse) + SparseAdam; the exponential
selector, Gaussian thresholding (sigma_sel=2, tau set for 100 expected false positives at every V) and the fast
sparse vector (c=1024). A (V, method) that fails (out of memory, killed) is printed and written under ``failed``
with its reason, and "largest over smallest V" is taken over the V values that ran (named: ``over``, ``vocabs_ran``).
Every subprocess tunes glibc malloc as the ``widedp`` CLI does (``widedp.allocator``; ``WIDEDP_MALLOC=system`` for
glibc's defaults) and reports its CPU time (user + system) and minor page faults per timed step.
``--device cuda`` (part 2): tables, batches and the step on the GPU (the Triton kernels where they apply), times
taken after ``torch.cuda.synchronize``, peak GPU memory (``max_memory_allocated``) beside the RSS, and one more
method, dense DP-SGD (``selection: all``: every row selected and noised, lazy Adam), the issue-15 baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from widedp.allocator import tune_malloc

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


def _median_time(fn, *, steps: int, repeats: int = 5, usage: dict | None = None, sync=lambda: None) -> float:
    """Median over ``repeats`` of the mean seconds per call over ``steps`` calls (after a warm-up); ``usage`` gets
    the minor page faults and the CPU ms (user + system) per timed call."""
    for _ in range(min(steps, 50)):
        fn()
    sync()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()  # a GPU step is timed when its kernels have finished, not when they were queued
        times.append((time.perf_counter() - t0) / steps)
    if usage is not None:
        r1, calls = resource.getrusage(resource.RUSAGE_SELF), repeats * steps
        usage["minflt"] = (r1.ru_minflt - r0.ru_minflt) / calls
        usage["cpu_ms"] = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / calls * 1e3
    return statistics.median(times)


# ------------------------------------------------------------------------------------------- part 1: paper preset


def paper_preset(steps: int) -> dict:
    from widedp import accounting
    from widedp.config import DPConfig, config_from_dict
    from widedp.data_prep.cbow import prepare_cbow
    from widedp.dp.optim import make_row_optimizer
    from widedp.dp.sampling import PoissonSampler, ShuffledBatches
    from widedp.dp.selection import SelectionContext, make_selector
    from widedp.dp.step import dp_step
    from widedp.models.cbow import CBOW
    from widedp.tasks.cbow import SplitTensors

    cfg = config_from_dict({"data": {"preset": "paper"}})
    data = prepare_cbow(cfg.data)
    split = SplitTensors.of(data.train, torch.device("cpu"))
    n, b, V, D = len(split), 20, len(data.vocab), 100
    results: dict = {"n_train": n, "batch_size": b, "vocab": V, "dim": D, "steps_per_measure": steps}

    def nonprivate(sparse: bool) -> float:
        model = CBOW(V, D, sparse=sparse, generator=torch.Generator().manual_seed(0))
        opt = (torch.optim.SparseAdam(list(model.parameters()), lr=1e-3) if sparse
               else torch.optim.Adam(model.parameters(), lr=1e-3))
        sampler = ShuffledBatches(n, batch_size=b, seed=0)
        state = {"t": 0}

        def one() -> None:
            batch = split.batch(sampler.batch(state["t"]))
            state["t"] += 1
            opt.zero_grad(set_to_none=True)
            model(batch).mean().backward()
            opt.step()

        return _median_time(one, steps=steps)

    results["nonprivate_dense_adam_s"] = nonprivate(False)
    results["nonprivate_sparse_adam_s"] = nonprivate(True)

    selections = {
        "exponential": {"name": "exponential", "k": 10, "epsilon": 1.0, "score_clip": 0.1},
        "sparse_vector": {"name": "sparse_vector", "epsilon": 1.0, "cutoff": 10, "threshold": 0.01},
        "sparse_vector_brute": {"name": "sparse_vector", "epsilon": 1.0, "cutoff": 10, "threshold": 0.01,
                                "method": "brute"},
        "gaussian_threshold": {"name": "gaussian_threshold", "sigma": 2.0, "threshold_sigmas": 2.0},
        "uniform": {"name": "uniform", "k": 10},
        "random_sparsification": {"name": "random_sparsification", "final_rate": 0.9},
        "all": {"name": "all"},
    }
    for name, sel in selections.items():
        for opt_name in ("lazy_adam", "adam", "sgd") if name == "exponential" else ("lazy_adam",):
            dp: DPConfig = config_from_dict({"dp": {"selection": sel}}).dp  # type: ignore[assignment]
            model = CBOW(V, D, sparse=True, generator=torch.Generator().manual_seed(0))
            selector = make_selector(dp.selection, num_rows=model.num_rows)
            opt = make_row_optimizer(opt_name, model.row_tables(), lr=1e-3)
            gen = torch.Generator().manual_seed(1)
            sampler = PoissonSampler(n, sampling_rate=b / n, seed=0)
            ledger = accounting.Ledger()
            ctx = SelectionContext(epoch=1, num_epochs=20)
            state = {"t": 0, "rows": 0}

            def one() -> None:
                batch = split.batch(sampler.batch(state["t"]))  # noqa: B023
                state["t"] += 1  # noqa: B023
                with torch.inference_mode():
                    _, g = model.per_sample_row_grads(batch)  # noqa: B023
                    res = dp_step(g, batch_size=b, sampling_rate=b / n, clip1=15.0, clip2=1.0,
                                  noise_multiplier=0.5, selector=selector, ctx=ctx, generator=gen)  # noqa: B023
                    opt.step(res.grad)  # noqa: B023
                ledger.add(res.spend)  # noqa: B023
                state["rows"] += res.stats.rows_selected  # noqa: B023

            key = f"dp_{name}_{opt_name}_s"
            results[key] = _median_time(one, steps=steps)
            results.setdefault("rows_selected_per_step", {})[name] = state["rows"] / state["t"]
    times = {k[:-2]: v for k, v in results.items() if k.endswith("_s")}
    base = times["nonprivate_dense_adam"]
    results["samples_per_s"] = {k: b / v for k, v in times.items()}
    results["ratio_vs_nonprivate_dense_adam"] = {k: base / v for k, v in times.items()}
    sparse = times["nonprivate_sparse_adam"]
    results["step_time_over_nonprivate_sparse_adam"] = {k: v / sparse for k, v in times.items()}
    return results


# -------------------------------------------------------------------------------------- part 2: step cost vs V


def one_vocab_case(vocab: int, method: str, dim: int, batch: int, k: int, steps: int, device: str = "cpu") -> dict:
    """Runs inside a subprocess: step time and peak RSS (and peak GPU memory on CUDA) of one (V, method)."""
    from scipy.stats import norm

    from widedp.config import (
        AllRowsConfig,
        ExponentialSelectionConfig,
        GaussianThresholdSelectionConfig,
        SparseVectorSelectionConfig,
    )
    from widedp.dp.optim import make_row_optimizer
    from widedp.dp.selection import SelectionContext, make_selector
    from widedp.dp.step import dp_step
    from widedp.models.cbow import CBOW, CBOWBatch
    from widedp.native import gpu as gpu_kernels

    g = torch.Generator().manual_seed(0)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # The tables are created and initialised on the device (a CPU init of a 1e7 x 128 table takes seconds per case).
    with torch.device(device):
        model = CBOW(vocab, dim, sparse=True, generator=torch.Generator(device=device).manual_seed(0))
    table_bytes = vocab * dim * 4
    # Zipf-like ids: heavy head, long tail, like words / items.
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = (1 / ranks) / (1 / ranks).sum()

    def draw(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.multinomial(probs, int(torch.tensor(shape).prod()), replacement=True, generator=g).view(shape)

    batches = [CBOWBatch(draw((batch,)), draw((batch, 1)), draw((batch, 8))).to(device) for _ in range(8)]
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    state = {"t": 0}
    if method == "nonprivate_sparse_adam":
        opt = torch.optim.SparseAdam(list(model.parameters()), lr=1e-3)
        state_bytes = 2 * table_bytes

        def one() -> None:
            bt = batches[state["t"] % 8]
            state["t"] += 1
            opt.zero_grad(set_to_none=True)
            model(bt).mean().backward()
            opt.step()
    else:
        opt_name = "sgd" if method == "dp_sparse_sgd" else "lazy_adam"
        ropt = make_row_optimizer(opt_name, model.row_tables(), lr=1e-3)
        state_bytes = (2 * table_bytes + vocab * 8) if opt_name == "lazy_adam" else 0
        sel_cfg: object = ExponentialSelectionConfig(k=k, epsilon=1.0, score_clip=0.1)
        if method == "dp_gaussian_threshold_lazy_adam":  # tau for 100 expected false positives, whatever V
            sel_cfg = GaussianThresholdSelectionConfig(sigma=2.0, threshold=2.0 * float(norm.isf(100 / model.num_rows)))
        elif method == "dp_sparse_vector_lazy_adam":
            sel_cfg = SparseVectorSelectionConfig(epsilon=1.0, threshold=0.01, cutoff=k, score_clip=0.1)
        elif method == "dpsgd_dense_lazy_adam":
            sel_cfg = AllRowsConfig()
        selector = make_selector(sel_cfg, num_rows=model.num_rows)
        gen = torch.Generator(device=device).manual_seed(1)
        ctx = SelectionContext(epoch=0, num_epochs=1)

        def one() -> None:
            bt = batches[state["t"] % 8]
            state["t"] += 1
            with torch.inference_mode():
                _, gr = model.per_sample_row_grads(bt)
                res = dp_step(gr, batch_size=batch, sampling_rate=0.01, clip1=1.0, clip2=1.0,
                              noise_multiplier=1.0, selector=selector, ctx=ctx, generator=gen)
                ropt.step(res.grad)

    usage: dict = {}
    sec = _median_time(one, steps=steps, repeats=3, usage=usage, sync=torch.cuda.synchronize if cuda else lambda: None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gpu = {"device": torch.cuda.get_device_name(), "peak_gpu_gb": torch.cuda.max_memory_allocated() / 2**30,
           "triton": gpu_kernels.use(None, model.input.weight.detach())} if cuda else {}
    return gpu | {"vocab": vocab, "method": method, "dim": dim, "batch": batch, "k": k, "step_ms": sec * 1e3,
            "cpu_ms_per_step": usage["cpu_ms"], "minflt_per_step": usage["minflt"],
            "peak_rss_gb": peak / 2**30, "baseline_rss_gb": rss0 * 1024 / 2**30,
            "tables_plus_state_gb": (table_bytes + state_bytes) / 2**30,
            "overhead_gb": (peak - table_bytes - state_bytes) / 2**30}


VOCAB_METHODS = ("nonprivate_sparse_adam", "dp_sparse_lazy_adam", "dp_sparse_sgd", "dp_gaussian_threshold_lazy_adam",
                 "dp_sparse_vector_lazy_adam")


def vocab_sweep(vocabs: list[int], dim: int, batch: int, k: int, steps: int, device: str = "cpu",
                methods: list[str] | None = None) -> list[dict]:
    rows = []
    every = VOCAB_METHODS + (("dpsgd_dense_lazy_adam",) if device != "cpu" else ())
    for vocab in vocabs:
        for method in [m for m in every if methods is None or m in methods]:
            cmd = [sys.executable, __file__, "--one", str(vocab), method, str(dim), str(batch), str(k), str(steps),
                   device]
            r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if r.returncode != 0:
                why = (r.stderr.strip().splitlines() or [""])[-1]
                if r.returncode < 0:  # killed by a signal (SIGKILL: most often the kernel's OOM killer)
                    why = f"killed by signal {-r.returncode}" + (f" ({why})" if why else "")
                rows.append({"vocab": vocab, "method": method, "error": why or f"exit code {r.returncode}"})
                print(f"FAILED V={vocab} {method}: {rows[-1]['error']}", flush=True)
            else:
                rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["paper", "vocab", "both"], default="both")
    ap.add_argument("--steps", type=int, default=400, help="steps per timing (part 1)")
    ap.add_argument("--vocab", type=float, nargs="+", default=[1e4, 1e5, 1e6, 1e7])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--vocab-steps", type=int, default=20)
    ap.add_argument("--device", default="cpu", help="part 2 on this device (cuda: one GPU)")
    ap.add_argument("--methods", nargs="+", choices=[*VOCAB_METHODS, "dpsgd_dense_lazy_adam"],
                    help="part 2: only these methods (default: all; dense DP-SGD on a GPU only)")
    ap.add_argument("--out", help="part 2's JSON (default bench/out/bench_step[_cuda_bB].json)")
    ap.add_argument("--one", nargs=7, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    malloc = tune_malloc()["status"]  # as the widedp CLI does (WIDEDP_MALLOC=system: glibc's defaults)
    if args.one:
        v, m, d, b, k, s, dev = args.one
        print(json.dumps(one_vocab_case(int(v), m, int(d), int(b), int(k), int(s), dev) | {"malloc": malloc}))
        return
    OUT.mkdir(parents=True, exist_ok=True)
    out: dict = {"torch": torch.__version__, "threads": 1, "device": args.device, "dim": args.dim, "batch": args.batch}
    if args.part in ("paper", "both"):
        out["paper"] = paper_preset(args.steps)
        print(json.dumps(out["paper"], indent=2), flush=True)
    if args.part in ("vocab", "both"):
        rows = vocab_sweep([int(v) for v in args.vocab], args.dim, args.batch, args.k, args.vocab_steps, args.device,
                           args.methods)
        out["vocab"] = rows
        by = {(r["vocab"], r["method"]): r for r in rows if "step_ms" in r}
        ratios: dict = {}
        flat: dict = {}
        for method in sorted({r["method"] for r in rows} - {"nonprivate_sparse_adam"}):
            for v in sorted({r["vocab"] for r in rows}):
                base = by.get((v, "nonprivate_sparse_adam"))
                dp = by.get((v, method))
                if base and dp:
                    ratios.setdefault(method, {})[str(v)] = dp["step_ms"] / base["step_ms"]
            vs = sorted(v for v in {r["vocab"] for r in rows} if (v, method) in by)  # the V values that ran
            if len(vs) >= 2:
                flat[method] = {"ratio": by[(vs[-1], method)]["step_ms"] / by[(vs[0], method)]["step_ms"],
                                "over": f"V={vs[-1]:g} / V={vs[0]:g}", "vocabs_ran": vs}
        out["dp_over_nonprivate_step_time"] = ratios
        out["dp_step_time_largest_over_smallest_V"] = flat  # over the V values that ran, named in "over"
        out["failed"] = [{"vocab": r["vocab"], "method": r["method"], "error": r["error"]} for r in rows
                         if "error" in r]
        print(json.dumps({k: out[k] for k in out if k.startswith("dp_")}, indent=2))
        for f in out["failed"]:
            print(f"FAILED V={f['vocab']:g} {f['method']}: {f['error']} (left out of the ratios above)")
    name = "bench_step.json" if args.device == "cpu" else f"bench_step_{args.device.split(':')[0]}_b{args.batch}.json"
    path = Path(args.out) if args.out else OUT / name
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
