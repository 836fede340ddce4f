"""The tiny recommender the two-process tests shard (tests/dp/test_distributed.py, test_selection_distributed.py)."""

from __future__ import annotations

from typing import Any


def tiny_recsys() -> tuple[Any, Any, Any]:
    """(prepared interactions, their train split, the model config): 11 users, 13 items, 400 interactions."""
    from widedp.config.recsys import RecsysDataConfig, RecsysModelConfig
    from widedp.data_prep.interactions import RecsysSplit, prepare_interactions

    data = prepare_interactions(RecsysDataConfig(num_users=11, num_items=13, num_interactions=400, num_tags=6,
                                                 tags_per_item=3, context_cardinality=5, cache_dir=""))
    return data, RecsysSplit(data.train, "cpu"), RecsysModelConfig(dim=4, hidden=(6,), init_scale=0.3)


def single_and_sharded(data: Any, mcfg: Any, rank: int, world: int) -> tuple[Any, Any]:
    """The single-process model and rank ``rank``'s row-sharded copy of the same initial weights."""
    from widedp.models.recsys_sharded import ShardedRecsys, shard_of
    from widedp.tasks.recsys import build_model

    single = build_model(data.cardinality, mcfg, seed=0)
    return single, ShardedRecsys(build_model(data.cardinality, mcfg, seed=0), shard_of(single, rank, world))
