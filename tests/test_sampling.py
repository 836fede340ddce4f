import torch

from widedp.sampling import PoissonSampler, ShuffledBatches


def test_poisson_batch_law():
    n, q, steps = 200, 0.05, 4000
    s = PoissonSampler(n, sampling_rate=q, seed=3)
    sizes = torch.zeros(steps)
    hits = torch.zeros(n)
    for t in range(steps):
        idx = s.batch(t)
        assert torch.unique(idx).numel() == idx.numel()  # a set, no repeats
        sizes[t] = idx.numel()
        hits[idx] += 1
    # Binomial(n, q): mean 10, var 9.5. A factor-2 error in q or a fixed batch size would fail these.
    assert abs(sizes.mean().item() - n * q) < 0.3
    assert abs(sizes.var().item() - n * q * (1 - q)) < 1.5
    # every example included with probability q: chi-square over examples
    expected = steps * q
    chi2 = (((hits - expected) ** 2) / expected).sum().item()
    assert chi2 < n + 4 * (2 * n) ** 0.5


def test_poisson_stateless_per_step():
    a = PoissonSampler(1000, sampling_rate=0.01, seed=7)
    b = PoissonSampler(1000, sampling_rate=0.01, seed=7)
    first = [a.batch(t).clone() for t in range(3000)]
    # b jumps straight to late steps (as a resumed run does) and must agree
    for t in (2999, 1500, 0, 1024):
        assert torch.equal(b.batch(t), first[t])
    c = PoissonSampler(1000, sampling_rate=0.01, seed=8)
    assert any(not torch.equal(c.batch(t), first[t]) for t in range(5))


def test_shuffled_batches_cover_each_epoch_once():
    s = ShuffledBatches(103, batch_size=10, seed=0)
    assert s.steps_per_epoch == 11
    for epoch in range(2):
        seen = torch.cat([s.batch(epoch * 11 + i) for i in range(11)])
        assert torch.equal(seen.sort().values, torch.arange(103))
    assert not torch.equal(s.batch(0), s.batch(11))
