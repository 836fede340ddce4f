"""What a finished (or budget-stopped) run reports: ``summary.json``, the privacy statement, the plot title.

``summary.json`` and ``metrics.jsonl`` hold non-private statistics of the training batches (train loss, clipped
fractions, the share of selected rows the batch touched, ...): they are diagnostics for whoever holds the private
run directory and must not be shared. ``widedp export`` writes what may be shared.
"""

from __future__ import annotations

import sys
from typing import Any

from widedp import accounting
from widedp.accounting import statement
from widedp.config import Config
from widedp.run import plan

DIAGNOSTICS_NOTICE = ("NON-PRIVATE diagnostics of the training batches (train loss, clipping, selection "
                      "statistics): not covered by the privacy guarantee; do not share this file. Share only what "
                      "`widedp export` writes.")


def run_statement(facts: statement.UnitFacts, dp: Any, ledger: accounting.Ledger, *, private_rng: bool,
                  prefix: plan.Prefix | None = None,
                  epsilons: dict[str, Any] | None = None) -> statement.PrivacyStatement:
    """The statement of a run of the DP-sparse engine: the headline accountant's ε over everything the ledger
    recorded (the DP vocabulary included, ``prefix``; ``epsilons``: ``epoch_epsilons``' figures, when at hand)."""
    eps = (epsilons if epsilons is not None else epoch_epsilons(dp, ledger, prefix)).get("epsilon", 0.0)
    return statement.for_run(facts, epsilon=eps, delta=dp.delta, accountant=dp.accountant, private_rng=private_rng)


def summary(cfg: Config, history: list[dict[str, Any]], *, step: int, per_epoch: int, wall: float, setup_s: float,
            n: int, st: statement.PrivacyStatement, unit_info: dict[str, Any] | None = None,
            kept_epoch: int | None = None) -> dict[str, Any]:
    """The summary dict of a run of the loop (written to summary.json; the engine adds its ``dp`` section).
    ``unit_info``: the privacy unit's facts (unit, N units, cap, samples dropped by the cap); with units,
    ``samples_per_s`` counts units."""
    last = history[-1] if history else {}
    if kept_epoch is not None:  # train.keep_best: the final weights are that epoch's
        last = next(h for h in history if h["epoch"] == kept_epoch)
    samples = step * cfg.train.batch_size
    out: dict[str, Any] = {
        "train_loss": last.get("train_loss"), "valid_loss": last.get("valid_loss"),
        "test_loss": last.get("test_loss"), "steps": step, "epochs": step / per_epoch,
        "samples_per_s": samples / wall if wall > 0 else None, "train_s": wall, "setup_s": setup_s, "n_train": n,
        "config_hash": cfg.hash(), "private": st.private,
        "initial_valid_loss": history[0]["valid_loss"], "privacy": st.to_json(), "notice": DIAGNOSTICS_NOTICE,
    }
    if kept_epoch is not None:
        out["kept_epoch"] = kept_epoch  # the losses above and the saved weights are that epoch's (train.keep_best)
    if unit_info:
        out["units"] = unit_info
    return out


def epoch_epsilons(dp: Any, ledger: accounting.Ledger, prefix: plan.Prefix | None = None) -> dict[str, float]:
    """Per-epoch ε for metrics.jsonl: the headline accountant's (as in the summary) and the RDP cross-check; with
    a DP vocabulary (``prefix``) its release is included."""
    if dp is None or not ledger.steps:
        return {}
    return plan.epsilons(dp, ledger, prefix)


def plot_title(dp: Any, st: statement.PrivacyStatement) -> str:
    """loss.png's title of a DP-sparse run: the method, and ε with its δ and unit."""
    head = f"DP {dp.selection.name}, σ={dp.noise_multiplier:.3g}\nε={st.epsilon:.3g}, δ={dp.delta:g} per {st.unit}"
    return head if st.private else "NOT PRIVATE (reproducible rng) " + head


def warn_nonfinite(count: int, step: int) -> None:
    print(f"widedp: warning: {count} sample(s) with a non-finite gradient up to step {step} contributed zero "
          "(see nonfinite_samples in metrics.jsonl)", file=sys.stderr)
