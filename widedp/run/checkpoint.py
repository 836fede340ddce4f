"""Atomic checkpoints and small JSON files that survive a crash or ``kill -9`` mid-write.

Checkpoints hold tensors, numbers, strings, lists and dicts only, and are read with
``torch.load(..., weights_only=True)``: a run directory from elsewhere cannot execute code.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from widedp.errors import ConfigError

CHECKPOINT = "checkpoint.pt"


def _atomic_write(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> None:
    """Write ``run_dir/checkpoint.pt`` atomically (temp file + fsync + rename); the previous one stays on failure."""
    def write(f: Any) -> None:
        try:
            torch.save(state, f)
        except RuntimeError as e:  # torch's writer reports a full disk as "[enforce fail at ...]"
            raise OSError(errno.EIO, f"cannot write the checkpoint ({str(e).splitlines()[0]})",
                          str(run_dir / CHECKPOINT)) from None

    _atomic_write(run_dir / CHECKPOINT, write)


def load_checkpoint(run_dir: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = run_dir / CHECKPOINT
    if not path.is_file():
        if (run_dir / "config.yaml").is_file():  # a run that stopped before its first checkpoint
            raise ConfigError(f"{run_dir}: no {CHECKPOINT} (the run stopped before its first checkpoint); start it "
                              "again with --overwrite (its spent-budget journal, and a DP vocabulary it drew, are "
                              "then deleted)")
        raise ConfigError(f"{run_dir}: no {CHECKPOINT} (not a widedp run directory, or nothing saved yet)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # a tampered or truncated file must not become a traceback (or code execution)
        raise ConfigError(f"{path}: cannot be loaded safely ({type(e).__name__})") from None


def write_json(path: Path, obj: Any, *, indent: int | None = 2) -> None:
    """Write JSON atomically (``indent`` None: compact, for large lists)."""
    data = json.dumps(obj, indent=indent, sort_keys=True, separators=None if indent else (",", ":")).encode()
    _atomic_write(path, lambda f: f.write(data))


def write_text(path: Path, text: str) -> None:
    """Write UTF-8 text atomically."""
    data = text.encode()
    _atomic_write(path, lambda f: f.write(data))


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except json.JSONDecodeError:
        raise ConfigError(f"{path}: not valid JSON") from None
