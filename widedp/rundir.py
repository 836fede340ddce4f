"""A run directory is created once, then only resumed (``--resume``) or replaced on request (``--overwrite``), and
written by one process at a time (an advisory lock on ``RUN/.lock``)."""

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


def holds_run(out: Path) -> bool:
    return out.is_dir() and any((out / f).exists() for f in RUN_FILES)


@contextmanager
def locked(out: Path) -> Iterator[None]:
    """Create ``out`` and hold its lock for the block; a second writer gets a ConfigError at once."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise ConfigError(f"{out}: cannot create the run directory ({e.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{out}: another widedp process is writing this run directory") from None
        if not os.access(out, os.W_OK):
            raise ConfigError(f"{out}: the run directory is not writable")
        yield
    finally:
        os.close(fd)  # closing releases the lock


def prepare(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to start a new run over an existing one unless ``overwrite`` (then its files are removed first)."""
    if resume or not holds_run(out):
        return
    if not overwrite:
        raise ConfigError(f"{out}: already holds a run; continue it with `widedp train --resume {out}`, or replace "
                          "it with --overwrite (its checkpoint, metrics and spent-budget journal are then deleted)")
    for p in out.iterdir():
        if p.name == LOCK:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
