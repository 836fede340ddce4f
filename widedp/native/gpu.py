"""Fused CUDA kernels for the DP step, written in Triton: clip + aggregate, and lazy Adam.

The CUDA counterparts of ``fused.cpp``; the PyTorch functions stay the reference (``widedp.dp.clipping``,
``widedp.dp.optim.LazyAdam``). Used when Triton imports, the tensors are on a CUDA device and ``WIDEDP_NATIVE`` is
not ``0``; otherwise the PyTorch path runs. Triton ships with torch's CUDA wheels (``torch==2.13.0`` pins
``triton==3.7.1``); the CPU requirements install the same version so that the tests run these kernels, on CPU
tensors, in Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported: the same kernel source
executed op by op with NumPy).

clip_aggregate, one program per sample j (its pairs are rows off[j] .. off[j+1] of ``values``, i.e. one contiguous
run of n_j·D entries, read three times while it is hot):

    values [nnz, D]  |-- sample 0 --|---- sample 1 ----|- 2 -| ...      slot [nnz]: pair -> position in touched
    pass 1: top = max |x| (NaN counts as inf)        -> nonfinite[j]
    pass 2: s = Σ (x / 2^e)², e = exponent of top     (float64: no overflow or underflow)
    pass 3: ghat[slot[i], :] += w_j / b · x_i         (atomic adds; w_j = 0, 1 or S1 / ||g_j||)
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
from torch import Tensor


@functools.cache
def available() -> bool:
    """Triton imports and ``WIDEDP_NATIVE`` is not ``0``."""
    if os.environ.get("WIDEDP_NATIVE", "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use(fused: bool | None, *tensors: Tensor) -> bool:
    """Whether to run the Triton kernels on ``tensors``: all on CUDA without autograd history, Triton available and
    ``fused`` not False. False for CPU tensors (``widedp.native``'s C++ kernels serve those); ``fused=True`` on CUDA
    tensors raises if Triton is missing."""
    if fused is False or not all(t.device.type == "cuda" and not t.requires_grad for t in tensors):
        return False
    if fused and not available():
        raise RuntimeError("fused=True: Triton is not installed (it comes with torch's CUDA wheels)")
    return available() and not _broken


_broken: dict[str, str] = {}  # "why": a kernel failed to compile or launch; the PyTorch path runs from then on


def _launch(name: str, grid: tuple[int], *args: object, strict: bool, **meta: object) -> bool:
    """Run kernel ``name``; False (one warning; Triton off for the process) if it fails and not ``strict``."""
    try:
        _kernels()[name][grid](*args, **meta)
        return True
    except Exception as e:  # a compile error on an untested GPU / Triton build must not end the run
        if strict:
            raise
        _broken["why"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        warnings.warn(f"widedp.native.gpu: the Triton kernel {name} failed ({_broken['why']}); using the PyTorch "
                      "path", RuntimeWarning, stacklevel=3)
        return False


@functools.cache
def _kernels() -> dict[str, object]:
    import triton  # with TRITON_INTERPRET=1 set before this import, triton.jit gives interpreted kernels

    from widedp.native import gpu_kernels as k

    return {name: triton.jit(f) for name, f in (("clip_scatter", k.clip_scatter), ("lazy_adam", k.lazy_adam))}


def clip_aggregate(values: Tensor, rows: Tensor, offsets: Tensor, *, num_rows: int, clip1: float, batch_size: float,
                   always_from: int | None = None, strict: bool = False
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """``clipping.clip_per_sample`` then ``clipping.aggregate`` (with its ``always_from``) in one kernel launch
    after ``torch.unique`` (the step's one remaining host sync).

    Args:
        values [nnz, D] float32/64, rows [nnz] int64 in [0, num_rows), offsets [B + 1] int64.

    Returns:
        touched [U] sorted unique ids, ghat [U, D], clipped [B] bool, nonfinite [B] bool; None if the kernel could
        not run (not ``strict``: ``_launch``).
    """
    values = values.contiguous()
    nnz, d = values.shape
    b = offsets.numel() - 1
    ids = rows
    if always_from is not None and always_from < num_rows:
        ids = torch.cat([rows, torch.arange(always_from, num_rows, device=rows.device)])
    touched, slot = torch.unique(ids, sorted=True, return_inverse=True)
    ghat = values.new_zeros(touched.numel(), d)
    clipped = torch.zeros(b, dtype=torch.bool, device=values.device)
    nonfinite = torch.zeros(b, dtype=torch.bool, device=values.device)
    if b and nnz and d and not _launch(
            "clip_scatter", (b,), values, slot[:nnz].contiguous(), offsets.contiguous(), ghat, clipped, nonfinite, d,
            strict=strict, CLIP1=float(clip1), ALPHA=1.0 / batch_size, IS64=values.dtype == torch.float64,
            BLOCK=1024):
        return None
    return touched, ghat, clipped, nonfinite


def lazy_adam_(weights: list[Tensor], moments: list[Tensor], steps: list[Tensor], bounds: list[int], rows: Tensor,
               grad: Tensor, coef: Tensor, *, lr: float, betas: tuple[float, float], eps: float,
               strict: bool = False) -> bool:
    """``optim.LazyAdam.step`` in place, one launch per table (a program per given row; rows outside the table
    return at once). ``rows`` [k] distinct global ids, ``grad`` [k, D]; ``moments[t]`` [n_t, 2, D] (m, v);
    ``coef`` [L, 2] the bias corrections by step count (``LazyAdam``'s table). False: the first launch failed
    (nothing was changed; not ``strict``: ``_launch``)."""
    k, d = grad.shape
    if not k:
        return True
    grad, rows = grad.contiguous(), rows.contiguous()
    for t, (w, mom, cnt, first) in enumerate(zip(weights, moments, steps, bounds)):
        if not _launch("lazy_adam", (k,), w, mom, cnt, rows, grad, coef, first, w.shape[0], d, coef.shape[0],
                       strict=strict or t > 0, LR=float(lr), B1=float(betas[0]), B2=float(betas[1]),
                       EPS=float(eps), BLOCK=min(1024, 1 << max(0, (d - 1).bit_length()))):
            return False
    return True
