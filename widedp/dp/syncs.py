"""Counting the host syncs of a piece of code, on any device.

On CUDA the host waits for the device whenever a result's size or value is needed in Python: a scalar read
(``.item()``, ``int(t)``, ``bool(t)``), an op whose output shape depends on the data (``torch.unique``, ``nonzero``,
boolean-mask indexing, ``masked_select``, ``bincount``, ``repeat_interleave`` without ``output_size``), or a copy to
the host (``.tolist()``, ``.numpy()``, ``.cpu()``). A blocking copy from the host waits too
(``torch.tensor(data, device=...)``; ``to_device`` below copies without waiting). ``HostSyncs`` counts the first two
kinds as aten calls are dispatched and the copies as functions and tensor methods are called, so the same count comes
out on a CPU (where nothing waits): a CPU-side proxy of ``torch.cuda.set_sync_debug_mode``. It does not see syncs
inside native kernels, nor a host tensor's ``.to(device)`` (on a CPU there is no copy to see).

    with HostSyncs() as syncs:
        dp_step(...)
    syncs.total, syncs.by_op   # 1, {'_unique2': 1}
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops whose output size or value the host must read (on CUDA: a sync every call).
SYNC_OPS = frozenset({
    "_local_scalar_dense",  # .item(), int(t), float(t)
    "is_nonzero",  # bool(t)
    "equal",  # torch.equal returns a Python bool
    "nonzero",
    "_unique", "_unique2", "unique_dim", "unique_consecutive",
    "masked_select",
    "bincount",
})


def _bool_index(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


#: tensor methods that copy to the host (on a CPU tensor nothing is dispatched, so they are counted by name)
HOST_COPIES = frozenset({"tolist", "cpu", "item"})


class HostSyncs:
    """Counts what makes the host wait for the device (module docstring) inside ``with``: ``by_op``: op or method
    name -> calls; ``total``: their sum."""

    def __init__(self) -> None:
        self.by_op: Counter[str] = Counter()
        self.reading = 0  # > 0 inside a counted host read: its own aten ops are not counted again
        self._modes = (_Copies(self), _Ops(self))

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __enter__(self) -> HostSyncs:
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device`` without the host waiting for the device: on CUDA, staged through pinned
    memory and copied asynchronously (the caching host allocator keeps the staging buffer until the copy is done)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


#: factories that copy Python data to their ``device=`` (on CUDA: a blocking copy from the host)
FROM_HOST = frozenset({"tensor", "as_tensor"})


def _copies(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    name = getattr(func, "__name__", "")
    if name in HOST_COPIES:
        return True
    if name in FROM_HOST:
        return kwargs.get("device") is not None and not (args and isinstance(args[0], torch.Tensor))
    if name != "to" or not isinstance(args[0], torch.Tensor) or args[0].device.type == "cpu":
        return False  # (a CPU tensor's .to(its own device) is no copy)
    return any(a == "cpu" or (isinstance(a, torch.device) and a.type == "cpu")
               for a in (*args[1:], kwargs.get("device")))


class _Counting:
    """What both modes share: the ``HostSyncs`` they count into."""

    def __init__(self, counter: HostSyncs) -> None:
        super().__init__()
        self.counter = counter


class _Copies(_Counting, TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not _copies(func, args, kwargs):
            return func(*args, **kwargs)
        self.counter.by_op[func.__name__] += 1
        self.counter.reading += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.counter.reading -= 1


class _Ops(_Counting, TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if not self.counter.reading and (
                name in SYNC_OPS
                or (name == "repeat_interleave" and func._overloadname == "Tensor"  # repeats given as a tensor
                    and kwargs.get("output_size") is None)
                or (name in ("index", "index_put", "index_put_") and _bool_index(args))):
            self.counter.by_op[name] += 1
        return func(*args, **kwargs)
