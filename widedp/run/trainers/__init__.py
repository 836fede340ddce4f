"""Trainers: what one training step is, as small objects the one loop (``widedp.run.loop``) drives.

    NonPrivateTrainer   autograd and a torch optimizer on shuffled batches          (no ``dp:`` section)
    SparseDPTrainer     widedp's DP step (``widedp.dp.step.dp_step``) on Poisson batches  (``dp.engine: widedp``)
    OpacusTrainer       Opacus' DP-SGD on the task's Opacus model, the baseline     (``dp.engine: opacus``)
    ShardedDPTrainer    widedp's DP step over row-sharded tables, one rank of several (torchrun, ``--nproc``)

Life of a trainer: ``make_trainer`` (checks the config; the DP trainers draw or load the run's secret seeds in
RUN/private/ and know what is spent before the first step), ``setup(built, task)`` (optimizer, sampler, the privacy
plan, with ``dp.preselect``'s one-shot draw: ``widedp.run.preselect_setup``), ``load_state_dict`` on resume, then
per step ``sample(step)`` and ``step(drawn, epoch)``. The DP trainers keep the privacy ledger, write the spent-budget
journal ahead of every logging interval (``reserve``) and stop before a step would exceed ``dp.target_epsilon``
(``exhausted``); ``widedp.run.journal`` says why.
"""

from __future__ import annotations

from pathlib import Path

import torch

from widedp.config import Config
from widedp.extras import needs
from widedp.run.trainers.base import Drawn, Report, StepOutput, Trainer

__all__ = ["Drawn", "Trainer", "Report", "StepOutput", "make_trainer"]


def make_trainer(cfg: Config, out: Path, *, device: torch.device, resumed: bool) -> Trainer:
    """The trainer ``cfg`` asks for (module docstring); ``resumed``: the run continues from a checkpoint."""
    from widedp.distributed import ranks

    if ranks.world() > 1:  # one rank of a distributed run (``widedp.distributed.ranks``)
        from widedp.run.trainers.sharded import ShardedDPTrainer

        return ShardedDPTrainer(cfg, out, device=device, resumed=resumed)
    if cfg.dp is None:
        from widedp.run.trainers.plain import NonPrivateTrainer

        return NonPrivateTrainer(cfg, device=device)
    if cfg.dp.engine == "opacus":
        with needs("opacus", "dp.engine: opacus"):
            from widedp.run.trainers.opacus_baseline import OpacusTrainer

        return OpacusTrainer(cfg, out, device=device, resumed=resumed)
    from widedp.run.trainers.sparse import SparseDPTrainer

    return SparseDPTrainer(cfg, out, device=device, resumed=resumed)
