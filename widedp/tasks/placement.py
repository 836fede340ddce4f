"""Where a task builds its model's tables: for real on one process; on the meta device (shapes, no storage) on each
rank of a run on several processes, whose sharded model then draws only its own row blocks of the same initial
weights (``widedp.models.rowinit``), so that no rank ever holds a whole table."""

from __future__ import annotations

from typing import Any

from widedp.distributed import ranks


def tables_on_meta(cfg: Any, *, resumed: bool) -> bool:
    """Whether this process builds the task's model on the meta device: a rank of a run on several processes, except
    rank 0 of a new run with ``dp.preselect``, which draws the pre-selection from the whole model's per-sample rows
    (a resumed run loads it from RUN/private/ instead)."""
    if ranks.world() <= 1:
        return False
    dp = getattr(cfg, "dp", None)
    preselects = dp is not None and dp.preselect is not None and not resumed
    return not (preselects and ranks.rank() == 0)
