"""``widedp train`` on several processes: the process group, who writes what, and agreement between the ranks.

    torchrun --standalone --nproc_per_node=2 -m widedp train CONFIG --out RUN
    widedp train CONFIG --out RUN --nproc 2          # the same, launched by widedp (``widedp.distributed.launch``)

A run is distributed when torchrun's environment says WORLD_SIZE > 1. Every rank then runs the one loop
(``widedp.run.loop``) with the sharded DP engine (``widedp.run.trainers.sharded``): the same Poisson batch, the
same collectives in the same order. Rank 0 alone locks and prepares the run directory, writes the run's files
(config.yaml, metrics.jsonl, spent.json, checkpoint.pt, summary.json, loss.png, private/seeds.json) and reports
errors; every rank writes its own shard file and its own generator states. A ``ConfigError`` is printed by rank 0
only, so what one rank alone can see (its shard file, its generator state) is first agreed on (``agree``): every
rank then raises the same error.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from widedp.errors import ConfigError


def env_world() -> int:
    """The world size torchrun (or ``widedp train --nproc``) gave this process; 1 outside a launcher."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE: expected an integer, got {os.environ['WORLD_SIZE']!r}") from None


def reports_errors() -> bool:
    """Whether this process prints a ConfigError: every process but the ranks > 0 of a distributed run."""
    return env_world() <= 1 or os.environ.get("RANK", "0") == "0"


def resolve_device(name: str) -> torch.device:
    """``train.device``: ``auto`` (CUDA when available), ``cpu``, ``cuda[:N]`` (refused without CUDA)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device: {name} requested but CUDA is not available")
    return torch.device(name)


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _import_before_joining() -> None:
    """Import what evaluates ``group.WORLD`` as a default argument (``torch.distributed.nn.functional``, which
    torchrec imports) BEFORE the group exists: imported after, its functions keep the world group alive past
    ``destroy_process_group``, and gloo's threads are then torn down at interpreter exit, where they can abort
    the process ("terminate called without an active exception", SIGABRT) after a run that succeeded."""
    import torch.distributed.nn.functional  # noqa: F401


def init(device_name: str) -> None:
    """Join the process group of torchrun's environment: NCCL when ``train.device`` resolves to CUDA (one GPU
    per local rank), gloo otherwise."""
    _import_before_joining()
    device = resolve_device(device_name)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")


def init_process_group(rank: int, world_size: int, *, port: int, backend: str | None = None) -> None:
    """Join a group of ``world_size`` processes as ``rank`` outside a launcher (tests, ``torch.multiprocessing``):
    gloo on CPU, NCCL when CUDA is available (unless ``backend``), rendezvous on 127.0.0.1:``port``."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    _import_before_joining()
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for ``init_process_group``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def close() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def agree(error: str | None) -> None:
    """Raise ConfigError(the lowest rank's message) on every rank when any rank has one; a collective."""
    errors: list[str | None] = [None] * world()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise ConfigError(first)


def broadcast_ints(values: list[int] | None, *, count: int, device: torch.device) -> list[int]:
    """Rank 0's ``values`` (``count`` int64s) on every rank, sent over the process group (never a file)."""
    t = torch.tensor(values if values is not None else [0] * count, dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return [int(v) for v in t.tolist()]


def share_release(folder: Path) -> None:
    """What rank 0's build released before the first step (the DP vocabulary: ``vocab_release.json`` in rank 0's
    ``folder``), written into every other rank's build ``folder`` over the process group, so that their builds
    load it rather than draw: it is drawn once, with rank 0's secret seed. A collective; nothing on one process."""
    if world() <= 1:
        return
    from widedp.dp.vocab import RELEASE_FILE

    path = folder / RELEASE_FILE
    box = [path.read_bytes() if rank() == 0 and path.is_file() else None]
    dist.broadcast_object_list(box, src=0)
    if rank() != 0 and box[0] is not None:
        path.write_bytes(box[0])


def derive_seed(secret: int, label: str) -> int:
    """A 62-bit seed derived from ``secret`` (SHA-256 of it and ``label``): secret as long as ``secret`` is, and
    different for each label (each rank's own generator, the generator all ranks share)."""
    digest = hashlib.sha256(f"widedp/{label}/{secret}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2
