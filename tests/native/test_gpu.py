"""The Triton kernels (widedp.native.gpu) against the PyTorch reference: clip + aggregate, lazy Adam, dp_step.

Without a GPU they run in Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 before
Triton is imported): the kernels' logic is checked here. With one, the same cases run compiled on CUDA tensors
(``DEV``), and the ``cuda`` tests below add larger ones. Tolerances: 1e-6 relative to the summed magnitudes (a
clipped sample's norm is summed in float64 in another order; atomic adds reorder the sums).
"""

from __future__ import annotations

import pytest
import torch
from test_native import jagged, lazy_adam_pair, reference

from widedp.config import ExponentialSelectionConfig, GaussianThresholdSelectionConfig
from widedp.dp.clipping import aggregate, clip_per_sample
from widedp.dp.optim import LazyAdam
from widedp.dp.rowgrads import PerSampleRows, SparseRows
from widedp.dp.selection import SelectionContext, make_selector
from widedp.dp.step import dp_step
from widedp.native import gpu

pytest.importorskip("triton")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the kernels run: compiled on CUDA, else interpreted


def on_dev(g: PerSampleRows) -> PerSampleRows:
    return PerSampleRows(g.values.to(DEV), g.rows.to(DEV), g.offsets.to(DEV), g.num_rows)


def assert_matches(g: PerSampleRows, *, clip1: float, b: float, always_from: int | None = None) -> None:
    touched, ghat, info = reference(g, clip1=clip1, b=b) if always_from is None else (
        *aggregate(clip_per_sample(g, clip1=clip1)[0], batch_size=b, always_from=always_from),
        clip_per_sample(g, clip1=clip1)[1])
    k = on_dev(g)
    t2, gh2, clipped, nonfinite = gpu.clip_aggregate(k.values, k.rows, k.offsets, num_rows=g.num_rows, clip1=clip1,
                                                     batch_size=b, always_from=always_from, strict=True)
    gh2, ghat = gh2.cpu(), ghat.cpu()
    assert torch.equal(t2.cpu(), touched.cpu()) and gh2.dtype == ghat.dtype and gh2.shape == ghat.shape
    assert torch.equal(clipped.cpu(), info.clipped.cpu()) and torch.equal(nonfinite.cpu(), info.nonfinite.cpu())
    mag = aggregate(PerSampleRows(clip_per_sample(g, clip1=clip1)[0].values.abs(), g.rows, g.offsets, g.num_rows),
                    batch_size=b, always_from=always_from)[1].cpu()
    assert torch.all((gh2 - ghat).abs() <= 1e-6 * mag + 1e-300), (gh2 - ghat).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("B", "R", "D", "max_len"), [(20, 2000, 100, 12), (40, 30, 7, 10), (6, 500, 300, 9)])
def test_clip_aggregate_equals_reference(dtype, B, R, D, max_len):
    gen = torch.Generator().manual_seed(B + D)
    g = jagged(gen, B=B, R=R, D=D, max_len=max_len, dtype=dtype)
    for clip1 in (0.5, 1.0, 1e9):  # some clipped / none clipped
        assert_matches(g, clip1=clip1, b=B * 1.5)


def test_always_rows_nonfinite_huge_tiny_and_empty():
    gen = torch.Generator().manual_seed(3)
    g = jagged(gen, B=12, R=40, D=6, max_len=8)
    v = g.values.clone()
    starts = g.offsets[:-1][g.offsets.diff() > 0]
    v[starts[0], 2] = float("nan")
    v[starts[1], 0] = float("-inf")
    v[starts[2]] *= 1e30  # squares overflow float32
    v[starts[3]] *= 1e-30  # squares underflow float32
    g = PerSampleRows(v, g.rows, g.offsets, g.num_rows)
    assert_matches(g, clip1=1.0, b=12.0)
    assert_matches(g, clip1=1.0, b=12.0, always_from=30)  # rows 30..39 touched, zero where no sample had them
    g64 = PerSampleRows(v.double() * 1e-300, g.rows, g.offsets, g.num_rows)  # entries near float64's subnormals
    assert_matches(g64, clip1=1e-301, b=12.0)
    big = v.double().nan_to_num(0.0).clamp(-1, 1)
    big[big.abs() > 0.1] = 1e308 * big[big.abs() > 0.1].sign()  # norms overflow float64: clipped to S1 all the same
    g_big = PerSampleRows(big, g.rows, g.offsets, g.num_rows)
    assert_matches(g_big, clip1=1.0, b=12.0)
    k = on_dev(g_big)
    out = gpu.clip_aggregate(k.values, k.rows, k.offsets, num_rows=g.num_rows, clip1=1.0, batch_size=12.0, strict=True)
    assert out[1].abs().max() > 0.01 and torch.isfinite(out[1]).all()
    empty = on_dev(PerSampleRows(torch.zeros(0, 6), torch.zeros(0, dtype=torch.long), torch.zeros(4, dtype=torch.long),
                                 9))
    touched, ghat, clipped, nonfinite = gpu.clip_aggregate(empty.values, empty.rows, empty.offsets, num_rows=9,
                                                           clip1=1.0, batch_size=3.0, always_from=7, strict=True)
    assert touched.tolist() == [7, 8] and torch.equal(ghat.cpu(), torch.zeros(2, 6))
    assert clipped.tolist() == nonfinite.tolist() == [False] * 3


class OnCuda:
    """A ``LazyAdam`` on CUDA copies of the tables, stepped with the CPU gradients moved over."""

    def __init__(self, tables: list[tuple[int, torch.Tensor]]) -> None:
        self.opt = LazyAdam([(off, w.cuda()) for off, w in tables], lr=0.01, betas=(0.9, 0.999), eps=1e-8)

    def step(self, grad: SparseRows) -> None:
        self.opt.step(SparseRows(grad.rows.cuda(), grad.values.cuda(), grad.num_rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lazy_adam_equals_reference(dtype, monkeypatch):
    if DEV == "cpu":
        monkeypatch.setattr(gpu, "use", lambda fused, *t: fused is not False)  # CPU tensors through the Triton path
    make = OnCuda if DEV == "cuda" else lambda t: LazyAdam(t, lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    ref, other, tables, _, before, untouched = lazy_adam_pair(dtype, make, steps=12)
    triton_opt = other.opt if DEV == "cuda" else other
    assert triton_opt.gpu and not triton_opt.fused and not ref.gpu
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    for (name, a), (name2, b) in zip(ref.state_dict().items(), triton_opt.state_dict().items()):
        assert name == name2  # m's lerp cancels: error relative to the moments' scale; step counts: equal
        torch.testing.assert_close(b.cpu(), a, rtol=tol, atol=tol * float(a.abs().max()))
    for (_, w), (_, w2) in zip(tables, triton_opt.tables):  # (atol: see test_cuda_lazy_adam_equals_reference)
        torch.testing.assert_close(w2.cpu(), w, rtol=tol, atol=tol * float(w.abs().max()))
    assert untouched and torch.equal(torch.cat([w.cpu() for _, w in triton_opt.tables])[untouched], before[untouched])


@pytest.mark.parametrize("sel", [ExponentialSelectionConfig(k=40, epsilon=1.0, score_clip=0.05),
                                 GaussianThresholdSelectionConfig(sigma=0.5, threshold=1.0)])
@pytest.mark.skipif(DEV == "cuda", reason="forces CPU tensors through Triton's interpreter; compiled on CUDA: "
                    "tests/dp/test_step_cuda.py::test_step_uses_the_triton_kernel_and_matches_the_pytorch_path")
def test_dp_step_through_the_triton_path_equals_reference(sel, monkeypatch):
    """``dp_step`` routes clip + aggregate to the Triton kernel (forced onto CPU tensors here): same selection,
    same noise, gradients within 1e-6."""
    g = jagged(torch.Generator().manual_seed(5), B=48, R=400, D=8, max_len=12)
    results = []
    for route in (False, True):
        monkeypatch.setattr(gpu, "use", lambda fused, *t, route=route: route)
        selector = make_selector(sel, num_rows=g.num_rows)
        results.append(dp_step(g, batch_size=48, sampling_rate=0.1, clip1=0.8, clip2=0.5, noise_multiplier=0.7,
                               selector=selector, ctx=SelectionContext(epoch=0, num_epochs=1),
                               generator=torch.Generator().manual_seed(9), fused=False if not route else None))
    a, b = results
    assert 0 < float(a.stats.clipped1) < 1
    assert torch.equal(a.selected, b.selected) and torch.equal(a.grad.rows, b.grad.rows)
    torch.testing.assert_close(b.grad.values, a.grad.values, rtol=1e-6, atol=1e-6 * float(a.grad.values.abs().max()))


def test_use_is_false_for_cpu_tensors_and_honours_fused_false():
    x = torch.zeros(2)
    assert not gpu.use(None, x) and not gpu.use(True, x) and not gpu.use(False, x)


# ------------------------------------------------------------------------------- compiled, on a CUDA device


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_clip_aggregate_equals_reference(dtype):
    g = jagged(torch.Generator().manual_seed(7), B=256, R=5000, D=64, max_len=30, dtype=dtype)
    g = PerSampleRows(g.values.cuda(), g.rows.cuda(), g.offsets.cuda(), g.num_rows)
    assert gpu.use(None, g.values)
    for clip1 in (0.5, 1e9):
        assert_matches(g, clip1=clip1, b=300.0)
        assert_matches(g, clip1=clip1, b=300.0, always_from=4990)


@cuda
def test_cuda_lazy_adam_equals_reference():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(100, 32, generator=gen)
    ref = LazyAdam([(0, w.clone().cuda())], lr=0.01, betas=(0.9, 0.999), eps=1e-8, fused=False)
    fast = LazyAdam([(0, w.clone().cuda())], lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    assert fast.gpu
    for _ in range(10):
        rows = torch.randperm(100, generator=gen)[:20].cuda()
        grad = SparseRows(rows, torch.randn(20, 32, generator=gen).cuda(), 100)
        ref.step(grad)
        fast.step(grad)
    # 1e-6 of the weights' scale: a weight near 0 after its update differs by ~10 float32 ulps of the update
    # (fused multiply-adds); a wrong moment or bias correction is off by ~lr = 1e-2
    w_ref = ref.tables[0][1]
    torch.testing.assert_close(fast.tables[0][1], w_ref, rtol=1e-6, atol=1e-6 * float(w_ref.abs().max()))


def test_a_kernel_that_fails_to_compile_warns_once_and_falls_back(monkeypatch):
    """A Triton build error on an untested GPU must not end a run: one warning, then the PyTorch path."""
    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("PTX assembly failed\nmore lines")

    monkeypatch.setattr(gpu, "_kernels", lambda: {"clip_scatter": Broken(), "lazy_adam": Broken()})
    monkeypatch.setattr(gpu, "_broken", {})
    g = jagged(torch.Generator().manual_seed(2), B=8, R=50, D=4, max_len=5)
    with pytest.raises(RuntimeError, match="PTX"):
        gpu.clip_aggregate(g.values, g.rows, g.offsets, num_rows=50, clip1=1.0, batch_size=8.0, strict=True)
    with pytest.warns(RuntimeWarning, match="clip_scatter failed .RuntimeError: PTX assembly failed.; using"):
        assert gpu.clip_aggregate(g.values, g.rows, g.offsets, num_rows=50, clip1=1.0, batch_size=8.0) is None
    assert gpu._broken["why"] == "RuntimeError: PTX assembly failed"  # use() is False for the rest of the process
