"""How a ``widedp`` command that failed or was interrupted ends: one line on stderr and its exit status, on one
process and on several.

- One process: ``widedp: error: ...`` (bad input: 2; the machine's ``OSError``: 1), or
  ``widedp: interrupted (SIGTERM) at step N ...`` (128 + the signal: 130 for Ctrl-C, 143 for SIGTERM); a bug keeps
  its traceback.
- A rank of torchrun: rank 0 alone says a config error or an interrupt (the ranks share them).
- A rank of widedp's ``--nproc`` launcher (``LAUNCH_DIR`` in its environment) prints nothing: it writes how it
  ended to ``LAUNCH_DIR/rank{R}.json`` and the launcher prints ONE line for the run (``launcher_line``), naming the
  rank that failed. ``WIDEDP_TRACEBACK=1`` also prints that rank's traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from widedp.distributed import signals
from widedp.errors import ConfigError

LAUNCH_DIR = signals.LAUNCH_DIR


def launched() -> bool:
    """Whether this process is a rank of widedp's ``--nproc`` launcher."""
    return bool(os.environ.get(LAUNCH_DIR)) and "RANK" in os.environ


@dataclass(frozen=True)
class Ending:
    """How a process ended: ``kind`` "error" or "interrupted", ``text`` its line without ``widedp: `` (``error:
    ...`` / ``interrupted (...) ...``), ``code`` its exit status, ``detail`` a bug's traceback."""

    kind: str
    text: str
    code: int
    detail: str = ""


def ending(e: BaseException, *, command: str) -> Ending | None:
    """How a command (``command``: the subcommand) that raised ``e`` ends; None for a bug outside a launched rank
    (the caller re-raises it: its traceback). After SIGINT/SIGTERM any exception is the interrupt unwinding."""
    signum = signals.received() or (signal.SIGINT if isinstance(e, KeyboardInterrupt) else None)
    if signum is not None:
        return Ending("interrupted", signals.interrupted_text(signum, signals.position_of(e), command=command),
                      128 + signum)
    if isinstance(e, ConfigError):
        return Ending("error", f"error: {e}", 2)
    if isinstance(e, OSError):  # the machine's side: a read-only or full disk, a file where a folder should be, ...
        where = f"{e.filename}: " if e.filename else ""
        return Ending("error", f"error: {where}{e.strerror or e} (what was written before is kept)", 1)
    if launched():
        first = (str(e).strip().splitlines() or [""])[0]
        return Ending("error", f"error: {type(e).__name__}" + (f": {first}" if first else ""), 1,
                      detail="".join(traceback.format_exception(e)))
    return None


def report(end: Ending) -> int:
    """Say ``end`` (stderr; in a launched rank, to the launcher) and return its exit status."""
    if launched():
        _write_status(Path(os.environ[LAUNCH_DIR]), end)
        return end.code
    from widedp.distributed import ranks

    if (end.kind == "error" and end.code == 1) or ranks.reports_errors():  # (a machine's error may be one rank's)
        print(f"widedp: {end.text}", file=sys.stderr)
    return end.code


def _write_status(folder: Path, end: Ending) -> None:
    """``folder/rank{R}.json``; nothing once the launcher is gone (killed: nobody reads it; the watchdog removes
    ``folder``)."""
    if str(os.getppid()) != os.environ.get(signals.LAUNCHER_PID):
        return
    rank = int(os.environ.get("RANK", "0"))
    doc = {"rank": rank, "kind": end.kind, "text": end.text, "code": end.code, "detail": end.detail,
           "time": time.time()}
    tmp = folder / f".rank{rank}.json.tmp"
    with contextlib.suppress(OSError):  # (the folder removed as the launcher dies)
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, folder / f"rank{rank}.json")


def read_statuses(folder: Path) -> dict[int, dict]:
    """The ranks' endings in ``folder`` (rank -> its document), those that wrote one."""
    out = {}
    for p in folder.glob("rank*.json"):
        try:
            doc = json.loads(p.read_text())
            out[int(doc["rank"])] = doc
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def launcher_line(folder: Path, *, nproc: int, signum: int | None, exits: dict[int, int]) -> tuple[str, int, str]:
    """The launcher's one line, its exit status and the traceback behind it ("" if none), from the ranks' endings
    in ``folder``, the signal the launcher got (None: none) and the failed ranks' exit codes (``exits``: rank ->
    code, negative: killed by that signal).

    The launcher interrupted: rank 0's interrupted line (where the run was), 128 + ``signum``. Else the first
    rank's error (an error every rank raised: rank 0's line, unchanged), else a rank that died without a word
    (``kill -9``), else the first rank interrupted from outside; the line names the rank."""
    statuses = read_statuses(folder)
    first = statuses.get(0)
    if signum is not None:
        text = (first["text"] if first and first["kind"] == "interrupted"
                else signals.interrupted_text(signum, None, command="train"))
        return f"widedp: {text}", 128 + signum, ""
    if first and first["kind"] == "error" and first["code"] == 2:
        return f"widedp: {first['text']}", 2, first.get("detail", "")
    errors = _first(statuses, "error")
    if errors is not None:
        return _rank_line(errors, nproc)
    silent = sorted(r for r in exits if r not in statuses)
    if silent:
        rank, code = silent[0], exits[silent[0]]
        how = f"killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
        return (f"widedp: error: rank {rank} of {nproc} {how} (the other ranks were stopped; what was written is "
                "kept)", code if code > 0 else 1, "")
    stopped = _first(statuses, "interrupted")
    if stopped is not None:
        return _rank_line(stopped, nproc)
    return "widedp: error: a rank failed without saying why", 1, ""


def _first(statuses: dict[int, dict], kind: str) -> dict | None:
    """The earliest ending of ``kind`` (ties: the lowest rank)."""
    found = sorted((s for s in statuses.values() if s.get("kind") == kind), key=lambda s: (s["time"], s["rank"]))
    return found[0] if found else None


def _rank_line(status: dict, nproc: int) -> tuple[str, int, str]:
    text = status["text"].removeprefix("error: ")
    return f"widedp: error: rank {status['rank']} of {nproc}: {text}", int(status["code"]), status.get("detail", "")


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
