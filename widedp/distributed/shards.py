"""A distributed run's checkpoint through ``torch.distributed.checkpoint`` (DCP): every rank writes its own row blocks
and its row optimizer's state; no process gathers a whole table.

    RUN/checkpoint.pt                 rank 0: step, history, ledger, world_size and ``dcp``: the name of the folder
                                      below (no weights)
    RUN/dcp-STEP/                     DCP: ``.metadata`` (each tensor's global shape and where its blocks lie) and
                                      ``__R_0.distcp`` (rank R's blocks)
    RUN/private/rng-STEP-rankR.pt     rank R: its generators' states (``widedp.dp.rng``); never in dcp-STEP/

Each table is a ShardedTensor of its global shape whose shard on rank r is its row block [n r / W, n (r + 1) / W)
(``widedp.dp.layout.RowShard``), so DCP reshards on load: a run saved on W ranks resumes on any W' >= 2, each rank
reading the rows of its new block. Keys: ``model.<the task model's state-dict key>`` (``input.weight``,
``ebc.embedding_bags.t_user.weight``, ``dense``, ...), ``optim.<the row optimizer's state key>`` and, with
``train.keep_best``, ``best.<model key>``; replicated tensors (a recommender's MLP rows, per-table step counts) are
plain tensors, written once.

A checkpoint at step S: rank 0 removes a stale folder of the name about to be written, every rank writes its part
(DCP writes ``.metadata`` last), rank 0 writes checkpoint.pt naming the folder, then deletes the other folders. The
folder checkpoint.pt names is never written again (a second checkpoint at step S, e.g. the run's last, goes to
``dcp-S.1``), so a kill -9 at any moment leaves it whole.

Reading (``widedp export``: ``tensor_specs``, ``read_tensor``) needs no process group: one tensor at a time, in
its global shape. Loading never runs code from the run directory: ``.metadata`` (a pickle) is read by an unpickler
that admits DCP's metadata classes only, the tensors by ``torch.load(weights_only=True)`` (DCP's reader).
"""

from __future__ import annotations

import errno
import pickle
import re
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from widedp.dp import rng

PREFIX = "dcp-"
METADATA = ".metadata"
_NAME_RE = re.compile(r"^dcp-\d+(?:\.1)?$")
_STATE_RE = re.compile(r"^rng-\d+-rank(\d+)\.pt$")


@dataclass(frozen=True)
class Block:
    """One tensor of a rank's checkpoint: ``local`` holds rows [lo, lo + local.shape[0]) of a tensor of ``rows``
    global rows; ``rows`` None: replicated (the same whole tensor on every rank)."""

    local: Tensor
    lo: int = 0
    rows: int | None = None


def blocks(tables: list[tuple[str, Tensor]], optimizer: dict[str, Tensor], shard: Any, *, prefix: str = "model"
           ) -> dict[str, Block]:
    """A rank's checkpoint entries. ``tables``: [(the task model's key, this rank's table)] in the order of the row
    optimizer's tables, the first ``len(shard.sizes)`` cut into ``shard``'s (a ``RowShard``) row blocks, the others
    replicated; ``optimizer``: the row optimizer's state, whose key ``NAME.T`` belongs to table T (a leading
    dimension of the block's rows: sharded alike; a per-table scalar: replicated)."""

    def block(v: Tensor, t: int) -> Block:
        if t < len(shard.sizes) and v.dim() > 0 and v.shape[0] == shard.own_sizes[t]:
            return Block(v, shard.lo[t], shard.sizes[t])
        return Block(v)

    out = {f"{prefix}.{k}": block(w.detach(), t) for t, (k, w) in enumerate(tables)}
    out.update({f"optim.{k}": block(v, int(k.rsplit(".", 1)[1])) for k, v in optimizer.items()})
    return out


@contextmanager
def _quiet() -> Iterator[None]:
    """DCP's deprecation notice for ShardedTensor, the one type of its that holds uneven row blocks (DTensor's
    Shard(0) cuts rows as torch.chunk does), and its note that a read without a process group is local."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dcp_state(entries: dict[str, Block]) -> dict[str, Any]:
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    rank, state = dist.get_rank(), {}
    for key, b in entries.items():
        if b.rows is None:
            state[key] = b.local
            continue
        md = ShardMetadata(shard_offsets=[b.lo] + [0] * (b.local.dim() - 1), shard_sizes=list(b.local.shape),
                           placement=f"rank:{rank}/{b.local.device}")
        state[key] = init_from_local_shards([Shard(b.local, md)], b.rows, *b.local.shape[1:])
    return state


def folder_name(step: int, named: str | None) -> str:
    """The folder a checkpoint of ``step`` goes to: ``dcp-STEP``, or ``dcp-STEP.1`` when ``dcp-STEP`` is the one
    checkpoint.pt names now (``named``), which is never overwritten."""
    name = f"{PREFIX}{step}"
    return f"{name}.1" if named == name else name


def save(out: Path, name: str, entries: dict[str, Block]) -> None:
    """Write ``entries`` into ``out/name/`` (a collective; a stale folder of that name is removed first).

    Raises:
        OSError: the checkpoint could not be written (a full disk, ...), on every rank.
    """
    path = out / name
    if dist.get_rank() == 0:
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(mode=0o700)  # private working state, as checkpoint.pt
    dist.barrier()
    with _quiet():
        state = _dcp_state(entries)
        try:
            dcp.save(state, storage_writer=FileSystemWriter(path, sync_files=True))
        except CheckpointException as e:
            raise OSError(errno.EIO, f"cannot write the checkpoint ({_first_failure(e)})", str(path)) from None


def check(out: Path, name: Any) -> str | None:
    """The one-line error for a checkpoint folder this rank cannot read (None: it looks whole)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        return (f"{out}: checkpoint.pt names no DCP checkpoint folder (written by an older widedp, with RUN/shards/); "
                "start the run again with --overwrite")
    if not (out / name / METADATA).is_file():
        return f"{out / name}: missing or incomplete (no {METADATA}); the checkpoint of this run is lost"
    return None


def load(out: Path, name: str, entries: dict[str, Block]) -> str | None:
    """Read ``out/name/`` into ``entries`` in place, resharded to this rank's blocks (a collective); None, or the
    one-line error."""
    with _quiet():
        state = _dcp_state(entries)
        try:
            dcp.load(state, storage_reader=_SafeReader(out / name))
        except CheckpointException as e:
            return f"{out / name}: does not fit this run ({_first_failure(e)})"
    return None


def _first_failure(e: Any) -> str:
    failures = getattr(e, "failures", None) or {}
    first = next(iter(failures.values()), e)
    text = " ".join(str(first).split()) or type(first).__name__
    return text[:300]


def prune(out: Path, keep: str) -> None:
    """Delete the checkpoint folders other than ``keep`` (rank 0, after checkpoint.pt names ``keep``)."""
    for p in out.iterdir():
        if p.name != keep and _NAME_RE.match(p.name) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def prune_gone_ranks(private: Path, world: int) -> None:
    """Delete the generator states of ranks >= ``world`` (a run resumed on fewer processes: they cannot replay)."""
    for p in private.iterdir() if private.is_dir() else ():
        t = rng.TEMP_RE.match(p.name)  # or their temp files, left by a kill mid-write
        m = _STATE_RE.match(t.group(1) if t else p.name)
        if m and int(m.group(1)) >= world:
            p.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------ reading


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the classes of DCP's ``.metadata`` and nothing else (a tampered file cannot run code)."""

    ALLOWED = {
        "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                  "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
                                                  "StorageMeta", "_MEM_FORMAT_ENCODING"},
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    }

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or name in self.ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


class _SafeReader(FileSystemReader):
    """DCP's file reader with ``.metadata`` read by ``_MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(self.path) / METADATA, "rb") as f:
            md = _MetadataUnpickler(f).load()
        if not isinstance(md, Metadata):
            raise pickle.UnpicklingError("not a DCP checkpoint's metadata")
        if md.storage_meta is not None:
            md.storage_meta.load_id = self.load_id
        return md


def tensor_specs(path: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every tensor of the DCP checkpoint folder ``path``: key -> (global shape, dtype).

    Raises:
        ValueError: the folder holds no readable DCP metadata (``.metadata`` missing, damaged or tampered).
    """
    try:
        md = _SafeReader(path).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"{path / METADATA}: not a readable DCP checkpoint ({type(e).__name__})") from None
    return {k: (m.size, m.properties.dtype) for k, m in md.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)}


def read_tensor(path: Path, key: str, spec: tuple[torch.Size, torch.dtype]) -> Tensor:
    """Tensor ``key`` of the DCP checkpoint folder ``path`` whole (``spec``: its shape and dtype, from
    ``tensor_specs``), read in this process alone (no process group)."""
    t = torch.empty(spec[0], dtype=spec[1])
    with _quiet():
        dcp.load({key: t}, storage_reader=_SafeReader(path), no_dist=True)
    return t
