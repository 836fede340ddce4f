"""A run directory is created once, then only resumed (``--resume``) or replaced on request (``--overwrite``), and
written by one process at a time (an advisory lock on ``RUN/.lock``).

A NEW run (not a resume) that stops on an error before it spent anything (no checkpoint, summary or spent-budget
journal yet: e.g. its data or its device turned out unusable, or a bug raised) leaves nothing behind, so the fixed
rerun needs no --overwrite: the directory is removed if this run created it, else the entries it added are. The
machine's errors (``OSError``: a full or read-only disk) and an interrupt keep what was written; a resumed run's
directory is never touched.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from widedp.errors import ConfigError

#: Files whose presence means the directory holds (part of) a run.
RUN_FILES = ("config.yaml", "checkpoint.pt", "summary.json", "spent.json", "metrics.jsonl")
LOCK = ".lock"
#: files whose presence means a run spent privacy or wrote results: never removed on a failure
_SPENT = ("checkpoint.pt", "summary.json", "spent.json")
#: new runs in progress (resolved path -> the entries the directory held when the run started)
_NEW: dict[Path, set[str]] = {}


def holds_run(out: Path) -> bool:
    return out.is_dir() and any((out / f).exists() for f in RUN_FILES)


@contextmanager
def locked(out: Path) -> Iterator[None]:
    """Create ``out`` and hold its lock for the block; a second writer gets a ConfigError at once. A new run
    (``prepare``) failing before it spent anything is removed (module docstring)."""
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        doing = "create the run directory" if created else "write in the run directory (to lock it)"
        raise ConfigError(f"{out}: cannot {doing} ({e.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{out}: another widedp process is writing this run directory") from None
        if not os.access(out, os.W_OK):
            raise ConfigError(f"{out}: the run directory is not writable")
        try:
            yield
        except Exception as e:
            before = _NEW.get(out.resolve())
            if before is not None and not isinstance(e, OSError) and not any((out / f).exists() for f in _SPENT):
                _discard(out, None if created else before)
            raise
    finally:
        _NEW.pop(out.resolve(), None)
        os.close(fd)  # closing releases the lock


def _discard(out: Path, keep: set[str] | None) -> None:
    """Remove ``out`` (``keep`` None) or the entries of ``out`` not in ``keep``."""
    if keep is None:
        shutil.rmtree(out, ignore_errors=True)
        return
    for p in out.iterdir():
        if p.name not in keep:
            _remove(p)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def prepare(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to start a new run over an existing one unless ``overwrite`` (then its files are removed first).
    Call inside ``locked(out)``."""
    if resume:
        return
    if holds_run(out):
        if not overwrite:
            raise ConfigError(f"{out}: already holds a run; continue it with `widedp train --resume {out}`, or "
                              "replace it with --overwrite (its checkpoint, metrics and spent-budget journal are then "
                              "deleted)")
        for p in out.iterdir():
            if p.name != LOCK:
                _remove(p)
    _NEW[out.resolve()] = {p.name for p in out.iterdir()} if out.is_dir() else set()
