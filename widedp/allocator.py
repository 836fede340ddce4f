"""glibc malloc tuning for the training process (Linux with glibc only; a no-op elsewhere).

With glibc's defaults a large-batch step (b >= 1024) hands its multi-MB buffers back to the OS every step — the
heap top is trimmed past M_TRIM_THRESHOLD, blocks over M_MMAP_THRESHOLD are mmap'ed and unmapped — and page-faults
them back in the next step. Keeping them in the heap removes those faults at the same peak RSS
(bench/bench_allocator.py, V=1e6, 1 thread: b=1024 ~4,000 -> 0 minor faults and 19 -> 13 CPU ms per step; b=4096
~18,000 -> 0 and 78 -> 54 ms).

``widedp`` (the CLI) calls ``tune_malloc()`` first thing. ``WIDEDP_MALLOC=system`` leaves glibc's defaults; a
parameter the user set (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_THRESHOLD_``, or its
``GLIBC_TUNABLES`` entry ``glibc.malloc.trim_threshold`` etc.) is kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys

from widedp.errors import ConfigError

_MiB = 2**20
#: mallopt parameter -> (its number in <malloc.h>, the value set, the glibc environment variable that overrides it)
SETTINGS = {
    "M_TRIM_THRESHOLD": (-1, 256 * _MiB, "MALLOC_TRIM_THRESHOLD_"),  # keep up to 256 MiB free at the heap top
    "M_TOP_PAD": (-2, 16 * _MiB, "MALLOC_TOP_PAD_"),  # grow the heap 16 MiB at a time
    "M_MMAP_THRESHOLD": (-3, 32 * _MiB, "MALLOC_MMAP_THRESHOLD_"),  # mmap only blocks > 32 MiB (glibc's maximum)
}
ENV = "WIDEDP_MALLOC"  # "tuned" (default) or "system"


def tune_malloc() -> dict[str, object]:
    """Set the glibc malloc parameters of ``SETTINGS`` for this process, before its large allocations.

    Returns what was done: ``{"status": "tuned", "set": {name: value}}`` (only those mallopt accepted),
    ``{"status": "system"}`` (opted out) or ``{"status": "unsupported", "reason": ...}``. Raises only
    ``ConfigError`` for a ``WIDEDP_MALLOC`` value other than tuned / system.
    """
    choice = os.environ.get(ENV, "tuned")
    if choice == "system":
        return {"status": "system"}
    if choice not in ("", "tuned"):
        raise ConfigError(f"environment variable {ENV}={choice!r}: expected 'tuned' (default) or 'system'")
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return {"status": "unsupported", "reason": "not glibc Linux"}
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        done = {}
        for name, (param, value, env) in SETTINGS.items():
            user_set = env in os.environ or f"glibc.malloc.{name[2:].lower()}" in os.environ.get("GLIBC_TUNABLES", "")
            if not user_set and mallopt(param, value) == 1:
                done[name] = value
    except (OSError, AttributeError, ValueError) as e:  # no libc / no mallopt: leave the allocator alone
        return {"status": "unsupported", "reason": f"mallopt: {e}"}
    return {"status": "tuned", "set": done}
