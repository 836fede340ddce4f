"""Write the privacy-utility frontier sweeps (issue 13): configs/frontier_v1k.yaml and configs/frontier_v10k.yaml.

    .venv/bin/python bench/frontier_configs.py            # regenerates both files (seconds)
    widedp compare configs/frontier_v1k.yaml --out runs/frontier_v1k     # hours; resume-safe
    widedp compare configs/frontier_v10k.yaml --out runs/frontier_v10k   # many hours

Every cell is at the same honestly accounted privacy: dp.target_epsilon = eps in {1, 3, 8}, delta = 1e-5, add/remove
one (target, context) pair, PLD, with sigma solved for it (dp.calibrate: noise_multiplier) and the selection's own
parameters fixed per cell. "Budget split" f is how the selection's share of the budget is set:
- exponential / sparse vector: eps'' (per pick / per segment) such that the selection ALONE, Poisson-subsampled
  over the whole run, spends f * eps by the RDP accountant (an upper bound: by PLD it spends less);
- gaussian_threshold: sigma_sel = sigma_DPSGD(eps) / sqrt(f), so that the selection takes the share f of the step's
  Gaussian budget 1/sigma_eff^2 = 1/sigma^2 + 1/sigma_sel^2 (sigma_eff = DP-SGD's sigma at eps).
Pick each mechanism's best cell by VALIDATION loss (never test), then add ``seeds: [0, 1]`` to that cell and rerun
the sweep (finished seeds are reused).
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from widedp import accounting
from widedp.config import SELECTIONS
from widedp.dp.selection import make_selector
from widedp.dp.spend import GaussianSpend, StepSpend

ROOT = Path(__file__).resolve().parents[1]
DELTA = 1e-5
EPSILONS = (1, 3, 8)

#: V -> (data preset, n_train, epochs, base sets, k grid, cutoff, random-sparsification rates, gaussian max_rows,
#: rows R of the untied model)
SETTINGS = {
    "v1k": {"preset": "paper", "n": 200_000, "epochs": 20, "k": (500,), "k_count": 500, "cutoff": 500,
            "rates": (0.5, 0.75), "max_rows": None, "nonprivate": "brown_cbow_nonprivate.yaml",
            "rows": 2_000,
            "title": "V = 1K (paper preset: 2,000 rows untied, 200K train pairs, b = 1000, 20 epochs = 4,000 steps)"},
    "v10k": {"preset": "brown_10k", "n": 1_508_593, "epochs": 5, "k": (2000, 5000), "k_count": 5000, "cutoff": 2000,
             "rates": (0.75, 0.9), "max_rows": 5000, "nonprivate": "brown10k_cbow_nonprivate.yaml",
             "rows": 20_000,
             "title": "V = 10K (brown_10k: 20,000 rows untied, 1.51M train pairs, b = 1000, 5 epochs = 7,545 steps)"},
}
B = 1000


def _steps(n: int, epochs: int) -> int:
    return epochs * max(1, round(n / B))


def dpsgd_sigma(q: float, steps: int, eps: float) -> float:
    return accounting.calibrate_noise_multiplier(lambda s: StepSpend(q, (GaussianSpend(s),)), steps=steps,
                                                 delta=DELTA, target_epsilon=eps)


def with_selection_eps(sel: dict, rows: int, q: float, steps: int, target: float) -> dict:
    """``sel`` (a ``dp.selection`` mapping, ``epsilon`` left None) with the ``epsilon`` at which the selection ALONE
    spends ``target`` (RDP); its spend is the selector's own (``make_selector(...).spend()``, as in training)."""
    def spend(x: float) -> StepSpend:
        return StepSpend(q, (make_selector(SELECTIONS[sel["name"]](**{**sel, "epsilon": x}), num_rows=rows).spend(),))

    e = accounting.calibrate_selection_epsilon(spend, steps=steps, delta=DELTA, target_epsilon=target,
                                               accountant="rdp")
    return {**sel, "epsilon": float(f"{e:.4g}")}


def cells(v: str) -> list[dict]:
    st = SETTINGS[v]
    q, steps = B / st["n"], _steps(st["n"], st["epochs"])
    split = (st["rows"], q, steps)  # with_selection_eps's row space, sampling rate and steps
    runs: list[dict] = []

    def add(name: str, config: str, sets: dict) -> None:
        dp = {"train.batch_size": B, "train.optimizer": "lazy_adam", "dp.delta": DELTA, "dp.accountant": "pld",
              "dp.calibrate": "noise_multiplier"}
        runs.append({"name": name, "config": config, "set": {**dp, **sets}})

    for eps in EPSILONS:
        sigma = dpsgd_sigma(q, steps, eps)
        tag = f"eps{eps}"
        for lr in (1e-3, 3e-3, 1e-2):
            add(f"dpsgd-{tag}-lr{lr:g}", "brown_cbow_dpsgd.yaml", {"dp.target_epsilon": eps, "train.lr": lr})
        for k in st["k"]:
            for f in (0.25, 0.5) if len(st["k"]) == 1 else (0.5,):
                sel = with_selection_eps({"name": "exponential", "k": k, "epsilon": None, "score_clip": 0.05}, *split,
                                         f * eps)
                add(f"exponential-{tag}-k{k}-f{f:g}", "brown_cbow_sparse_exp.yaml",
                    {"dp.target_epsilon": eps, "dp.selection": sel})
        kc = st["k_count"]
        sel = with_selection_eps({"name": "exponential", "k": kc, "epsilon": None, "score": "count",
                                  "score_clip": float(B)}, *split, 0.5 * eps)
        add(f"exponential_count-{tag}-k{kc}-f0.5", "brown_cbow_sparse_exp.yaml",
            {"dp.target_epsilon": eps, "dp.selection": sel})
        c = st["cutoff"]
        sel = with_selection_eps({"name": "sparse_vector", "epsilon": None, "cutoff": c, "threshold": 0.01,
                                  "threshold_fraction": 0.5, "score_clip": 0.05}, *split, 0.5 * eps)
        add(f"sparse_vector-{tag}-c{c}-f0.5", "brown_cbow_sparse_vector.yaml",
            {"dp.target_epsilon": eps, "dp.selection": sel})
        for k in st["k"]:
            add(f"uniform-{tag}-k{k}", "brown_cbow_sparse_uniform.yaml",
                {"dp.target_epsilon": eps, "dp.selection": {"name": "uniform", "k": k}})
        for r in st["rates"]:
            add(f"random_sparsification-{tag}-r{r:g}", "brown_cbow_random_sparsification.yaml",
                {"dp.target_epsilon": eps,
                 "dp.selection": {"name": "random_sparsification", "final_rate": r, "gradual_cooling": True}})
        for f in (0.25, 0.5):
            for ts in (0.5, 1.0):
                sel = {"name": "gaussian_threshold", "sigma": float(f"{sigma / math.sqrt(f):.4g}"),
                       "threshold_sigmas": ts}
                if st["max_rows"]:
                    sel["max_rows"] = st["max_rows"]
                add(f"gaussian_threshold-{tag}-f{f:g}-t{ts:g}", "brown_cbow_gaussian_threshold.yaml",
                    {"dp.target_epsilon": eps, "dp.selection": sel})
    return runs


def sweep(v: str) -> tuple[str, dict]:
    st = SETTINGS[v]
    runs = cells(v)
    common = {"data.preset": st["preset"], "model.tied": False, "train.epochs": st["epochs"]}
    if v == "v10k":
        common["train.eval_max_samples"] = 100_000  # valid/test losses on 100K of ~500K pairs each (per epoch)
    panels = {f"target ε = {eps}": [r["name"] for r in runs if f"-eps{eps}-" in r["name"]] + ["nonprivate"]
              for eps in EPSILONS}
    np_set = {"train.batch_size": B, "train.optimizer": "sparse_adam"}
    runs.append({"name": "nonprivate", "config": st["nonprivate"], "set": np_set})
    header = (
        f"# Privacy-utility frontier, {st['title']} — written by bench/frontier_configs.py (edit that, not this).\n"
        "# Every DP cell at target epsilon in {1, 3, 8}, delta 1e-5 (add/remove one pair, PLD), sigma calibrated;\n"
        "# lazy Adam. Grid per epsilon (budget split f: see bench/frontier_configs.py):\n"
        "#   dpsgd: lr in {1e-3, 3e-3, 1e-2}            exponential (gradient-norm scores): k, f (eps'' per pick)\n"
        "#   exponential_count: k, f=0.5, count scores  sparse_vector: cutoff c, f=0.5 (eps per segment)\n"
        "#   uniform: k                                 random_sparsification: final rate r\n"
        "#   gaussian_threshold: f in {0.25, 0.5} (sigma_sel = sigma_DPSGD/sqrt(f)) x tau in {0.5, 1} sigma_sel"
        + (f", max_rows {st['max_rows']}" if st["max_rows"] else "") + "\n"
        "# Sparse cells train at lr 5e-3 (their configs'). Choose each mechanism's best cell by validation loss, then\n"
        "# add seeds: [0, 1] to it and rerun (finished seeds are reused).\n"
        f"#   widedp compare configs/frontier_{v}.yaml --out runs/frontier_{v}\n"
    )
    return header, {"set": common, "panels": panels, "runs": runs}


def main() -> None:
    for v in SETTINGS:
        header, body = sweep(v)
        path = ROOT / "configs" / f"frontier_{v}.yaml"
        path.write_text(header + yaml.safe_dump(body, sort_keys=False, allow_unicode=True, width=120))
        print(f"wrote {path} ({len(body['runs'])} runs)")


if __name__ == "__main__":
    main()
