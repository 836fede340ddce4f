"""A distributed run's DCP checkpoint (``widedp.distributed.shards``) on gloo processes.

- row blocks and row optimizer state saved on 2 ranks load resharded on 3 and back, equal to the whole tensors (a
  brute-force reference), and read whole in one process without a process group;
- a tampered ``.metadata`` (a pickle that would run code) is refused in one line and runs nothing;
- no rank-0 object holds a whole table at any checkpoint of a 2-process run (the same scan finds the tables of a
  1-process run, so it can fail);
- folder names and pruning: the folder checkpoint.pt names is never written again.
"""

from __future__ import annotations

import gc
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tiny_corpus import data_section

from widedp.distributed import shards

V, D = 17, 6  # the tables' rows and width (a size nothing else in these runs has)


def _tables() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"input.weight": torch.randn(V, D, generator=g), "output.weight": torch.randn(V, D, generator=g)}


def _optimizer_state(full: bool, shard, world: int) -> dict[str, torch.Tensor]:
    """A lazy Adam's state over both tables (moments [n, 2, D], step counts [n]) and a dense Adam's per-table scalar,
    whole (``full``) or this rank's rows of it."""
    g = torch.Generator().manual_seed(1)
    whole = {"moments.0": torch.randn(V, 2, D, generator=g), "moments.1": torch.randn(V, 2, D, generator=g),
             "steps.0": torch.randint(0, 50, (V,), generator=g), "steps.1": torch.randint(0, 50, (V,), generator=g),
             "step.0": torch.tensor(7.0)}
    if full:
        return whole
    return {k: v if v.dim() == 0 else v[shard.lo[int(k[-1])]:shard.hi[int(k[-1])]].clone() for k, v in whole.items()}


def _entries(rank: int, world: int, *, filled: bool) -> dict[str, shards.Block]:
    from widedp.dp.layout import RowShard

    shard = RowShard(rank, world, (0, V), (V, V), 0)
    full = _tables()
    tables = [(k, full[k][shard.lo[t]:shard.hi[t]].clone()) for t, k in enumerate(full)]
    opt = _optimizer_state(False, shard, world)
    if not filled:
        tables = [(k, torch.zeros_like(w)) for k, w in tables]
        opt = {k: torch.zeros_like(v) for k, v in opt.items()}
    return shards.blocks(tables, opt, shard)


def _reshard_worker(rank: int, world: int, port: int, folder: str, load: bool, save: bool) -> None:
    from widedp.distributed.ranks import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, world, port=port, backend="gloo")
    out = Path(folder)
    if load:
        assert shards.check(out, "dcp-5") is None
        got, want = _entries(rank, world, filled=False), _entries(rank, world, filled=True)
        assert shards.load(out, "dcp-5", got) is None
        for k in want:
            assert torch.equal(got[k].local, want[k].local), (rank, k)
        err = shards.load(out, "dcp-5", {**got, "optim.exp_avg.0": shards.Block(torch.zeros(2))})  # not saved
        assert err is not None and "does not fit this run" in err and "exp_avg" in err and "\n" not in err, err
    if save:
        shards.save(out, "dcp-5", _entries(rank, world, filled=True))
    dist.destroy_process_group()


def _spawn(fn, world: int, *args) -> None:
    """``fn(rank, world, port, *args)`` on ``world`` forked processes (they inherit this one's imports)."""
    from widedp.distributed.ranks import free_port

    mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=True, start_method="fork")


def test_blocks_saved_on_2_ranks_load_resharded_on_3_and_back(tmp_path):
    _spawn(_reshard_worker, 2, str(tmp_path), False, True)
    folder = tmp_path / "dcp-5"
    assert (folder / ".metadata").is_file()
    assert sorted(p.name for p in folder.iterdir() if p.suffix == ".distcp") == ["__0_0.distcp", "__1_0.distcp"]
    specs = shards.tensor_specs(folder)
    whole = {**{f"model.{k}": v for k, v in _tables().items()},
             **{f"optim.{k}": v for k, v in _optimizer_state(True, None, 2).items()}}
    assert set(specs) == set(whole)
    for k, v in whole.items():  # one tensor at a time, whole, in this process (no process group)
        assert specs[k] == (v.shape, v.dtype)
        assert torch.equal(shards.read_tensor(folder, k, specs[k]), v), k
    _spawn(_reshard_worker, 3, str(tmp_path), True, True)  # loaded on 3 ranks, saved again from them
    _spawn(_reshard_worker, 2, str(tmp_path), True, False)  # and loaded on 2


class _Payload:
    """Unpickled, it would run a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_tampered_metadata_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    folder = tmp_path / "dcp-3"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(ValueError, match=r"\.metadata: not a readable DCP checkpoint") as e:
        shards.tensor_specs(folder)
    assert "\n" not in str(e.value) and not marker.exists()


def test_folder_names_and_pruning(tmp_path):
    assert shards.folder_name(40, None) == "dcp-40"
    assert shards.folder_name(40, "dcp-20") == "dcp-40"
    assert shards.folder_name(40, "dcp-40") == "dcp-40.1"  # the named folder is never written again
    assert shards.folder_name(40, "dcp-40.1") == "dcp-40"
    for name in ("dcp-20", "dcp-40", "dcp-40.1", "dcpx", "keep"):
        (tmp_path / name).mkdir()
    shards.prune(tmp_path, keep="dcp-40.1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dcp-40.1", "dcpx", "keep"]
    assert "older widedp" in shards.check(tmp_path, None)
    assert "no .metadata" in shards.check(tmp_path, "dcp-40.1")
    priv = tmp_path / "private"
    priv.mkdir()
    for name in ("rng-4-rank0.pt", "rng-4-rank2.pt", "rng-8-rank3.pt", "seeds.json", ".rng-9-rank2.pt.bfb40dce.tmp",
                 ".rng-9-rank1.pt.0123abcd.tmp"):  # temp files of a kill mid-write: a gone rank's go too
        (priv / name).write_bytes(b"")
    shards.prune_gone_ranks(priv, 2)
    assert sorted(p.name for p in priv.iterdir()) == [".rng-9-rank1.pt.0123abcd.tmp", "rng-4-rank0.pt", "seeds.json"]


# ------------------------------------------------------------------------------------------------ no whole table


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "cbow.yaml"
    cfg.write_text(f"""
{data_section(tmp_path, words=V)}
model: {{dim: {D}, tied: false}}
train: {{epochs: 1, max_steps: 30, batch_size: 10, optimizer: lazy_adam, lr: 0.01, log_every: 10,
        checkpoint_every: 10, eval_max_samples: 50, seed: 3}}
dp: {{clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, rng: reproducible, selection: {{name: uniform, k: 4}}}}
""")
    return cfg


def _whole_tables() -> int:
    """Live tensors shaped as a whole table (or its Adam moments)."""
    gc.collect()
    with warnings.catch_warnings():  # (isinstance on torch.distributed's deprecated reduce_op)
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_floating_point()
                   and tuple(o.shape) in ((V, D), (V, 2, D)))


def _spy_checkpoints(monkeypatch_target, seen: list[int]) -> None:
    """Count whole tables each time the loop writes checkpoint.pt (rank 0 alone writes it)."""
    import widedp.run.loop as loop

    save = loop.save_checkpoint

    def spy(out, state):
        seen.append(_whole_tables())
        save(out, state)

    monkeypatch_target(loop, "save_checkpoint", spy)


def _train_worker(rank: int, world: int, port: int, cfg: str, out: str) -> None:
    from widedp.config import load_config
    from widedp.distributed.ranks import init_process_group
    from widedp.run.train import train_rank

    torch.set_num_threads(1)
    init_process_group(rank, world, port=port, backend="gloo")
    seen: list[int] = []
    _spy_checkpoints(setattr, seen)
    train_rank(load_config(cfg), Path(out), resume=False, progress=False, overwrite=False)
    if rank == 0:
        assert len(seen) >= 3 and seen == [0] * len(seen), seen  # no whole table at any checkpoint
    dist.destroy_process_group()


def test_rank0_holds_no_whole_table_while_it_trains(tmp_path, monkeypatch):
    cfg = _config(tmp_path)
    from widedp.config import load_config
    from widedp.run.train import train

    seen: list[int] = []  # the control: one process holds the tables whole, and the scan sees them
    _spy_checkpoints(monkeypatch.setattr, seen)
    train(load_config(str(cfg)), tmp_path / "one", progress=False)
    assert seen and min(seen) >= 2, seen
    monkeypatch.undo()
    _spawn(_train_worker, 2, str(cfg), str(tmp_path / "two"))
    ckpt = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)
    assert ckpt["model"] == {} and (tmp_path / "two" / ckpt["dcp"] / ".metadata").is_file()
