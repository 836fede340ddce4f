"""Engines: what one training step is, as small objects the one loop (``widedp.run.loop``) drives.

    NonPrivateEngine   autograd and a torch optimizer on shuffled batches          (no ``dp:`` section)
    SparseDPEngine     widedp's DP step (``widedp.dp.step.dp_step``) on Poisson batches  (``dp.engine: widedp``)
    OpacusEngine       Opacus' DP-SGD on the task's Opacus model, the baseline     (``dp.engine: opacus``)
    ShardedDPEngine    widedp's DP step over row-sharded tables, one rank of several (torchrun, ``--nproc``)

Life of an engine: ``make_engine`` (checks the config; the DP engines draw or load the run's secret seeds in
RUN/private/ and know what is spent before the first step), ``setup(built, task)`` (optimizer, sampler, the privacy
plan, with ``dp.preselect``'s one-shot draw: ``widedp.run.preselect_setup``), ``load_state_dict`` on resume, then
per step ``sample(step)`` and ``step(drawn, epoch)``. The DP engines keep the privacy ledger, write the spent-budget
journal ahead of every logging interval (``reserve``) and stop before a step would exceed ``dp.target_epsilon``
(``exhausted``); ``widedp.run.journal`` says why.
"""

from __future__ import annotations

from pathlib import Path

import torch

from widedp.config import Config
from widedp.run.engines.base import Drawn, Engine, Report, StepOutput

__all__ = ["Drawn", "Engine", "Report", "StepOutput", "make_engine"]


def make_engine(cfg: Config, out: Path, *, device: torch.device, resumed: bool) -> Engine:
    """The engine ``cfg`` asks for (module docstring); ``resumed``: the run continues from a checkpoint."""
    from widedp.run import ranks

    if ranks.world() > 1:  # one rank of a distributed run (``widedp.run.ranks``)
        from widedp.run.engines.sharded import ShardedDPEngine

        return ShardedDPEngine(cfg, out, device=device, resumed=resumed)
    if cfg.dp is None:
        from widedp.run.engines.plain import NonPrivateEngine

        return NonPrivateEngine(cfg, device=device)
    if cfg.dp.engine == "opacus":
        from widedp.run.engines.opacus_baseline import OpacusEngine

        return OpacusEngine(cfg, out, device=device, resumed=resumed)
    from widedp.run.engines.sparse import SparseDPEngine

    return SparseDPEngine(cfg, out, device=device, resumed=resumed)
