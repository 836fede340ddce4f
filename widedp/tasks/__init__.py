"""Tasks: what a run trains (its data, its model, the facts its privacy statement needs), behind one protocol.

    TASKS = {"cbow": ..., "recsys": ..., "glm": ..., "module": ...}   name -> a function returning the task
    task = get_task(cfg.task)

The functions import their task's module when called (recsys pulls in torchrec): nothing registers itself at import
time. A ``Task`` is trained by the one loop (``widedp.run.loop``) with any engine (``widedp.run.trainers``); an
``AlgorithmTask`` (glm: convex DP algorithms, not the DP-sparse step) runs its own ``train``. The protocols and what
a task builds are in ``widedp.tasks.protocol``; ``widedp.tasks.base.LoopTask`` holds the defaults a task may keep.
"""

from __future__ import annotations

from collections.abc import Callable

from widedp.accounting.statement import UnitFacts
from widedp.errors import ConfigError
from widedp.extras import needs
from widedp.tasks.protocol import AlgorithmTask, Built, Shape, Task

__all__ = ["TASKS", "AlgorithmTask", "Built", "Shape", "Task", "UnitFacts", "get_task", "loop_task"]


def _cbow() -> Task:
    from widedp.tasks.cbow import TASK

    return TASK


def _recsys() -> Task:
    with needs("recsys", "task: recsys"):
        from widedp.tasks.recsys import TASK

    return TASK


def _glm() -> AlgorithmTask:
    from widedp.tasks.glm import TASK

    return TASK


def _module() -> Task:
    from widedp.tasks.module import TASK

    return TASK


#: task name (the config's ``task:``) -> the function that returns it
TASKS: dict[str, Callable[[], Task | AlgorithmTask]] = {"cbow": _cbow, "recsys": _recsys, "glm": _glm,
                                                          "module": _module}


def get_task(name: str) -> Task | AlgorithmTask:
    if name not in TASKS:
        raise ConfigError(f"task: expected one of {', '.join(TASKS)}, got {name!r}")
    return TASKS[name]()


def loop_task(name: str) -> Task:
    """The task ``name``, which must be one the loop trains (not an ``AlgorithmTask``)."""
    task = get_task(name)
    if isinstance(task, AlgorithmTask):
        raise ConfigError(f"task: {name} runs its own algorithms (`widedp train CONFIG`), not the DP-sparse loop")
    return task
