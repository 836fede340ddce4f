"""MovieLens-100K at ``data.privacy_unit: user``: what a user-level run's release scores once each user adds an offset
of their own, and why a user's own row stays noisy.

    .venv/bin/python bench/movielens_user.py local RUN [RUN ...]   # release + per-user offset: valid/test AUC
    .venv/bin/python bench/movielens_user.py local --offset-only RUN # the offsets alone (z = 0: no model at all)
    .venv/bin/python bench/movielens_user.py snr --epsilon 8         # mu = q·sqrt(T)/sigma over (b, T), PLD
    .venv/bin/python bench/movielens_user.py share RUN               # where each user's summed gradient lies

``local``: the release of RUN (what ``widedp export --format torch`` writes: the user table left out, or none in the
model with ``data.user_feature: false``) scores every rating z = f(item, hour); each user then fits one offset
beta_u on their own train ratings, argmin sum_i BCE(z_i + beta_u, y_i) + lam/2·beta_u² (Newton), as they can on their
side from the public release and their own data (joint DP: the offset is a function of that user's own ratings, which
only they see; every other user's view is the DP release). lam is chosen on the valid split (printed: the choice
looks at the private valid split, not covered by ε). Output: JSON lines (also bench/out/movielens_user_local.jsonl).

``snr``: for user-level DP-SGD on N = 943 users, sigma calibrated (PLD, delta 1e-5) to epsilon for each expected batch
b and step count T; mu = q·sqrt(T)/sigma is the signal-to-noise ratio a single user's own row can reach (signal
q·T·S1/b when the whole clipped gradient is on it, noise sqrt(T)·sigma·S1/b), and the shared rows' SNR is mu·N·(the
average user's share of S1 on them).

``share``: at RUN's final weights (checkpoint.pt, user table included), each user's summed train gradient (at most m
ratings, as the DP step sums it before clipping at S1): its norm, and the share of it on the user's own row, the item
rows, the hour rows and the dense (head) rows. NON-PRIVATE diagnostics of the private data: not for release.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
LAMBDAS = (0.3, 1.0, 3.0, 10.0, 30.0)


def release_scores(run: Path) -> tuple[dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], dict]:
    """Per split: (logits of the release alone [n], labels [n], user [n]) and the run's summary."""
    from widedp.commands.export import export_release
    from widedp.config import load_config
    from widedp.data_prep.interactions import RecsysSplit, prepare_interactions
    from widedp.tasks.recsys import build_model

    cfg = load_config(run / "config.yaml")
    data = prepare_interactions(cfg.data)
    model = build_model(data.cardinality, cfg.model, seed=cfg.train.seed)
    with tempfile.TemporaryDirectory() as tmp:
        export_release(run, Path(tmp) / "rel", fmt="torch")
        state = torch.load(Path(tmp) / "rel" / "model.pt", weights_only=True)
    gone = [f for f in model.features if f"ebc.embedding_bags.t_{f}.weight" not in state]
    missing, _ = model.load_state_dict(state, strict=False)
    assert all(any(f"t_{f}." in k for f in gone) for k in missing), missing
    out = {}
    for name in ("train", "valid", "test"):
        part = getattr(data, name)
        split = RecsysSplit(part, "cpu")
        with torch.inference_mode():
            z = torch.cat([model.logits(split.batch(torch.arange(s, min(len(split), s + 16384))),
                                        zero_features=gone) for s in range(0, len(split), 16384)])
        user = part.user if part.user is not None else part.features["user"][:, 0]
        out[name] = (z.double().numpy(), part.label.astype(np.float64), np.asarray(user, dtype=np.int64))
    return out, json.loads((run / "summary.json").read_text())


def fit_offsets(z: np.ndarray, y: np.ndarray, user: np.ndarray, *, lam: float, users: int, iters: int = 25
                ) -> np.ndarray:
    """[users] beta_u = argmin sum_{i of u} softplus(z_i + b) - y_i (z_i + b) + lam/2 b² (Newton; concave-free)."""
    beta = np.zeros(users)
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(z + beta[user])))
        g = np.bincount(user, p - y, minlength=users) + lam * beta
        h = np.bincount(user, p * (1 - p), minlength=users) + lam
        beta -= g / h
    return beta


def local(runs: list[str], *, offset_only: bool = False) -> None:
    from widedp.models.recsys import exact_auc

    OUT.mkdir(parents=True, exist_ok=True)
    for run in map(Path, runs):
        s, summary = release_scores(run)
        if offset_only:  # what each user's own offset gives with no model (a constant release)
            s = {k: (np.zeros_like(z), y, u) for k, (z, y, u) in s.items()}
        users = 1 + max(int(u.max()) for _, _, u in s.values())
        row = {"run": str(run), "offset_only": offset_only, "test_auc": summary.get("test_auc"),
               "release_test_auc": summary.get("release_test_auc", summary.get("test_auc")),
               "epsilon": (summary.get("privacy") or {}).get("epsilon"),
               "delta": (summary.get("privacy") or {}).get("delta")}
        best = None
        for lam in LAMBDAS:
            beta = fit_offsets(*s["train"], lam=lam, users=users)
            auc = {k: exact_auc(torch.from_numpy(s[k][0] + beta[s[k][2]]), torch.from_numpy(s[k][1]))
                   for k in ("valid", "test")}
            if best is None or auc["valid"] > best[1]["valid"]:
                best = (lam, auc)
        row.update({"local_lambda": best[0], "local_valid_auc": best[1]["valid"], "local_test_auc": best[1]["test"],
                    "release_only_test_auc": exact_auc(torch.from_numpy(s["test"][0]), torch.from_numpy(s["test"][1]))})
        print(json.dumps(row))
        with open(OUT / "movielens_user_local.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def share(run: Path) -> None:
    from widedp.config import load_config
    from widedp.data_prep.interactions import RecsysSplit, prepare_interactions
    from widedp.run.checkpoint import load_checkpoint
    from widedp.tasks.recsys import RecsysTask, build_model

    cfg = load_config(run / "config.yaml")
    model = build_model((data := prepare_interactions(cfg.data)).cardinality, cfg.model, seed=cfg.train.seed)
    model.load_state_dict(load_checkpoint(run)["model"])
    split = RecsysSplit(data.train, "cpu")
    units = RecsysTask().units(cfg, split, device="cpu")
    bounds = {f: (o, o + n) for f, o, n in zip(model.features, model.table_offsets, model.sizes)}
    bounds["dense"] = (model.num_rows, model.total_rows)
    norms, parts = [], {k: [] for k in bounds}
    for j in range(units.num_units):
        idx = units.samples[units.offsets[j]:units.offsets[j + 1]]
        with torch.inference_mode():
            _, g = model.per_sample_row_grads(split.batch(idx))
            sq = torch.zeros(model.total_rows, model.dim).index_add_(0, g.rows, g.values).pow(2).sum(1)
        norms.append(float(sq.sum().sqrt()))
        for k, (a, b) in bounds.items():
            parts[k].append(float(sq[a:b].sum()) / max(float(sq.sum()), 1e-30))
    n, s1 = np.array(norms), cfg.dp.clip1 if cfg.dp else float("inf")
    row = {"run": str(run), "users": len(n), "clip1": s1, "median_norm": float(np.median(n)),
           "clipped": float((n > s1).mean())}
    for k, v in parts.items():  # share of the squared norm; and of S1 after clipping, sqrt(share)·min(norm, S1)/S1
        v = np.array(v)
        row[f"{k}_sq_share_median"] = float(np.median(v))
        row[f"{k}_of_S1_median"] = float(np.median(np.sqrt(v) * np.minimum(n, s1) / s1))
    print(json.dumps(row))


def snr(epsilon: float, *, delta: float = 1e-5, n: int = 943) -> None:
    from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

    def eps(q: float, sigma: float, steps: int) -> float:
        acc = PLDAccountant(value_discretization_interval=1e-3)
        acc.compose(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)
        return acc.get_epsilon(delta)

    for b in (100, 300, 943):
        for steps in (20, 60, 200, 600):
            q, lo, hi = b / n, 0.2, 100.0
            for _ in range(40):
                lo, hi = ((lo + hi) / 2, hi) if eps(q, (lo + hi) / 2, steps) > epsilon else (lo, (lo + hi) / 2)
            print(json.dumps({"epsilon": epsilon, "delta": delta, "b": b, "T": steps, "sigma": round(hi, 3),
                              "noise_per_step_over_S1": round(hi / b, 5), "mu": round(q * math.sqrt(steps) / hi, 3)}))


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("local")
    lp.add_argument("runs", nargs="+")
    lp.add_argument("--offset-only", action="store_true")
    sub.add_parser("snr").add_argument("--epsilon", type=float, default=8.0)
    sub.add_parser("share").add_argument("run")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.cmd == "local":
        local(a.runs, offset_only=a.offset_only)
    elif a.cmd == "share":
        share(Path(a.run))
    else:
        snr(a.epsilon)


if __name__ == "__main__":
    main(sys.argv[1:])
