"""``widedp train ... --nproc N``: N local processes of ``python -m widedp train ...`` under torch elastic (what
``torchrun --standalone --nproc_per_node=N -m widedp train ...`` does), for users without torchrun at hand.

The exit status is 0, or the first failed rank's (2 for a bad config, whose one-line error rank 0 printed);
torch elastic's own failure report is not printed (the ranks say what failed).
"""

from __future__ import annotations

import logging
import os
import sys
import uuid

from widedp.errors import ConfigError


def launch(nproc: int, argv: list[str]) -> int:
    """Run ``python -m widedp *argv`` on ``nproc`` local ranks (rendezvous on a free localhost port)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 1:
        raise ConfigError(f"--nproc: expected a number of processes >= 1, got {nproc}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("--nproc: this process is already one rank of a distributed run (torchrun); drop --nproc")
    warn_oversubscribed(nproc)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N processes share the cores
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0)
    try:
        elastic_launch(config, sys.executable)("-m", "widedp", *argv)
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


def warn_oversubscribed(nproc: int) -> None:
    """One line on stderr when ``nproc`` processes are more than the CPU cores this process may use: they share
    them (each rank also starts its own Python and torch), so the run starts and steps slowly."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if nproc > cores:
        print(f"widedp: warning: --nproc {nproc} on {cores} CPU core(s): the processes share them and start slowly "
              f"(each imports torch); at most {cores} is faster here", file=sys.stderr)
