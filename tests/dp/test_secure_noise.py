"""``dp.noise: secure``: the discrete Gaussian sampler's law, the snapped release (exact multiples of the grid, a
function of the rounded input only), the secure DP step (unselected rows untouched, noise of the right scale), its
accounting (RDP only, never below the continuous Gaussian's ε), the config's refusals, the distributed step and
CUDA."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from test_step import CTX, dense_delta, random_batch

from widedp import accounting
from widedp.config import ExponentialSelectionConfig, config_from_dict
from widedp.dp.noise import GRID_SLACK, discrete_gaussian, grid_step, snapped_release
from widedp.dp.selection import AllRowsSelector, ExponentialSelector, make_selector
from widedp.dp.spend import DiscreteGaussianSpend, ExponentialSpend, GaussianSpend, StepSpend
from widedp.dp.step import dp_step, dp_step_spend
from widedp.errors import ConfigError

N = 200_000


def chi2_pvalue(z: np.ndarray, sigma: float, *, bins: int = 60) -> float:
    """Pearson χ² of integer draws ``z`` against the exact N_Z(0, σ²) pmf, over ~``bins`` bins of equal mass
    (consecutive integers; the tails pooled)."""
    m = int(40 * sigma) + 10
    support = np.arange(-m, m + 1)
    pmf = np.exp(-0.5 * (support / sigma) ** 2)
    cdf = np.cumsum(pmf / pmf.sum())
    last = np.unique(np.searchsorted(cdf, np.linspace(0, 1, bins + 1)[1:-1]))  # last support index of each bin
    expected = np.diff(np.concatenate([[0.0], cdf[last], [1.0]])) * len(z)
    observed = np.bincount(np.searchsorted(support[last], z, side="left"), minlength=len(expected))
    return float(stats.chisquare(observed, expected).pvalue)


# ------------------------------------------------------------------------------------------------ the sampler


@pytest.mark.parametrize("sigma", [1.5, 20.0])
def test_discrete_gaussian_has_the_exact_law(sigma):
    z = discrete_gaussian(N, sigma=sigma, generator=torch.Generator().manual_seed(11), device="cpu")
    assert z.dtype == torch.int64 and z.shape == (N,)
    assert chi2_pvalue(z.numpy(), sigma) > 1e-3


def test_discrete_gaussian_negative_controls_fail():
    """The same test rejects what a careless sampler would draw: a rounded continuous Gaussian at σ = 1.5 (its pmf
    differs by ~1/(24σ²) in relative terms), and the sampler at 1.05·σ or 2·σ (σ = 20)."""
    gen = torch.Generator().manual_seed(12)
    rounded = torch.round(torch.randn(N, generator=gen, dtype=torch.float64) * 1.5).long()
    assert chi2_pvalue(rounded.numpy(), 1.5) < 1e-6
    for factor in (1.05, 2.0):
        z = discrete_gaussian(N, sigma=20.0 * factor, generator=gen, device="cpu")
        assert chi2_pvalue(z.numpy(), 20.0) < 1e-6


def test_discrete_gaussian_is_reproducible_from_its_generator_and_large_sigma_is_centred():
    a = discrete_gaussian(5000, sigma=3.0, generator=torch.Generator().manual_seed(5), device="cpu")
    b = discrete_gaussian(5000, sigma=3.0, generator=torch.Generator().manual_seed(5), device="cpu")
    assert torch.equal(a, b)
    s = 3e6  # the scale a step uses (σΔ₂/γ >= 1024σ·√d)
    z = discrete_gaussian(N, sigma=s, generator=torch.Generator().manual_seed(6), device="cpu").double() / s
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1) < 0.01
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-3
    with pytest.raises(ValueError):
        discrete_gaussian(3, sigma=0.0, generator=torch.Generator(), device="cpu")


# ------------------------------------------------------------------------------------------------ the release


def test_grid_step_is_the_largest_power_of_two_within_the_slack():
    for d2, dim in ((0.015, 50_000), (1.0, 1), (3e-7, 10**9)):
        g = grid_step(sensitivity=d2, dim=dim)
        assert math.log2(g).is_integer()
        assert g * math.sqrt(dim) <= GRID_SLACK * d2 < 2 * g * math.sqrt(dim)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_released_values_are_exact_multiples_of_the_grid(dtype):
    x = torch.randn(300, 7, generator=torch.Generator().manual_seed(1), dtype=dtype) * 0.3
    d2, std = 0.02, 0.05
    out = snapped_release(x, std=std, sensitivity=d2, generator=torch.Generator().manual_seed(2))
    assert out.dtype == dtype and out.shape == x.shape
    gamma = grid_step(sensitivity=d2, dim=x.numel())
    lattice = out.double() / gamma
    assert torch.equal(lattice, torch.round(lattice))  # every released value is an integer multiple of γ
    z = (out.double() - x.double()) / std
    assert abs(float(z.std()) - 1) < 0.03


def test_the_release_depends_on_the_input_only_through_its_rounding():
    """Two inputs with the same rounding onto the grid and the same generator state give bit-identical releases:
    no low-order bit of the input (or of the noise's floating-point sum with it) survives."""
    d2, std = 0.02, 0.05
    x = torch.randn(500, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 0.3
    gamma = grid_step(sensitivity=d2, dim=x.numel())
    centre = torch.round(x / gamma) * gamma
    y = centre + (torch.rand(500, generator=torch.Generator().manual_seed(4), dtype=torch.float64) - 0.5) * 0.8 * gamma
    a = snapped_release(centre, std=std, sensitivity=d2, generator=torch.Generator().manual_seed(9))
    b = snapped_release(y, std=std, sensitivity=d2, generator=torch.Generator().manual_seed(9))
    assert not torch.equal(centre, y) and torch.equal(a, b)


# --------------------------------------------------------------------------------------------------- the step


def test_secure_step_keeps_unselected_rows_and_has_the_right_noise_scale():
    """privacy.md §4.4 in secure mode: unselected rows bit-identical; (value − Δ̂)/(σΔ₂) ~ N(0, 1) (KS), and a
    std off by 2 or by √2 (a factor 2 in the variance) fails."""
    num_rows, dim, b, clip1, clip2, sigma = 200, 8, 30.0, 1.0, 0.01, 0.7
    d2 = min(clip1 / b, 2 * clip2)
    gen = torch.Generator().manual_seed(0)
    sel = ExponentialSelector(k=100, epsilon=1.0, score_clip=0.05)
    z = []
    for _ in range(5):
        g = random_batch(gen, batch=30, num_rows=num_rows, dim=dim)
        res = dp_step(g, batch_size=b, sampling_rate=0.01, clip1=clip1, clip2=clip2, noise_multiplier=sigma,
                      selector=sel, ctx=CTX, generator=gen, noise="secure")
        assert isinstance(res.spend.parts[0], DiscreteGaussianSpend)
        weights = torch.randn(num_rows, dim, generator=gen, dtype=torch.float64)
        updated = weights.clone().index_add_(0, res.grad.rows, res.grad.values, alpha=-0.1)
        unselected = torch.ones(num_rows, dtype=torch.bool)
        unselected[res.selected] = False
        assert torch.equal(updated[unselected], weights[unselected])
        gamma = grid_step(sensitivity=d2, dim=res.grad.values.numel())
        assert torch.equal(res.grad.values / gamma, torch.round(res.grad.values / gamma))
        ref = dense_delta(g, res.selected, clip1=clip1, clip2=clip2, b=b)
        z.append(((res.grad.values - ref) / (sigma * d2)).flatten())
    z = torch.cat(z).numpy()
    assert z.size == 4000
    assert stats.kstest(z, "norm").pvalue > 0.01
    assert stats.kstest(z / 2, "norm").pvalue < 1e-6
    assert stats.kstest(z / math.sqrt(2), "norm").pvalue < 1e-6


def test_secure_step_selecting_nothing_is_well_formed():
    from widedp.config import SparseVectorSelectionConfig

    gen = torch.Generator().manual_seed(5)
    g = random_batch(gen, batch=4, num_rows=20, dim=3)
    sel = make_selector(SparseVectorSelectionConfig(threshold=1e6, cutoff=3), num_rows=20)
    res = dp_step(g, batch_size=30.0, sampling_rate=0.01, clip1=1.0, clip2=0.01, noise_multiplier=0.7, selector=sel,
                  ctx=CTX, generator=gen, noise="secure")
    assert res.selected.numel() == 0 and res.grad.values.shape == (0, 3)


def test_default_noise_is_the_continuous_gaussian_bit_for_bit():
    g = random_batch(torch.Generator().manual_seed(1), batch=20, num_rows=50, dim=4)
    kw = dict(batch_size=20.0, sampling_rate=0.1, clip1=1.0, clip2=0.5, noise_multiplier=0.9,
              selector=AllRowsSelector(), ctx=CTX)
    a = dp_step(g, generator=torch.Generator().manual_seed(2), **kw)
    b = dp_step(g, generator=torch.Generator().manual_seed(2), noise="gaussian", **kw)
    assert torch.equal(a.grad.values, b.grad.values) and isinstance(a.spend.parts[0], GaussianSpend)


# ------------------------------------------------------------------------------------------------- accounting


@pytest.mark.parametrize("selection", [None, ExponentialSpend(0.05, 10)])
def test_secure_epsilon_is_at_least_the_continuous_one(selection):
    extra = () if selection is None else (selection,)
    cont = StepSpend(0.01, (GaussianSpend(0.8, 0.02), *extra))
    disc = StepSpend(0.01, (DiscreteGaussianSpend(0.8, 0.02, GRID_SLACK), *extra))
    e_disc = accounting.epsilon_for_step(disc, steps=2000, delta=1e-5, accountant="rdp")
    e_rdp = accounting.epsilon_for_step(cont, steps=2000, delta=1e-5, accountant="rdp")
    e_pld = accounting.epsilon_for_step(cont, steps=2000, delta=1e-5, accountant="pld")
    assert e_disc >= e_rdp >= e_pld
    assert e_disc < 1.5 * e_rdp  # the general subsampling bound and the 2^-10 slack cost little here
    with pytest.raises(ConfigError, match="dp.noise: secure"):
        accounting.epsilon_for_step(disc, steps=10, delta=1e-5, accountant="pld")
    rep = accounting.report(disc, steps=2000, delta=1e-5, accountant="rdp")
    assert rep["epsilon"] == pytest.approx(e_disc) and rep["epsilon_pld"] is None and "discrete" in rep["noise"]


def test_discrete_record_round_trips_through_the_ledger():
    led = accounting.Ledger([(StepSpend(0.01, (DiscreteGaussianSpend(0.8, 0.02, GRID_SLACK),)), 7)])
    back = accounting.Ledger.from_json(led.to_json())
    assert back == led and led.to_json()["runs"][0]["step"]["parts"][0]["kind"] == "discrete_gaussian"


# ----------------------------------------------------------------------------------------------------- config

SEL = {"name": "exponential", "k": 5, "epsilon": 0.1, "score_clip": 0.1}


@pytest.mark.parametrize("dp, match", [
    ({"noise": "discrete"}, "dp.noise: expected one of gaussian, secure"),
    ({"noise": "secure"}, "dp.accountant: pld does not cover dp.noise: secure"),
    ({"noise": "secure", "accountant": "rdp", "engine": "opacus", "selection": {"name": "all"}}, "dp.noise: secure"),
    ({"noise": "secure", "accountant": "rdp", "selection": {"name": "sparse_vector", "epsilon": 0.1, "cutoff": 3,
      "threshold": 0.1, "score_clip": 0.1, "release_values": True, "epsilon_release": 0.1}}, "release_values"),
])
def test_config_refuses_what_secure_noise_does_not_cover(dp, match):
    with pytest.raises(ConfigError, match=match) as e:
        config_from_dict({"dp": {"selection": SEL, **dp}})
    assert "\n" not in str(e.value)


def test_config_secure_noise_plans_the_discrete_record_and_keeps_old_hashes():
    from widedp.run import plan

    with pytest.raises(ConfigError, match="data.vocabulary: dp"):
        config_from_dict({"dp": {"selection": SEL, "noise": "secure", "accountant": "rdp"},
                          "data": {"vocabulary": "dp", "privacy_unit": "sentence"}})
    cfg = config_from_dict({"dp": {"selection": SEL, "noise": "secure", "accountant": "rdp"}})
    spend = plan.step_spend(cfg.dp, num_rows=100, batch_size=10, n=1000)
    assert spend == dp_step_spend(make_selector(cfg.dp.selection, num_rows=100), sampling_rate=0.01,
                                  noise_multiplier=cfg.dp.noise_multiplier, clip1=cfg.dp.clip1, clip2=cfg.dp.clip2,
                                  batch_size=10, noise="secure")
    assert isinstance(spend.parts[0], DiscreteGaussianSpend)
    default = config_from_dict({"dp": {"selection": SEL}})
    assert default.dp.noise == "gaussian"
    assert config_from_dict({"dp": {"selection": SEL, "noise": "gaussian"}}).hash() == default.hash()
    assert cfg.hash() != default.hash()


def test_privacy_engine_takes_the_noise_keyword():
    """PrivacyEngine(noise="secure"): refused with the PLD accountant; with RDP its steps (tables and the dense
    layer) run and record the discrete Gaussian, and its statement names the RDP accountant."""
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader

    from widedp.api.engine import PrivacyEngine

    sel = ExponentialSelectionConfig(k=3, epsilon=0.1, score_clip=0.1)
    with pytest.raises(ConfigError, match="dp.accountant: pld"):
        PrivacyEngine(selection=sel, clip1=1.0, noise_multiplier=1.0, noise="secure")
    eng = PrivacyEngine(selection=sel, clip1=1.0, clip2=1.0, noise_multiplier=1.0, noise="secure", accountant="rdp")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (200, 1), generator=g)
    data = list(zip(ids, (ids[:, 0] < 10).long()))
    model = nn.Sequential(nn.EmbeddingBag(20, 4, mode="mean"), nn.Linear(4, 2))

    def loss(b):
        return F.cross_entropy(model(b[0]), b[1], reduction="none")

    model, opt, loader = eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          DataLoader(data, batch_size=20, collate_fn=lambda it: (
                                              torch.stack([x for x, _ in it]), torch.stack([y for _, y in it]))),
                                          epochs=1)
    for step, batch in enumerate(loader):
        eng.step(batch, loss)
        if step == 2:
            break
    assert eng.steps == 3 and all(isinstance(s.parts[0], DiscreteGaussianSpend) for s, _ in eng.ledger.runs)
    assert eng.statement().accountant == "RDP" and eng.epsilon() > 0


# ------------------------------------------------------------------------------------------------- a whole run


def test_secure_run_resumes_exactly_and_reports_rdp(tmp_path, monkeypatch):
    """``widedp train`` with dp.noise: secure: every step's record is the discrete one, the statement names the RDP
    accountant, and a resume from a mid-run checkpoint replays the remaining steps bit for bit."""
    from snapshots import train_with_snapshot
    from tiny_corpus import data_section

    from widedp.config import load_config
    from widedp.run.train import train

    path = tmp_path / "c.yaml"
    path.write_text(f"""
{data_section(tmp_path, lines=300)}
model: {{dim: 8, tied: false}}
train: {{epochs: 1, max_steps: 40, batch_size: 10, optimizer: lazy_adam, lr: 0.01, log_every: 20,
        checkpoint_every: 20, eval_max_samples: 30}}
dp: {{clip1: 1.0, clip2: 1.0, noise_multiplier: 1.0, noise: secure, accountant: rdp,
     selection: {{name: exponential, k: 4, epsilon: 0.5, score_clip: 0.1}}}}
""")
    cfg = load_config(path)
    run, snap = tmp_path / "run", tmp_path / "snap"
    full = train_with_snapshot(cfg, run, snap, step=20, monkeypatch=monkeypatch)
    ledger = accounting.Ledger.from_json(full["dp"]["ledger"])
    assert ledger.steps == 40 and all(isinstance(s.parts[0], DiscreteGaussianSpend) for s, _ in ledger.runs)
    assert "[RDP accountant]" in full["privacy"]["text"]
    resumed = train(cfg, snap, resume=True, progress=False)
    assert resumed["dp"]["ledger"] == full["dp"]["ledger"]
    a = torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(snap / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_secure_noise_on_cuda():
    gen = torch.Generator(device="cuda").manual_seed(21)
    z = discrete_gaussian(N, sigma=20.0, generator=gen, device="cuda")
    assert z.device.type == "cuda" and chi2_pvalue(z.cpu().numpy(), 20.0) > 1e-3
    x = torch.randn(400, 16, device="cuda") * 0.1
    out = snapped_release(x, std=0.03, sensitivity=0.01, generator=gen)
    gamma = grid_step(sensitivity=0.01, dim=x.numel())
    assert out.device.type == "cuda" and torch.equal(out.double() / gamma, torch.round(out.double() / gamma))
    assert abs(float(((out - x) / 0.03).std()) - 1) < 0.05
    selector = make_selector(ExponentialSelectionConfig(k=5, epsilon=1.0, score_clip=0.5), num_rows=40)
    res = dp_step(_cuda_batch(), batch_size=12.0, sampling_rate=0.01, clip1=1.0, clip2=1.0, noise_multiplier=1.0,
                  selector=selector, ctx=CTX, generator=gen, noise="secure")
    assert res.grad.values.device.type == "cuda" and isinstance(res.spend.parts[0], DiscreteGaussianSpend)


def _cuda_batch():
    from widedp.dp.rowgrads import PerSampleRows

    g = random_batch(torch.Generator().manual_seed(1), batch=12, num_rows=40, dim=3)
    return PerSampleRows(g.values.cuda(), g.rows.cuda(), g.offsets.cuda(), g.num_rows)


# ------------------------------------------------------------------------------------------ two processes (gloo)


def _distributed_worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from distributed_toy import single_and_sharded, tiny_recsys

    from widedp.distributed.ranks import init_process_group
    from widedp.dp.layout import RowBlocks
    from widedp.dp.selection import SelectionContext

    init_process_group(rank, 2, port=port, backend="gloo")
    data, split, mcfg = tiny_recsys()
    single, sharded = single_and_sharded(data, mcfg, rank, 2)
    selector = make_selector(ExponentialSelectionConfig(k=10, epsilon=1.0, score_clip=0.05), num_rows=single.num_rows)
    A, b, clip1, sigma = single.num_dense_rows, 40, 0.4, 2.0
    d2 = clip1 / b
    zs = []
    with torch.inference_mode():
        _, local = sharded.per_sample_row_grads(split.batch(torch.arange(40)))
        for t in range(40):
            def kw(t=t):  # the same fresh generators for both calls
                return dict(batch_size=b, sampling_rate=0.1, clip1=clip1, clip2=None, selector=selector,
                            ctx=SelectionContext(epoch=0, num_epochs=1), generator=torch.Generator().manual_seed(
                                10_000 * rank + t), layout=RowBlocks(sharded.shard,
                                                                     shared=torch.Generator().manual_seed(t)))
            loud = dp_step(local, noise_multiplier=sigma, noise="secure", **kw())
            quiet = dp_step(local, noise_multiplier=1e-9, **kw())
            assert torch.equal(loud.selected, quiet.selected)
            gamma = grid_step(sensitivity=d2, dim=loud.selected.numel() * local.dim)  # one grid, all ranks
            assert torch.equal(loud.grad.values.double() / gamma, torch.round(loud.grad.values.double() / gamma))
            mlp = loud.grad.values[-A:]
            both = [torch.zeros_like(mlp) for _ in range(2)]
            dist.all_gather(both, mlp)
            assert torch.equal(both[0], both[1])  # the MLP rows' release is rank 0's, broadcast
            zs.append(((loud.grad.values - quiet.grad.values) / (sigma * d2)).flatten())
    assert isinstance(loud.spend.parts[0], DiscreteGaussianSpend)
    assert loud.spend == dp_step_spend(selector, sampling_rate=0.1, noise_multiplier=sigma, clip1=clip1, clip2=None,
                                       batch_size=b, noise="secure")
    z = torch.cat(zs).numpy()
    assert abs(z.std() - 1) < 0.12 and stats.kstest(z, "norm").pvalue > 1e-3, z.std()
    dist.destroy_process_group()


def test_secure_noise_on_two_processes():
    """The row-sharded step in secure mode: one grid for the whole release (every rank's values are multiples of
    the γ of (selected + MLP rows)·D coordinates), each selected coordinate noised once at σΔ₂, the MLP rows'
    release broadcast from rank 0, and the single-process spend."""
    import torch.multiprocessing as mp

    from widedp.distributed.ranks import free_port

    mp.spawn(_distributed_worker, args=(free_port(),), nprocs=2, join=True)
