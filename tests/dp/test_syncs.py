"""Host syncs of the DP step, counted on the CPU by ``HostSyncs``: the counter itself, then the step."""

import pytest
import torch
from test_step import CTX, random_batch

import widedp.config as C
from widedp.dp import selection as sel_mod
from widedp.dp.optim import LazyAdam
from widedp.dp.selection import make_selector, sample_distinct
from widedp.dp.step import dp_step
from widedp.dp.syncs import HostSyncs, to_device
from widedp.models.cbow import CBOW, CBOWBatch

X = torch.arange(10)


@pytest.mark.parametrize("op", [
    lambda: X.sum().item(),
    lambda: int(X.max()),
    lambda: torch.unique(X),
    lambda: X[X > 3],
    lambda: X.nonzero(),
    lambda: X.tolist(),
    lambda: torch.bincount(X),
    lambda: torch.repeat_interleave(X, X),
    lambda: X.cpu(),
    lambda: torch.tensor([1, 2], device=X.device),  # a blocking copy from the host
    lambda: torch.as_tensor([1.0], device=X.device),
])
def test_counts_each_sync_once(op):
    with HostSyncs() as s:
        op()
    assert s.total == 1, dict(s.by_op)


def test_sync_free_ops_count_nothing():
    gen = torch.Generator().manual_seed(0)
    with HostSyncs() as s:
        y = X.index_select(0, X.flip(0)).sort().values.topk(3).indices
        torch.searchsorted(X, y)
        torch.repeat_interleave(X, X, output_size=45)
        torch.randint(10, (5,), generator=gen).cumsum(0)
        X.to(X.device)
        torch.full((1,), 2.0, device=X.device)
        to_device(torch.tensor([1, 2]), X.device)  # staged and copied without a wait
        torch.as_tensor(X, device=X.device)
    assert s.total == 0, dict(s.by_op)


@pytest.mark.parametrize("dense_factor", [4, 10_000])  # the rejection path, the permutation path
@pytest.mark.parametrize("exclude", [0, 30])
def test_sample_distinct_never_syncs(monkeypatch, dense_factor, exclude):
    monkeypatch.setattr(sel_mod.base, "_DENSE_FACTOR", dense_factor)
    gen = torch.Generator().manual_seed(1)
    ex = torch.arange(0, 2 * exclude, 2)
    for n in (1, 7, 200):
        with HostSyncs() as s:
            out = sample_distinct(n, 5000, exclude=ex, generator=gen, device="cpu")
        assert s.total == 0, dict(s.by_op)
        assert out.numel() == n == out.unique().numel() and not torch.isin(out, ex).any()


#: Host syncs of one dp_step on the PyTorch path (the one CUDA runs): 1 = learning how many rows the batch touched
#: (torch.unique); selectors whose output size is random read it once more.
EXPECTED = {
    "exponential": (C.ExponentialSelectionConfig(k=300, epsilon=0.1), 1),
    "exponential_count": (C.ExponentialSelectionConfig(k=300, epsilon=0.1, score="count", score_clip=64.0), 1),
    "uniform": (C.UniformSelectionConfig(k=300), 1),
    "random_sparsification": (C.RandomSparsificationConfig(final_rate=0.5), 1),
    "all": (C.AllRowsConfig(), 1),
    "gaussian_threshold": (C.GaussianThresholdSelectionConfig(sigma=1.0), 2),
    "gaussian_threshold_capped": (C.GaussianThresholdSelectionConfig(sigma=0.5, max_rows=20), 2),
    "sparse_vector": (C.SparseVectorSelectionConfig(epsilon=1.0, cutoff=20), 2),  # one copy for the host scan
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dp_step_syncs_per_selector(name):
    cfg, expected = EXPECTED[name]
    gen = torch.Generator().manual_seed(2)
    for batch in (8, 200):  # independent of the batch size...
        for always in (0, 16):  # ...and of always-selected rows (no search for where they start)
            g = random_batch(gen, batch=batch, num_rows=20_000, dim=4)
            selector = make_selector(cfg, num_rows=20_000)
            with HostSyncs() as s:
                res = dp_step(g, batch_size=float(batch), sampling_rate=0.01, clip1=1.0, clip2=1.0,
                              noise_multiplier=1.0, selector=selector, ctx=CTX, generator=gen, always_rows=always,
                              fused=False)
            assert s.total == expected, (batch, always, dict(s.by_op))
            if always:
                assert torch.isin(torch.arange(20_000 - always, 20_000), res.selected).all()


@pytest.mark.parametrize("tied,expected", [(True, 2), (False, 3)])
def test_whole_cbow_step_syncs(tied, expected):
    """Model (coalescing each sample's rows: torch.unique), dp_step (touched rows), lazy Adam (where each table's rows
    start, with two tables): the per-step host syncs of the default job on CUDA, whatever the batch size."""
    gen = torch.Generator().manual_seed(3)
    model = CBOW(1000, 16, tied=tied, generator=gen)
    opt = LazyAdam(model.row_tables(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, fused=False)
    selector = make_selector(C.ExponentialSelectionConfig(k=100, epsilon=0.1), num_rows=model.num_rows)
    for b in (4, 256):
        batch = CBOWBatch(torch.randint(1000, (b,), generator=gen), torch.randint(1000, (b, 1), generator=gen),
                          torch.randint(1000, (b, 8), generator=gen))
        with torch.inference_mode(), HostSyncs() as s:
            _, grads = model.per_sample_row_grads(batch, fused=False)  # the PyTorch path (the one CUDA runs)
            res = dp_step(grads, batch_size=float(b), sampling_rate=0.01, clip1=1.0, clip2=1.0, noise_multiplier=1.0,
                          selector=selector, ctx=CTX, generator=gen, fused=False)
            opt.step(res.grad)
        assert s.total == expected, dict(s.by_op)


def test_public_rows_add_two_syncs():
    gen = torch.Generator().manual_seed(4)
    selector = make_selector(C.GaussianThresholdSelectionConfig(sigma=1.0), num_rows=20_000)
    for batch in (8, 200):
        g = random_batch(gen, batch=batch, num_rows=20_000, dim=4)
        with HostSyncs() as s:
            dp_step(g, batch_size=float(batch), sampling_rate=0.01, clip1=1.0, clip2=1.0, noise_multiplier=1.0,
                    selector=selector, ctx=CTX, generator=gen, fused=False, public_rows=torch.arange(0, 20_000, 7))
        assert s.total == 4, dict(s.by_op)
