"""The accounting tables of docs/results.md ("Accounting"), recomputed with widedp.accounting (no training).

    nice .venv/bin/python bench/accounting_tables.py     # Markdown to stdout, JSON to bench/out/accounting_tables.json

(1) The paper setting (n = 200K, b = 20: q = 1e-4, T = 200K steps, σ = 0.5, δ = 1e-5, add/remove; 100 exponential
    picks per step at the ε'' the paper's Theorem 3 split of (10, 5e-6) gives, ``paper_selection_epsilon``): ε of the
    Gaussian alone, the selection alone, the joint step (composed inside the step, subsampled once), the invalid
    shortcut (each part subsampled, then composed), the joint step with the selection as pure ε-DP picks (randomised
    response instead of the bounded-range pair), and DP-SGD at σ = 0.32; PLD, RDP and the paper's Theorem 3 figure
    (a labelled reference, not a bound).
(2) Calibration in that setting: σ for a target ε with ε'' fixed, and ε'' for a target with σ = 0.5 fixed.
(3) The sparse vector steps (c = 500, q = 0.005, 4,000 steps) whose PLD step distribution is heavier than 1: its
    mass, RDP, and what the PLD accountant answers now (its ε, or its refusal).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "accounting_tables.json"
Q, T, SIGMA, DELTA, PICKS = 1e-4, 200_000, 0.5, 1e-5, 100


def _eps(runs: list, accountant: str) -> float | str:
    from widedp.accounting import compose_epsilon
    from widedp.accounting.pld import PLDRangeError
    from widedp.errors import ConfigError

    try:
        return compose_epsilon(runs, delta=DELTA, accountant=accountant)
    except (PLDRangeError, ConfigError) as e:
        return f"refused: {e}"


def paper_setting() -> dict[str, Any]:
    from widedp.accounting import paper_selection_epsilon, paper_theorem3_reference
    from widedp.dp.spend import ExponentialSpend, GaussianSpend, StepSpend

    e2 = paper_selection_epsilon(10.0, delta=5e-6, sampling_rate=Q, steps=T, picks=PICKS)
    gauss, sel = GaussianSpend(SIGMA), ExponentialSpend(e2, PICKS)
    rows = {
        "Gaussian alone (subsampled)": [(StepSpend(Q, (gauss,)), T)],
        "selection alone (subsampled)": [(StepSpend(Q, (sel,)), T)],
        "joint (composed inside the step, subsampled once)": [(StepSpend(Q, (gauss, sel)), T)],
        "invalid shortcut (each part subsampled, then composed)": [(StepSpend(Q, (gauss,)), T),
                                                                   (StepSpend(Q, (sel,)), T)],
        "joint, selection as pure ε-DP (randomised response per pick)": [
            (StepSpend(Q, (gauss, ExponentialSpend(e2, PICKS, bounded_range=False))), T)],
        "DP-SGD at σ = 0.32 (for the paper's \"ε = 30\")": [(StepSpend(Q, (GaussianSpend(0.32),)), T)],
    }
    whole = ("joint (composed inside the step, subsampled once)", "DP-SGD at σ = 0.32 (for the paper's \"ε = 30\")")
    out: dict[str, Any] = {"selection_epsilon_per_pick": e2, "rows": {}}
    for name, runs in rows.items():  # the paper's Theorem 3 figure: for a whole method (its reference, not a bound)
        out["rows"][name] = {"pld": _eps(runs, "pld"), "rdp": _eps(runs, "rdp"),
                             "paper": paper_theorem3_reference(runs, DELTA)["epsilon"] if name in whole else None}
        print(f"  {name}: {out['rows'][name]}", file=sys.stderr, flush=True)
    return out


def calibration(e2: float) -> dict[str, Any]:
    from widedp.accounting import calibrate_noise_multiplier, calibrate_selection_epsilon
    from widedp.dp.spend import ExponentialSpend, GaussianSpend, StepSpend
    from widedp.errors import ConfigError

    def sigma_step(s: float) -> StepSpend:
        return StepSpend(Q, (GaussianSpend(s), ExponentialSpend(e2, PICKS)))

    def eps_step(e: float) -> StepSpend:
        return StepSpend(Q, (GaussianSpend(SIGMA), ExponentialSpend(e, PICKS)))

    out: dict[str, Any] = {}
    for target in (1.0, 3.0, 8.0):
        row = {}
        for acct in ("pld", "rdp"):
            for what, fn, make in (("sigma", calibrate_noise_multiplier, sigma_step),
                                   ("selection_epsilon", calibrate_selection_epsilon, eps_step)):
                try:
                    row[f"{what}_{acct}"] = fn(make, steps=T, delta=DELTA, target_epsilon=target, accountant=acct)
                except ConfigError as e:
                    row[f"{what}_{acct}"] = f"infeasible: {e}"
        out[str(target)] = row
        print(f"  target {target}: {row}", file=sys.stderr, flush=True)
    return out


def heavy_steps() -> dict[str, Any]:
    from widedp.accounting import pld as P
    from widedp.accounting.parts import costs_of
    from widedp.dp.spend import SparseVectorSpend, StepSpend

    out: dict[str, Any] = {}
    for seg in (0.0115, 0.003, 0.001013):
        step = StepSpend(0.005, (SparseVectorSpend(seg, 500),))
        costs = costs_of(step)
        d = P.DEFAULT_DISCRETIZATION
        pld = P.subsampled_pld(P.HockeyStick(P.product_pmf(costs, d)), costs.q, d)  # unchecked: its mass
        mass = max(float(sum(m.to_dense_pmf()._probs)) + float(m.to_dense_pmf()._infinity_mass)
                   for m in (pld._pmf_remove, pld._pmf_add))
        out[str(seg)] = {"step_mass": mass, "rdp": _eps([(step, 4000)], "rdp"), "pld": _eps([(step, 4000)], "pld")}
        print(f"  sparse vector {seg}: {out[str(seg)]}", file=sys.stderr, flush=True)
    return out


def _f(x: Any, digits: int = 4) -> str:
    """A cell: the number, "–", or a refusal in a few words (the JSON keeps the whole message)."""
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    if x is None:
        return "–"
    m = re.search(r"the (selection|Gaussian noise) alone already spends eps = ([\d.]+)", str(x))
    if m:
        return f"infeasible ({m.group(1).split()[-1]} alone {m.group(2)})"
    return "refused (numerically unstable: use rdp)" if "numerically unstable" in str(x) else str(x)


def markdown(res: dict[str, Any]) -> str:
    lines = ["| | PLD (headline) | RDP | paper Thm 3 |", "|---|---|---|---|"]
    lines += [f"| {k} | {_f(r['pld'])} | {_f(r['rdp'])} | {_f(r['paper'])} |" for k, r in res["paper"]["rows"].items()]
    lines += ["", "| target ε | σ (ε'' fixed), PLD | σ, RDP | ε'' per pick (σ = 0.5 fixed), PLD | ε'', RDP |",
              "|---|---|---|---|---|"]
    lines += [f"| {t} | {_f(r['sigma_pld'], 5)} | {_f(r['sigma_rdp'], 5)} | {_f(r['selection_epsilon_pld'], 5)} | "
              f"{_f(r['selection_epsilon_rdp'], 5)} |" for t, r in res["calibration"].items()]
    lines += ["", "| ε per segment | step PMF mass | RDP | PLD now |", "|---|---|---|---|"]
    lines += [f"| {s} | {r['step_mass']:.6g} | {_f(r['rdp'], 3)} | {_f(r['pld'], 3)} |"
              for s, r in res["heavy_steps"].items()]
    return "\n".join(lines)


def main() -> int:
    res: dict[str, Any] = {"setting": {"sampling_rate": Q, "steps": T, "sigma": SIGMA, "delta": DELTA,
                                       "picks": PICKS}}
    res["paper"] = paper_setting()
    res["calibration"] = calibration(res["paper"]["selection_epsilon_per_pick"])
    res["heavy_steps"] = heavy_steps()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1) + "\n")
    print(markdown(res))
    print(f"wrote {OUT.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
