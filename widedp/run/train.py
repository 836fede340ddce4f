"""``widedp train`` and its Python API: ``train(cfg, out)``.

    widedp train configs/brown_cbow_sparse_exp.yaml --out runs/exp
    widedp train configs/brown_cbow_nonprivate.yaml --set train.epochs=1
    widedp train --resume runs/exp            # after a crash or kill -9

A task the loop trains (``widedp.tasks.TASKS``: cbow, recsys, module) runs through the one loop
(``widedp.run.loop``, which documents the run directory); a task with its own algorithms (glm) through its ``train``.
Share only what ``widedp export`` writes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from widedp.config import Config, config_from_dict
from widedp.distributed import ranks
from widedp.errors import ConfigError
from widedp.run import loop, rundir
from widedp.tasks import AlgorithmTask, get_task


def train(cfg: Config, out: Path, *, resume: bool = False, progress: bool | str = True, data: Any = None,
          overwrite: bool = False) -> dict[str, Any]:
    """Train ``cfg`` into run directory ``out``; returns the summary dict (also written to summary.json).

    ``data``: already prepared data for the task (e.g. a corpus with canaries inserted); default: the task prepares
    it. A directory that already holds a run is only resumed (``resume``) or replaced (``overwrite``); one process
    at a time writes it.
    """
    with rundir.locked(out):
        rundir.prepare(out, resume=resume, overwrite=overwrite)
        task = get_task(cfg.task)
        if isinstance(task, AlgorithmTask):
            return task.train(cfg, out, resume=resume, progress=progress)
        return loop.run(cfg, task, out, resume=resume, progress=progress, data=data)


def train_rank(cfg: Config, out: Path, *, resume: bool, progress: bool | str, overwrite: bool) -> dict[str, Any]:
    """``train`` in one rank of a distributed run (``widedp.distributed.ranks``): rank 0 locks and prepares ``out``,
    then every rank runs the loop. Returns the summary (rank 0's is the one written)."""
    import torch.distributed as dist

    task = get_task(cfg.task)
    if isinstance(task, AlgorithmTask):
        raise ConfigError(f"task: {cfg.task} runs on one process (its own algorithms have no sharded version)")
    if ranks.rank() == 0:
        with rundir.locked(out):
            rundir.prepare(out, resume=resume, overwrite=overwrite)
            dist.barrier()  # the other ranks start once the directory is ready
            return loop.run(cfg, task, out, resume=resume, progress=progress)
    dist.barrier()
    return loop.run(cfg, task, out, resume=resume, progress=False)


def load_run_config(run_dir: Path) -> Config:
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no config.yaml (not a widedp run directory)")
    return config_from_dict(yaml.safe_load(path.read_text()))


def default_out(config_path: str | os.PathLike[str]) -> Path:
    return Path("runs") / Path(config_path).stem
