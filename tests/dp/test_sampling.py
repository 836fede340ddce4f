"""Batch samplers: the law of Poisson sampling (what the accountant assumes) — for PoissonSampler directly and for
the batches the real DP training loop trains on — with fixed-size and shuffled batches as negative controls."""

import itertools

import numpy as np
import pytest
import torch
from scipy import stats

from widedp.dp.sampling import PoissonSampler, ShuffledBatches, uniform_subsets

P_MIN = 1e-4  # goodness-of-fit p-values below this fail (the runs are seeded: no flakiness)


def binomial_gof_pvalue(x: np.ndarray, trials: int, p: float) -> float:
    """Pearson chi-square p-value of integer samples ``x`` against Binomial(trials, p) (tail bins merged until
    every bin expects >= 5)."""
    x = np.asarray(x, dtype=np.int64)
    n = len(x)
    lo, hi = int(stats.binom.ppf(1e-6, trials, p)), int(stats.binom.isf(1e-6, trials, p))
    edges = list(range(lo, hi + 1))  # bin k = {k}, with (-inf, lo] and [hi, inf) as the end bins

    def expected(es: list[int]) -> np.ndarray:
        cdf = stats.binom.cdf(np.array(es[:-1]), trials, p)
        return n * np.diff(np.concatenate([[0.0], cdf, [1.0]]))

    while len(edges) > 2 and expected(edges)[0] < 5:
        edges.pop(0)
    while len(edges) > 2 and expected(edges)[-1] < 5:
        edges.pop(-2)
    exp = expected(edges)
    obs = np.bincount(np.searchsorted(np.array(edges[:-1]), x, side="left"), minlength=len(exp))
    if len(exp) < 2:
        return 1.0 if np.all(x == x[0]) else 0.0
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    return float(stats.chi2.sf(chi2, len(exp) - 1))


def poisson_violations(batches: list[np.ndarray], n: int, q: float) -> list[str]:
    """What in ``batches`` (member ids per step) contradicts Poisson(q) sampling of n examples (empty: none).

    Under Poisson sampling the inclusions of every (example, step) are independent Bernoulli(q), so
    - batch sizes are Binomial(n, q): mean nq, variance nq(1 - q) (fixed-size batches: variance 0; any dependence
      between examples of one step moves the variance, which is the sum of their covariances);
    - one example's inclusion count over T steps is Binomial(T, q), independently over examples (shuffled epochs:
      exactly once per epoch, variance 0).
    """
    t = len(batches)
    out = []
    if any(len(np.unique(b)) != len(b) for b in batches):
        out.append("a batch repeats an example")
    sizes = np.array([len(b) for b in batches])
    if abs(sizes.mean() - n * q) > 5 * np.sqrt(n * q * (1 - q) / t):
        out.append(f"mean batch size {sizes.mean():.3f} vs nq = {n * q:.3f}")
    ratio = sizes.var(ddof=1) / (n * q * (1 - q))
    if not 1 - 5 * np.sqrt(2 / t) < ratio < 1 + 5 * np.sqrt(2 / t):
        out.append(f"batch-size variance / nq(1-q) = {ratio:.3f}")
    if (p := binomial_gof_pvalue(sizes, n, q)) < P_MIN:
        out.append(f"batch sizes vs Binomial(n, q): chi-square p = {p:.2g}")
    counts = np.bincount(np.concatenate(batches).astype(np.int64), minlength=n)
    ratio = counts.var(ddof=1) / (t * q * (1 - q))
    if not 1 - 5 * np.sqrt(2 / n) < ratio < 1 + 5 * np.sqrt(2 / n):
        out.append(f"per-example inclusion-count variance / Tq(1-q) = {ratio:.3f}")
    if (p := binomial_gof_pvalue(counts, t, q)) < P_MIN:
        out.append(f"per-example inclusion counts vs Binomial(T, q): chi-square p = {p:.2g}")
    return out


def _draw(sampler, steps: int) -> list[np.ndarray]:
    return [sampler.batch(t).numpy() for t in range(steps)]


class _FixedSizeSubsets:
    """Negative control: a uniform random subset of exactly b examples per step (sampling without replacement)."""

    def __init__(self, n: int, b: int, seed: int) -> None:
        self.n, self.b, self.g = n, b, torch.Generator().manual_seed(seed)

    def batch(self, step: int) -> torch.Tensor:
        return torch.randperm(self.n, generator=self.g)[: self.b]


def test_poisson_sampler_law():
    n, q, steps = 2000, 0.02, 3000
    batches = _draw(PoissonSampler(n, sampling_rate=q, seed=3), steps)
    assert poisson_violations(batches, n, q) == []
    # inclusion frequency of every example ~ q (chi-square over examples, as counts above)
    counts = np.bincount(np.concatenate(batches), minlength=n)
    assert abs(counts.mean() / steps - q) < 5 * np.sqrt(q * (1 - q) / (steps * n))
    # batch sizes: also a KS-type check of the whole CDF against Binomial(n, q)
    sizes = np.array([len(b) for b in batches])
    grid = np.arange(sizes.min(), sizes.max() + 1)
    ecdf = np.searchsorted(np.sort(sizes), grid, side="right") / steps
    assert np.abs(ecdf - stats.binom.cdf(grid, n, q)).max() < 1.95 / np.sqrt(steps)  # KS 0.1% critical value


@pytest.mark.parametrize("control", ["fixed_size", "shuffled", "double_rate"])
def test_poisson_checks_reject_other_samplers(control):
    n, q, steps = 2000, 0.02, 3000
    sampler = {"fixed_size": lambda: _FixedSizeSubsets(n, int(n * q), seed=3),
               "shuffled": lambda: ShuffledBatches(n, batch_size=int(n * q), seed=3),
               "double_rate": lambda: PoissonSampler(n, sampling_rate=2 * q, seed=3)}[control]()
    assert poisson_violations(_draw(sampler, steps), n, q) != []


@pytest.mark.parametrize(("n", "q"), [(1000, 0.01), (300, 0.1), (60, 0.5)])  # few / most batches collide, dense
def test_poisson_stateless_per_step(n, q):
    a = PoissonSampler(n, sampling_rate=q, seed=7)
    b = PoissonSampler(n, sampling_rate=q, seed=7)
    first = [a.batch(t).clone() for t in range(3000)]
    # b jumps straight to late steps (as a resumed run does) and must agree
    for t in (2999, 1500, 0, 1024, 2048, 1023):
        assert torch.equal(b.batch(t), first[t])
    c = PoissonSampler(n, sampling_rate=q, seed=8)
    assert any(not torch.equal(c.batch(t), first[t]) for t in range(5))


# ------------------------------------------------- the members: a uniform subset (pairs too), drawn in O(m) memory


def pair_violations(batches: list[np.ndarray], n: int, q: float) -> list[str]:
    """What contradicts "each pair of examples is in a step's batch together with probability q^2, independently
    over steps": the pair counts over T steps are Binomial(T, q^2) (their mean, and their extremes with a Bonferroni
    bound over the n(n-1)/2 pairs). Marginally uniform but dependent members (a random window) fail here."""
    t = len(batches)
    x = np.zeros((t, n))
    for i, b in enumerate(batches):
        x[i, b] = 1.0
    pairs = (x.T @ x)[np.triu_indices(n, 1)]
    out = []
    per_step = np.array([len(b) * (len(b) - 1) / 2 for b in batches]) / (n * (n - 1) / 2)  # share of pairs
    if abs(per_step.mean() - q * q) > 5 * per_step.std(ddof=1) / np.sqrt(t):
        out.append(f"mean pair inclusion {per_step.mean():.4g} vs q^2 = {q * q:.4g}")
    if (p := len(pairs) * stats.binom.sf(pairs.max() - 1, t, q * q)) < P_MIN:
        out.append(f"a pair is together {pairs.max():.0f} times in {t} steps (q^2 T = {q * q * t:.1f}; p <= {p:.2g})")
    if (p := len(pairs) * stats.binom.cdf(pairs.min(), t, q * q)) < P_MIN:
        out.append(f"a pair is together {pairs.min():.0f} times in {t} steps (q^2 T = {q * q * t:.1f}; p <= {p:.2g})")
    return out


class _BiasedSubsets:
    """Negative controls with Binomial(n, q) sizes: a random contiguous window (every member uniform, pairs not),
    the m smallest of 2m uniform distinct ids, i.i.d. ids (with replacement) and i.i.d. ids deduplicated."""

    def __init__(self, kind: str, n: int, q: float, seed: int) -> None:
        self.kind, self.n, self.q, self.g = kind, n, q, torch.Generator().manual_seed(seed)

    def batch(self, step: int) -> torch.Tensor:
        n, g = self.n, self.g
        m = int(torch.binomial(torch.tensor(float(n)), torch.tensor(self.q), generator=g))
        if self.kind == "window":
            return (torch.randint(n, (1,), generator=g) + torch.arange(m)) % n
        if self.kind == "smallest":
            return torch.randperm(n, generator=g)[: min(2 * m, n)].sort().values[:m]
        ids = torch.randint(n, (m,), generator=g)
        return ids if self.kind == "with_replacement" else torch.unique(ids)


@pytest.mark.parametrize(("n", "q"), [(300, 0.1), (60, 0.5)])  # most batches collide (sparse path); dense path
def test_poisson_sampler_members_uniform_and_pairwise(n, q):
    batches = _draw(PoissonSampler(n, sampling_rate=q, seed=11), 4000)
    assert poisson_violations(batches, n, q) == []
    assert pair_violations(batches, n, q) == []


@pytest.mark.parametrize("kind", ["window", "smallest", "with_replacement", "deduplicated"])
def test_subset_checks_reject_biased_subsets(kind):
    n, q = 300, 0.1
    batches = _draw(_BiasedSubsets(kind, n, q, seed=11), 4000)
    assert pair_violations(batches, n, q) != [] if kind == "window" else poisson_violations(batches, n, q) != []


@pytest.mark.parametrize(("n", "m"), [(12, 3), (8, 3)])  # rejection path (4m <= n); permutation path
def test_uniform_subsets_ordered_law(n, m):
    """Brute-force reference: each segment is uniform over the n!/(n-m)! ordered m-tuples of distinct ids."""
    segs = 60_000
    flat = uniform_subsets(torch.full((segs,), m), n, generator=torch.Generator().manual_seed(5))
    codes = (flat.view(segs, m).numpy() * n ** np.arange(m)).sum(1)
    cells = np.bincount(codes, minlength=n**m)
    tuples = [sum(v * n**j for j, v in enumerate(p)) for p in itertools.permutations(range(n), m)]
    assert cells[tuples].sum() == segs  # no repeated id
    assert stats.chisquare(cells[tuples]).pvalue > P_MIN


@pytest.mark.parametrize(("n", "q"), [(200_000, 0.005), (1000, 0.5)])
def test_poisson_chunk_memory_is_o_batch_sizes(n, q):
    """The tensors a chunk of steps keeps alive hold O(sum of batch sizes) bytes, not O(n) per step (a batch that
    is a slice of an n-long permutation keeps the whole permutation)."""
    s = PoissonSampler(n, sampling_rate=q, seed=1)
    s.batch(0)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in s._batches}
    total = sum(t.numel() for t in s._batches)
    assert total > 0.9 * n * q * len(s._batches)
    assert sum(storages.values()) <= 8 * total + 64 * len(storages)


def test_batch_sizes_are_exact_for_large_n_and_rates():
    """Binomial(n, q) in float64: n = 2^24 + 1 is not rounded to 2^24 (float32 was)."""
    n = 2**24 + 1
    assert PoissonSampler(n, sampling_rate=1.0, seed=0)._sizes(torch.Generator().manual_seed(0)).eq(n).all()


def test_shuffled_batches_cover_each_epoch_once():
    s = ShuffledBatches(103, batch_size=10, seed=0)
    assert s.steps_per_epoch == 11
    for epoch in range(2):
        seen = torch.cat([s.batch(epoch * 11 + i) for i in range(11)])
        assert torch.equal(seen.sort().values, torch.arange(103))
    assert not torch.equal(s.batch(0), s.batch(11))


# ------------------------------------------------------------------------- the batches the DP training loop uses

TEXT = "".join(f"w{i % 11} w{(i * 3) % 11} w{(i * 5) % 11} w{(i + 1) % 11} w{(i * 7) % 11}\n" for i in range(600))


@pytest.mark.parametrize("fixed_q", [None, 0.03])
def test_dp_training_trains_on_poisson_batches(tmp_path, monkeypatch, fixed_q):
    """widedp.run.train.train on a tiny CBOW: the batches per_sample_row_grads actually sees are Poisson(q), q = b/n
    or ``dp.sampling_rate`` (then an epoch is round(1/q) steps and the data's size leaves the statement)."""
    from widedp.accounting.statement import SIZE_NOT_COVERED
    from widedp.config import load_config
    from widedp.models.cbow import CBOW
    from widedp.run.train import train
    from widedp.tasks.cbow import SplitTensors

    n, b, epochs = 1000, 50, 20  # q = 0.05, 20 steps per epoch, T = 400
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(f"""
data: {{preset: custom, corpus: "text:{corpus}", vocab_size: 11, remove_stopwords: false, alpha_only: false,
       splits: [{n}, 50, 50], cache_dir: "{tmp_path / 'cache'}"}}
model: {{dim: 4, tied: false}}
train: {{epochs: {epochs}, batch_size: {b}, optimizer: sgd, lr: 0.01, log_every: 1000, eval_max_samples: 10}}
dp: {{clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, rng: reproducible, selection: {{name: uniform, k: 2}}
    {'' if fixed_q is None else f', sampling_rate: {fixed_q}'}}}
""")
    cfg = load_config(cfg_path)
    seen: list[np.ndarray] = []
    last: dict[str, torch.Tensor] = {}
    split_batch, row_grads = SplitTensors.batch, CBOW.per_sample_row_grads

    def batch(self, idx):
        last["idx"] = idx
        return split_batch(self, idx)

    def per_sample_row_grads(self, bt):
        assert bt.target.numel() == last["idx"].numel()
        seen.append(last["idx"].cpu().numpy().copy())
        return row_grads(self, bt)

    monkeypatch.setattr(SplitTensors, "batch", batch)
    monkeypatch.setattr(CBOW, "per_sample_row_grads", per_sample_row_grads)
    summary = train(cfg, tmp_path / "run", progress=False)
    n = summary["n_train"]  # 1000 expected (the split is Binomial)
    q = b / n if fixed_q is None else fixed_q
    assert abs(n - 1000) < 150 and summary["steps"] == len(seen) == epochs * round(1 / q if fixed_q else n / b)
    assert poisson_violations(seen, n, q) == []
    assert (SIZE_NOT_COVERED in summary["privacy"]["not_covered"]) == (fixed_q is None)
    from widedp import accounting

    (step, _), = accounting.Ledger.from_json(summary["dp"]["ledger"]).runs
    assert step.sampling_rate == q
