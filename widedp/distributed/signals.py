"""Ctrl-C (SIGINT) and SIGTERM: one line, exit status 130 or 143, nothing written lost; ranks that outlive their
``--nproc`` launcher end.

``widedp`` turns the first SIGINT or SIGTERM into ``Interrupted`` (a ``KeyboardInterrupt``) in the main thread; it
unwinds the run (the lock is released, an atomic write in progress leaves the previous file, the spent-budget
journal was written ahead), and the CLI prints ``interrupted_text``: the signal, the step the run reached, its last
checkpoint and how to continue. A later signal while the first unwinds is ignored (``kill -9`` still works).

The training loop attaches where it was (``Position``, through ``noting``) to whatever exception leaves it.

A rank started by widedp's launcher (``LAUNCHER_PID`` in its environment) ends with the launcher, even one killed
by SIGKILL: it asks Linux for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``) and a watchdog thread polls its
parent's pid (the race before the ``prctl``, other systems), sending SIGTERM, then SIGKILL after ``GRACE_S``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

#: the signals widedp handles in every process (torch elastic handles the launcher's while the ranks run)
HANDLED = (signal.SIGINT, signal.SIGTERM)
#: set by widedp's ``--nproc`` launcher for its ranks: its pid (the parent they end with)
LAUNCHER_PID = "WIDEDP_LAUNCHER_PID"
#: set by widedp's ``--nproc`` launcher for its ranks: the folder where each writes how it ended
#: (``widedp.distributed.outcome``), removed by a rank that outlives the launcher
LAUNCH_DIR = "WIDEDP_LAUNCH_DIR"
#: seconds an orphaned rank has to unwind after its SIGTERM before the watchdog sends SIGKILL
GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1

_state: dict[str, int | None] = {"received": None}
_installed: dict[int, object] = {}  # signal -> the handler ``handled`` replaced


class Interrupted(KeyboardInterrupt):
    """The process got ``signum`` (SIGINT or SIGTERM): the run unwinds and the process exits 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def received() -> int | None:
    """The first SIGINT or SIGTERM this process got since ``handled`` began (None: none)."""
    return _state["received"]


def mark(signum: int) -> None:
    """Record that the process got ``signum`` through another handler (torch elastic's in the launcher): a later
    SIGINT / SIGTERM is then ignored too."""
    if _state["received"] is None:
        _state["received"] = signum


def _handler(signum: int, frame: FrameType | None) -> None:
    if _state["received"] is not None:  # the first one is unwinding the run: let it finish (and say one line)
        return
    _state["received"] = signum
    raise Interrupted(signum)


def check() -> None:
    """Raise ``Interrupted`` again if a SIGINT / SIGTERM came within ``handled`` and the run still goes on: Python
    drops an exception raised in a finaliser (``__del__``, a weakref callback), printing "Exception ignored", and a
    later signal is ignored by design, so without this a run interrupted there would never stop. The training loop
    calls it every step."""
    if _state["received"] is not None and _installed:
        raise Interrupted(_state["received"])


def install() -> None:
    """(Re)install widedp's handler for the ``HANDLED`` signals ``handled`` took over (after torch elastic had
    its own in the launcher)."""
    for sig in _installed:
        signal.signal(sig, _handler)


@contextmanager
def handled() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise ``Interrupted`` (once); the previous handlers come back after it.
    A signal ignored when the block begins (``nohup``, a background job), or handled outside Python, is left
    alone. In a rank of widedp's launcher, the rank also ends when the launcher dies (``follow_launcher``)."""
    if threading.current_thread() is not threading.main_thread():  # (signals are the main thread's)
        yield
        return
    _state["received"] = None
    previous = {sig: signal.getsignal(sig) for sig in HANDLED}
    _installed.clear()
    _installed.update({sig: h for sig, h in previous.items() if h is not None and h is not signal.SIG_IGN})
    install()
    follow_launcher()
    try:
        yield
    finally:
        for sig, h in _installed.items():
            signal.signal(sig, h)  # type: ignore[arg-type]
        _installed.clear()


def follow_launcher() -> None:
    """In a rank of widedp's launcher: SIGTERM when the launcher dies, SIGKILL ``GRACE_S`` later if still alive."""
    launcher = os.environ.get(LAUNCHER_PID)
    if not launcher or not launcher.isdigit():
        return
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no prctl: the watchdog alone
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    threading.Thread(target=_watch, args=(int(launcher),), name="widedp-launcher-watchdog", daemon=True).start()


def _watch(launcher: int, *, every_s: float = 0.2) -> None:
    """Poll the parent's pid; once it is not ``launcher`` (the launcher died, even before the ``prctl``): remove
    the launcher's ``LAUNCH_DIR`` (nobody reads it now), SIGTERM unless a signal already came, then SIGKILL after
    ``GRACE_S``."""
    while os.getppid() == launcher:
        time.sleep(every_s)
    if os.environ.get(LAUNCH_DIR):
        shutil.rmtree(os.environ[LAUNCH_DIR], ignore_errors=True)
    if received() is None:
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class Position:
    """Where a run was when it stopped: ``step`` of ``total`` done, ``checkpoint`` the step of its last checkpoint
    (None: none yet), on ``world`` processes, in run directory ``out``."""

    out: Path
    step: int
    total: int
    checkpoint: int | None
    world: int = 1


@contextmanager
def noting(where: Callable[[], Position]) -> Iterator[None]:
    """Attach ``where()`` to an exception (an interrupt, an error) leaving the block (``position_of`` reads it)."""
    try:
        yield
    except BaseException as e:
        if position_of(e) is None:
            e.widedp_position = where()  # type: ignore[attr-defined]
        raise


def position_of(e: BaseException | None) -> Position | None:
    """The ``Position`` attached to ``e`` or to an exception it was raised from or while handling."""
    seen = 0
    while e is not None and seen < 20:
        pos = getattr(e, "widedp_position", None)
        if isinstance(pos, Position):
            return pos
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def interrupted_text(signum: int, pos: Position | None, *, command: str) -> str:
    """``interrupted (SIGTERM) at step N of T; the last checkpoint is step M: resume with ...`` (without the
    ``widedp: `` prefix): the signal, where the run of ``command`` (a subcommand) was, how to continue."""
    said = f"interrupted ({signal.Signals(signum).name})"
    if pos is None:
        return f"{said}; nothing written is lost (a checkpoint and the spent-budget journal, where there are any, " \
               "are kept)"
    said += f" at step {pos.step:,} of {pos.total:,}"
    if pos.checkpoint is None:
        return f"{said}, before its first checkpoint (its spent-budget journal is kept): nothing to resume; start " \
               f"it again with --overwrite"
    said += f"; the last checkpoint is step {pos.checkpoint:,}"
    if command != "train":
        return f"{said} (in {pos.out})"
    nproc = f" --nproc {pos.world}" if pos.world > 1 else ""
    return f"{said}: resume with `widedp train --resume {shlex.quote(str(pos.out))}{nproc}`"
