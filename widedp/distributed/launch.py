"""``widedp train ... --nproc N``: N local processes of ``python -m widedp train ...`` under torch elastic (what
``torchrun --standalone --nproc_per_node=N -m widedp train ...`` does), for users without torchrun at hand.

The launcher prints ONE line for the run when it fails or is interrupted (``widedp.distributed.outcome``: the
ranks tell it how they ended; torch elastic's logs and failure report are not printed). SIGINT / SIGTERM are
forwarded to the ranks (by torch elastic), which stop where they are; the line says where (rank 0's step and last
checkpoint) and the exit status is 128 + the signal. A failed rank: the line names it; the exit status is its
status (2 for a bad config), 1 for a rank killed by a signal. The ranks end with the launcher, even a launcher
killed by SIGKILL (``widedp.distributed.signals.follow_launcher``).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from widedp.distributed import outcome, signals
from widedp.errors import ConfigError


def launch(nproc: int, argv: list[str]) -> int:
    """Run ``python -m widedp *argv`` on ``nproc`` local ranks (rendezvous on a free localhost port); the exit
    status, after one line on stderr if the run failed or was interrupted."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ConfigError(f"--nproc: expected a number of processes >= 1, got {nproc}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("--nproc: this process is already one rank of a distributed run (torchrun); drop --nproc")
    warn_oversubscribed(nproc)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N processes share the cores
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    signum, exits = None, {}
    with _ranks_report_to() as folder:
        try:
            elastic_launch(config, sys.executable)("-m", "widedp", *argv)
            return 0
        except SignalException as e:  # torch elastic forwarded it to the ranks and waited for them
            signum = int(e.sigval)
            signals.mark(signum)
        except ChildFailedError as e:
            exits = {rank: f.exitcode for rank, f in e.failures.items()}
        finally:
            signals.install()  # (torch elastic's handlers raise its SignalException)
        line, code, detail = outcome.launcher_line(folder, nproc=nproc, signum=signum, exits=exits)
    if detail and os.environ.get("WIDEDP_TRACEBACK"):
        print(detail, end="", file=sys.stderr)
    print(line, file=sys.stderr)
    return code


@contextmanager
def _ranks_report_to() -> Iterator[Path]:
    """A folder the ranks write how they ended to (``outcome.LAUNCH_DIR``), this process's pid for them to end
    with (``signals.LAUNCHER_PID``), torch elastic's logs off; all undone after the block."""
    saved = {k: os.environ.get(k) for k in (outcome.LAUNCH_DIR, signals.LAUNCHER_PID)}
    with tempfile.TemporaryDirectory(prefix="widedp-launch-") as folder:
        os.environ[outcome.LAUNCH_DIR], os.environ[signals.LAUNCHER_PID] = folder, str(os.getpid())
        logging.disable(logging.CRITICAL)  # its warnings on a signal or a failure would be lines beside ours
        try:
            yield Path(folder)
        finally:
            logging.disable(logging.NOTSET)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def warn_oversubscribed(nproc: int) -> None:
    """One line on stderr when ``nproc`` processes are more than the CPU cores this process may use: they share
    them (each rank also starts its own Python and torch), so the run starts and steps slowly."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if nproc > cores:
        print(f"widedp: warning: --nproc {nproc} on {cores} CPU core(s): the processes share them and start slowly "
              f"(each imports torch); at most {cores} is faster here", file=sys.stderr)
