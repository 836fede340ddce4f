"""The tables of a run on several processes are built sharded from the start (``widedp.tasks.placement``,
``widedp.models.rowinit``): the task's model is on the meta device (no storage), and each rank's ``ShardedCBOW`` /
``ShardedRecsys`` draws only its own row blocks, equal bit for bit to the rows of the one-process model (so a
``--nproc`` run starts from the one-process run's weights), its peak memory O(own rows), not the whole table."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import yaml
from tiny_corpus import data_section

from widedp.config import config_from_dict
from widedp.config.recsys import RecsysModelConfig
from widedp.distributed import ranks
from widedp.models.cbow import CBOW
from widedp.models.cbow_sharded import ShardedCBOW, cbow_shard
from widedp.models.recsys_sharded import ShardedRecsys, shard_of
from widedp.models.rowinit import Deferred
from widedp.run.trainers.sharded import shard_model
from widedp.tasks.cbow import TASK as CBOW_TASK
from widedp.tasks.recsys import TASK as RECSYS_TASK
from widedp.tasks.recsys import build_model


def _no_storage(model: torch.nn.Module) -> bool:
    return all(t.is_meta for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sharded_cbow_blocks_equal_the_one_process_rows(tied, dtype):
    torch.set_default_dtype(dtype)
    try:
        full = CBOW(103, 7, tied=tied, init_scale=0.7, generator=torch.Generator().manual_seed(3))
        with torch.device("meta"):
            meta = CBOW(103, 7, tied=tied, init_scale=0.7)
    finally:
        torch.set_default_dtype(torch.float32)
    meta.deferred = Deferred(3, torch.device("cpu"))
    assert _no_storage(meta)
    for world in (1, 2, 3):
        for rank in range(world):
            shard = cbow_shard(meta, rank, world)
            mine = ShardedCBOW(meta, shard)
            (lo, *_), (hi, *_) = shard.lo, shard.hi
            assert mine.input.shape == (hi - lo, 7) and mine.input.dtype == dtype
            assert torch.equal(mine.input, full.input.weight[lo:hi])
            if not tied:
                assert torch.equal(mine.output, full.output.weight[shard.lo[1]:shard.hi[1]])
            assert [p.shape[0] for _, p in mine.local_tables()] == list(shard.own_sizes)


def test_sharded_recsys_blocks_and_mlp_equal_the_one_process_model():
    card = {"user": 101, "item": 257, "tag": 13}
    mcfg = RecsysModelConfig(dim=8, hidden=(6,), init_scale=0.3)
    full, meta = build_model(card, mcfg, seed=4), build_model(card, mcfg, seed=4, meta=True)
    assert _no_storage(meta) and meta.deferred == Deferred(4, torch.device("cpu"))
    for world in (2, 3):
        for rank in range(world):
            want = ShardedRecsys(full, shard_of(full, rank, world))
            got = ShardedRecsys(meta, shard_of(meta, rank, world))
            ws, gs = want.state_dict(), got.state_dict()
            assert list(ws) == list(gs) and all(torch.equal(ws[k], gs[k]) for k in ws)
            assert torch.equal(want.pairs, got.pairs) and torch.equal(want.row_offsets, got.row_offsets)
            assert [t.shape[0] for _, t in got.local_tables()[:-1]] == list(got.shard.own_sizes)


@pytest.mark.parametrize("task", ["cbow", "recsys"])
def test_the_tasks_build_on_meta_on_several_processes(tmp_path, monkeypatch, task):
    """Each rank's build (world 2) holds no table; its ``shard_model`` blocks are the one-process build's rows."""
    if task == "cbow":
        text = f"{data_section(tmp_path)}\nmodel: {{dim: 8, tied: false}}\n"
    else:
        text = (f"task: recsys\ndata: {{preset: synthetic, num_users: 40, num_items: 60, num_interactions: 500, "
                f"num_tags: 8, context_cardinality: 5, cache_dir: \"{tmp_path / 'cache'}\"}}\n"
                "model: {dim: 4, hidden: [8]}\n")
    text += ("train: {epochs: 1, batch_size: 10, optimizer: lazy_adam, lr: 0.01, seed: 5}\n"
             "dp: {clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, selection: {name: all}}\n")
    cfg = config_from_dict(yaml.safe_load(text))
    build = (CBOW_TASK if task == "cbow" else RECSYS_TASK).build
    one = build(cfg, tmp_path, device=torch.device("cpu")).model
    one_rows = {k: w.detach().clone() for k, w in one.state_dict().items()}
    monkeypatch.setattr(ranks, "world", lambda: 2)
    for rank in range(2):
        monkeypatch.setattr(ranks, "rank", lambda rank=rank: rank)
        model = build(cfg, tmp_path, device=torch.device("cpu")).model
        assert _no_storage(model.ebc if task == "recsys" else model)
        part = shard_model(task, model, rank, 2)
        for key, (_, block) in zip(part.table_keys(), part.local_tables()):
            off = part.shard.lo[part.table_keys().index(key)] if key != "dense" else 0
            assert torch.equal(block, one_rows[key][off:off + block.shape[0]]), key


def test_rank_zero_of_a_new_preselecting_run_builds_the_whole_model(monkeypatch):
    """``dp.preselect`` is drawn by rank 0 from the whole model's per-sample rows (a resumed run loads it)."""
    from widedp.tasks.placement import tables_on_meta

    cfg = config_from_dict(yaml.safe_load(
        "dp: {clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, selection: {name: all},\n"
        "     preselect: {rows: 4, sigma: 1.0, threshold: 2.0}}"))
    assert not tables_on_meta(cfg, resumed=False)  # one process
    monkeypatch.setattr(ranks, "world", lambda: 2)
    for rank, resumed, meta in ((0, False, False), (0, True, True), (1, False, True)):
        monkeypatch.setattr(ranks, "rank", lambda rank=rank: rank)
        assert tables_on_meta(cfg, resumed=resumed) is meta


PEAK = textwrap.dedent("""
    import json, resource, sys, torch
    from widedp.models.cbow import CBOW
    from widedp.models.cbow_sharded import ShardedCBOW, cbow_shard
    from widedp.models.rowinit import Deferred
    V, D, rank, world = 1_000_000, 64, 1, 4
    def build(v):
        with torch.device("meta"):
            meta = CBOW(v, D, tied=False)
        meta.deferred = Deferred(0, torch.device("cpu"))
        return meta, ShardedCBOW(meta, cbow_shard(meta, rank, world))
    build(8)  # what the meta device loads once (~130 MB of modules), not per row
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    meta, mine = build(V)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_kib": peak - base, "own": [list(p.shape) for p in mine.parameters()]}))
""")


def test_no_rank_allocates_a_whole_table():
    """Rank 1 of 4 of an untied CBOW of 1e6 x 64 rows (2 tables of 256 MB): its peak RSS grows by its blocks (2 x
    64 MB) and a chunk, far from one table."""
    proc = subprocess.run([sys.executable, "-c", PEAK], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["own"] == [[250_000, 64], [250_000, 64]]
    own_kib = 2 * 250_000 * 64 * 4 // 1024
    assert got["peak_kib"] <= own_kib + 32 * 1024, got  # one table alone is 250,000 KiB
