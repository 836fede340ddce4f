"""What the machine gives a run, checked before it is asked for: memory for the model's tables and CPU threads.

Will the tables fit? An estimate made before they are allocated, so that a model larger than the machine is one line
naming ``model.dim`` (exit 2) rather than an allocator's traceback or the kernel's OOM killer.

The estimate: rows x dim x 4 bytes (float32) for the weights, times ``STATE_COPIES`` for what training keeps
beside them (the optimizer's moments, the gradient and noise of selected rows, the best epoch's copy, the
checkpoint's), against the memory the device has free now (``MemAvailable`` on Linux; the GPU's free memory for a
CUDA device).
"""

from __future__ import annotations

import os
import sys

import torch

from widedp.errors import ConfigError

#: weights + Adam's two moments + a gradient / noise buffer + a copy (checkpoint or keep_best)
STATE_COPIES = 5
_BYTES = 4  # float32


def available_bytes(device: torch.device | str = "cpu") -> int | None:
    """Memory free on ``device`` now (None: unknown)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_tables_fit(rows: int, dim: int, *, device: torch.device | str = "cpu", what: str = "") -> None:
    """A ConfigError naming model.dim when ``rows`` x ``dim`` float32 weights, with their training state, need more
    than ``device`` has free. ``what``: the tables, in words (e.g. "2 x 1,000 rows")."""
    need = rows * dim * _BYTES * STATE_COPIES
    free = available_bytes(device)
    if free is None or need <= free:
        return
    raise ConfigError(f"model.dim: {dim:,} over {what or f'{rows:,} rows'} needs about {_gib(need)} to train "
                      f"(weights {_gib(rows * dim * _BYTES)} and their optimizer state), more than the {_gib(free)} "
                      f"free on {torch.device(device).type}; lower it")


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"


def set_threads(threads: int) -> None:
    """``torch.set_num_threads(train.threads)`` (0: torch's default), at most the machine's CPUs: more is clamped
    with a one-line warning (torch's thread pools crash on absurd counts)."""
    if not threads:
        return
    cpus = os.cpu_count() or 1
    if threads > cpus:
        print(f"widedp: warning: train.threads: {threads:,} is more than this machine's {cpus} CPUs; using {cpus}",
              file=sys.stderr)
        threads = cpus
    torch.set_num_threads(threads)
