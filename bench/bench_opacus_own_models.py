"""widedp against Opacus on two models a user writes (README's "Why not Opacus?"): a benchmark, not a test.

    nice .venv/bin/python bench/bench_opacus_own_models.py   # the three parts -> bench/out/bench_opacus_own_models.json

(1) ``grads``: per-sample gradients of an ``nn.EmbeddingBag`` text classifier (1-D ids + offsets, the layout
    ``nn.EmbeddingBag`` documents; ``mode="mean"`` and ``"sum"``; bags with repeated ids) against brute-force
    autograd, one sample at a time: Opacus' ``GradSampleModule`` (hooks) and widedp's
    ``PrivacyEngine.per_sample_grads``. The figure is the largest absolute difference of any entry of the
    embedding table's per-sample gradient ([B, V, D]), beside the largest entry itself.
(2) ``classifier``: the wall time of DP training of that classifier (4,000 synthetic topic-labelled bags, DP-SGD
    with the same clip, noise multiplier, expected batch, optimizer and epochs) with Opacus' ``PrivacyEngine`` and
    with widedp's (``selection: all``, the same algorithm; and ``exponential``, widedp's sparse selection), each the
    best of ``--repeats`` runs (the cases alternate), with its ε and final training loss, for each ``--vocab`` V
    (Opacus materialises every sample's [V, D] gradient; widedp the rows each sample touched).
(3) ``torchrec``: a torchrec ``EmbeddingBagCollection`` click model (KeyedJaggedTensor input): Opacus'
    ``make_private`` and one step (the exception, if any, and the function it came from) against widedp's
    ``make_private`` and one epoch (its loss before and after, its ε).
Torch runs on 1 thread. Opacus and torchrec are the ``opacus`` and ``recsys`` extras.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "bench_opacus_own_models.json"
V, D, C = 2000, 16, 4  # vocabulary (of the gradient check; the classifier's: --vocab), embedding width, classes


class BagClassifier(nn.Module):
    """``nn.EmbeddingBag(vocab, D, mode)`` over 1-D ids with offsets, then a linear layer: logits [B, C]."""

    def __init__(self, mode: str, vocab: int = V) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab, D, mode=mode)
        self.head = nn.Linear(D, C)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(ids, offsets))


def bags(n: int, *, seed: int, vocab: int = V) -> list[tuple[torch.Tensor, int]]:
    """n (ids [L], label) items: L in [5, 30], ids Zipf-like over ``vocab`` with repeats; the label is the topic
    (id mod C) most of the bag's ids come from (a planted rule the classifier can learn)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        topic = int(torch.randint(C, (1,), generator=g))
        length = int(torch.randint(5, 31, (1,), generator=g))
        ranks = (torch.rand(length, generator=g) ** 3 * (vocab // C)).long()  # small ranks (frequent words) likelier
        ids = ranks * C + torch.where(torch.rand(length, generator=g) < 0.6, topic,
                                      torch.randint(C, (length,), generator=g))
        out.append((ids.clamp_max(vocab - 1), topic))
    return out


def collate(items: list[tuple[torch.Tensor, int]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Items -> ({"ids": [sum L], "offsets": [B]}, labels [B])."""
    lengths = torch.tensor([len(x) for x, _ in items], dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]]) if items else lengths
    ids = torch.cat([x for x, _ in items]) if items else torch.zeros(0, dtype=torch.long)
    return {"ids": ids, "offsets": offsets}, torch.tensor([y for _, y in items], dtype=torch.long)


def _ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(**x), y, reduction="none")


# ------------------------------------------------------------------------------------------------ (1) gradients


def brute_force(model: nn.Module, items: list) -> torch.Tensor:
    """[B, V, D]: each item's gradient of the embedding table, plain autograd, one item at a time."""
    out = []
    for it in items:
        model.zero_grad(set_to_none=True)
        _ce(model, collate([it])).sum().backward()
        out.append(model.bag.weight.grad.detach().clone())
    return torch.stack(out)


def opacus_grads(model: nn.Module, items: list) -> torch.Tensor:
    from opacus import GradSampleModule

    gsm = GradSampleModule(copy.deepcopy(model), batch_first=True, loss_reduction="sum")
    _ce(gsm, collate(items)).sum().backward()
    return gsm._module.bag.weight.grad_sample.detach()


def widedp_grads(model: nn.Module, items: list) -> torch.Tensor:
    from widedp import PrivacyEngine

    m = copy.deepcopy(model)
    eng = PrivacyEngine(selection={"name": "all"}, clip1=1.0, noise_multiplier=1.0)
    eng.make_private(m, torch.optim.SGD(m.parameters(), lr=0.1), DataLoader(items, batch_size=8, collate_fn=collate),
                     epochs=1)
    _, g = eng.per_sample_grads(collate(items), lambda b: _ce(m, b))
    t = eng.layout.tables[0]
    return g.to_dense()[:, t.offset:t.offset + t.num_rows, :t.dim]


def part_grads(n: int = 16) -> dict[str, Any]:
    out = {}
    items = bags(n, seed=1)
    items[0] = (torch.tensor([7, 7, 7, 11]), 1)  # a repeated id
    for mode in ("mean", "sum"):
        torch.manual_seed(0)
        model = BagClassifier(mode)
        ref = brute_force(copy.deepcopy(model), items)
        row: dict[str, Any] = {"batch": n, "largest_entry": float(ref.abs().max())}
        for name, fn in (("opacus", opacus_grads), ("widedp", widedp_grads)):
            try:
                row[f"{name}_max_abs_error"] = float((fn(model, items) - ref).abs().max())
            except Exception as e:  # what the library does with this model is the measurement
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
        out[mode] = row
        print(f"  EmbeddingBag mode={mode}: {row}", flush=True)
    return out


# ----------------------------------------------------------------------------------------------- (2) classifier

#: the DP-SGD both libraries run: per-sample clip S1, noise multiplier σ, expected batch b, SGD, epochs
CLF = {"n": 4000, "batch": 64, "clip": 1.0, "sigma": 1.0, "lr": 0.5, "epochs": 2, "delta": 1e-5}


def _train_loss(model: nn.Module, data: list) -> float:
    with torch.no_grad():
        return float(_ce(model, collate(data)).mean())


def train_opacus(data: list, mode: str, vocab: int) -> dict[str, Any]:
    from opacus import PrivacyEngine

    torch.manual_seed(0)
    model = BagClassifier(mode, vocab)
    t0 = time.perf_counter()
    engine = PrivacyEngine(accountant="prv")
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=CLF["lr"]),
        data_loader=DataLoader(data, batch_size=CLF["batch"], collate_fn=collate),
        noise_multiplier=CLF["sigma"], max_grad_norm=CLF["clip"], poisson_sampling=True)
    for _ in range(CLF["epochs"]):
        for x, y in loader:
            opt.zero_grad()
            if len(y):
                F.cross_entropy(model(**x), y).backward()
            opt.step()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "epsilon": engine.get_epsilon(CLF["delta"]), "train_loss": _train_loss(model, data)}


def train_widedp(data: list, mode: str, vocab: int, selection: dict[str, Any]) -> dict[str, Any]:
    from widedp import PrivacyEngine

    torch.manual_seed(0)
    model = BagClassifier(mode, vocab)
    t0 = time.perf_counter()
    engine = PrivacyEngine(selection=selection, clip1=CLF["clip"], clip2=None, noise_multiplier=CLF["sigma"],
                           delta=CLF["delta"])
    model, _, loader = engine.make_private(model, torch.optim.SGD(model.parameters(), lr=CLF["lr"]),
                                           DataLoader(data, batch_size=CLF["batch"], collate_fn=collate),
                                           epochs=CLF["epochs"])
    for _ in range(CLF["epochs"]):
        for batch in loader:
            engine.step(batch, lambda b: _ce(model, b))
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "epsilon": engine.epsilon(), "train_loss": _train_loss(model, data)}


def part_classifier(repeats: int, vocab: int, mode: str = "mean") -> dict[str, Any]:
    data = bags(CLF["n"], seed=2, vocab=vocab)
    cases = {"opacus_dpsgd": lambda: train_opacus(data, mode, vocab),
             "widedp_dpsgd": lambda: train_widedp(data, mode, vocab, {"name": "all"}),
             "widedp_exponential": lambda: train_widedp(
                 data, mode, vocab, {"name": "exponential", "k": 100, "epsilon": 0.05, "score_clip": 0.05})}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    for _ in range(repeats):  # the cases alternate, so that load from other jobs falls on all of them alike
        for name, fn in cases.items():
            runs[name].append(fn())
            print(f"  classifier V={vocab} {name}: {runs[name][-1]}", flush=True)
    best = {name: min(r, key=lambda x: x["wall_s"]) for name, r in runs.items()}
    return {"settings": {**CLF, "mode": mode, "vocabulary": vocab, "dim": D, "classes": C, "repeats": repeats,
                         "initial_loss": _train_loss(BagClassifier(mode, vocab), data)},
            "best": best, "all": runs,
            "opacus_over_widedp_dpsgd": best["opacus_dpsgd"]["wall_s"] / best["widedp_dpsgd"]["wall_s"],
            "opacus_over_widedp_exponential": best["opacus_dpsgd"]["wall_s"] / best["widedp_exponential"]["wall_s"]}


# -------------------------------------------------------------------------------------------------- (3) torchrec


class ClickModel(nn.Module):
    """torchrec EmbeddingBagCollection (user, item, tags) -> concatenated bags -> MLP -> one logit."""

    def __init__(self) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=n, feature_names=[f],
                               pooling=PoolingType.MEAN) for f, n in (("user", 500), ("item", 1000), ("tags", 50))])
        self.mlp = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, kjt: Any) -> torch.Tensor:
        return self.mlp(self.ebc(kjt).values()).squeeze(1)


def clicks(n: int, *, seed: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        u, i = int(torch.randint(500, (1,), generator=g)), int(torch.randint(1000, (1,), generator=g))
        out.append({"user": [u], "item": [i], "tags": torch.randint(50, (3,), generator=g).tolist(),
                    "label": float((u + i) % 3 == 0)})
    return out


def collate_kjt(items: list[dict[str, Any]]) -> tuple[Any, torch.Tensor]:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = ["user", "item", "tags"]
    values = torch.tensor([v for f in keys for it in items for v in it[f]], dtype=torch.long)
    lengths = torch.tensor([len(it[f]) for f in keys for it in items], dtype=torch.long)
    return (KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths),
            torch.tensor([it["label"] for it in items]))


def _bce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model(batch[0]), batch[1], reduction="none")


def torchrec_opacus(data: list) -> dict[str, Any]:
    from opacus import PrivacyEngine

    torch.manual_seed(0)
    model = ClickModel()
    try:
        engine = PrivacyEngine(accountant="prv")
        model, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=64, collate_fn=collate_kjt), noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=True)
        x, y = next(iter(loader))
        F.binary_cross_entropy_with_logits(model(x), y).backward()
        opt.step()
    except Exception as e:  # the crash is the measurement
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return {"ran": False, "exception": f"{type(e).__name__}: {e}"[:300], "in_function": frame.name,
                "in_file": "/".join(Path(frame.filename).parts[-3:])}
    return {"ran": True}


def torchrec_widedp(data: list) -> dict[str, Any]:
    from widedp import PrivacyEngine

    torch.manual_seed(0)
    model = ClickModel()
    before = float(_bce(model, collate_kjt(data)).mean().detach())
    engine = PrivacyEngine(selection={"name": "exponential", "k": 64, "epsilon": 0.05, "score_clip": 0.05},
                           clip1=1.0, clip2=1.0, noise_multiplier=1.0)
    model, _, loader = engine.make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                           DataLoader(data, batch_size=64, collate_fn=collate_kjt), epochs=1)
    t0 = time.perf_counter()
    for batch in loader:
        engine.step(batch, lambda b: _bce(model, b))
    return {"ran": True, "steps": engine.steps, "wall_s": time.perf_counter() - t0, "loss_before": before,
            "loss_after": float(_bce(model, collate_kjt(data)).mean().detach()), "epsilon": engine.epsilon()}


def part_torchrec() -> dict[str, Any]:
    data = clicks(3000, seed=3)
    out = {"opacus": torchrec_opacus(data), "widedp": torchrec_widedp(data)}
    print(f"  torchrec: {out}", flush=True)
    return out


# ------------------------------------------------------------------------------------------------------ main


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("torch", "opacus", "torchrec")} | {"python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["grads", "classifier", "torchrec", "all"], default="all")
    ap.add_argument("--repeats", type=int, default=3, help="(classifier) runs of each case; the best is kept")
    ap.add_argument("--vocab", type=int, nargs="+", default=[2000, 20000], help="(classifier) vocabulary sizes")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # Opacus' and widedp's notices (secure RNG, hooks) are not the measurement
    res: dict[str, Any] = {"versions": _versions(), "threads": 1}
    if args.part in ("grads", "all"):
        res["grads"] = part_grads()
    if args.part in ("classifier", "all"):
        res["classifier"] = {str(v): part_classifier(args.repeats, v) for v in args.vocab}
    if args.part in ("torchrec", "all"):
        res["torchrec"] = part_torchrec()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
