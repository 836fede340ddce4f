"""The audit table of docs/audit.md: ``widedp audit`` over mechanisms x ε x privacy units, one run per cell.

    .venv/bin/python bench/bench_audit.py                      # the grid; JSON + markdown to bench/out/
    .venv/bin/python bench/bench_audit.py --eps 8 --mechanisms dpsgd --units pair --canaries 5000
    .venv/bin/python bench/bench_audit.py --table-only         # rebuild the markdown from the JSON

Each cell runs ``widedp audit configs/audit_dpsgd.yaml --canaries M --per-step --set ...`` in its own process
(``taskset`` to one core when available; the config's ``train.threads: 1``) and reads its ``audit.json``: one run
gives the three scores (white-box on the released weights, black-box loss, per-step updates). Cells already in the
JSON are kept (resume-safe: run it again after an interruption). Mechanisms:

- ``dpsgd``: every row, noise calibrated to the target ε;
- ``exponential``: k = 1000 rows per step at ε″ = 0.005·ε per pick (score clip S0 = S1/b), noise calibrated;
- ``gaussian_threshold`` (pooled): the negatives from a 200-word public pool per step, rows whose ℓ2-normalised
  contribution count + N(0, σ_sel²) exceeds τ = σ_sel, with σ_sel = 2σ of the DP-SGD cell of the same ε and unit
  (a quarter of the step's Gaussian budget; that cell runs first), noise calibrated.

Units: ``pair`` (q = 0.05, b = 4200) and ``sentence`` (q = 0.05 of the ~3,900 sentences, b = 200); 5 epochs = 100
steps. ``--q1`` adds the DP-SGD pair cells at q = 1 (every unit in each of 10 full-batch steps: no amplification).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
CONFIG = "configs/audit_dpsgd.yaml"
UNITS = {"pair": ["--set", "train.batch_size=4200"],
         "sentence": ["--set", "data.privacy_unit=sentence", "--set", "train.batch_size=200"]}
Q1 = ["--set", "dp.sampling_rate=1.0", "--set", "train.epochs=10", "--set", "train.batch_size=86700"]


def mechanism_args(mech: str, eps: float, sigma_dpsgd: float | None) -> list[str]:
    """The ``--set`` overrides of a mechanism at target ``eps``."""
    if mech in ("dpsgd", "dpsgd_q1"):
        return ["--set", "dp.selection.name=all"] + (Q1 if mech == "dpsgd_q1" else [])
    if mech == "exponential":
        return ["--set", "dp.selection.name=exponential", "--set", "dp.selection.k=1000",
                "--set", f"dp.selection.epsilon={0.005 * eps:g}", "--set", "dp.selection.score_clip=0.000238"]
    if mech == "gaussian_threshold":
        if sigma_dpsgd is None:
            raise RuntimeError("gaussian_threshold needs the DP-SGD cell of the same eps and unit first")
        return ["--set", "data.negatives_pool=200", "--set", "dp.selection.name=gaussian_threshold",
                "--set", f"dp.selection.sigma={2 * sigma_dpsgd:.4f}", "--set", "dp.selection.threshold_sigmas=1.0"]
    raise ValueError(mech)


def run_cell(mech: str, eps: float, unit: str, *, m: int, work: Path, sigma_dpsgd: float | None) -> dict:
    """One ``widedp audit`` run; its audit.json plus the command, the noise multiplier and the wall time."""
    out = work / f"{mech}-eps{eps:g}-{unit}"
    args = ["audit", CONFIG, "--canaries", str(m), "--out", str(out), "--per-step", "--overwrite", "--no-plot",
            "--no-progress", "--set", f"dp.target_epsilon={eps:g}", *UNITS[unit], *mechanism_args(mech, eps,
                                                                                                     sigma_dpsgd)]
    pin = ["taskset", "-c", os.environ.get("AUDIT_CPU", "0")] if shutil.which("taskset") else []
    t0 = time.perf_counter()
    proc = subprocess.run([*pin, sys.executable, "-m", "widedp", *args], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    cell = {"mechanism": mech, "epsilon_target": eps, "unit": unit, "m": m, "wall_s": wall,
            "command": "widedp " + " ".join(a for a in args if a not in ("--no-progress",))}
    if proc.returncode != 0:
        return cell | {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    rep = json.loads((out / "audit.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    return cell | {"epsilon": rep["epsilon"], "noise_multiplier": summary["dp"]["noise_multiplier"],
                   "epsilon_cap": rep["epsilon_cap"], "privacy": rep["privacy"],
                   "scores": {k: {x: v[x] for x in ("epsilon_lower", "guesses", "correct")}
                              for k, v in rep["scores"].items()}}


def table(cells: list[dict]) -> str:
    """The markdown table: ε_lower / ε per score, m, seconds."""
    head = ("| mechanism | unit | ε (accountant) | σ | white-box ε_lower (ratio) | black-box ε_lower (ratio) | "
            "per-step ε_lower (ratio) | guesses correct (per-step) | cap | m | run s |")
    lines = [head, "|" + "---|" * 11]
    for c in sorted(cells, key=lambda c: (c["mechanism"], c["unit"], c["epsilon_target"])):
        if "error" in c:
            lines.append(f"| {c['mechanism']} | {c['unit']} | target {c['epsilon_target']:g} | – | not run: "
                         f"{c['error'][:80]} | | | | | {c['m']} | {c['wall_s']:.0f} |")
            continue
        s, eps = c["scores"], c["epsilon"]
        lows = {k: f"{v['epsilon_lower']:.2f} ({v['epsilon_lower'] / eps:.2f})" for k, v in s.items()}
        ps = s["per_step"]
        lines.append(f"| {c['mechanism']} | {c['unit']} | {eps:.2f} | {c['noise_multiplier']:.3f} | "
                     f"{lows['white_box']} | {lows['black_box']} | {lows['per_step']} | "
                     f"{ps['correct']}/{ps['guesses']} | {c['epsilon_cap']:.2f} | {c['m']} | {c['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mechanisms", nargs="+", default=["dpsgd", "exponential", "gaussian_threshold"])
    ap.add_argument("--eps", nargs="+", type=float, default=[8.0, 4.0, 1.0])
    ap.add_argument("--units", nargs="+", default=["pair", "sentence"])
    ap.add_argument("--canaries", type=int, default=5000)
    ap.add_argument("--q1", action="store_true", help="add DP-SGD pair cells at q = 1")
    ap.add_argument("--work", default="/tmp/widedp-bench-audit", help="run directories (private working state)")
    ap.add_argument("--json", default=str(OUT / "audit.json"))
    ap.add_argument("--table-only", action="store_true")
    a = ap.parse_args()
    path = Path(a.json)
    cells = json.loads(path.read_text()) if path.is_file() else []
    mechs = list(a.mechanisms) + (["dpsgd_q1"] if a.q1 else [])
    for eps in [] if a.table_only else a.eps:
        for unit in a.units:
            for mech in mechs:
                if mech == "dpsgd_q1" and unit != "pair":
                    continue
                key = (mech, eps, unit)
                if any((c["mechanism"], c["epsilon_target"], c["unit"]) == key and "error" not in c for c in cells):
                    continue
                base = next((c for c in cells if (c["mechanism"], c["epsilon_target"], c["unit"]) ==
                             ("dpsgd", eps, unit) and "error" not in c), None)
                try:
                    cell = run_cell(mech, eps, unit, m=a.canaries, work=Path(a.work),
                                    sigma_dpsgd=base["noise_multiplier"] if base else None)
                except RuntimeError as e:  # (gaussian_threshold without its DP-SGD cell)
                    cell = {"mechanism": mech, "epsilon_target": eps, "unit": unit, "m": a.canaries, "wall_s": 0.0,
                            "error": str(e)}
                cells = [c for c in cells if (c["mechanism"], c["epsilon_target"], c["unit"]) != key] + [cell]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(cells, indent=1))
                print(json.dumps({k: cell.get(k) for k in ("mechanism", "epsilon_target", "unit", "epsilon",
                                                           "wall_s", "error")}), flush=True)
    (path.with_suffix(".md")).write_text(table(cells))
    print(table(cells))


if __name__ == "__main__":
    main()
