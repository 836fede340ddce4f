"""First-batch checks for what one backward cannot see: samples coupled by a batch statistic, state that learns
across calls, and a step whose gradients are not ``loss_fn``'s on the loader's batch (another batch, a mean-reduced
backward).

``per_sample.check_independent`` catches samples that interact through the graph (a sample's loss with a gradient
path to another sample's outputs). A batch statistic that sends no gradient between samples escapes it: a dense input
standardised over the batch (``x = (x - x.mean(0)) / x.std(0)`` in ``forward``, or in ``collate_fn``), a loss divided
by a detached batch mean, padding to the batch's longest sequence without a mask. A sample's gradient then depends on
which other samples share its batch, so adding one sample moves the others' clipped gradients and the step's
sensitivity (S1) does not hold. ``check_batch_coupling`` collates sub-batches of m <= 16 of the batch's items (items
fetched once, so randomness of ``__getitem__`` is frozen; a dataset's ``__getitems__`` is called per sub-batch, since
it may compute over what it fetches) and compares each sample's gradient there with its gradient among the m::

    items        [i0 i1 i2 i3 i4 i5 i6 i7]          one pass: g_j among all m
    halves       [i0 i1 i2 i3] [i4 i5 i6 i7]        two passes     } each sample's gradient must equal its g_j
    pairs        [i0 i1] [i2 i3] [i4 i5] [i6 i7]    m/2 passes     } (relative to its own norm; NaN only where NaN)
    offset pairs [i1 i2] [i3 i4] [i5 i6] [i7 i0]    m/2 passes     } (no fixed pairing of the batch survives)

and, for a batch of more than m items, the first m samples' gradients among all the batch's items with theirs among
the m (a statistic that starts above m items). Every pass runs in training mode with dropout off (dropout modules and
RReLU in eval mode, dropout's kernels the identity, however they are called) from one seed. A pass that still draws
random numbers (torch, numpy or Python: noise, stochastic depth, random negatives in ``collate_fn``) is refused, as
sub-batches cannot be compared then, unless the caller opts out; before comparing, one sub-batch runs twice, and a
difference means state that changes between calls (a running statistic in a buffer, an attribute, or via ``.data``):
refused. Recorded calls, gradients, modes and the torch, numpy and Python random states are restored afterwards.
What no computation here sees: statistics over the whole dataset computed before the loader (or cached by a
``collate_fn`` across calls), and coupling that appears only on some batches.

``check_replay`` compares the per-sample gradients the step is about to use with ``loss_fn``'s on the batch the
loader yielded, replayed from the random state the step started from: equal, or exactly 1/B or B of them (the
backward ran on ``loss.mean()`` while ``loss_reduction`` says ``sum``), or the step's batch or loss is not what was
checked; a batch changed in place since it was yielded (``x -= x.mean(0)``) is refused first.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from widedp.api.capture import Capture, Record, UnsupportedModelError
from widedp.api.per_sample import Layout, grads_of
from widedp.dp.rowgrads import PerSampleRows
from widedp.errors import ConfigError

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout, nn.RReLU)
#: dropout's kernels, patched to the identity for the check wherever they are called from (F.dropout by any name,
#: torch.dropout)
_VF_DROPOUT = tuple(f"{kind}dropout{inplace}" for kind in ("", "feature_", "alpha_", "feature_alpha_")
                    for inplace in ("", "_"))
MAX_ITEMS = 16  # items the coupling check compares (sub-batch passes grow with them)
OPT_OUT = "make_private(..., check_independence=False) skips these checks, and the statement then says so"
#: the statement's entry when the caller skipped the checks
UNCHECKED = ("samples' independence not checked (make_private(check_independence=False)): a batch statistic in the "
             "model, loss or collate_fn would void ε")
Pass = tuple[Tensor, PerSampleRows, list[Record]]


def check_batch_coupling(capture: Capture, layout: Layout, loss_fn: Callable[[Any], Tensor],
                         batch_of: Callable[[list[int]], Any], m: int, *, total: int | None = None,
                         seed: int = 0) -> None:
    """Refuse a model whose samples' gradients change with the other samples of their batch (module docstring).

    Args:
        loss_fn: batch -> [B] per-sample losses. batch_of: positions in [0, total) -> the batch of those items, as the
            loader collates it. m: the items compared in sub-batches (< 3: nothing to compare, the check is
            skipped). total: all the batch's items (default m); when larger, its first m samples among all of them
            must equal their gradients among the m (a statistic that starts above m items).
    """
    if m < 3:
        return
    with _preserved(capture, layout), _check_mode(capture):
        def run(pos: list[int]) -> Pass:
            return _seeded_pass(capture, layout, loss_fn, batch_of, pos, seed=seed)

        first = _probe(run, list(range(m // 2)), dtype=layout.dtype)
        full = run(list(range(m)))
        for part in _parts(m):
            _compare(capture, full, first if part == list(range(m // 2)) else run(part), part, dtype=layout.dtype)
        if total is not None and total > m:
            _compare(capture, run(list(range(total))), full, list(range(m)), dtype=layout.dtype)


def _parts(m: int) -> list[list[int]]:
    """Halves, pairs, and pairs offset by one (so that no fixed pairing of the batch survives), of m items."""
    h = m // 2
    pairs = [[i, i + 1] for i in range(0, m - 1, 2)] + ([[m - 2, m - 1]] if m % 2 else [])
    offset = [[i, (i + 1) % m] for i in range(1, m, 2)]
    return [list(range(h)), list(range(h, m))] + pairs + offset


def _seeded_pass(capture: Capture, layout: Layout, loss_fn: Callable[[Any], Tensor],
                 batch_of: Callable[[list[int]], Any], pos: list[int], *, seed: int) -> Pass:
    """One pass from ``seed`` (collate_fn's randomness included); refuses any random draw it makes (dropout is off):
    randomness other than dropout makes sub-batches incomparable."""
    torch.manual_seed(seed)
    before = _random_states()
    with torch.enable_grad():
        out = grads_of(capture, layout, loss_fn, batch_of(pos))
    if not _same_states(before, _random_states()):
        raise UnsupportedModelError("the first batch's pass draws random numbers even with dropout off (random ops "
                                    "in collate_fn or forward, e.g. noise, RReLU, stochastic depth), so widedp cannot "
                                    "check that samples do not interact; draw per-item randomness in the dataset's "
                                    f"__getitem__ (fetched once for the check) or make it deterministic ({OPT_OUT})")
    return out


def _probe(run: Callable[[list[int]], Pass], pos: list[int], *, dtype: torch.dtype) -> Pass:
    """Two identical passes must agree: state that changes across calls learns from the data outside DP."""
    first = run(pos)
    if _differs(first[1], list(range(len(pos))), run(pos)[1], dtype=dtype):
        raise UnsupportedModelError("two identical passes on the first batch gave different gradients: the model or "
                                    "loss_fn changes state between calls in training mode (a running statistic kept "
                                    "in a buffer or attribute learns from the data outside DP); keep such state fixed "
                                    f"({OPT_OUT})")
    return first


def _random_states() -> list[Any]:
    states: list[Any] = [torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()]  # noqa: NPY002
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def _same_states(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, Tensor) else bool(np.array_equal(x, y)) if isinstance(x, np.ndarray)
        else x == y for x, y in zip(a, b))


def check_replay(actual: PerSampleRows, reference: PerSampleRows, *, what: str, reduction: str | None) -> None:
    """Refuse a step whose per-sample gradients ``actual`` (already scaled for ``reduction``) are not ``reference``,
    ``loss_fn``'s on the loader's batch replayed from the same random state; ``reduction`` (the hook path) names a
    factor ~B off as the wrong reduction."""
    b = reference.batch_size
    same = actual.batch_size == b and not _differs(reference, list(range(b)), actual, dtype=actual.values.dtype)
    if same:
        return
    if reduction is not None and actual.batch_size == b and b >= 2:
        mine, ref = _norms(actual), _norms(reference)
        ok = (ref > 0) & torch.isfinite(ref) & torch.isfinite(mine)
        ratio = float((mine[ok] / ref[ok]).median()) if bool(ok.any()) else 1.0
        if abs(ratio * b - 1) < 1e-3 or abs(ratio / b - 1) < 1e-3:
            ran, other = ("loss.mean()", "mean") if ratio < 1 else ("loss.sum()", "sum")
            raise ConfigError(f"optimizer.step(): the recorded per-sample gradients are 1/{b}x or {b}x what "
                              f"loss_reduction={reduction!r} implies: the backward ran on {ran}; pass "
                              f"make_private(..., loss_reduction={other!r}) or back-propagate the {reduction} (this "
                              "step is not taken)")
    raise UnsupportedModelError(f"{what}: the step's per-sample gradients are not loss_fn's on the batch the loader "
                                "yielded (replayed from the same random state): the batch was changed between the "
                                "loader and the forward (e.g. standardised), the loss differs from loss_fn, or random "
                                f"numbers were drawn in between; pass the batch and loss as they are ({OPT_OUT})")


def replayed_rows(capture: Capture, layout: Layout, loss_fn: Callable[[Any], Tensor], batch: Any,
                  rng: dict[str, Any], *, reduce: Callable[[Tensor], Tensor] | None = None) -> PerSampleRows:
    """``loss_fn``'s per-sample gradients on ``batch`` in the model's own modes, from the random state ``rng``
    (``random_state``); recorded calls, gradients and the current random state left as they were."""
    with _preserved(capture, layout):
        _set_random_state(rng)
        with torch.enable_grad():
            return grads_of(capture, layout, loss_fn, batch, reduce=reduce)[1]


def random_state(device: torch.device) -> dict[str, Any]:
    """torch's CPU (and ``device``'s CUDA) random state, to replay a step's dropout."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = (device, torch.cuda.get_rng_state(device))
    return state


def _set_random_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"][1], state["cuda"][0])


def _compare(capture: Capture, full: Pass, sub: Pass, part: list[int], *, dtype: torch.dtype) -> None:
    """The samples at positions ``part`` of ``full`` against the samples of ``sub`` (in that order)."""
    if not _differs(full[1], part, sub[1], dtype=dtype):
        return
    layer = _coupled_input(capture, full[2], sub[2], part)
    what = f"in sub-batches of {len(part)}"
    if layer is not None:
        raise UnsupportedModelError(f"{layer}: a sample's input to this layer changes with the other samples in its "
                                    f"batch ({what}): a batch statistic (e.g. x.mean() / x.std() over the batch, or "
                                    "padding to the batch's longest item without a mask, in forward or collate_fn) "
                                    "couples the samples, so the step's sensitivity and ε would be wrong; compute it "
                                    "per sample or from public data")
    raise UnsupportedModelError(f"a sample's gradient changes with the other samples in its batch though no gradient "
                                f"flows between them ({what}): a batch statistic in the loss or after the last hooked "
                                "layer (e.g. a loss divided by a detached batch mean) couples the samples, so the "
                                "step's sensitivity and ε would be wrong; compute it per sample or from public data")


def _coupled_input(capture: Capture, full: list[Record], sub: list[Record], part: list[int]) -> str | None:
    """The first dense layer whose batch-first input for the compared samples differs between the two passes."""
    if len(full) != len(sub):
        return None
    for rf, rs in zip(full, sub):
        if rf.module is None or rs.module is not rf.module or not rf.args or not rs.args:
            continue
        a, b = rf.args[0], rs.args[0]
        if not (isinstance(a, Tensor) and isinstance(b, Tensor) and a.dim() and a.shape[0] == rf.batch
                and b.shape[0] == len(part)) or not a.is_floating_point():
            continue
        a = a[part]
        if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-4, atol=1e-7, equal_nan=True):
            return capture.label(rf)
    return None


def _differs(a: PerSampleRows, part: list[int], b: PerSampleRows, *, dtype: torch.dtype) -> bool:
    """Do the samples at positions ``part`` of ``a`` differ from samples 0.. of ``b``: by more than a relative
    max(1e-3, 8 eps(dtype)) of their own norm, or in which of them are finite?"""
    count = len(part)
    where = torch.full((a.batch_size,), -1, dtype=torch.long, device=a.rows.device)
    where[torch.tensor(part, dtype=torch.long, device=a.rows.device)] = torch.arange(count, device=a.rows.device)
    sa = where[a.sample_ids()]
    keep = sa >= 0
    sa, ra, va = sa[keep], a.rows[keep], a.values[keep]
    sb, rb, vb = b.sample_ids(), b.rows, b.values.to(va.dtype)
    bad_a = va.new_zeros(count).index_add_(0, sa, (~va.isfinite().all(1)).to(va.dtype)) > 0
    bad_b = va.new_zeros(count).index_add_(0, sb, (~vb.isfinite().all(1)).to(va.dtype)) > 0
    if not torch.equal(bad_a, bad_b):
        return True
    if sa.shape == sb.shape and torch.equal(sa, sb) and torch.equal(ra, rb):  # the same entries in the same order
        sample, diff = sa, va - vb
    else:
        width = max(a.num_rows, b.num_rows)
        uniq, inv = torch.unique(torch.cat([sa, sb]) * width + torch.cat([ra, rb]), return_inverse=True)
        diff = va.new_zeros(uniq.numel(), va.shape[1]).index_add_(0, inv, torch.cat([va, -vb]))
        sample = torch.div(uniq, width, rounding_mode="floor")
    err = va.new_zeros(count).index_add_(0, sample, diff.nan_to_num(0.0, 0.0, 0.0).square().sum(1)).sqrt()
    own = torch.maximum(_norms_of(sa, va, count), _norms_of(sb, vb, count))
    rtol = max(1e-3, 8 * torch.finfo(dtype).eps)
    return bool((err > rtol * own + 1e-12 * float(own.max() if own.numel() else 0.0) + 1e-30)[~bad_a].any())


def _norms_of(sample: Tensor, values: Tensor, count: int) -> Tensor:
    sq = values.nan_to_num(0.0, 0.0, 0.0).square().sum(1)
    return values.new_zeros(count).index_add_(0, sample, sq).sqrt()


def _norms(g: PerSampleRows) -> Tensor:
    """[B] each sample's L2 norm over all its rows."""
    return g.values.new_zeros(g.batch_size).index_add_(0, g.sample_ids(), g.values.square().sum(1)).sqrt()


@contextmanager
def _preserved(capture: Capture, layout: Layout) -> Iterator[None]:
    """Run a check without disturbing the step it precedes: recorded calls, gradients, the random states."""
    # (copies: DDP writes later backwards' gradients into the same bucket storage a .grad may view)
    records, grads = list(capture.records), [(p, None if p.grad is None else p.grad.clone()) for _, p in layout.dense]
    devices = sorted({p.device.index or 0 for _, p in layout.dense if p.is_cuda} |
                     {t.weight.device.index or 0 for t in layout.tables if t.weight.is_cuda})
    py, npy = random.getstate(), np.random.get_state()  # noqa: NPY002 (the user's global state)
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)  # noqa: NPY002
        capture.clear()
        capture.records.extend(records)
        for p, g in grads:
            p.grad = g


@contextmanager
def _check_mode(capture: Capture) -> Iterator[None]:
    """Training mode with dropout off: dropout modules (and RReLU) in eval mode, dropout's kernels the identity."""
    saved = [(m, m.training) for m in capture.model.modules()]
    kernels = [(ns, name, getattr(ns, name)) for ns in (torch._VF, torch) for name in _VF_DROPOUT if hasattr(ns, name)]
    try:
        for m in capture.model.modules():
            if isinstance(m, _DROPOUT):
                m.training = False
        for ns, name, _ in kernels:
            setattr(ns, name, _identity)
        yield
    finally:
        for ns, name, f in kernels:
            setattr(ns, name, f)
        for m, mode in saved:
            m.training = mode


def _identity(input: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    return input


class FirstStepChecks:
    """The checks ``PrivacyEngine`` runs on its first steps (module docstring), with what they need: the loader's
    items (``fetch_items`` / ``collate``, or ``fetch`` for a dataset whose ``__getitems__`` returns a batch), the
    issued batch's items and the random state it was issued at. ``enabled`` False (the caller's opt-out) skips all."""

    def __init__(self, capture: Capture, layout: Layout, *, n: int, fetch_items: Callable[[list[int]], Any],
                 collate: Callable[[list[Any]], Any], fetch: Callable[[list[int]], Any], batched: bool,
                 enabled: bool, reduce: Callable[[Tensor], Tensor] | None = None) -> None:
        """``reduce``: as ``widedp.api.per_sample.per_sample_rows``'s (a DMP model's DDP-averaged gradients)."""
        self.capture, self.layout, self.n, self.enabled, self.reduce = capture, layout, n, enabled, reduce
        self._fetch_items, self._collate, self._fetch, self._batched = fetch_items, collate, fetch, batched
        self._versions: list[tuple[Tensor, int]] = []
        self.coupling_done = self.replay_done = not enabled
        self._items: list[int] = []
        self._batch: Any = None
        self._rng: dict[str, Any] | None = None

    def issue(self, items: list[int], batch: Any, device: torch.device) -> None:
        """The loader yields ``batch`` (of ``items``) now: remember them and the random state (for the replay)."""
        self._items = items
        self._batch, self._rng = (batch, random_state(device)) if not self.replay_done else (None, None)
        self._versions = [(t, t._version) for t in _tensors(batch)] if not self.replay_done else []

    def coupling(self, loss_fn: Callable[[Any], Tensor]) -> None:
        """``check_batch_coupling`` once, on the issued batch's first 16 items (padded to >= 4 with the dataset's
        first items)."""
        if self.coupling_done:
            return
        items = list(self._items)
        items = items + [i for i in range(min(self.n, 8)) if i not in set(items)][: max(0, 4 - len(items))]
        check_batch_coupling(self.capture, self.layout, loss_fn, self._batch_maker(items), min(len(items), MAX_ITEMS),
                             total=len(items))
        self.coupling_done = True

    def replay(self, actual: PerSampleRows, loss_fn: Callable[[Any], Tensor], rng: dict[str, Any] | None, *,
               what: str, reduction: str | None) -> None:
        """``check_replay`` once, of ``actual`` against ``loss_fn`` on the batch the loader yielded, from ``rng``
        (None: the random state when it was yielded)."""
        rng = rng if rng is not None else self._rng
        if self.replay_done or rng is None or self._batch is None:
            return
        if any(t._version != v for t, v in self._versions):
            raise UnsupportedModelError(f"{what}: the batch the loader yielded was changed in place before the step "
                                        "(e.g. x -= x.mean(0)): a change the checks cannot see, which may couple the "
                                        "samples; change it out of place, in collate_fn (checked), or per item in "
                                        f"__getitem__ ({OPT_OUT})")
        check_replay(actual, replayed_rows(self.capture, self.layout, loss_fn, self._batch, rng, reduce=self.reduce),
                     what=what, reduction=reduction)
        self.replay_done, self._batch, self._rng = True, None, None

    def _batch_maker(self, items: list[int]) -> Callable[[list[int]], Any]:
        """positions -> the batch of those of ``items``, from items fetched once (``__getitem__`` randomness frozen)."""
        if self._batched:  # the dataset's own __getitems__ may compute over the items it fetches: call it per sub-batch
            return lambda pos: self._fetch([items[p] for p in pos])
        got = self._fetch_items(items)
        if isinstance(got, list) and len(got) == len(items):
            return lambda pos: self._collate([got[p] for p in pos])
        return lambda pos: self._fetch([items[p] for p in pos])


def _tensors(batch: Any) -> list[Tensor]:
    """The tensors a batch holds: in tuples, lists, dicts, and the attributes of objects such as a KJT."""
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, (tuple, list)):
        return [t for x in batch for t in _tensors(x)]
    if isinstance(batch, dict):
        return [t for x in batch.values() for t in _tensors(x)]
    return [x for x in getattr(batch, "__dict__", {}).values() if isinstance(x, Tensor)]

