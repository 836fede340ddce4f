"""Recommender (torchrec EBC + MLP): DP-sparse step vs non-private training, measured in the same run.

    .venv/bin/python bench/bench_recsys.py                      # CPU: samples/s, JSON to bench/out/bench_recsys.json
    .venv/bin/python bench/bench_recsys.py --gpu                # GPU: step ms for tables 1e5..1e7 rows, b up to 8192
    .venv/bin/python bench/bench_recsys.py --gpu --device cpu --rows 1e4 --batch 256   # the GPU mode's code on CPU

CPU part: synthetic power-law data (10K users, 50K items, 2-tag bags, 1 context feature; D=16, MLP 32-16) on 1
torch thread. Methods, each the whole inner loop of ``widedp.run.loop`` (batch gather + KJT, model, step, optimizer):
non-private dense Adam (autograd), non-private sparse SGD (sparse EBC gradients), DP-sparse (closed-form per-sample
rows, ``dp_step`` with k exponential picks + the always-updated MLP rows, lazy Adam), DP-SGD (``selection: all``,
lazy Adam). Rate = median over repeats of samples / s; ratios are to non-private dense Adam of the same run.

GPU part: one item table of R rows (1e5 .. 1e7), a 1e5-row user table, a 1K-row tag table, D=64, MLP 128-64; Zipf
batches drawn on the device; median ms per step of non-private sparse SGD vs DP-sparse (k = b rows, lazy Adam).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, *, steps: int, repeats: int, device: torch.device) -> float:
    """Median over ``repeats`` of the mean seconds per call over ``steps`` calls (after a warm-up)."""
    for _ in range(min(steps, 10)):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def _poisson_batches(split, sampler):
    """A function returning the next Poisson batch of ``split``."""
    counter = iter(range(10**12))
    return lambda: split.batch(sampler.batch(next(counter)))


def _zipf_batches(card: dict[str, int], b: int, device: torch.device):
    """A function returning a batch of b Zipf ids (P(i) ~ 1/(i+1), inverse CDF) per feature, drawn on ``device``;
    ``tags`` bags hold 2 ids."""
    from widedp.models.recsys import RecsysBatch, make_kjt

    gen = torch.Generator(device=device).manual_seed(1)

    def zipf(n_ids: int, width: int) -> torch.Tensor:
        u = torch.rand((b, width), generator=gen, device=device, dtype=torch.float64)
        return u.mul_(torch.log1p(torch.tensor(float(n_ids), device=device, dtype=torch.float64))).exp_() \
            .floor_().long().sub_(1).clamp_(0, n_ids - 1)

    def next_batch():
        ids = [zipf(n, 2 if name == "tags" else 1) for name, n in card.items()]
        labels = (torch.rand(b, generator=gen, device=device) < 0.4).float()
        return RecsysBatch(make_kjt(list(card), ids), labels)

    return next_batch


def _step_fns(model, next_batch, *, b: int, n: int, k: int, device: torch.device) -> dict:
    """name -> a function running one training step of that method."""
    from widedp.config import AllRowsConfig, ExponentialSelectionConfig
    from widedp.dp.optim import make_row_optimizer
    from widedp.dp.selection import SelectionContext, make_selector
    from widedp.dp.step import dp_step

    ctx = SelectionContext(epoch=0, num_epochs=1)
    gen = torch.Generator(device=device).manual_seed(0)
    fns = {}

    def dp_fn(selector, optimizer):
        def run():
            batch = next_batch()
            with torch.inference_mode():
                _, g = model.per_sample_row_grads(batch)
                res = dp_step(g, batch_size=b, sampling_rate=b / n, clip1=3.0, clip2=1.0, noise_multiplier=1.0,
                              selector=selector, ctx=ctx, generator=gen)
                optimizer.step(res.grad)
        return run

    lazy = make_row_optimizer("lazy_adam", model.row_tables(), lr=1e-3)
    exp_sel = make_selector(ExponentialSelectionConfig(k=k, epsilon=0.05, score_clip=0.05), num_rows=model.num_rows)
    fns["dp_sparse_exponential"] = dp_fn(exp_sel, lazy)
    fns["dp_sgd_all_rows"] = dp_fn(make_selector(AllRowsConfig(), num_rows=model.num_rows), lazy)

    def plain_fn(optimizer, sparse: bool):
        def run():
            for bag in model.ebc.embedding_bags.values():
                bag.sparse = sparse
            batch = next_batch()
            optimizer.zero_grad(set_to_none=True)
            model(batch).mean().backward()
            optimizer.step()
        return run

    fns["nonprivate_dense_adam"] = plain_fn(torch.optim.Adam(model.parameters(), lr=1e-3), False)
    fns["nonprivate_sparse_sgd"] = plain_fn(torch.optim.SGD(model.parameters(), lr=0.1), True)
    return fns


def cpu_part(batches: list[int], steps: int, repeats: int) -> dict:
    from widedp.config.recsys import RecsysDataConfig, RecsysModelConfig
    from widedp.data_prep.interactions import RecsysSplit, prepare_interactions
    from widedp.dp.sampling import PoissonSampler
    from widedp.tasks.recsys import build_model

    torch.set_num_threads(1)
    dev = torch.device("cpu")
    data = prepare_interactions(RecsysDataConfig(num_users=10_000, num_items=50_000, num_interactions=200_000,
                                                 cache_dir=""))
    split = RecsysSplit(data.train, dev)
    n = len(split)
    out = {"device": "cpu", "threads": 1, "n_train": n, "cardinality": data.cardinality, "dim": 16,
           "hidden": [32, 16], "results": []}
    for b in batches:
        model = build_model(data.cardinality, RecsysModelConfig(dim=16, hidden=(32, 16)), seed=0)
        next_batch = _poisson_batches(split, PoissonSampler(n, sampling_rate=b / n, seed=0, device=dev))
        rec = {"batch_size": b, "k": b, "embedding_rows": model.num_rows, "dense_rows": model.num_dense_rows}
        for name, fn in _step_fns(model, next_batch, b=b, n=n, k=b, device=dev).items():
            rec[f"{name}_samples_per_s"] = b / _median_time(fn, steps=steps, repeats=repeats, device=dev)
        base = rec["nonprivate_dense_adam_samples_per_s"]
        for name in ("dp_sparse_exponential", "dp_sgd_all_rows", "nonprivate_sparse_sgd"):
            rec[f"{name}_vs_nonprivate_adam"] = rec[f"{name}_samples_per_s"] / base
        rec["dp_sparse_vs_nonprivate_sparse_sgd"] = (rec["dp_sparse_exponential_samples_per_s"]
                                                     / rec["nonprivate_sparse_sgd_samples_per_s"])
        out["results"].append(rec)
        print(json.dumps(rec))
    return out


def gpu_part(rows: list[int], batches: list[int], steps: int, repeats: int, device: torch.device) -> dict:
    from widedp.models.recsys import RecsysModel

    out = {"device": str(device), "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "dim": 64, "hidden": [128, 64], "results": []}
    for R in rows:
        card = {"user": 100_000, "item": R, "tags": 1000}
        gen = torch.Generator(device=device).manual_seed(0)
        model = RecsysModel(card, dim=64, hidden=(128, 64), generator=gen, device=device)
        for b in batches:
            next_batch = _zipf_batches(card, b, device)
            fns = _step_fns(model, next_batch, b=b, n=100 * b, k=b, device=device)
            rec = {"item_rows": R, "batch_size": b, "k": b}
            for name in ("nonprivate_sparse_sgd", "dp_sparse_exponential"):
                try:
                    rec[f"{name}_ms"] = 1e3 * _median_time(fns[name], steps=steps, repeats=repeats, device=device)
                except torch.OutOfMemoryError:
                    rec[f"{name}_ms"] = "OOM"
                    torch.cuda.empty_cache()
            if all(isinstance(rec[f"{m}_ms"], float) for m in ("nonprivate_sparse_sgd", "dp_sparse_exponential")):
                rec["dp_sparse_vs_nonprivate_sparse"] = (rec["dp_sparse_exponential_ms"]
                                                         / rec["nonprivate_sparse_sgd_ms"])
            out["results"].append(rec)
            print(json.dumps(rec))
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="the GPU part (large tables) instead of the CPU part")
    ap.add_argument("--device", default="cuda", help="device of the GPU part")
    ap.add_argument("--rows", type=float, nargs="+", default=[1e5, 1e6, 1e7], help="GPU part: item table rows")
    ap.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.gpu:
        res = gpu_part([int(r) for r in args.rows], args.batch or [1024, 8192], args.steps, args.repeats,
                       torch.device(args.device))
        path = OUT / "bench_recsys_gpu.json"
    else:
        res = cpu_part(args.batch or [256, 1024], args.steps, args.repeats)
        path = OUT / "bench_recsys.json"
    path.write_text(json.dumps(res, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
