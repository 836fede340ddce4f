"""Hooks on a user's model that record what per-sample gradients need, from one forward and one backward pass.

Wide parts ("tables"): every ``nn.Embedding`` / ``nn.EmbeddingBag`` whose weight is trainable, including the ones
inside a torchrec ``EmbeddingBagCollection`` (one ``nn.EmbeddingBag`` per table, called per feature with the KJT's
``offsets``: one bag per sample) and ``EmbeddingCollection`` (one ``nn.Embedding`` per table, called on a feature's
KJT values). A lookup call is recorded as entries, one per looked-up id::

    KJT feature "tags", B = 3:   sample 0     sample 1    sample 2       <-- batch indices
        values                   [4, 4, 7]    []          [1]            ids (global row = table offset + id)
        offsets                  [0,          3,          3,         4]  bag j = values[offsets[j]:offsets[j+1]]
    entries:   row  [o+4, o+4, o+7, o+1]   src [0, 0, 0, 2] (the bag's output row)   sample [0, 0, 0, 2]
               scale (MEAN: 1/|bag|) [1/3, 1/3, 1/3, 1]   (SUM: per_sample_weights or 1)

The lookup runs with its weight's ``requires_grad`` off (no dense [V, D] gradient is ever built) and its output is
made to require grad; the backward's gradient of that output, ``go`` [bags or positions, D], gives each entry's
per-sample row gradient ``go[src] * scale`` (``widedp.api.per_sample``). A table weight that still gets a
``.grad`` was read outside its lookup (e.g. a tied output layer): an error, not a silent omission.

Dense parts: every other module with trainable parameters of its own (``nn.Linear``, ``nn.LayerNorm``, ``nn.Conv1d``,
your own leaf modules, ...), whose forward uses no other trainable module; its batch-first inputs and its output's
gradient are recorded. Ids are checked against ``num_embeddings`` before every lookup (``IdOutOfRangeError``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


class IdOutOfRangeError(ValueError):
    """An id outside its table (negative or >= num_embeddings)."""


class UnsupportedModelError(ValueError):
    """A model the engine cannot compute exact per-sample gradients for; the message says what to change."""


@dataclass(frozen=True)
class Table:
    """One embedding weight [num_rows, dim]; its global rows are [offset, offset + num_rows)."""

    name: str
    weight: nn.Parameter
    offset: int
    padding_idx: int | None = None  # a row no lookup trains (torch keeps it fixed): the update leaves it as it is

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    @property
    def dim(self) -> int:
        return self.weight.shape[1]


@dataclass
class Record:
    """One recorded call. Wide: rows/src/sample/scale [N] per entry and ``bags`` output rows. Dense: ``module`` with
    its inputs ``args``. ``go``: the gradient of the call's output, filled by the backward (None: not reached)."""

    batch: int
    table: Table | None = None
    rows: Tensor | None = None
    src: Tensor | None = None
    sample: Tensor | None = None
    scale: Tensor | None = None
    module: nn.Module | None = None
    args: tuple[Any, ...] = ()
    go: Tensor | None = field(default=None, repr=False)

    def add_grad(self, g: Tensor) -> None:
        self.go = g if self.go is None else self.go + g


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str) -> Any:
    """Argument ``i`` / ``name`` of a call (``nn.Embedding(input)``, ``nn.EmbeddingBag(input, offsets, psw)``)."""
    return args[i] if len(args) > i else kwargs.get(name)


def _is_torchrec(m: nn.Module, name: str) -> bool:
    return type(m).__name__ == name and type(m).__module__.startswith("torchrec")


def _check_table_module(name: str, m: nn.Module) -> None:
    if getattr(m, "max_norm", None) is not None:
        raise UnsupportedModelError(f"{name}: max_norm renormalises table rows inside the forward (a data-dependent "
                                    "update outside DP); construct the table without max_norm")
    if getattr(m, "scale_grad_by_freq", False):
        raise UnsupportedModelError(f"{name}: scale_grad_by_freq scales by batch counts (not per sample); turn it off")
    if isinstance(m, nn.EmbeddingBag) and m.mode == "max":
        raise UnsupportedModelError(f"{name}: EmbeddingBag mode='max' is not supported (use 'sum' or 'mean')")


def read_outside(name: str) -> str:
    return (f"{name}: the table's weight was read outside its lookup (e.g. a tied output layer, weight @ h): its "
            "per-sample gradient is not computed")


class Capture:
    """Discovers the tables and dense modules of ``model`` and keeps the hooks that record calls.

    Attributes:
        tables: in ``model.named_modules()`` order (torchrec tables in collection order), global offsets in order.
        dense_params: [(name, parameter)] trainable non-table parameters, in ``model.named_parameters()`` order.
        records: the calls recorded since the last ``clear()``.
    """

    def __init__(self, model: nn.Module, *, sharded: tuple[nn.Module, ...] = ()) -> None:
        self.model = model
        # modules whose tables another capture records (torchrec's sharded collections, ``widedp.api.sharded``):
        # their sub-modules are neither tables nor dense layers here
        self._inside_sharded = {id(c) for m in sharded for c in m.modules()}
        self.sharded_check: Any = None  # the sharded tables' own ``check_tables_untouched`` (``widedp.api.sharded``)
        self.records: list[Record] = []
        self.enabled = True
        self.independence_checked = False  # ``widedp.api.per_sample.check_independent`` has passed once
        self._handles: list[Any] = []
        self._ec_queue: dict[int, list[Tensor]] = {}  # inner nn.Embedding of an EmbeddingCollection -> sample maps
        self._off: set[int] = set()  # lookups running with their weight's requires_grad switched off
        self.tables, self._table_of = self._find_tables()
        self.dense_params, dense_modules = self._find_dense()
        self._dense_ids = {id(m) for m in dense_modules}
        for m in model.modules():
            if id(m) in self._table_of:
                self._handles.append(m.register_forward_pre_hook(self._wide_pre, with_kwargs=True))
                self._handles.append(m.register_forward_hook(self._wide_post, with_kwargs=True))
            elif _is_torchrec(m, "EmbeddingCollection"):
                self._handles.append(m.register_forward_pre_hook(self._ec_pre))
            elif _is_torchrec(m, "EmbeddingBagCollection"):
                self._handles.append(m.register_forward_pre_hook(self._ebc_pre))
        for m in dense_modules:
            self._handles.append(m.register_forward_hook(self._dense_post, with_kwargs=True))
        for m in model.modules():  # with or without trainable parameters: training mode uses batch statistics
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                self._handles.append(m.register_forward_pre_hook(self._batchnorm_pre))
        self._buffer_snap: dict[int, list[tuple[nn.Module, str, Tensor, int]]] = {}
        for m in model.modules():  # a buffer that learns from the batch: running statistics, counters, caches
            if id(m) not in self._inside_sharded and next(m.buffers(recurse=m is model), None) is not None:
                self._handles.append(m.register_forward_pre_hook(self._buffers_pre))
                self._handles.append(m.register_forward_hook(self._buffers_post))
        self._names = {id(m): n for n, m in model.named_modules()}

    # ------------------------------------------------------------------------------------------------ discovery

    def _find_tables(self) -> tuple[list[Table], dict[int, Table]]:
        tables: list[Table] = []
        by_weight: dict[int, Table] = {}
        table_of: dict[int, Table] = {}
        offset = 0
        for name, m in self.model.named_modules():
            if (not isinstance(m, (nn.Embedding, nn.EmbeddingBag)) or not m.weight.requires_grad
                    or id(m) in self._inside_sharded):
                continue
            _check_table_module(name, m)
            t = by_weight.get(id(m.weight))
            if t is None:
                t = by_weight[id(m.weight)] = Table(name, m.weight, offset, m.padding_idx)
                tables.append(t)
                offset += t.num_rows
            elif t.padding_idx != m.padding_idx:
                raise UnsupportedModelError(f"{name}: shares {t.name}'s weight with another padding_idx "
                                            f"({m.padding_idx} vs {t.padding_idx})")
            table_of[id(m)] = t
        if not tables and not self._inside_sharded:
            raise UnsupportedModelError("no trainable nn.Embedding / nn.EmbeddingBag / torchrec table in the model: "
                                        "widedp trains wide models; use Opacus for dense-only models")
        return tables, table_of

    def _find_dense(self) -> tuple[list[tuple[str, nn.Parameter]], list[nn.Module]]:
        table_ids = {id(t.weight) for t in self.tables}
        owners: dict[int, str] = {}
        modules: list[nn.Module] = []
        for name, m in self.model.named_modules():
            if id(m) in self._table_of or id(m) in self._inside_sharded:
                continue
            own = [p for p in m.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            label = name or type(m).__name__
            if type(m).__module__.startswith(("torchrec", "fbgemm")):
                raise UnsupportedModelError(f"{label} ({type(m).__name__}): fused / sharded torchrec tables expose no "
                                            "per-lookup outputs; use the unsharded EmbeddingBagCollection")
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                raise UnsupportedModelError(f"{label}: batch normalisation mixes the samples of a batch (no per-sample "
                                            "gradient); use nn.LayerNorm or nn.GroupNorm")
            nested = [n for n, c in m.named_modules() if c is not m and any(p.requires_grad for p in c.parameters())]
            if nested:
                raise UnsupportedModelError(f"{label}: has parameters of its own and trainable sub-modules {nested}; "
                                            "per-sample gradients need each parameter in a module whose forward "
                                            "uses no other trainable module (move them into a sub-module)")
            for p in own:
                if id(p) in table_ids:
                    raise UnsupportedModelError(f"{label}: uses an embedding table's weight as a dense parameter "
                                                "(tied weights); only lookups may read a table")
                owners[id(p)] = label
            modules.append(m)
        sharded = {id(p) for m in self.model.modules() if id(m) in self._inside_sharded
                   for p in m.parameters(recurse=False)}
        dense = [(n, p) for n, p in self.model.named_parameters()
                 if p.requires_grad and id(p) not in table_ids and id(p) not in sharded]
        missing = [n for n, p in dense if id(p) not in owners]
        if missing:
            raise UnsupportedModelError(f"parameters {missing} are used outside a module the engine can hook; "
                                        "put them in a leaf nn.Module, or freeze them (requires_grad_(False))")
        return dense, modules

    # -------------------------------------------------------------------------------------------------- hooks

    def hooked_modules(self) -> set[int]:
        """ids of the modules whose calls are recorded (tables and dense layers)."""
        return set(self._table_of) | self._dense_ids

    def _recording(self, m: nn.Module) -> bool:
        return self.enabled and m.training and torch.is_grad_enabled()

    def label(self, r: Record) -> str:
        """The name of what record ``r`` recorded: its table, or its module."""
        return r.table.name if r.table is not None else self._label(r.module) if r.module is not None else "?"

    def _label(self, m: nn.Module) -> str:
        return self._names.get(id(m), type(m).__name__)

    def _batchnorm_pre(self, m: nn.Module, args: tuple[Any, ...]) -> None:
        if m.training:
            raise UnsupportedModelError(f"{self._label(m)}: batch normalisation in training mode mixes the samples of "
                                        "a batch (and writes their statistics into its buffers, outside DP); use "
                                        "nn.LayerNorm or nn.GroupNorm, or keep it in eval mode with fixed statistics")

    def _buffers_pre(self, m: nn.Module, args: tuple[Any, ...]) -> None:
        if self.enabled and m.training:
            owners = [o for o in m.modules() if id(o) not in self._inside_sharded] if m is self.model else (m,)
            self._buffer_snap[id(m)] = [(o, n, b, b._version) for o in owners for n, b in o._buffers.items()
                                        if b is not None]

    def _buffers_post(self, m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        """Refuse a forward in training mode that wrote into a buffer (in place or by reassignment)."""
        for owner, name, before, version in self._buffer_snap.pop(id(m), ()):
            now = owner._buffers.get(name)
            if now is not before or now._version != version:
                where = ".".join(x for x in (self._label(owner) if owner is not self.model else "", name) if x)
                raise UnsupportedModelError(f"{where}: the forward wrote into this buffer in training mode: a buffer "
                                            "that learns from the batch (running statistics, a counter, a cache) "
                                            "carries private data outside DP into later steps and state_dict(); "
                                            "keep it fixed (that module in eval mode) or compute it from public "
                                            "data")

    def _ebc_pre(self, m: nn.Module, args: tuple[Any, ...]) -> None:
        kjt = args[0] if args else None
        if kjt is not None and hasattr(kjt, "variable_stride_per_key") and kjt.variable_stride_per_key():
            raise UnsupportedModelError(f"{self._label(m)}: variable-batch KJTs (stride per key) are not supported")

    def _ec_pre(self, m: nn.Module, args: tuple[Any, ...]) -> None:
        """Queue, for each inner nn.Embedding call to come (tables in order, their features in order), the sample of
        each of its entries: lookups of a KJT's values do not see the batch."""
        if not self._recording(m):
            return
        jts = args[0].to_dict()
        for emb, feats in zip(m.embeddings.values(), m._feature_names):
            for f in feats:
                lengths = jts[f].lengths()
                sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
                self._ec_queue.setdefault(id(emb), []).append(sample)

    def _wide_pre(self, m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = _arg(args, kwargs, 0, "input")
        t = self._table_of[id(m)]
        if ids.is_floating_point():
            raise UnsupportedModelError(f"{self._label(m)}: ids must be integers, got {ids.dtype}")
        bad = (ids < 0) | (ids >= t.num_rows)
        if ids.numel() and bool(bad.any()):
            pos = int(bad.reshape(-1).nonzero()[0])
            raise IdOutOfRangeError(f"{self._label(m)}: id {int(ids.reshape(-1)[pos])} (entry {pos} of the "
                                    f"lookup) is outside the table's {t.num_rows} rows [0, {t.num_rows}); "
                                    "map ids to rows before the lookup (a hash or an out-of-vocabulary row)")
        if self._recording(m):
            m.weight.requires_grad_(False)  # no dense [V, D] gradient; any other read of the weight gets one
            self._off.add(id(m))

    def _wide_post(self, m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Tensor) -> Tensor | None:
        if id(m) not in self._off:
            return None
        self._off.discard(id(m))
        m.weight.requires_grad_(True)
        t = self._table_of[id(m)]
        ids = _arg(args, kwargs, 0, "input")
        if isinstance(m, nn.EmbeddingBag):
            rec = self._bag_record(m, t, ids, _arg(args, kwargs, 1, "offsets"),
                                   _arg(args, kwargs, 2, "per_sample_weights"))
        else:
            queue = self._ec_queue.get(id(m))
            rec = self._embedding_record(m, t, ids, queue.pop(0) if queue else None)
        self.records.append(rec)
        if out.grad_fn is None:  # a leaf (ids only): let the backward reach it, and return a non-leaf copy so
            out.requires_grad_(True)  # that in-place ops on the output (x += pos) stay legal
            out.register_hook(rec.add_grad)
            return out.clone()
        out.register_hook(rec.add_grad)  # per_sample_weights that require grad: the output has a graph already
        return None

    def _embedding_record(self, m: nn.Module, t: Table, ids: Tensor, sample: Tensor | None) -> Record:
        """nn.Embedding: ids [B, ...] (batch first) or, inside an EmbeddingCollection, a feature's values [N]."""
        flat = ids.reshape(-1)
        src = torch.arange(flat.numel(), device=flat.device)
        if sample is None:
            batch = ids.shape[0] if ids.dim() else 1
            per = flat.numel() // max(batch, 1)
            sample = torch.div(src, max(per, 1), rounding_mode="floor")
        else:
            batch = -1  # the collection's stride is checked through the entries (sample < B)
        keep = None if m.padding_idx is None else flat != m.padding_idx
        return self._wide(t, flat, src, sample, None, keep, batch)

    def _bag_record(self, m: nn.EmbeddingBag, t: Table, ids: Tensor, offsets: Tensor | None,
                    psw: Tensor | None) -> Record:
        """nn.EmbeddingBag: ids [B, L] (one bag per row) or ids [N] with offsets [B] ([B + 1] with
        include_last_offset): entry i of bag j scaled by per_sample_weights[i] (SUM) or 1/|bag j| (MEAN)."""
        flat = ids.reshape(-1)
        scale = None if psw is None else psw.detach().reshape(-1)
        if ids.dim() == 2:
            bags, n = ids.shape
            bag = torch.arange(bags, device=ids.device).repeat_interleave(n)
        else:
            assert offsets is not None, "nn.EmbeddingBag checks that 1-D input has offsets"
            bags = offsets.numel() - (1 if m.include_last_offset else 0)
            last = offsets.new_tensor([flat.numel()])
            ends = offsets[1:] if m.include_last_offset else torch.cat([offsets[1:], last])
            bag = torch.repeat_interleave(torch.arange(bags, device=ids.device), ends - offsets[:bags])
            flat = flat[: bag.numel()]  # entries past the last offset are not looked up
            scale = None if scale is None else scale[: bag.numel()]
        keep = None if m.padding_idx is None else flat != m.padding_idx
        if m.mode == "mean":
            counts = torch.bincount(bag if keep is None else bag[keep], minlength=bags).clamp_min(1)
            scale = counts.reciprocal().index_select(0, bag).to(t.weight.dtype)
        return self._wide(t, flat, bag, bag, scale, keep, bags)

    @staticmethod
    def _wide(t: Table, ids: Tensor, src: Tensor, sample: Tensor, scale: Tensor | None, keep: Tensor | None,
              batch: int) -> Record:
        if keep is not None:
            ids, src, sample = ids[keep], src[keep], sample[keep]
            scale = None if scale is None else scale[keep]
        return Record(batch=batch, table=t, rows=ids.long() + t.offset, src=src, sample=sample, scale=scale)

    def _dense_post(self, m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if not self._recording(m):
            return
        if not isinstance(out, Tensor):
            raise UnsupportedModelError(f"{self._label(m)} ({type(m).__name__}): returns {type(out).__name__}, not a "
                                        "tensor; per-sample gradients support layers with one batch-first tensor "
                                        "output (for an LSTM, opacus.layers.DPLSTM is built from nn.Linear)")
        if any(isinstance(v, Tensor) for v in kwargs.values()):
            raise UnsupportedModelError(f"{self._label(m)}: tensor keyword arguments are not supported; pass them "
                                        "positionally (batch first)")
        if not out.requires_grad:
            return
        rec = Record(batch=out.shape[0] if out.dim() else -1, module=m,
                     args=tuple(a.detach() if isinstance(a, Tensor) else a for a in args))
        self.records.append(rec)
        out.register_hook(rec.add_grad)

    # ----------------------------------------------------------------------------------------------- lifecycle

    def check_tables_untouched(self) -> None:
        """Raise when a table weight got a gradient outside its lookups (then clear it)."""
        for t in self.tables:
            if t.weight.grad is not None:
                t.weight.grad = None
                raise UnsupportedModelError(read_outside(t.name))
        if self.sharded_check is not None:
            self.sharded_check()

    def clear(self) -> None:
        self.records.clear()
        self._ec_queue.clear()

    def remove(self) -> None:
        """Remove every hook (the model is then a plain module again)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.clear()
