"""The spent-budget journal (``RUN/spent.json``), which survives crashes: written atomically *before* anything derived
from the steps it covers leaves the process (logs, checkpoints). On resume:
- a run whose seeds and generator states are in ``RUN/private/`` (``widedp.dp.rng``) replays the lost steps bit-for-bit
  (same batches, same selection, same noise), which releases nothing new, so the ledger continues from the
  checkpoint and ends equal to an uninterrupted run's;
- a run that cannot replay (``private/`` lost, or the Opacus engine) gets fresh randomness, so every step the journal
  recorded stays spent: the steps between the checkpoint and the journal's high-water mark are kept as an extra
  entry of the ledger. When a lost secrets or generator-state file is the reason, the run says so in one line on
  stderr (``warn_redrawn``); a damaged one is refused instead (``widedp.dp.rng.damaged``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from widedp import accounting
from widedp.errors import ConfigError
from widedp.run.checkpoint import read_json, write_json

JOURNAL = "spent.json"


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
