"""The row layouts of the DP step (``widedp.dp.layout``) in one process: the one place that refuses an option, the
row-block geometry, and the DP layer's independence from models and tasks. The collectives of ``RowBlocks`` are
tested on two processes in test_distributed.py, test_secure_noise.py and selection/test_selection_distributed.py."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from widedp.dp.layout import OPTIONS, RowBlocks, RowShard, SingleProcess, check_options
from widedp.errors import ConfigError


def test_options_are_refused_in_one_place_with_the_key():
    blocks = RowBlocks(RowShard(0, 2, (0, 5), (5, 7), 2), shared=torch.Generator())
    check_options(SingleProcess(), dict.fromkeys(OPTIONS, True))  # one process carries every option
    check_options(blocks, dict.fromkeys(OPTIONS, True))  # and so do row blocks (dp.preselect: drawn by rank 0)
    refusing = dataclasses.replace(blocks, refuses=frozenset({"dp.preselect"}))  # a layout that cannot carry one
    check_options(refusing, {"dp.preselect": False, "data.negatives_pool": True})
    with pytest.raises(ConfigError, match=r"^dp\.preselect: not available on several processes") as e:
        check_options(refusing, {"dp.preselect": True})
    assert "\n" not in str(e.value)


def test_row_shard_maps_own_rows_both_ways():
    for rank in (0, 1, 2):
        shard = RowShard(rank, 3, offsets=(0, 5), sizes=(5, 7), num_dense_rows=2)
        rows = torch.arange(shard.num_rows)
        own = rows[shard.is_own(rows)]
        assert own.numel() == shard.num_own
        local = shard.to_local(own)
        assert torch.equal(local, torch.arange(shard.num_own))
        assert torch.equal(shard.own_to_global(local), own)
        dense = torch.arange(shard.num_rows, shard.num_rows + 2)  # the replicated rows follow the own ones
        assert torch.equal(shard.to_local(dense), torch.arange(shard.num_own, shard.num_own + 2))
    taken = [RowShard(r, 3, (0,), (4,), 0).samples(10) for r in range(3)]
    assert taken == [(0, 3), (3, 6), (6, 10)]  # every sample's replicated rows taken by exactly one rank


def test_the_dp_layer_imports_no_model_and_no_task():
    root = Path(__file__).resolve().parents[2] / "widedp" / "dp"
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.startswith(("widedp.models", "widedp.tasks"))]
    assert offenders == []
