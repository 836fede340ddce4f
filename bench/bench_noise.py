"""The cost of floating-point-safe noise (``dp.noise: secure``) beside the default Gaussian, in the same run.

    .venv/bin/python bench/bench_noise.py                       # CPU: noise draws + the DP step, JSON to bench/out/
    .venv/bin/python bench/bench_noise.py --device cuda         # the same on a GPU

- **draw**: ms to release k×D noisy values, ``x + gaussian_noise`` vs ``snapped_release`` (rounding onto the grid,
  discrete Gaussian sampler, back to float32), for k×D = 500×100 (the default job's selected rows), 1024×128 and
  8192×128.
- **step**: ms per ``dp_step`` (clip + aggregate, exponential selection, S2 clip, noise) + lazy Adam on synthetic
  Zipf CBOW batches shaped like the default job (V = 1,000 words, untied: 2,000 rows, D = 100, b = 1,000 pairs with
  8 negatives, k = 500 rows).

Each (case, noise) is timed as the median of ``--rounds`` rounds of ``--steps`` calls, the two noises alternating
round by round so that a loaded machine slows both alike, in wall and in process CPU time; ratios are secure /
gaussian. Torch runs on 1 thread; glibc malloc is tuned as the ``widedp`` CLI does (``widedp.allocator``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from widedp.allocator import tune_malloc

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
NOISES = ("gaussian", "secure")


def _alternated(fns: dict[str, Callable[[], None]], *, steps: int, rounds: int, sync: Callable[[], None]
                ) -> dict[str, dict[str, float]]:
    """{name: {"wall": s, "cpu": s}}: medians over rounds of the mean wall and process-CPU seconds per call, the
    functions alternating round by round (the CPU time is the steadier figure on a shared machine)."""
    times: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in fns}
    for fn in fns.values():  # warm-up
        for _ in range(3):
            fn()
    sync()
    for _ in range(rounds):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                fn()
            sync()
            times[name]["wall"].append((time.perf_counter() - t0) / steps)
            times[name]["cpu"].append((time.process_time() - c0) / steps)
    return {k: {w: statistics.median(v) for w, v in d.items()} for k, d in times.items()}


def _figures(t: dict[str, dict[str, float]]) -> dict[str, float]:
    """ms per call of each noise (wall and CPU) and the secure / gaussian ratios."""
    out = {f"{n}_{w}_ms": t[n][w] * 1e3 for n in NOISES for w in ("wall", "cpu")}
    for w in ("wall", "cpu"):
        out[f"ratio_secure_over_gaussian_{w}"] = t["secure"][w] / t["gaussian"][w]
    return out


def draw_case(rows: int, dim: int, *, device: str, steps: int, rounds: int, sync: Callable[[], None]) -> dict:
    """ms per release of [rows, dim] float32 values with each noise."""
    from widedp.dp.noise import noisy, sensitivity

    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(0)).to(device) * 1e-3
    d2 = sensitivity(clip1=15.0, clip2=1.0, batch_size=1000)
    gen = torch.Generator(device=device).manual_seed(1)
    fns = {n: (lambda n=n: noisy(x, std=0.5 * d2, sensitivity=d2, noise=n, generator=gen)) for n in NOISES}
    return {"rows": rows, "dim": dim, **_figures(_alternated(fns, steps=steps, rounds=rounds, sync=sync))}


def step_case(*, device: str, steps: int, rounds: int, sync: Callable[[], None]) -> dict:
    """ms per dp_step + lazy Adam with each noise on the default job's shapes (synthetic Zipf batches)."""
    from widedp.config import ExponentialSelectionConfig
    from widedp.dp.optim import make_row_optimizer
    from widedp.dp.selection import SelectionContext, make_selector
    from widedp.dp.step import dp_step
    from widedp.models.cbow import CBOW, CBOWBatch

    vocab, dim, b, k = 1000, 100, 1000, 500
    g = torch.Generator().manual_seed(0)
    probs = 1 / torch.arange(1, vocab + 1, dtype=torch.float64)

    def draw(*shape: int) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        return torch.multinomial(probs, n, replacement=True, generator=g).view(shape)

    batches = [CBOWBatch(draw(b), draw(b, 1), draw(b, 8)).to(device) for _ in range(8)]
    ctx = SelectionContext(epoch=0, num_epochs=1)
    fns: dict[str, Callable[[], None]] = {}
    for noise in NOISES:
        with torch.device(device):
            model = CBOW(vocab, dim, tied=False, sparse=True, generator=torch.Generator(device=device).manual_seed(0))
        opt = make_row_optimizer("lazy_adam", model.row_tables(), lr=1e-3)
        sel = make_selector(ExponentialSelectionConfig(k=k, epsilon=1.0, score_clip=0.1), num_rows=model.num_rows)
        gen, state = torch.Generator(device=device).manual_seed(1), {"t": 0}

        def one(model=model, opt=opt, sel=sel, gen=gen, state=state, noise=noise) -> None:
            batch = batches[state["t"] % len(batches)]
            state["t"] += 1
            with torch.inference_mode():
                _, grads = model.per_sample_row_grads(batch)
                res = dp_step(grads, batch_size=b, sampling_rate=0.01, clip1=15.0, clip2=1.0, noise_multiplier=1.0,
                              selector=sel, ctx=ctx, generator=gen, noise=noise)
                opt.step(res.grad)

        fns[noise] = one
    return {"vocab": vocab, "rows": 2 * vocab, "dim": dim, "batch": b, "k": k,
            **_figures(_alternated(fns, steps=steps, rounds=rounds, sync=sync))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tune_malloc()
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    kw = dict(device=args.device, steps=args.steps, rounds=args.rounds, sync=sync)
    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (1 thread)", "torch": torch.__version__,
                 "steps": args.steps, "rounds": args.rounds, "draw": []}
    for rows, dim in ((500, 100), (1024, 128), (8192, 128)):
        res["draw"].append(draw_case(rows, dim, **kw))
        print(json.dumps(res["draw"][-1]), flush=True)
    res["step"] = step_case(**kw)
    print(json.dumps(res["step"]), flush=True)
    out = args.out or OUT / f"bench_noise{'_cuda' if cuda else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
