"""Write the privacy-utility frontier sweeps: configs/frontier_{v1k,v10k,full}.yaml (the whole grid per
V) and configs/frontier_v10k_eps8.yaml, configs/frontier_full_eps8.yaml (the cells that decide the issue's targets).

    .venv/bin/python bench/frontier_configs.py            # regenerates every file (seconds)
    widedp compare configs/frontier_v10k_eps8.yaml --out runs/frontier_v10k_eps8 --set train.threads=1   # ~2 h
    widedp compare configs/frontier_v10k.yaml --out runs/frontier_v10k   # many hours; resume-safe

Every cell is at the same honestly accounted privacy: dp.target_epsilon = eps in {1, 3, 8}, delta = 1e-5, add/remove
one (target, context) pair, PLD, with sigma solved for it (dp.calibrate: noise_multiplier) and the selection's own
parameters fixed per cell. "Budget split" f is how the selection's share of the budget is set:
- exponential / sparse vector: eps'' (per pick / per segment) such that the selection ALONE, Poisson-subsampled
  over the whole run, spends f * eps by the RDP accountant (an upper bound: by PLD it spends less);
- gaussian_threshold: sigma_sel = sigma_DPSGD(eps) / sqrt(f), so that the selection takes the share f of the step's
  Gaussian budget 1/sigma_eff^2 = 1/sigma^2 + 1/sigma_sel^2 (sigma_eff = DP-SGD's sigma at eps).
- pre-selection (``dp.preselect``, one-shot over the whole training set, then the step on the kept rows only):
  rows K = R/4 (so at most a quarter of the rows is ever noised per step), sigma_pre such that the pre-selection
  ALONE spends PRE_SHARE * eps (PLD), tau = 3 sigma_pre; sigma of the steps is calibrated for the prefix AND the
  steps together. Two cells per eps: ``preselect-dpsgd`` (``selection: all`` on the K rows = DP-SGD on the subset,
  lr in {3e-3, 1e-2}) and ``preselect-gt`` (gaussian_threshold on the K rows, f = 0.25, tau = 0.5 sigma_sel).
The ``_eps8`` files hold, in run order, what decides the targets at eps = 8: DP-SGD (lr grid), the pre-selection
cells, gaussian_threshold (its grid), exponential k = 2000 (reference), non-private; the whole-Brown one DP-SGD at
the lr that won at V = 10K, gaussian_threshold at the V = 10K winner (f = 0.25, tau = sigma_sel), the pre-selection
with half of K = R/2 per table, non-private (sparse Adam, b = 1000). Results: docs/results.md;
tabulate and plot finished cells with bench/frontier_results.py.
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

PRE_SHARE = 0.1  # the pre-selection's share of eps (alone, PLD)
#: gaussian_threshold cells: (budget share f, tau / sigma_sel, capped at max_rows = R/4 (V >= 10K)); the uncapped
#: ones (the whole-Brown target has no row limit) keep every row above tau.
GT_GRID = ((0.25, 0.5, True), (0.25, 1.0, True), (0.25, 1.5, True), (0.5, 0.5, True), (0.5, 1.0, True),
           (0.1, 1.0, False), (0.25, 1.0, False))

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
    "v10k": {"preset": "brown_10k", "n": 1_508_593, "epochs": 5, "k": (2000, 5000), "k_count": 2000, "cutoff": 2000,
             "rates": (0.75, 0.9), "max_rows": 5000, "nonprivate": "brown10k_cbow_nonprivate.yaml",
             "rows": 20_000,
             "title": "V = 10K (brown_10k: 20,000 rows untied, 1.51M train pairs, b = 1000, 5 epochs = 7,545 steps)"},
    "full": {"preset": "brown_full", "n": 1_591_740, "epochs": 5, "k": (2000, 5000), "k_count": 2000,
             "cutoff": 2000, "rates": (0.75, 0.9), "max_rows": 6616, "nonprivate": "brown10k_cbow_nonprivate.yaml",
             "rows": 26_464,
             "title": "whole Brown (brown_full: every word seen >= 5 times, V = 13,232: 26,464 rows untied, 1.59M "
                      "train pairs, b = 1000, 5 epochs = 7,960 steps)"},
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


def preselect_sigma(eps: float) -> float:
    """sigma_pre: the one-shot pre-selection (sensitivity 1, every sample) alone spends PRE_SHARE * eps (PLD)."""
    s = accounting.calibrate_noise_multiplier(lambda x: StepSpend(1.0, (GaussianSpend(x),)), steps=1, delta=DELTA,
                                              target_epsilon=PRE_SHARE * eps)
    return float(f"{s:.4g}")


def _dp_sets(sets: dict) -> dict:
    return {"train.batch_size": B, "train.optimizer": "lazy_adam", "dp.delta": DELTA, "dp.accountant": "pld",
            "dp.calibrate": "noise_multiplier", **sets}


def preselect_cells(v: str, eps: float, *, lrs: tuple[float, ...] = (3e-3, 1e-2)) -> list[dict]:
    """DP-SGD on the pre-selected rows (one cell per lr) and gaussian_threshold on them (f = 0.25, tau = 0.5)."""
    st = SETTINGS[v]
    q, steps = B / st["n"], _steps(st["n"], st["epochs"])
    k = st["rows"] // 4
    pre = {"rows": k, "sigma": preselect_sigma(eps), "threshold_sigmas": 3.0}
    tag = f"eps{eps}"
    out = [{"name": f"preselect-dpsgd-{tag}-K{k}-lr{lr:g}", "config": "brown_cbow_dpsgd.yaml",
            "set": _dp_sets({"dp.target_epsilon": eps, "train.lr": lr, "dp.preselect": pre})} for lr in lrs]
    sel = {"name": "gaussian_threshold", "sigma": float(f"{dpsgd_sigma(q, steps, eps) / math.sqrt(0.25):.4g}"),
           "threshold_sigmas": 0.5}
    out.append({"name": f"preselect-gt-{tag}-K{k}-f0.25-t0.5", "config": "brown_cbow_gaussian_threshold.yaml",
                "set": _dp_sets({"dp.target_epsilon": eps, "dp.selection": sel, "dp.preselect": pre})})
    # half of K per table (input, output): pooled, the output rows (targets + negatives) crowd the input rows out
    for kk in (k, 2 * k) if v == "full" else (k,):
        half = {**pre, "rows": kk, "table_rows": [kk // 2, kk // 2]}
        out.append({"name": f"preselect-dpsgd-{tag}-K{kk}-half-lr0.003", "config": "brown_cbow_dpsgd.yaml",
                    "set": _dp_sets({"dp.target_epsilon": eps, "train.lr": 3e-3, "dp.preselect": half})})
    return out


def cells(v: str) -> list[dict]:
    st = SETTINGS[v]
    q, steps = B / st["n"], _steps(st["n"], st["epochs"])
    split = (st["rows"], q, steps)  # with_selection_eps's row space, sampling rate and steps
    runs: list[dict] = []

    def add(name: str, config: str, sets: dict) -> None:
        runs.append({"name": name, "config": config, "set": _dp_sets(sets)})

    for eps in EPSILONS:
        sigma = dpsgd_sigma(q, steps, eps)
        tag = f"eps{eps}"
        for lr in (1e-3, 3e-3, 1e-2):
            add(f"dpsgd-{tag}-lr{lr:g}", "brown_cbow_dpsgd.yaml", {"dp.target_epsilon": eps, "train.lr": lr})
        runs.extend(preselect_cells(v, eps))
        for k in st["k"][:1]:  # (k = 5000 exponential picks per step overflow the PLD accountant's grid)
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
        # (RDP where PLD refuses these steps: c tiny pure-DP segments make its step PMF unstable: eps < 8, and V = 1K)
        rdp = eps < 8 or v == "v1k"
        add(f"sparse_vector-{tag}-c{c}-f0.5", "brown_cbow_sparse_vector.yaml",
            {"dp.target_epsilon": eps, "dp.selection": sel, **({"dp.accountant": "rdp"} if rdp else {})})
        for k in st["k"]:
            add(f"uniform-{tag}-k{k}", "brown_cbow_sparse_uniform.yaml",
                {"dp.target_epsilon": eps, "dp.selection": {"name": "uniform", "k": k}})
        for r in st["rates"]:
            add(f"random_sparsification-{tag}-r{r:g}", "brown_cbow_random_sparsification.yaml",
                {"dp.target_epsilon": eps,
                 "dp.selection": {"name": "random_sparsification", "final_rate": r, "gradual_cooling": True}})
        # without cooling: the same share of rows every step (r = 0.75: 1/4 of the rows, the frontier's row budget)
        for lr in (5e-3, 3e-3, 1e-2):
            add(f"random_sparsification-{tag}-r0.75-nocool" + ("" if lr == 5e-3 else f"-lr{lr:g}"),
                "brown_cbow_random_sparsification.yaml",
                {"dp.target_epsilon": eps, "train.lr": lr,
                 "dp.selection": {"name": "random_sparsification", "final_rate": 0.75, "gradual_cooling": False}})
        for f, ts, cap in GT_GRID:
            sel = {"name": "gaussian_threshold", "sigma": float(f"{sigma / math.sqrt(f):.4g}"),
                   "threshold_sigmas": ts}
            if st["max_rows"] and cap:
                sel["max_rows"] = st["max_rows"]
            add(f"gaussian_threshold-{tag}-f{f:g}-t{ts:g}{'' if cap else '-nocap'}",
                "brown_cbow_gaussian_threshold.yaml", {"dp.target_epsilon": eps, "dp.selection": sel})
            if (f, ts, cap) == (0.25, 1.0, True):  # its lr grid (the others train at the config's 5e-3)
                for lr in (1e-2, 2e-2):
                    add(f"gaussian_threshold-{tag}-f{f:g}-t{ts:g}-lr{lr:g}", "brown_cbow_gaussian_threshold.yaml",
                        {"dp.target_epsilon": eps, "dp.selection": sel, "train.lr": lr})
        # data.negatives_pool: each step's negatives from a pool of M ids drawn without the data, whose rows are
        # then public (noised for free): DP-SGD (the reference with the same negatives) and gaussian_threshold
        for m in (1000, 2000):
            add(f"dpsgd-{tag}-lr0.003-pool{m}", "brown_cbow_dpsgd.yaml",
                {"dp.target_epsilon": eps, "train.lr": 3e-3, "data.negatives_pool": m})
            sel = {"name": "gaussian_threshold", "sigma": float(f"{sigma / math.sqrt(0.25):.4g}"),
                   "threshold_sigmas": 1.0}
            add(f"gaussian_threshold-{tag}-f0.25-t1-pool{m}", "brown_cbow_gaussian_threshold.yaml",
                {"dp.target_epsilon": eps, "dp.selection": sel, "data.negatives_pool": m})
            if st["max_rows"]:  # <= R/4 rows every step: the pool's <= M distinct rows + at most R/4 - M picks
                add(f"gaussian_threshold-{tag}-f0.25-t1-pool{m}-cap", "brown_cbow_gaussian_threshold.yaml",
                    {"dp.target_epsilon": eps, "dp.selection": {**sel, "max_rows": st["max_rows"] - m},
                     "data.negatives_pool": m})
    return runs


#: The eps = 8 cells that decide the targets, in run order (``{k}``: R/4, ``{k2}``: R/2); whole Brown: DP-SGD and
#: gaussian_threshold at the cell that won at V = 10K on validation (lr 3e-3; f = 0.25, tau = sigma_sel, lr 5e-3),
#: and the pre-selection with half of K per table (set after those runs, see docs/results.md).
DECISIVE = {
    "v10k": ["dpsgd-eps8-lr0.003", "dpsgd-eps8-lr0.01", "preselect-dpsgd-eps8-K{k}-lr0.003",
             "preselect-gt-eps8-K{k}-f0.25-t0.5", "gaussian_threshold-eps8-f0.25-t0.5",
             "exponential-eps8-k2000-f0.5", "preselect-dpsgd-eps8-K{k}-half-lr0.003",
             "gaussian_threshold-eps8-f0.25-t1", "gaussian_threshold-eps8-f0.25-t1.5",
             "gaussian_threshold-eps8-f0.5-t0.5", "gaussian_threshold-eps8-f0.5-t1",
             "gaussian_threshold-eps8-f0.1-t1-nocap", "gaussian_threshold-eps8-f0.25-t1-nocap",
             "gaussian_threshold-eps8-f0.25-t1-lr0.01", "gaussian_threshold-eps8-f0.25-t1-lr0.02", "nonprivate",
             "dpsgd-eps8-lr0.001", "sparse_vector-eps8-c2000-f0.5", "uniform-eps8-k5000",
             "random_sparsification-eps8-r0.75", "exponential_count-eps8-k2000-f0.5", "uniform-eps8-k2000",
             "random_sparsification-eps8-r0.9", "random_sparsification-eps8-r0.75-nocool",
             "random_sparsification-eps8-r0.75-nocool-lr0.003", "random_sparsification-eps8-r0.75-nocool-lr0.01",
             "gaussian_threshold-eps8-f0.25-t1-pool2000", "dpsgd-eps8-lr0.003-pool2000",
             "gaussian_threshold-eps8-f0.25-t1-pool1000", "dpsgd-eps8-lr0.003-pool1000",
             "gaussian_threshold-eps8-f0.25-t1-pool2000-cap", "gaussian_threshold-eps8-f0.25-t1-pool1000-cap"],
    "full": ["dpsgd-eps8-lr0.003", "gaussian_threshold-eps8-f0.25-t1", "preselect-dpsgd-eps8-K{k2}-half-lr0.003",
             "nonprivate", "preselect-dpsgd-eps8-K{k}-half-lr0.003", "gaussian_threshold-eps8-f0.25-t1-pool1000-cap",
             "gaussian_threshold-eps8-f0.25-t1-pool1000", "dpsgd-eps8-lr0.003-pool1000",
             "gaussian_threshold-eps8-f0.25-t1-pool2000-cap"],
}


#: The second seed of each mechanism's best cell at eps = 8, picked by validation loss (docs/frontier.json).
SEEDS = {
    "v10k": {"dpsgd-eps8-lr0.003": [0, 1], "gaussian_threshold-eps8-f0.25-t1": [0, 1],
             "gaussian_threshold-eps8-f0.25-t1-pool1000": [0, 1],
             "gaussian_threshold-eps8-f0.25-t1-pool1000-cap": [0, 1],
             # the best cell of every other mechanism (validation)
             "random_sparsification-eps8-r0.9": [0, 1], "uniform-eps8-k5000": [0, 1],
             "preselect-dpsgd-eps8-K5000-half-lr0.003": [0, 1], "sparse_vector-eps8-c2000-f0.5": [0, 1],
             "exponential_count-eps8-k2000-f0.5": [0, 1], "exponential-eps8-k2000-f0.5": [0, 1],
             "random_sparsification-eps8-r0.75-nocool": [0, 1]},
    "full": {"gaussian_threshold-eps8-f0.25-t1-pool1000-cap": [0, 1]},
}


#: The pooled-negative cells at eps = 1 and 3 (the eps = 8 ones are in DECISIVE), with the same names as in the
#: whole grids: run with --out runs/frontier_<v> so that the cell directories are the grids' own.
POOLED = {
    "v10k": ["dpsgd-eps{e}-lr0.003-pool1000", "gaussian_threshold-eps{e}-f0.25-t1-pool1000-cap",
             "gaussian_threshold-eps{e}-f0.25-t1-pool1000"],
    "full": ["dpsgd-eps3-lr0.003-pool1000", "gaussian_threshold-eps3-f0.25-t1-pool1000-cap"],
}


def sweep(v: str, only: list[str] | None = None, tag: str = "eps8") -> tuple[str, dict]:
    st = SETTINGS[v]
    k = st["rows"] // 4  # the pre-selection's rows
    runs = cells(v)
    runs.append({"name": "nonprivate", "config": st["nonprivate"],
                 "set": {"train.batch_size": B, "train.optimizer": "sparse_adam", "model.sparse": True}})
    common = {"data.preset": st["preset"], "model.tied": False, "train.epochs": st["epochs"]}
    if v != "v1k":
        common["train.eval_max_samples"] = 100_000  # valid/test losses on 100K of ~500K pairs each (per epoch)
    epsilons = EPSILONS
    name = f"frontier_{v}"
    if only is not None:
        by_name = {r["name"]: r for r in runs}
        epsilons = (8,) if tag == "eps8" else (1, 3)
        names = dict.fromkeys(n.format(k=k, k2=2 * k, e=e) for e in epsilons for n in only)
        runs = [by_name[n] for n in names if n in by_name]
        for r in runs:
            if r["name"] in SEEDS.get(v, {}):
                r["seeds"] = SEEDS[v][r["name"]]
        name = f"frontier_{v}_{tag}"
    np_ = ["nonprivate"] if any(r["name"] == "nonprivate" for r in runs) else []
    panels = {f"target ε = {eps}": [r["name"] for r in runs if f"-eps{eps}-" in r["name"]] + np_
              for eps in epsilons if any(f"-eps{eps}-" in r["name"] for r in runs)}
    header = (
        f"# Privacy-utility frontier, {st['title']} — written by bench/frontier_configs.py (edit that, not this).\n"
        + ("# Only the eps = 8 cells that decide the frontier's targets, in run order.\n"
           if only and tag == "eps8" else "")
        + (f"# Only the pooled-negative cells at eps = 1 and 3 (cells of configs/frontier_{v}.yaml: run with\n"
           f"# --out runs/frontier_{v}).\n" if tag == "pool" else "")
        + "# Every DP cell at target epsilon in {1, 3, 8}, delta 1e-5 (add/remove one pair, PLD), sigma calibrated;\n"
        "# lazy Adam. Grid per epsilon (budget split f: see bench/frontier_configs.py):\n"
        "#   dpsgd: lr in {1e-3, 3e-3, 1e-2}            exponential (gradient-norm scores): k, f (eps'' per pick)\n"
        "#   exponential_count: k, f=0.5, count scores  sparse_vector: cutoff c, f=0.5 (eps per segment)\n"
        "#   uniform: k                                 random_sparsification: final rate r (gradual cooling);\n"
        "#   -nocool: r = 0.75 every step (1/4 of the rows) at lr in {5e-3, 3e-3, 1e-2}\n"
        "#   -poolM: data.negatives_pool = M (each step's negatives from M ids drawn without the data: public rows),\n"
        "#   for DP-SGD (lr 3e-3) and gaussian_threshold (f = 0.25, tau = sigma_sel, uncapped; -cap: max_rows\n"
        "#   R/4 - M, so that <= R/4 rows are noised every step), M in {1000, 2000}\n"
        "#   gaussian_threshold: (f, tau/sigma_sel) in {(.25, .5), (.25, 1), (.25, 1.5), (.5, .5), (.5, 1)}"
        + (f", max_rows {st['max_rows']}" if st["max_rows"] else "") + "; -nocap: (.1, 1), (.25, 1) uncapped;\n"
        "#   (.25, 1) capped also at lr 1e-2, 2e-2\n"
        f"#   preselect-*: dp.preselect rows K = {k} (R/4), its own share {PRE_SHARE} of eps; then DP-SGD\n"
        "#   (lr in {3e-3, 1e-2}) or gaussian_threshold (f = 0.25, tau = 0.5 sigma_sel) on the K rows;\n"
        "#   -half: K/2 rows per table (table_rows), DP-SGD at lr 3e-3 (whole Brown: also K = R/2)\n"
        "# Sparse cells train at lr 5e-3 (their configs'). Choose each mechanism's best cell by validation loss, then\n"
        "# add seeds: [0, 1] to it and rerun (finished seeds are reused).\n"
        f"#   widedp compare configs/{name}.yaml --out runs/{name} --set train.threads=1\n"
    )
    return header, {"set": common, "panels": panels, "runs": runs}


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data: object) -> bool:
        return True


def main() -> None:
    jobs = ([(v, None, "") for v in SETTINGS] + [(v, names, "eps8") for v, names in DECISIVE.items()]
            + [(v, names, "pool") for v, names in POOLED.items()])
    for v, only, tag in jobs:
        header, body = sweep(v, only, tag or "eps8")
        path = ROOT / "configs" / f"frontier_{v}{'_' + tag if tag else ''}.yaml"
        path.write_text(header + yaml.dump(body, Dumper=_NoAliases, sort_keys=False, allow_unicode=True, width=120))
        print(f"wrote {path} ({len(body['runs'])} runs)")


if __name__ == "__main__":
    main()
