"""Tabulate (and plot) the privacy-utility frontier runs from their run directories.

    .venv/bin/python bench/frontier_results.py runs/frontier_v10k_eps8 runs/frontier_full_eps8 \
        --json docs/frontier.json --png docs/frontier.png

Reads every ``OUT/<cell>/seed<k>/`` that holds a ``summary.json`` (finished runs only; unfinished cells are listed as
not run), not the sweep's ``results.json``: the table also needs the mean rows noised per step (``metrics.jsonl``)
and the cell's resolved config (``config.yaml``). Per cell: mechanism, its parameters, lr, spent eps (PLD, the run's
headline), sigma, validation and test loss (of the final weights), rows noised per step (mean over the run; of R
rows), step time (training time / steps: evaluation and checkpoints excluded) and wall time. The best cell of each
mechanism per (V, eps) is chosen on VALIDATION loss; the figure plots its test loss against eps, one panel per V,
with DP-SGD's best and the non-private run as references.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import yaml

V_OF_PRESET = {"paper": "V = 1K", "brown_10k": "V = 10K", "brown_full": "whole Brown (V = 13,232)"}


def mechanism(cfg: dict[str, Any]) -> str:
    dp = cfg.get("dp")
    if dp is None:
        return "non-private"
    sel = dp["selection"]["name"]
    name = {"all": "DP-SGD"}.get(sel, sel)
    if sel == "exponential" and dp["selection"].get("score") == "count":
        name = "exponential (count)"
    if sel == "random_sparsification" and not dp["selection"].get("gradual_cooling", True):
        name = "random_sparsification (no cooling)"
    if sel == "gaussian_threshold" and dp["selection"].get("public_head"):
        name = "gaussian_threshold + public head"
    if cfg["data"].get("negatives_pool"):
        name = f"{name} + negatives pool"
    return f"preselect + {name}" if dp.get("preselect") else name


def params(cfg: dict[str, Any]) -> str:
    dp = cfg.get("dp")
    out = [f"lr {cfg['train']['lr']:g}"]
    if dp is None:
        return ", ".join(out)
    s = dp["selection"]
    if s["name"] == "gaussian_threshold":
        tau = s["threshold"] if s.get("threshold") is not None else (s.get("threshold_sigmas") or 1.0) * s["sigma"]
        out.append(f"σ_sel {s['sigma']:.3g}, τ {tau:.3g}" + (f", ≤{s['max_rows']} rows" if s.get("max_rows") else ""))
    elif s["name"] in ("exponential", "uniform"):
        out.append(f"k {s.get('k')}" + (f", ε'' {s['epsilon']:.3g}" if "epsilon" in s else ""))
    elif s["name"] == "sparse_vector":
        out.append(f"c {s['cutoff']}, ε {s['epsilon']:.3g}")
    elif s["name"] == "random_sparsification":
        out.append(f"rate {s['final_rate']}")
    elif s["name"] == "public_top":
        out.append(f"H {s['rows_per_table']} per table")
    if s.get("public_head"):
        out.append(f"head H {s['public_head']} per table")
    if cfg["data"].get("negatives_pool"):
        out.append(f"pool M {cfg['data']['negatives_pool']}")
    if dp.get("accountant") == "rdp":
        out.append("RDP")
    if dp.get("preselect"):
        p = dp["preselect"]
        out.append(f"K {p['rows']}" + (f" ({' + '.join(map(str, p['table_rows']))} per table)"
                                         if p.get("table_rows") else " pooled") + f", σ_pre {p['sigma']:g}")
    return ", ".join(out)


def cell(run: Path) -> dict[str, Any] | None:
    if not (run / "summary.json").is_file():
        return None
    s = json.loads((run / "summary.json").read_text())
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    noised = [r["rows_selected"] for r in rows if r.get("kind") == "interval" and "rows_selected" in r]
    tied = cfg["model"].get("tied", False)
    vocab = len(json.loads((run / "vocab.json").read_text()))
    dp = s.get("dp") or {}
    label = V_OF_PRESET.get(cfg["data"].get("preset"), f"V = {vocab}")
    unit = cfg["data"].get("privacy_unit", "pair")
    if unit != "pair":  # a unit other than the pair: its own panel (and the vocabulary it was run with)
        label = f"{label}, per {unit}" + (f" ({cfg['data']['vocabulary']})" if cfg["data"].get("vocabulary") else "")
    return {
        "cell": run.parent.name, "seed": run.name, "dir": str(run), "V": label, "unit": unit,
        "vocab": vocab, "rows": vocab * (1 if tied else 2), "mechanism": mechanism(cfg), "params": params(cfg),
        "epsilon": dp.get("epsilon"), "target_epsilon": dp.get("target_epsilon"),
        "sigma": dp.get("noise_multiplier"), "valid_loss": s["valid_loss"], "test_loss": s["test_loss"],
        "rows_noised": sum(noised) / len(noised) if noised else None, "steps": s["steps"],
        "step_ms": 1000 * s["train_s"] / max(1, s["steps"]), "wall_s": s["wall_s"],
    }


def collect(outs: list[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    cells, missing = [], []
    for out in outs:
        for d in sorted(p for p in out.iterdir() if p.is_dir()):
            for run in sorted(d.glob("seed*")):
                c = cell(run)
                (cells.append(c) if c is not None else missing.append(str(run)))
    return cells, missing


def merge_seeds(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell: valid/test loss, rows noised and times averaged over its finished seeds (``seeds``: how
    many; ``test_range``: max - min test loss over them)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault(str(Path(c["dir"]).parent), []).append(c)
    out = []
    for runs in groups.values():
        m = dict(runs[0])
        for k in ("valid_loss", "test_loss", "step_ms", "wall_s"):
            m[k] = sum(r[k] for r in runs) / len(runs)
        noised = [r["rows_noised"] for r in runs if r["rows_noised"] is not None]
        m["rows_noised"] = sum(noised) / len(noised) if noised else None
        m["seeds"] = len(runs)
        m["test_range"] = max(r["test_loss"] for r in runs) - min(r["test_loss"] for r in runs)
        out.append(m)
    return out


def markdown(cells: list[dict[str, Any]]) -> str:
    head = ("| V | mechanism | parameters | ε | σ | valid loss | test loss | rows noised / step | step ms |"
            " wall s |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for c in sorted(cells, key=lambda c: (c["rows"], -(c["target_epsilon"] or 99), c["valid_loss"])):
        eps = "–" if c["epsilon"] is None else f"{c['epsilon']:.3f}"
        sig = "–" if c["sigma"] is None else f"{c['sigma']:.4f}"
        rows = "–" if c["rows_noised"] is None else f"{c['rows_noised']:,.0f} of {c['rows']:,} " \
                                                    f"({c['rows_noised'] / c['rows']:.0%})"
        seeds = f" ({c['seeds']} seeds, test range {c['test_range']:.3f})" if c.get("seeds", 1) > 1 else ""
        lines.append(f"| {c['V']} | {c['mechanism']} | {c['params']}{seeds} | {eps} | {sig} | {c['valid_loss']:.4f} | "
                     f"{c['test_loss']:.4f} | {rows} | {c['step_ms']:.0f} | {c['wall_s']:.0f} |")
    return head + "\n".join(lines) + "\n"


def best_by_validation(cells: list[dict[str, Any]]) -> dict[tuple[str, str, Any], dict[str, Any]]:
    best: dict[tuple[str, str, Any], dict[str, Any]] = {}
    for c in cells:
        key = (c["V"], c["mechanism"], c["target_epsilon"])
        if key not in best or c["valid_loss"] < best[key]["valid_loss"]:
            best[key] = c
    return best


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_by_validation(cells)
    rows_of = {c["V"]: c["rows"] for c in cells}
    unit_of = {c["V"]: c.get("unit", "pair") for c in cells}
    vs = sorted({k[0] for k in best}, key=rows_of.get)
    mechs_all = sorted({k[1] for k in best if k[1] not in ("non-private", "DP-SGD")})
    cmap = plt.get_cmap("tab20")
    colors = ({m: cmap(i % 20) for i, m in enumerate(mechs_all)}
              | {"DP-SGD": "black", "DP-SGD + negatives pool": "dimgray"})
    fig, axes = plt.subplots(1, len(vs), figsize=(5.5 * len(vs), 5.2), squeeze=False)
    handles: dict[str, Any] = {}
    for ax, v in zip(axes[0], vs):
        mechs = sorted({k[1] for k in best if k[0] == v and k[1] != "non-private"})
        dpsgd = [c["test_loss"] for k, c in best.items() if k[0] == v and k[1].startswith("DP-SGD")]
        top = max(dpsgd) + 0.8 if dpsgd else None  # cells far above DP-SGD are off-scale (in the table / JSON)
        for m in mechs:
            pts = sorted((c["epsilon"], c["test_loss"], c) for k, c in best.items() if k[0] == v and k[1] == m)
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            bold = m.startswith("DP-SGD") or "negatives pool" in m and m.startswith("gaussian")
            (line,) = ax.plot(xs, ys, "o-", label=m, color=colors[m], lw=2.5 if bold else 1.2)
            handles.setdefault(m, line)
            for x, y, c in pts:
                if c["rows_noised"] is not None and m != "DP-SGD" and (top is None or y <= top):
                    ax.annotate(f"{c['rows_noised'] / c['rows']:.0%}", (x, y), fontsize=7, xytext=(4, 2),
                                textcoords="offset points")
        np_ = [c for k, c in best.items() if k[0] == v and k[1] == "non-private"]
        if np_:
            handles["non-private"] = ax.axhline(np_[0]["test_loss"], color="gray", ls="--", label="non-private")
        if top is not None:
            ax.set_ylim(top=top, bottom=(np_[0]["test_loss"] - 0.1) if np_ else None)
        ax.set_title(f"{v}: best cell per mechanism (by validation)", fontsize=9)
        ax.set_xlabel(f"ε (PLD, δ = 1e-5, add/remove one {unit_of[v]})")
        ax.set_ylabel("test loss (cells > DP-SGD + 0.8 off-scale)")
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle("CBOW on Brown: test loss vs ε (labels: share of rows noised per step)", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path)
    a = ap.parse_args()
    cells, missing = collect(a.outs)
    cells = merge_seeds(cells)
    print(markdown(cells))
    if missing:
        print("not finished:", ", ".join(missing))
    if a.json:
        a.json.write_text(json.dumps({"cells": cells, "not_finished": missing}, indent=1,
                                     default=lambda x: None if isinstance(x, float) and math.isnan(x) else x) + "\n")
    if a.png and cells:
        plot(cells, a.png)


if __name__ == "__main__":
    main()
