"""Accuracy vs epsilon of the GLM algorithms: run a sweep file (``widedp compare`` format, task glm) and write
``OUT/accuracy_vs_eps.png``, ``OUT/results.md`` and ``OUT/results.json``.

    NLTK_DATA=../shared/nltk_data .venv/bin/python bench/bench_glm.py configs/brown_glm_sweep.yaml \
        --out bench/out/glm_sweep

Finished runs (OUT/<name>/seed<k>/summary.json) are reused. A row per (algorithm, target epsilon): test accuracy
mean +- std over seeds, the headline epsilon actually spent (DP-AGD: zCDP), wall time. The sweep's seeds vary
train.seed; with the default ``algorithm.rng: secure`` the noise is secret and differs on every run anyway.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from widedp.commands.compare import load_sweep, run_dir
from widedp.run.checkpoint import read_json, write_json
from widedp.run.train import train


def _stats(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd


def run(sweep_path: str, out: Path) -> list[dict[str, Any]]:
    sweep = load_sweep(sweep_path)
    rows: dict[tuple[str, float | None], dict[str, Any]] = {}
    for r in sweep.runs:
        for seed in r.seeds:
            d = run_dir(out, r.name, seed)
            if not (d / "summary.json").is_file():
                print(f"bench_glm: {r.name} seed {seed}", file=sys.stderr, flush=True)
                train(r.config(seed), d, progress=False)
            s = read_json(d / "summary.json")
            key = (s["algorithm"], (s.get("dp") or {}).get("target_epsilon"))
            row = rows.setdefault(key, {"algorithm": key[0], "target_epsilon": key[1], "runs": []})
            row["runs"].append({"name": r.name, "seed": seed, "test_accuracy": s["test_accuracy"],
                                "test_loss": s["test_loss"], "train_accuracy": s["train_accuracy"],
                                "epsilon": s.get("epsilon"), "epsilon_rdp": (s.get("dp") or {}).get("epsilon_rdp"),
                                "wall_s": s["wall_s"]})
    out_rows = []
    for row in rows.values():
        acc = _stats([x["test_accuracy"] for x in row["runs"]])
        row["test_accuracy_mean"], row["test_accuracy_std"] = acc
        row["train_accuracy_mean"] = _stats([x["train_accuracy"] for x in row["runs"]])[0]
        row["epsilon_max"] = max((x["epsilon"] or 0.0) for x in row["runs"])
        row["wall_s_mean"] = _stats([x["wall_s"] for x in row["runs"]])[0]
        out_rows.append(row)
    return out_rows


def markdown(rows: list[dict[str, Any]]) -> str:
    algos = sorted({r["algorithm"] for r in rows if r["target_epsilon"] is not None})
    eps = sorted({r["target_epsilon"] for r in rows if r["target_epsilon"] is not None})
    by = {(r["algorithm"], r["target_epsilon"]): r for r in rows}
    lines = ["| algorithm | " + " | ".join(f"ε={e:g}" for e in eps) + " |", "|---" * (len(eps) + 1) + "|"]
    for a in algos:
        cells = []
        for e in eps:
            r = by.get((a, e))
            cells.append("–" if r is None else f"{r['test_accuracy_mean']:.3f} ± {r['test_accuracy_std']:.3f}")
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    for r in rows:
        if r["target_epsilon"] is None:
            lines.append(f"| {r['algorithm']} (ε=∞) | " + " | ".join(
                f"{r['test_accuracy_mean']:.3f} ± {r['test_accuracy_std']:.3f}" for _ in eps) + " |")
    lines += ["", "Spent ε (accountant of each config; max over seeds) and mean wall time per run:", "",
              "| algorithm | target ε | spent ε | ε RDP | train acc | wall s |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["algorithm"], r["target_epsilon"] or math.inf)):
        rdps = [x["epsilon_rdp"] for x in r["runs"] if x["epsilon_rdp"] is not None]
        rdp = f"{max(rdps):.3f}" if rdps else "–"  # none for DP-AGD (zCDP headline) and the non-private run
        lines.append(f"| {r['algorithm']} | {r['target_epsilon'] if r['target_epsilon'] is not None else '∞'} | "
                     f"{r['epsilon_max']:.3f} | {rdp} | {r['train_accuracy_mean']:.3f} | {r['wall_s_mean']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=110)
    for a in sorted({r["algorithm"] for r in rows if r["target_epsilon"] is not None}):
        rs = sorted((r for r in rows if r["algorithm"] == a), key=lambda r: r["target_epsilon"])
        ax.errorbar([r["target_epsilon"] for r in rs], [r["test_accuracy_mean"] for r in rs],
                    yerr=[r["test_accuracy_std"] for r in rs], marker="o", ms=4, capsize=2, label=a)
    for r in rows:
        if r["target_epsilon"] is None:
            ax.axhline(r["test_accuracy_mean"], color="k", ls="--", lw=1, label=f"{r['algorithm']} (ε=∞)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("target ε (δ = 1e-5)")
    ax.set_ylabel("test accuracy")
    ax.set_title("Brown categories (15), multinomial logistic regression")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep")
    p.add_argument("--out", default="bench/out/glm_sweep")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = run(args.sweep, out)
    write_json(out / "results.json", {"sweep": args.sweep, "rows": rows})
    (out / "results.md").write_text(markdown(rows))
    plot(rows, out / "accuracy_vs_eps.png")
    print(markdown(rows))
    print(json.dumps({"out": str(out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
