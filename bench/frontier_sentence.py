"""Write the sentence- and document-level frontier sweeps with the public vocabulary (``data.vocabulary: wordfreq``):

    configs/frontier_sentence_v10k_eps8.yaml   V = 10K, eps = 8: every mechanism (the cells that decide)
    configs/frontier_sentence_v10k.yaml        V = 10K, eps = 1 and 3: DP-SGD, the pooled threshold, the heads
    configs/frontier_sentence_v10k_seeds.yaml  V = 10K, eps = 1 and 3: second seeds of the best cells, more lrs
    configs/frontier_sentence_v1k.yaml         V = 1K (paper preset), eps = 8: the default job's candidates
    configs/frontier_document_v10k.yaml        V = 10K, one document (a Brown file) per unit, eps = 8

    .venv/bin/python bench/frontier_sentence.py      # regenerates the five files (seconds)
    bash bench/frontier_sentence_lanes.sh start      # runs them in the background, two lanes (resume-safe)
    .venv/bin/python bench/frontier_sentence_status.py   # what finished, what runs, how to resume

Every DP cell: (eps, delta = 1e-5) for adding/removing one sentence (<= 32 pairs) or one document (<= 4096 pairs),
PLD, sigma calibrated (dp.calibrate: noise_multiplier); the sampling rate q = b / N is FIXED (dp.sampling_rate), so
the data's size is covered too; delta = 1e-5 < 1/N (N = 51,269 sentences at V = 10K, 34,544 at V = 1K, 500
documents), so dp.allow_large_delta is false. b = 1000 sentences (50 documents) per Poisson batch, S1 = 1 per unit,
lazy Adam, 20 epochs, negatives from a public per-step pool of 1,000 ids (data.negatives_pool; V = 1K: the
negatives stored with each pair, as in the default job). Mechanisms (``dp.selection``):
- ``all``: DP-SGD (lr 3e-3; eps = 8 also 1e-2).
- ``gaussian_threshold`` pooled: f = 0.25 of the step's Gaussian budget (sigma_sel = sigma_DPSGD / sqrt(f)),
  tau = sigma_sel, lr 5e-3 (the pair-level winner, untuned for units).
- ``public_top`` H: the first H rows of each table every step (wordfreq's H most frequent words): data-independent,
  free; DP-SGD on the head, the tail frozen (lr 3e-3; V = 10K, eps = 8, H = 2000 also 1e-2).
- ``gaussian_threshold`` + ``public_head`` H: the head for free, the threshold over the tail with each unit's
  contribution normalised over its tail rows (f = 0.25, tau = sigma_sel).
Cells are chosen on VALIDATION loss; add ``seeds: [0, 1]`` to the best (``SEEDS`` below) and rerun.
"""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier_configs import DELTA, _NoAliases, dpsgd_sigma

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 20

#: name -> (data preset, unit, b, fixed q (b / N, N units with a train pair), m, pool, head sizes H, eval pairs)
SETTINGS = {
    "v10k": {"preset": "brown_10k", "unit": "sentence", "b": 1000, "q": 0.0195, "m": 32, "pool": 1000,
             "heads": (1000, 2000, 5000), "eval": 100_000,
             "title": "V = 10K (brown_10k, wordfreq's first 10,000 words: 20,000 rows untied; 51,269 sentences, "
                      "1.39M train pairs)"},
    "v1k": {"preset": "paper", "unit": "sentence", "b": 1000, "q": 0.029, "m": 32, "pool": 0,
            "heads": (250, 500), "eval": None,
            "title": "V = 1K (paper preset, wordfreq's first 1,000 words: 2,000 rows untied; 34,544 sentences, "
                     "173K train pairs)"},
    "doc": {"preset": "brown_10k", "unit": "document", "b": 50, "q": 0.1, "m": 4096, "pool": 1000,
            "heads": (2000,), "eval": 100_000,
            "title": "V = 10K, one Brown document (of 500) per unit"},
}

EPSILONS = (1, 3, 8)
LRS = (3e-3, 5e-3, 1e-2, 2e-2)

#: file stem -> (setting, the cells it runs, in run order). The threshold cells name no lr at its config's 5e-3.
SWEEPS = {
    "frontier_sentence_v10k_eps8": ("v10k", (
        "dpsgd-eps8-lr0.003", "gt_head-eps8-H2000-f0.25-t1-lr0.01", "public_top-eps8-H5000-lr0.01",
        "gaussian_threshold-eps8-f0.25-t1-lr0.01", "nonprivate", "dpsgd-eps8-lr0.02", "dpsgd-eps8-lr0.01",
        "gt_head-eps8-H5000-f0.25-t1-lr0.01", "gt_head-eps8-H1000-f0.25-t1-lr0.01", "public_top-eps8-H2000-lr0.01",
        "gaussian_threshold-eps8-f0.25-t1")),
    "frontier_sentence_v10k": ("v10k", (
        "dpsgd-eps3-lr0.01", "gt_head-eps3-H2000-f0.25-t1-lr0.01", "dpsgd-eps1-lr0.01",
        "gaussian_threshold-eps3-f0.25-t1-lr0.01", "gaussian_threshold-eps1-f0.25-t1-lr0.01",
        "public_top-eps1-H2000-lr0.01", "public_top-eps1-H5000-lr0.01", "gt_head-eps1-H2000-f0.25-t1",
        "public_top-eps1-H1000-lr0.01", "public_top-eps3-H2000-lr0.01")),
    # (the second lane's share of eps 1 and 3: the best cells' second seeds, more lrs and heads)
    "frontier_sentence_v10k_seeds": ("v10k", (
        "dpsgd-eps3-lr0.005", "dpsgd-eps1-lr0.005", "gt_head-eps1-H2000-f0.25-t1-lr0.01", "dpsgd-eps1-lr0.003",
        "public_top-eps3-H5000-lr0.01", "public_top-eps1-H2000-lr0.005")),
    "frontier_sentence_v1k": ("v1k", (
        "dpsgd-eps8-lr0.003", "dpsgd-eps8-lr0.01", "public_top-eps8-H250", "public_top-eps8-H500",
        "gaussian_threshold-eps8-f0.25-t1", "nonprivate", "dpsgd-eps8-lr0.005", "dpsgd-eps3-lr0.003",
        "gaussian_threshold-eps3-f0.25-t1", "dpsgd-eps1-lr0.003", "gaussian_threshold-eps1-f0.25-t1",
        "dpsgd-eps3-lr0.005", "dpsgd-eps1-lr0.005", "dpsgd-eps3-lr0.01", "dpsgd-eps1-lr0.01", "dpsgd-eps1-lr0.02",
        "public_top-eps1-H500-lr0.01", "public_top-eps1-H250-lr0.01")),
    "frontier_document_v10k": ("doc", ("dpsgd-eps8-lr0.003", "dpsgd-eps8-lr0.02")),
}

#: setting -> cell -> seeds: a second seed for each mechanism's best cell (by validation loss) once it has finished
SEEDS: dict[str, dict[str, list[int]]] = {
    "v1k": {"dpsgd-eps8-lr0.003": [0, 1], "dpsgd-eps8-lr0.005": [0, 1], "dpsgd-eps3-lr0.005": [0, 1],
            "dpsgd-eps1-lr0.01": [0, 1]},
    "v10k": {"dpsgd-eps8-lr0.01": [0, 1], "dpsgd-eps3-lr0.005": [0, 1], "dpsgd-eps1-lr0.005": [0, 1],
             "gt_head-eps1-H2000-f0.25-t1-lr0.01": [0, 1], "public_top-eps1-H2000-lr0.01": [0, 1],
             "dpsgd-eps3-lr0.01": [0, 1], "public_top-eps3-H5000-lr0.01": [0, 1]}}


def steps(q: float) -> int:
    return EPOCHS * max(1, round(1 / q))


def common(v: str) -> dict:
    st = SETTINGS[v]
    out = {"data.preset": st["preset"], "data.privacy_unit": st["unit"], "data.max_samples_per_unit": st["m"],
           "data.vocabulary": "wordfreq", "data.negatives_pool": st["pool"], "model.tied": False,
           "train.epochs": EPOCHS, "train.batch_size": st["b"], "train.optimizer": "lazy_adam", "train.log_every": 10,
           "train.checkpoint_every": 200, "train.threads": 1}
    if st["eval"]:
        out["train.eval_max_samples"] = st["eval"]
    return out


def dp_sets(v: str, eps: float, extra: dict) -> dict:
    return {"dp.sampling_rate": SETTINGS[v]["q"], "dp.delta": DELTA, "dp.allow_large_delta": False,
            "dp.accountant": "pld", "dp.calibrate": "noise_multiplier", "dp.target_epsilon": float(eps), **extra}


@functools.cache
def sigma_dpsgd(v: str, eps: float) -> float:
    q = SETTINGS[v]["q"]
    return dpsgd_sigma(q, steps(q), eps)


def gt(v: str, eps: float, f: float = 0.25, **more: int) -> dict:
    sigma = sigma_dpsgd(v, eps)
    return {"name": "gaussian_threshold", "sigma": float(f"{sigma / math.sqrt(f):.4g}"), "threshold_sigmas": 1.0,
            **more}


def grid(v: str, eps: float) -> list[dict]:
    """Every cell of setting ``v`` at ``eps``: DP-SGD per lr; public_top per head H and lr; the pooled threshold
    (f = 0.25, tau = sigma_sel) per lr; the threshold with a public head per H and lr. A name carries ``-lr`` unless
    the lr is its config's (DP-SGD always names it; public_top 3e-3, the threshold 5e-3)."""
    tag = f"eps{eps:g}"
    out: list[dict] = []

    def add(name: str, config: str, extra: dict) -> None:
        out.append({"name": name, "config": config, "set": dp_sets(v, eps, extra)})

    def lr_tag(lr: float, default: float) -> str:
        return "" if lr == default else f"-lr{lr:g}"

    for lr in LRS:
        add(f"dpsgd-{tag}-lr{lr:g}", "brown_cbow_dpsgd.yaml", {"train.lr": lr})
    for h in SETTINGS[v]["heads"]:
        for lr in LRS:
            add(f"public_top-{tag}-H{h}{lr_tag(lr, 3e-3)}", "brown_cbow_dpsgd.yaml",
                {"train.lr": lr, "dp.selection": {"name": "public_top", "rows_per_table": h}})
    for h in (None, *SETTINGS[v]["heads"]):
        for lr in LRS:
            sel = gt(v, eps) if h is None else gt(v, eps, public_head=h)
            name = f"gaussian_threshold-{tag}" if h is None else f"gt_head-{tag}-H{h}"
            add(f"{name}-f0.25-t1{lr_tag(lr, 5e-3)}", "brown_cbow_gaussian_threshold.yaml",
                {"dp.selection": sel, "train.lr": lr})
    return out


def pick(v: str, names: tuple[str, ...]) -> list[dict]:
    """The cells ``names`` (``nonprivate`` included) of setting ``v``, in that order."""
    by_name = {c["name"]: c for e in EPSILONS for c in grid(v, e)} | {"nonprivate": nonprivate(v)}
    return [by_name[n] for n in names]


def nonprivate(v: str) -> dict:
    """The reference: the same data (its sentence-keyed splits) without DP, b = 1000 pairs, 5 epochs."""
    return {"name": "nonprivate", "config": "brown10k_cbow_nonprivate.yaml",
            "set": {"train.batch_size": 1000, "train.epochs": 5, "train.optimizer": "sparse_adam",
                    "model.sparse": True, "data.negatives_pool": 0}}


def sweeps() -> dict[str, tuple[str, list[dict]]]:
    """file stem -> (its setting, its runs in run order)."""
    return {stem: (v, pick(v, names)) for stem, (v, names) in SWEEPS.items()}


def write(stem: str, v: str, runs: list[dict]) -> Path:
    for r in runs:
        if r["name"] in SEEDS.get(v, {}):
            r["seeds"] = SEEDS[v][r["name"]]
    st = SETTINGS[v]
    epsilons = sorted({r["set"]["dp.target_epsilon"] for r in runs if "dp.target_epsilon" in r["set"]})
    panels = {f"target ε = {e:g}": [r["name"] for r in runs if r["set"].get("dp.target_epsilon") == e]
              + [r["name"] for r in runs if r["name"] == "nonprivate"] for e in epsilons}
    header = (f"# {st['unit'].capitalize()}-level frontier, {st['title']} — written by bench/frontier_sentence.py "
              "(edit that, not this).\n"
              f"# (eps, delta = 1e-5) per {st['unit']} (<= {st['m']} pairs), PLD, sigma calibrated, "
              f"q = {st['q']} fixed (b = {st['b']} {st['unit']}s), {EPOCHS} epochs = {steps(st['q'])} steps; "
              "public vocabulary (wordfreq).\n"
              f"#   widedp compare configs/{stem}.yaml --out bench/out/frontier_sentence/{v}   (or the lanes script)\n")
    body = {"set": common(v), "panels": panels, "runs": runs}
    path = ROOT / "configs" / f"{stem}.yaml"
    path.write_text(header + yaml.dump(body, Dumper=_NoAliases, sort_keys=False, allow_unicode=True, width=120))
    return path


def main() -> None:
    for stem, (v, runs) in sweeps().items():
        print(f"wrote {write(stem, v, runs)} ({len(runs)} runs)")


if __name__ == "__main__":
    main()
