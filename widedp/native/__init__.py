"""Optional fused CPU kernels for the DP step (``fused.cpp``): clip + aggregate, and lazy Adam; and the
sparse vector selector's host scan (``svt.cpp``).

The PyTorch functions stay the reference (``widedp.dp.clipping``, ``widedp.dp.optim.LazyAdam``); these are used when the
library is available, the tensors are on the CPU and ``WIDEDP_NATIVE`` is not ``0``. Otherwise widedp says so
once (a warning) and runs the PyTorch path. On CUDA, ``widedp.native.gpu`` runs Triton counterparts of the first two.

Build: one compiler call per source, side by side, then a link (``$CXX``, default ``c++``; flags and paths from
``torch.utils.cpp_extension``; no ninja, no Python headers), ~20 s, into ``build_dir()``: ``scripts/setup_env.sh``
runs ``python -m widedp.native`` once; otherwise the first use builds it (with a one-line message). The file name
carries a hash of the source, the flags and the torch version, so an edit or a torch upgrade rebuilds; concurrent
builders wait on a file lock.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import torch
from torch import Tensor

SOURCES = tuple(Path(__file__).with_name(f) for f in ("fused.cpp", "svt.cpp"))  # one library
_state: dict[str, object] = {}  # "ok": bool once available() ran; "why": the reason it is not available


def build_dir() -> Path:
    """``$WIDEDP_NATIVE_DIR``, else ``<venv>/share/widedp-native`` in a virtual environment, else the user cache."""
    if os.environ.get("WIDEDP_NATIVE_DIR"):
        return Path(os.environ["WIDEDP_NATIVE_DIR"])
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "share" / "widedp-native"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "widedp" / "native"


def _command(out: Path) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [os.environ.get("CXX", "c++"), "-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off",
           "-fno-math-errno", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths()), *map(str, SOURCES)]
    libs = library_paths()
    return [*cmd, *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs), "-lc10", "-ltorch_cpu", "-o",
            str(out)]


def _steps(out: Path) -> tuple[list[list[str]], list[str]]:
    """``_command`` as one compile per source (run side by side: half the wall time on two cores) and a link."""
    cmd = _command(out)
    flags = [a for a in cmd[1:] if a.startswith(("-O", "-std", "-f", "-w", "-D", "-I"))]
    objs = [out.with_name(f"{out.name}.{src.stem}.o") for src in SOURCES]
    compiles = [[cmd[0], *flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(SOURCES, objs)]
    link = [cmd[0], "-shared", "-fopenmp", *map(str, objs), *(a for a in cmd if a.startswith(("-L", "-Wl", "-l"))),
            "-o", str(out)]
    return compiles, link


def _run_all(commands: list[list[str]]) -> subprocess.CompletedProcess | None:
    """Run ``commands`` side by side; the first that failed (None: none)."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    outputs = [p.communicate() for p in procs]
    done = [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs)]
    return next((d for d in done if d.returncode != 0), None)


def library_path() -> Path:
    tag = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES) + " ".join(_command(Path("x"))[:-1]).encode()
                         + torch.__version__.encode() + sysconfig.get_platform().encode()).hexdigest()[:16]
    return build_dir() / f"widedp_fused_{tag}.so"


def build(*, quiet: bool = False) -> Path:
    """Compile the sources unless this source/torch/flags combination is already built; returns the library.

    Raises:
        RuntimeError: the compiler failed (its last lines in the message).
    """
    import fcntl  # POSIX only: elsewhere this raises inside available(), which then falls back

    out = library_path()
    if out.exists():  # built (possibly in a read-only environment)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same file
        if out.exists():
            return out
        if not quiet:
            print(f"[widedp] building the fused CPU kernels (once, ~20 s) into {out.parent}", file=sys.stderr)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        compiles, link = _steps(tmp)
        try:
            r = _run_all(compiles) or _run_all([link])
            if r is not None:
                tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
                names = " + ".join(s.name for s in SOURCES)
                raise RuntimeError(f"compiling {names} failed (exit {r.returncode}): {tail}")
            os.replace(tmp, out)  # atomic: a reader sees a whole library or none
        finally:
            tmp.unlink(missing_ok=True)
            for obj in compiles:
                Path(obj[-1]).unlink(missing_ok=True)
        for old in out.parent.glob("widedp_fused_*.so"):  # other sources / torch versions (a loaded one stays mapped)
            if old != out:
                old.unlink(missing_ok=True)
    return out


def available() -> bool:
    """Load (building if needed) the kernels once per process; False, with one warning, if that fails."""
    if "ok" not in _state:
        if os.environ.get("WIDEDP_NATIVE", "1") == "0":
            _state.update(ok=False, why="WIDEDP_NATIVE=0")
            return False
        try:
            torch.ops.load_library(str(build()))
            _state["ok"] = True
        except Exception as e:  # any failure means: use the PyTorch path
            _state.update(ok=False, why=f"{type(e).__name__}: {e}")
            warnings.warn(f"widedp.native: fused CPU kernels unavailable ({_state['why']}); using the PyTorch path",
                          RuntimeWarning, stacklevel=2)
    return bool(_state["ok"])


def use(fused: bool | None, *tensors: Tensor) -> bool:
    """Whether to run the native kernels on ``tensors``: ``fused`` None = when available and every tensor is a CPU
    tensor without autograd history; False = never; True = always (raises if that is impossible)."""
    if fused is False:
        return False
    ok = all(t.device.type == "cpu" and not t.requires_grad for t in tensors)
    if fused is None:
        return ok and available()
    if not ok:
        raise ValueError("fused=True: the native kernels take CPU tensors without autograd history only")
    if not available():
        raise RuntimeError(f"fused=True: the native kernels are unavailable ({_state['why']})")
    return True


def clip_aggregate(values: Tensor, rows: Tensor, offsets: Tensor, *, num_rows: int, clip1: float,
                   batch_size: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``clipping.clip_per_sample`` then ``clipping.aggregate`` in one native pass.

    Returns:
        touched [U] sorted unique ids, ghat [U, D], clipped [B] bool, nonfinite [B] bool.
    """
    return torch.ops.widedp.clip_aggregate(values, rows, offsets, num_rows, clip1, 1.0 / batch_size)


def lazy_adam_(weights: list[Tensor], moments: list[Tensor], steps: list[Tensor], bounds: list[int], rows: Tensor,
               grad: Tensor, coef: Tensor | None, *, lr: float, betas: tuple[float, float], eps: float) -> None:
    """``optim.LazyAdam.step`` on every table in place; global ``rows`` [k] (distinct), ``grad`` [k, D]."""
    torch.ops.widedp.lazy_adam_(weights, moments, steps, bounds, rows, grad, coef, lr, betas[0], betas[1], eps)


def cbow_row_grads(w_in: Tensor, w_out: Tensor, context: Tensor, out_ids: Tensor, *, num_rows: int,
                   out_shift: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``CBOW.per_sample_row_grads`` in one native call: loss [B], values [nnz, D], global rows [nnz] (ascending
    within each sample, unique), offsets [B + 1]. ``out_ids`` [B, L]: target then negatives; ``out_shift``: the
    output table's first global row (V untied, 0 tied)."""
    return torch.ops.widedp.cbow_row_grads(w_in, w_out, context, out_ids, num_rows, out_shift)


def svt_scan(tpos: Tensor, tnoisy: Tensor, tid: Tensor, thr: Tensor, unif: Tensor, *, num_rows: int,
             query_scale: float) -> Tensor:
    """``selection.svt.scan`` in one native call: [<= c] int64, a touched id or -1 (an untouched answer) per segment.
    ``tpos``/``tid`` [U] int64, ``tnoisy`` [U], ``thr``/``unif`` [c] float64, all contiguous CPU tensors."""
    return torch.ops.widedp.svt_scan(tpos, tnoisy, tid, thr, unif, num_rows, query_scale)
