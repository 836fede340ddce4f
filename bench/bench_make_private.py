"""make_private on a user's torchrec EBC + MLP vs the built-in recommender's closed-form fast path, in the same run.

    .venv/bin/python bench/bench_make_private.py                 # b = 256 and 1024 -> bench/out/bench_make_private.json
    .venv/bin/python bench/bench_make_private.py --batch 256 --steps 10 --repeats 3      # quicker

Data and sizes as ``bench_recsys.py``'s CPU part (synthetic power-law interactions: 10K users, 50K items, 2-tag bags,
1 context feature; D=16, DLRM dot interaction, MLP 32-16), 1 torch thread. Every method runs the whole inner loop
on the same kind of Poisson batches (sampling, KJT batch, per-sample gradients, ``dp_step`` with k = b exponential
picks + the always-updated MLP rows, lazy Adam on the tables):

- ``fast_path``: ``RecsysModel.per_sample_row_grads`` (closed form) as ``widedp train`` runs it;
- ``make_private_linear``: ``widedp.PrivacyEngine.make_private`` on a user-written model (the same EBC tables,
  ``nn.Linear`` MLP: per-sample gradients from one backward, nn.Linear in closed form), user loop
  ``loss.sum().backward(); optimizer.step()``;
- ``make_private_torch_func``: the same, but the MLP is one leaf module over the built-in model's own parameters,
  so its per-sample gradients come from torch.func (vmap of grad).

Rate = median over repeats of samples / s, the methods timed in turn within each repeat; ratios are to
``fast_path`` of the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
DP = dict(clip1=3.0, clip2=1.0, noise_multiplier=1.0, delta=1e-5)


def _interleaved_rates(fns: dict, *, b: int, steps: int, repeats: int) -> dict[str, float]:
    """name -> median samples/s over ``repeats`` rounds of ``steps`` steps; each round times every method in turn,
    so that load from other processes falls on all of them alike."""
    for fn in fns.values():  # warm-up
        for _ in range(3):
            fn()
    rates: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            rates[name].append(b * steps / (time.perf_counter() - t0))
    return {name: statistics.median(r) for name, r in rates.items()}


class UserDLRM(nn.Module):
    """What a user writes: torchrec EBC (MEAN bags) -> [pooled, pairwise dots] -> nn.Linear MLP -> one logit."""

    def __init__(self, ebc: nn.Module, num_features: int, dim: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        self.ebc, self.shape = ebc, (num_features, dim)
        self.register_buffer("pairs", torch.triu_indices(num_features, num_features, 1))
        sizes = [num_features * dim + num_features * (num_features - 1) // 2, *hidden, 1]
        layers: list[nn.Module] = []
        for i in range(len(sizes) - 1):
            layers += [nn.Linear(sizes[i], sizes[i + 1]), nn.ReLU()]
        self.mlp = nn.Sequential(*layers[:-1])

    def forward(self, kjt) -> torch.Tensor:
        e = self.ebc(kjt).values().view(-1, *self.shape)
        dots = (e.index_select(1, self.pairs[0]) * e.index_select(1, self.pairs[1])).sum(-1)
        return self.mlp(torch.cat([e.flatten(1), dots], 1)).squeeze(1)


class _Rows:
    """The training split as a map-style dataset whose batch read is one gather (``__getitems__``)."""

    def __init__(self, split) -> None:
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitems__(self, idx: list[int]):
        return self.split.batch(torch.tensor(idx, dtype=torch.long))


def _engine_step_fn(model: nn.Module, split, *, b: int):
    """One user-loop step of make_private on ``model`` (endless Poisson batches)."""
    import widedp

    engine = widedp.PrivacyEngine(selection={"name": "exponential", "k": b, "epsilon": 0.05, "score_clip": 0.05},
                                  **DP)
    def loss_fn(batch):
        return F.binary_cross_entropy_with_logits(model(batch.kjt), batch.labels, reduction="none")

    model, opt, loader = engine.make_private(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                                             torch.utils.data.DataLoader(_Rows(split), batch_size=b,
                                                                         collate_fn=lambda batch: batch),
                                             epochs=10**6, loss_fn=loss_fn, loss_reduction="sum")
    batches = iter(loader)

    def run() -> None:
        loss_fn(next(batches)).sum().backward()
        opt.step()

    return run


def _fast_step_fn(model, split, *, b: int):
    from widedp.config import ExponentialSelectionConfig
    from widedp.dp.optim import make_row_optimizer
    from widedp.dp.sampling import PoissonSampler
    from widedp.dp.selection import SelectionContext, make_selector
    from widedp.dp.step import dp_step

    n = len(split)
    sampler = PoissonSampler(n, sampling_rate=b / n, seed=0)
    opt = make_row_optimizer("lazy_adam", model.row_tables(), lr=1e-3)
    sel = make_selector(ExponentialSelectionConfig(k=b, epsilon=0.05, score_clip=0.05), num_rows=model.num_rows)
    gen, ctx, step = torch.Generator().manual_seed(0), SelectionContext(epoch=0, num_epochs=1), iter(range(10**9))

    def run() -> None:
        batch = split.batch(sampler.batch(next(step)))
        with torch.inference_mode():
            _, g = model.per_sample_row_grads(batch)
            res = dp_step(g, batch_size=b, sampling_rate=b / n, clip1=DP["clip1"], clip2=DP["clip2"],
                          noise_multiplier=DP["noise_multiplier"], selector=sel, ctx=ctx, generator=gen)
            opt.step(res.grad)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from api_toys import GenericRecsys

    from widedp.config.recsys import RecsysDataConfig, RecsysModelConfig
    from widedp.data_prep.interactions import RecsysSplit, prepare_interactions
    from widedp.tasks.recsys import build_model

    torch.set_num_threads(1)
    data = prepare_interactions(RecsysDataConfig(num_users=10_000, num_items=50_000, num_interactions=200_000,
                                                 cache_dir=""))
    split = RecsysSplit(data.train, "cpu")
    out = {"device": "cpu", "threads": 1, "torch": torch.__version__, "n_train": len(split),
           "cardinality": data.cardinality, "dim": 16, "hidden": [32, 16], "results": []}
    for b in args.batch:
        def model():
            return build_model(data.cardinality, RecsysModelConfig(dim=16, hidden=(32, 16)), seed=0)

        fns = {"fast_path": _fast_step_fn(model(), split, b=b),
               "make_private_linear": _engine_step_fn(UserDLRM(model().ebc, len(data.cardinality), 16, (32, 16)),
                                                      split, b=b),
               "make_private_torch_func": _engine_step_fn(GenericRecsys(model()), split, b=b)}
        rec: dict[str, float | int] = {"batch_size": b, "k": b}
        for name, rate in _interleaved_rates(fns, b=b, steps=args.steps, repeats=args.repeats).items():
            rec[f"{name}_samples_per_s"] = rate
        for name in ("make_private_linear", "make_private_torch_func"):
            rec[f"{name}_vs_fast_path"] = rec[f"{name}_samples_per_s"] / rec["fast_path_samples_per_s"]
        out["results"].append(rec)
        print(json.dumps(rec))
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "bench_make_private.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
