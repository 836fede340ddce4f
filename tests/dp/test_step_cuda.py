"""The DP step on CUDA: every selector's picks in law against the CPU's, the noise's scale, the Triton
clip + aggregate inside the step, and the host-sync proxy (``HostSyncs``) against CUDA's own sync detector.
Skipped without CUDA; run on the GPU machine."""

import warnings

import pytest
import torch
from test_step import CTX, random_batch
from test_syncs import EXPECTED

import widedp.config as C
from widedp.dp.optim import LazyAdam
from widedp.dp.rowgrads import PerSampleRows
from widedp.dp.selection import make_selector
from widedp.dp.step import dp_step
from widedp.dp.syncs import HostSyncs
from widedp.models.cbow import CBOW, CBOWBatch
from widedp.native import gpu

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

R = 40
SMALL = {  # over R rows: touched rows have high scores, so a wrong ε or score scale moves the marginals
    "exponential": C.ExponentialSelectionConfig(k=5, epsilon=2.0, score_clip=0.5),
    "exponential_count": C.ExponentialSelectionConfig(k=5, epsilon=2.0, score="count", score_clip=4.0),
    "uniform": C.UniformSelectionConfig(k=5),
    "random_sparsification": C.RandomSparsificationConfig(final_rate=0.5),
    "gaussian_threshold": C.GaussianThresholdSelectionConfig(sigma=0.5, threshold=1.0),
    "sparse_vector": C.SparseVectorSelectionConfig(epsilon=2.0, cutoff=5, threshold=0.2, score_clip=0.5),
}


def cuda_rows(g: PerSampleRows) -> PerSampleRows:
    return PerSampleRows(g.values.cuda(), g.rows.cuda(), g.offsets.cuda(), g.num_rows)


def picks(name: str, g: PerSampleRows, device: str, steps: int) -> torch.Tensor:
    """[R] how often each row was selected over ``steps`` steps on ``device``."""
    gen = torch.Generator(device=device).manual_seed(7)
    selector = make_selector(SMALL[name], num_rows=R)
    counts = torch.zeros(R, dtype=torch.long)
    for _ in range(steps):
        res = dp_step(g, batch_size=12.0, sampling_rate=0.01, clip1=1.0, clip2=1.0, noise_multiplier=1.0,
                      selector=selector, ctx=CTX, generator=gen)
        assert res.selected.device.type == device and res.grad.values.device.type == device
        counts += torch.bincount(res.selected.cpu(), minlength=R)
    return counts


@pytest.mark.parametrize("name", sorted(SMALL))
def test_selection_on_cuda_has_the_cpu_law(name):
    from scipy import stats

    g = random_batch(torch.Generator().manual_seed(1), batch=12, num_rows=R, dim=3)
    cpu, dev = picks(name, g, "cpu", 400), picks(name, cuda_rows(g), "cuda", 400)
    keep = (cpu + dev) > 0
    p = stats.chi2_contingency(torch.stack([cpu[keep], dev[keep]]).numpy()).pvalue
    assert p > 1e-4, (name, cpu.tolist(), dev.tolist())
    touched = torch.zeros(R, dtype=torch.bool)
    touched[g.rows.unique()] = True
    if name not in ("uniform", "random_sparsification"):  # the data-driven ones favour touched rows on both
        assert dev[touched].float().mean() > 1.3 * dev[~touched].float().mean()  # measured on the CPU: >= 1.7


def test_noise_scale_on_cuda():
    """All rows selected, an empty batch: the released values are the noise alone, N(0, (σ Δ₂)²), Δ₂ = min(S1/b,
    2 S2)."""
    empty = PerSampleRows(torch.zeros(0, 8, dtype=torch.float64, device="cuda"),
                          torch.zeros(0, dtype=torch.long, device="cuda"),
                          torch.zeros(11, dtype=torch.long, device="cuda"), 5000)
    res = dp_step(empty, batch_size=10.0, sampling_rate=0.01, clip1=2.0, clip2=1.0, noise_multiplier=1.5,
                  selector=make_selector(C.AllRowsConfig(), num_rows=5000), ctx=CTX,
                  generator=torch.Generator(device="cuda").manual_seed(3))
    std = float(res.grad.values.std())
    assert abs(std / (1.5 * 0.2) - 1) < 0.03, std  # 40,000 draws: the std is within 1% (a factor 2 is far out)


def test_step_uses_the_triton_kernel_and_matches_the_pytorch_path():
    g = cuda_rows(random_batch(torch.Generator().manual_seed(2), batch=64, num_rows=2000, dim=16))
    assert gpu.use(None, g.values)
    out = []
    for fused in (None, False):
        out.append(dp_step(g, batch_size=64.0, sampling_rate=0.01, clip1=0.5, clip2=1.0, noise_multiplier=0.7,
                           selector=make_selector(C.ExponentialSelectionConfig(k=50, epsilon=1.0), num_rows=2000),
                           ctx=CTX, generator=torch.Generator(device="cuda").manual_seed(4), fused=fused))
    a, b = out
    assert torch.equal(a.selected, b.selected)
    torch.testing.assert_close(a.grad.values, b.grad.values, rtol=1e-6, atol=1e-6 * float(b.grad.values.abs().max()))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sync_proxy_matches_cuda(name):
    """CUDA's sync detector (``set_sync_debug_mode("warn")``) sees the syncs ``HostSyncs`` counts on the CPU."""
    cfg, expected = EXPECTED[name]
    gen = torch.Generator(device="cuda").manual_seed(2)
    g = cuda_rows(random_batch(torch.Generator().manual_seed(5), batch=200, num_rows=20_000, dim=4))
    selector = make_selector(cfg, num_rows=20_000)
    kw = dict(batch_size=200.0, sampling_rate=0.01, clip1=1.0, clip2=1.0, noise_multiplier=1.0, selector=selector,
              ctx=CTX, generator=gen)
    dp_step(g, **kw)  # warm-up (lazy inits may sync once)
    torch.cuda.synchronize()
    with HostSyncs() as proxy:
        dp_step(g, **kw)
    real = cuda_syncs(lambda: dp_step(g, **kw))
    assert proxy.total == expected and len(real) == expected, (dict(proxy.by_op), real)


def cuda_syncs(fn) -> list[str]:
    """Where ``fn()`` makes the host wait, by ``torch.cuda.set_sync_debug_mode("warn")``."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # (the first use also warns that the detector "is a prototype feature": not a sync)
    return [f"{w.filename}:{w.lineno}" for w in seen if "called a synchronizing" in str(w.message)]


@pytest.mark.parametrize("tied", [True, False])
def test_whole_cbow_step_on_cuda_waits_twice(tied):
    """The default job's step on CUDA (per-sample grads, dp_step, lazy Adam through Triton): 2 host syncs, tied or
    untied (the row optimizer's per-table split, the CPU path's third sync, is not run), the same by the proxy."""
    gen = torch.Generator().manual_seed(3)
    model = CBOW(1000, 16, tied=tied, generator=gen).cuda()
    opt = LazyAdam(model.row_tables(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    assert opt.gpu
    selector = make_selector(C.ExponentialSelectionConfig(k=100, epsilon=0.1), num_rows=model.num_rows)
    dgen = torch.Generator(device="cuda").manual_seed(5)
    for b in (4, 256):
        batch = CBOWBatch(torch.randint(1000, (b,), generator=gen), torch.randint(1000, (b, 1), generator=gen),
                          torch.randint(1000, (b, 8), generator=gen)).to("cuda")

        def step(batch: CBOWBatch = batch, b: int = b) -> None:
            with torch.inference_mode():
                _, grads = model.per_sample_row_grads(batch)
                res = dp_step(grads, batch_size=float(b), sampling_rate=0.01, clip1=1.0, clip2=1.0,
                              noise_multiplier=1.0, selector=selector, ctx=CTX, generator=dgen)
                opt.step(res.grad)

        step()  # warm-up: Triton compiles, lazy inits
        with HostSyncs() as proxy:
            step()
        real = cuda_syncs(step)
        assert proxy.total == len(real) == 2, (dict(proxy.by_op), real)
