"""Glue between a training config and the accountant: the per-step spend, calibration, the budget stop, and the
spent-budget journal that survives crashes.

The journal (``RUN/spent.json``) is written atomically *before* anything derived from the steps it covers leaves
the process (logs, checkpoints). On resume:
- a run whose seeds and generator states are in ``RUN/private/`` (``widedp.dp.rng``) replays the lost steps bit-for-bit
  (same batches, same selection, same noise), which releases nothing new, so the ledger continues from the
  checkpoint and ends equal to an uninterrupted run's;
- a run that cannot replay (``private/`` lost, or the Opacus engine) gets fresh randomness, so every step the journal
  recorded stays spent: the steps between the checkpoint and the journal's high-water mark are kept as an extra
  entry of the ledger. When a lost secrets or generator-state file is the reason, the run says so in one line on
  stderr (``warn_redrawn``); a damaged one is refused instead (``widedp.dp.rng.damaged``).

Every eps here is by ``dp.accountant`` (pld or rdp; the config refuses ``paper``); ``ledger_epsilons`` is what a run
reports per epoch and in its summary (the headline accountant's eps, and ``epsilon_rdp`` as the cross-check).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from widedp import accounting
from widedp.config import Config, DPConfig, GaussianThresholdSelectionConfig
from widedp.dp.selection import make_selector
from widedp.dp.spend import GaussianSpend, StepSpend
from widedp.dp.step import dp_step_spend
from widedp.errors import ConfigError
from widedp.run.checkpoint import read_json, write_json

JOURNAL = "spent.json"

#: Training runs ``dp.preselect`` (``widedp.dp.selection.preselect``, drawn by ``widedp.run.preselect_setup``) and
#: charges it before the first step (``preselect_runs`` as a ``run_budget.RunBudget`` prefix entry, recorded by
#: ``widedp.run.engines.sparse.SparseDPEngine.setup``, the one place a run's plan is made; ``widedp epsilon``
#: includes it). False would refuse such configs (``calibrated``, on every training and ``widedp epsilon`` path).
PRESELECT_WIRED = True


def step_spend(dp: DPConfig, *, num_rows: int, batch_size: int, n: int) -> StepSpend:
    """The StepSpend every step of this config emits: ``dp_step_spend`` of the selector ``make_selector`` builds over
    the model's R = ``num_rows`` rows (the record the step itself emits)."""
    return dp_step_spend(make_selector(dp.selection, num_rows=num_rows), sampling_rate=sampling_rate(dp, batch_size, n),
                         noise_multiplier=dp.noise_multiplier, clip1=dp.clip1, clip2=dp.clip2, batch_size=batch_size,
                         noise=dp.noise)


def vocabulary_spend(vocab_dp: Any) -> StepSpend:
    """The DP vocabulary's ledger entry (``widedp.dp.vocab``): one Gaussian of l2 sensitivity 1 and noise multiplier
    ``vocab_dp.noise_multiplier`` on the whole corpus (sampling rate 1), recorded once before the first step. Its
    threshold's delta is not in the entry: ``widedp.run.run_budget`` takes it off the run's delta."""
    return StepSpend(sampling_rate=1.0, parts=(GaussianSpend(noise_multiplier=vocab_dp.noise_multiplier,
                                                             sensitivity=1.0),))


def preselect_runs(dp: DPConfig) -> list[tuple[StepSpend, int]]:
    """What is spent before the first step: ``[(the one-shot pre-selection, 1)]`` with ``dp.preselect``, else []."""
    if dp.preselect is None:
        return []
    from widedp.dp.selection.preselect import preselect_step

    return [(preselect_step(dp.preselect), 1)]


def sampling_rate(dp: DPConfig, batch_size: int, n: int) -> float:
    """q: ``dp.sampling_rate`` when the config fixes it, else b / n (n: the training units, i.e. the data's size)."""
    return dp.sampling_rate if dp.sampling_rate is not None else batch_size / n


def steps_per_epoch(batch_size: int, n: int, *, rate: float | None = None) -> int:
    """Poisson steps per epoch: round(n / b), or round(1 / q) for a fixed sampling rate q."""
    return max(1, round(1 / rate)) if rate is not None else max(1, round(n / batch_size))


def calibrated(cfg: Config, *, num_rows: int, n: int) -> DPConfig:
    """Return ``cfg.dp`` with sigma or the selection's epsilon solved for ``dp.target_epsilon`` (if asked)."""
    dp = cfg.dp
    assert dp is not None
    if dp.preselect is not None and not PRESELECT_WIRED:
        raise ConfigError("dp.preselect: the one-shot pre-selection (widedp.dp.selection.preselect) is not wired into "
                          "training yet; remove dp.preselect")
    if dp.calibrate == "none":
        return dp
    b = cfg.train.batch_size
    steps = total_steps(cfg, n)
    kw: dict[str, Any] = {"steps": steps, "delta": dp.delta, "target_epsilon": dp.target_epsilon,
                          "accountant": dp.accountant}
    if dp.calibrate == "noise_multiplier":
        sigma = accounting.calibrate_noise_multiplier(
            lambda s: step_spend(replace(dp, noise_multiplier=s), num_rows=num_rows, batch_size=b, n=n), **kw
        )
        return replace(dp, noise_multiplier=sigma)
    if isinstance(dp.selection, GaussianThresholdSelectionConfig):
        # its privacy parameter is 1/sigma_sel (eps grows with it); threshold_sigmas keeps tau = c * sigma_sel
        inv = accounting.calibrate_selection_epsilon(
            lambda e: step_spend(
                replace(dp, selection=replace(dp.selection, sigma=1.0 / e)), num_rows=num_rows, batch_size=b, n=n
            ),
            **kw,
        )
        return replace(dp, selection=replace(dp.selection, sigma=1.0 / inv))
    eps = accounting.calibrate_selection_epsilon(
        lambda e: step_spend(
            replace(dp, selection=replace(dp.selection, epsilon=e)), num_rows=num_rows, batch_size=b, n=n
        ),
        **kw,
    )
    return replace(dp, selection=replace(dp.selection, epsilon=eps))


def total_steps(cfg: Config, n: int) -> int:
    """Steps of the whole run: epochs x steps per epoch (n/b Poisson steps with DP), capped by train.max_steps."""
    per_epoch = (steps_per_epoch(cfg.train.batch_size, n, rate=cfg.dp.sampling_rate) if cfg.dp is not None
                 else -(-n // cfg.train.batch_size))
    t = cfg.train.epochs * per_epoch
    return min(t, cfg.train.max_steps) if cfg.train.max_steps else t


def budget_steps(dp: DPConfig, step: StepSpend) -> int | None:
    """The most steps whose composition stays within ``dp.target_epsilon`` (None = no target)."""
    if dp.target_epsilon is None:
        return None
    return accounting.max_steps(step, delta=dp.delta, target_epsilon=dp.target_epsilon, accountant=dp.accountant)


def ledger_epsilons(dp: DPConfig, ledger: accounting.Ledger) -> dict[str, Any]:
    """eps spent by ``ledger``: ``epsilon`` by the run's accountant (the same as summary.json's headline),
    ``epsilon_accountant`` naming it, and ``epsilon_rdp`` (the RDP cross-check); 0 for an empty ledger."""
    return accounting.headline_epsilons(ledger, delta=dp.delta, accountant=dp.accountant)


def write_journal(run_dir: Path, ledger: accounting.Ledger) -> None:
    write_json(run_dir / JOURNAL, ledger.to_json())


def read_journal(run_dir: Path) -> accounting.Ledger | None:
    path = run_dir / JOURNAL
    if not path.exists():
        return None
    try:
        return accounting.Ledger.from_json(read_json(path))
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
    except (KeyError, TypeError, ValueError, AttributeError):
        raise ConfigError(f"{path}: not a spent-budget journal (corrupted?)") from None


def resumed_ledger(checkpointed: accounting.Ledger, journal: accounting.Ledger | None, *, replayable: bool
                   ) -> accounting.Ledger:
    """The ledger a resumed run continues from (see the module docstring)."""
    if journal is None or replayable or journal.steps <= checkpointed.steps:
        return checkpointed
    return journal


def warn_redrawn(lost: str, *, step: int, recharged: int) -> None:
    """One line on stderr: a resume from checkpoint ``step`` cannot replay the lost steps because ``lost`` (a secrets
    or generator-state file of ``RUN/private/``) is missing, so their randomness is drawn fresh and the ``recharged``
    steps the journal recorded after the checkpoint are charged again (conservative)."""
    if recharged > 0:
        what = (f"the {recharged:,} step(s) journaled after it (steps {step + 1:,}-{step + recharged:,}) are charged "
                f"again (conservative: the ledger counts {recharged:,} more step(s) than the run trains, so its ε "
                "is above an uninterrupted run's)")
    else:
        what = "no step was journaled after it, so none is charged twice"
    print(f"widedp: warning: {lost} is missing: the randomness of the steps after the checkpoint at step {step:,} is "
          f"drawn fresh (they cannot be replayed); {what}", file=sys.stderr)
