"""The fused native step (widedp.native) vs the PyTorch reference path, measured in the same run.

    NLTK_DATA=../shared/nltk_data .venv/bin/python bench/bench_native.py                   # both parts
    NLTK_DATA=../shared/nltk_data .venv/bin/python bench/bench_native.py --part paper --steps 3000
    .venv/bin/python bench/bench_native.py --part large --vocab 1e4 1e5 1e6 --batch 1024 4096
    .venv/bin/python bench/bench_native.py --part svt --vocab 1e5 1e6 --batch 1024 4096

paper: Brown paper preset (V=1K, D=100, b=20, tied, exponential k=100, as bench/bench_opacus.py part a):
    samples/s through ``widedp.run.train.train`` (sampling, per-sample grads, DP step, optimizer, ledger; evaluation
    excluded) with the native kernels and with the reference path, for lazy Adam and dense Adam, and Opacus DP-SGD
    (its PrivacyEngine, dense Adam; 500 steps) in the same run: ratios vs Opacus; every case once per round, the
    best of ``--rounds`` kept. Plus the DP step + lazy Adam alone on precomputed grads (µs).
large: synthetic Zipf CBOW batches (D=128, 8 negatives, tied table, exponential k=1024, lazy Adam): ms per step
    (per-sample grads + dp_step + optimizer; fused: the native CBOW gradients too) fused vs reference, alternating
    on one model and one optimizer, and the clip + aggregate part and the optimizer part alone.
svt: the sparse-vector selector (c = k, threshold 0.01, S0 = 0.1, as bench_step.py) on the touched rows of the same
    Zipf batches: ms per ``select`` with the native host scan (``widedp.native.svt_scan``) vs the Python reference
    scan, same inputs and seeds (the picks are checked equal).
The paper and large parts count, for one clip + aggregate (large: also for one whole step), the ATen calls, the
bytes read + written by them (each op's whole input and output tensors: an upper bound, a gather counts its whole
table; the native op counted as reading ``values`` twice) and the fresh allocations of >= [nnz, D] elements (a
TorchDispatchMode); the minimum is reading values, rows, offsets once and writing touched and ghat.
Torch runs on 1 thread. JSON: bench/out/bench_native.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
sys.path.insert(0, str(ROOT / "bench"))


@contextmanager
def reference_path():
    """Run the PyTorch reference wherever widedp would pick the native kernels (fused=None)."""
    from widedp import native

    saved = dict(native._state)
    native._state.update(ok=False, why="reference (bench)")
    try:
        yield
    finally:
        native._state.clear()
        native._state.update(saved)


class Traffic(TorchDispatchMode):
    """Counts ATen calls, bytes of their tensor inputs + outputs, and fresh outputs of >= ``big`` elements."""

    def __init__(self, big: int) -> None:
        super().__init__()
        self.big, self.calls, self.bytes, self.big_allocs = big, 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.calls += 1
        reads = sum(t.nbytes for t in ins)
        if "widedp.clip_aggregate" in str(func):
            reads += ins[0].nbytes  # values: the norm pass, then the aggregation pass
        self.bytes += reads + sum(t.nbytes for t in outs)
        fresh = [r.alias_info is None for r in func._schema.returns]
        self.big_allocs += sum(t.numel() >= self.big for t, f in zip(outs, fresh) if f)
        return out


def traffic(g: Any, *, clip1: float, b: float, fused: bool) -> dict[str, float]:
    from widedp.dp.clipping import clip_aggregate

    nnz, D = g.values.shape
    with Traffic(max(nnz * D, 1)) as t:
        touched, ghat, _ = clip_aggregate(g, clip1=clip1, batch_size=b, fused=fused)
    minimum = g.values.nbytes + g.rows.nbytes + g.offsets.nbytes + touched.nbytes + ghat.nbytes
    return {"aten_calls": t.calls, "mb_moved": t.bytes / 1e6, "mb_minimum": minimum / 1e6,
            "allocs_ge_nnz_x_D": t.big_allocs, "nnz": nnz, "touched": touched.numel()}


def _time(fn, *, steps: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean seconds per call over ``steps`` calls (after warm-up)."""
    for _ in range(min(steps, 20)):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        out.append((time.perf_counter() - t0) / steps)
    return statistics.median(out)


# ----------------------------------------------------------------------------------------------- paper preset


def paper(steps: int, log_every: int, rounds: int) -> dict[str, Any]:
    from bench_opacus import SELECTIONS, _paper_cfg, _rate

    from widedp.data_prep.cbow import prepare_cbow
    from widedp.run.train import train

    data = prepare_cbow(_paper_cfg(None, steps=1, log_every=1, cache_dir=None).data)
    res: dict[str, Any] = {}
    cases = [(f"{opt}-{path}", opt, path) for opt in ("lazy_adam", "adam") for path in ("fused", "reference")]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):  # every case once per round, the best round kept: load on a shared machine drifts
            for name, opt, path in [*cases, ("opacus-dpsgd", "adam", "opacus")]:
                engine = "opacus" if path == "opacus" else "widedp"
                n, every = (steps, log_every) if engine == "widedp" else (500, 50)
                cfg = _paper_cfg(SELECTIONS["all" if engine == "opacus" else "exponential"], engine=engine, steps=n,
                                 log_every=every, cache_dir=None, optimizer=opt)
                with reference_path() if path == "reference" else _nothing():
                    train(cfg, Path(tmp) / f"{name}-{r}", progress=False, data=data)
                rate = _rate(Path(tmp) / f"{name}-{r}")
                print(f"  round {r}: {name:22s} {rate:9.0f} samples/s ({1e3 * 20 / rate:.3f} ms/step)", flush=True)
                rate = max(rate, res.get(name, {}).get("samples_per_s", 0.0))
                res[name] = {"samples_per_s": rate, "ms_per_step": 1e3 * 20 / rate}
    base = res["opacus-dpsgd"]["samples_per_s"]
    for r in res.values():
        r["x_opacus"] = r["samples_per_s"] / base
    for opt in ("lazy_adam", "adam"):
        res[f"{opt}-fused_speedup"] = res[f"{opt}-fused"]["samples_per_s"] / res[f"{opt}-reference"]["samples_per_s"]
    return {"train": res, "step_only": step_only(data, steps)}


@contextmanager
def _nothing():
    yield


def step_only(data: Any, steps: int) -> dict[str, Any]:
    """dp_step + lazy Adam on precomputed per-sample grads of paper-preset batches (µs), and the traffic count."""
    from widedp.config import ExponentialSelectionConfig
    from widedp.dp.optim import LazyAdam
    from widedp.dp.sampling import PoissonSampler
    from widedp.dp.selection import SelectionContext, make_selector
    from widedp.dp.step import dp_step
    from widedp.models.cbow import CBOW
    from widedp.tasks.cbow import SplitTensors

    split = SplitTensors.of(data.train, torch.device("cpu"))
    n, b, V = len(split), 20, len(data.vocab)
    model = CBOW(V, 100, generator=torch.Generator().manual_seed(0))
    sampler = PoissonSampler(n, sampling_rate=b / n, seed=0)
    with torch.inference_mode():
        grads = [model.per_sample_row_grads(split.batch(sampler.batch(t)))[1] for t in range(64)]
    selector = make_selector(ExponentialSelectionConfig(k=100, epsilon=0.27, score_clip=0.1), num_rows=V)
    out: dict[str, Any] = {}
    for fused in (True, False):
        opt = LazyAdam(model.row_tables(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, fused=fused)
        gen, ctx, it = torch.Generator().manual_seed(1), SelectionContext(epoch=1, num_epochs=20), iter(range(10**9))

        def one() -> None:
            g = grads[next(it) % 64]  # noqa: B023
            with torch.inference_mode():
                res = dp_step(g, batch_size=b, sampling_rate=b / n, clip1=15.0, clip2=1.0, noise_multiplier=0.5,
                              selector=selector, ctx=ctx, generator=gen, fused=fused)  # noqa: B023
                opt.step(res.grad)  # noqa: B023

        key = "fused" if fused else "reference"
        out[key] = {"us_per_step": 1e6 * _time(one, steps=max(steps // 5, 100)),
                    **traffic(grads[0], clip1=15.0, b=b, fused=fused)}
    out["speedup"] = out["reference"]["us_per_step"] / out["fused"]["us_per_step"]
    return out


# ------------------------------------------------------------------------------------------------ large batches


def zipf_batch(V: int, batch: int, g: torch.Generator) -> Any:
    """A CBOWBatch of ``batch`` (target, 1 context, 8 negatives) with Zipf ids over V words."""
    from widedp.models.cbow import CBOWBatch

    probs = 1 / torch.arange(1, V + 1, dtype=torch.float64)

    def draw(*shape: int) -> torch.Tensor:
        return torch.multinomial(probs, int(torch.tensor(shape).prod()), replacement=True, generator=g).view(shape)

    return CBOWBatch(draw(batch), draw(batch, 1), draw(batch, 8))


def large_case(V: int, batch: int, dim: int, k: int, steps: int, alternations: int) -> dict[str, Any]:
    from widedp.config import ExponentialSelectionConfig
    from widedp.dp.clipping import clip_aggregate
    from widedp.dp.optim import LazyAdam
    from widedp.dp.selection import SelectionContext, make_selector
    from widedp.dp.step import dp_step
    from widedp.models.cbow import CBOW

    g = torch.Generator().manual_seed(0)
    model = CBOW(V, dim, generator=g)
    batches = [zipf_batch(V, batch, g) for _ in range(4)]
    with torch.inference_mode():
        grads = [model.per_sample_row_grads(bt)[1] for bt in batches]
    selector = make_selector(ExponentialSelectionConfig(k=k, epsilon=1.0, score_clip=0.1), num_rows=model.num_rows)
    opt = LazyAdam(model.row_tables(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, fused=True)
    gen, ctx = torch.Generator().manual_seed(1), SelectionContext(epoch=0, num_epochs=1)
    state = {"t": 0, "fused": True}

    def full() -> None:
        bt = batches[state["t"] % 4]
        state["t"] += 1
        with torch.inference_mode():
            _, gr = model.per_sample_row_grads(bt, fused=state["fused"])
            res = dp_step(gr, batch_size=batch, sampling_rate=0.01, clip1=1.0, clip2=1.0, noise_multiplier=1.0,
                          selector=selector, ctx=ctx, generator=gen, fused=state["fused"])
            opt.step(res.grad)

    def clip_agg() -> None:
        state["t"] += 1
        clip_aggregate(grads[state["t"] % 4], clip1=1.0, batch_size=batch, fused=state["fused"])

    with torch.inference_mode():
        res = dp_step(grads[0], batch_size=batch, sampling_rate=0.01, clip1=1.0, clip2=1.0, noise_multiplier=1.0,
                      selector=selector, ctx=ctx, generator=gen)

    def adam() -> None:
        opt.step(res.grad)

    row: dict[str, Any] = {"vocab": V, "batch": batch, "dim": dim, "k": k, "nnz": grads[0].values.shape[0]}
    for name, fn in (("step", full), ("clip_aggregate", clip_agg), ("lazy_adam", adam)):
        for _ in range(alternations):  # alternate the two paths; keep each one's best (load drifts)
            for fused in (True, False):
                state["fused"] = opt.fused = fused
                key = f"{name}_ms_{'fused' if fused else 'reference'}"
                row[key] = min(row.get(key, float("inf")), 1e3 * _time(fn, steps=steps, repeats=3))
        row[f"{name}_speedup"] = row[f"{name}_ms_reference"] / row[f"{name}_ms_fused"]
    nnz_d = grads[0].values.numel()
    for fused in (True, False):
        path = "fused" if fused else "reference"
        row[f"traffic_{path}"] = traffic(grads[0], clip1=1.0, b=batch, fused=fused)
        state["fused"] = opt.fused = fused
        with Traffic(nnz_d) as t:  # the whole step: per-sample grads + dp_step + optimizer
            full()
        row[f"traffic_step_{path}"] = {"aten_calls": t.calls, "mb_moved": t.bytes / 1e6,
                                       "allocs_ge_nnz_x_D": t.big_allocs}
    print(json.dumps(row), flush=True)
    return row


def svt_case(V: int, batch: int, k: int, steps: int, alternations: int) -> dict[str, Any]:
    from widedp.dp.clipping import clip_aggregate
    from widedp.dp.selection import SelectionContext, SparseVectorSelector
    from widedp.models.cbow import CBOW

    g = torch.Generator().manual_seed(0)
    model = CBOW(V, 128, generator=g)
    with torch.inference_mode():
        _, grads = model.per_sample_row_grads(zipf_batch(V, batch, g))
        touched, ghat, _ = clip_aggregate(grads, clip1=1.0, batch_size=batch)
    scores = ghat.norm(dim=1).clamp_max(0.1)  # norm scores clipped at S0
    sel = SparseVectorSelector(epsilon=1.0, threshold=0.01, cutoff=k, threshold_fraction=0.5, score_clip=0.1)
    ctx = SelectionContext(epoch=0, num_epochs=1)
    seed = {"s": 0}

    def one() -> torch.Tensor:
        seed["s"] += 1
        return sel.select(touched, scores, selectable_rows=model.num_rows, score_sensitivity=min(0.1, 1.0 / batch),
                          ctx=ctx, generator=torch.Generator().manual_seed(seed["s"]))

    seed["s"] = 0
    native_picks = [one() for _ in range(3)]
    seed["s"] = 0
    with reference_path():
        assert all(torch.equal(a, one()) for a in native_picks), "native and reference scans differ"
    row: dict[str, Any] = {"vocab": V, "batch": batch, "k": k, "touched": touched.numel(),
                           "picks": native_picks[0].numel()}
    for _ in range(alternations):
        row["select_ms_native"] = min(row.get("select_ms_native", float("inf")), 1e3 * _time(one, steps=steps))
        with reference_path():
            row["select_ms_reference"] = min(row.get("select_ms_reference", float("inf")),
                                             1e3 * _time(one, steps=steps))
    row["select_speedup"] = row["select_ms_reference"] / row["select_ms_native"]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["paper", "large", "svt", "both"], default="both")
    ap.add_argument("--steps", type=int, default=3000, help="paper: widedp steps per case")
    ap.add_argument("--log-every", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=2, help="paper: rounds over all cases (best kept)")
    ap.add_argument("--vocab", type=float, nargs="+", default=[1e4, 1e5, 1e6])
    ap.add_argument("--batch", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--large-steps", type=int, default=10)
    ap.add_argument("--alternations", type=int, default=3, help="large: fused/reference alternations (best kept)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from widedp import native

    t0 = time.perf_counter()
    if not native.available():
        sys.exit(f"bench_native: the native kernels are unavailable ({native._state['why']})")
    out: dict[str, Any] = {"torch": torch.__version__, "threads": 1, "command": " ".join(sys.argv),
                           "load_or_build_s": time.perf_counter() - t0}
    if args.part in ("paper", "both"):
        print("paper preset V=1K D=100 b=20 (samples/s through widedp.run.train.train):", flush=True)
        out["paper"] = paper(args.steps, args.log_every, args.rounds)
        print(json.dumps(out["paper"], indent=1), flush=True)
    if args.part in ("large", "both"):
        print(f"large batches D={args.dim} k={args.k}:", flush=True)
        out["large"] = [large_case(int(v), b, args.dim, args.k, args.large_steps, args.alternations)
                        for v in args.vocab for b in args.batch]
    if args.part == "svt":
        print(f"sparse vector selection, c={args.k}:", flush=True)
        out["svt"] = [svt_case(int(v), b, args.k, args.large_steps, args.alternations)
                      for v in args.vocab for b in args.batch]
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "bench_native.json"
    if path.is_file():  # keep the other part's figures from an earlier run
        out = {**json.loads(path.read_text()), **out}
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
