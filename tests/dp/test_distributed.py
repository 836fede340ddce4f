"""Two CPU processes (gloo): ``dp_step`` on the row-block layout (``widedp.dp.layout.RowBlocks``) against the
single-process model and ``dp_step`` on ``SingleProcess()``.

- pooled embeddings, per-sample clipping (norms all_reduced across shards), S2 clip, selection and updates of a
  data-independent selection match a single-process ``dp_step`` with the same seeds, over 3 SGD steps;
- the sharded exponential mechanism (per-rank Gumbel keys + order statistics, local top-k, all_gather) has the
  single-process Gumbel top-k law: chi^2 over all ordered outcomes, and a negative control (doubled logits) fails;
- every selected row is noised once at std sigma·Δ₂ (a row noised by both ranks would show sqrt(2) times that);
- the spend is the single-process StepSpend;
- a sample with a NaN / inf in one rank's rows (or in the replicated MLP rows) is zeroed on every rank;
- public rows (``data.negatives_pool``) on row blocks: with sigma -> 0 the update equals one process's.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from laws import ordered_law
from scipy import stats

WORLD = 2


def _chi2_p(counts: dict, law: dict, n: int) -> float:
    obs = np.array([counts.get(s, 0) for s in law])
    exp = np.array([law[s] * n for s in law])
    return float(stats.chisquare(obs, exp).pvalue)


class _Nothing:
    """A selector that picks no row (the step then releases its public rows alone)."""

    score_kind, score_clip = "none", None

    def spend(self):
        from widedp.dp.spend import FreeSpend

        return FreeSpend("uniform")

    def select(self, touched: torch.Tensor, scores: torch.Tensor, **_: object) -> torch.Tensor:
        return touched.new_zeros(0)


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    from distributed_toy import single_and_sharded, tiny_recsys

    from widedp.config import (
        AllRowsConfig,
        ExponentialSelectionConfig,
        GaussianThresholdSelectionConfig,
        UniformSelectionConfig,
    )
    from widedp.distributed.ranks import init_process_group
    from widedp.dp.layout import RowBlocks, RowShard, sharded_gumbel_topk
    from widedp.dp.optim import make_row_optimizer
    from widedp.dp.selection import SelectionContext, make_selector
    from widedp.dp.step import dp_step
    from widedp.models.recsys_sharded import shard_of

    init_process_group(rank, WORLD, port=port, backend="gloo")
    ctx = SelectionContext(epoch=0, num_epochs=1)
    data, split, mcfg = tiny_recsys()

    def gathered(grad) -> torch.Tensor:
        """The ranks' updates (global ids) summed into [R + A, D]; the replicated dense rows from rank 0 only."""
        dense = torch.zeros(grad.num_rows, grad.values.shape[1])
        keep = grad.rows < (grad.num_rows if rank == 0 else single.num_rows)
        dense.index_copy_(0, grad.rows[keep], grad.values[keep])
        dist.all_reduce(dense)
        mlp = grad.values[grad.rows >= single.num_rows]
        both = [torch.zeros_like(mlp) for _ in range(WORLD)]
        dist.all_gather(both, mlp)
        assert all(torch.equal(b, mlp) for b in both)  # the MLP replicas get the same (broadcast) update
        return dense

    # ---- 1. updates and selection equal a single process over 3 steps (data-independent selections)
    for sel_cfg in (UniformSelectionConfig(k=7), AllRowsConfig()):
        single, sharded = single_and_sharded(data, mcfg, rank, WORLD)
        opt_s = make_row_optimizer("sgd", single.row_tables(), lr=0.5)
        opt_d = make_row_optimizer("sgd", sharded.local_tables(), lr=0.5)
        selector = make_selector(sel_cfg, num_rows=single.num_rows)
        kw = dict(batch_size=40, sampling_rate=0.1, clip1=0.4, clip2=0.05, noise_multiplier=1e-7,
                  selector=selector, ctx=ctx)
        for t in range(3):
            batch = split.batch(torch.arange(40 * t, 40 * t + 40))
            with torch.inference_mode():
                torch.testing.assert_close(sharded.pooled(batch.kjt), single.pooled(batch.kjt), rtol=1e-5,
                                           atol=1e-6)
                loss_s, g = single.per_sample_row_grads(batch)
                res_s = dp_step(g, generator=torch.Generator().manual_seed(10 + t), **kw)
                loss_d, local = sharded.per_sample_row_grads(batch)
                res_d = dp_step(local, generator=torch.Generator().manual_seed(100 + rank),
                                layout=RowBlocks(sharded.shard, shared=torch.Generator().manual_seed(10 + t)), **kw)
                torch.testing.assert_close(loss_d, loss_s, rtol=1e-5, atol=1e-6)
                assert torch.equal(res_d.selected, res_s.selected)
                assert res_d.spend == res_s.spend
                assert float(res_s.stats.clipped1) > 0.2 and bool(res_s.stats.clipped2)  # both clips active
                torch.testing.assert_close(gathered(res_d.grad), res_s.grad.to_dense(),
                                           rtol=1e-4, atol=1e-7)
                opt_s.step(res_s.grad)
                opt_d.step(RowBlocks(sharded.shard, shared=torch.Generator()).local(res_d.grad))
        batch = split.batch(torch.arange(200, 260))
        with torch.inference_mode():
            torch.testing.assert_close(sharded(batch), single(batch), rtol=1e-4, atol=1e-6)

    # ---- 2. the exponential mechanism's law (R = 6 rows, two tables of 3: rank 0 owns rows {0, 3})
    shard = RowShard(rank, WORLD, offsets=(0, 3), sizes=(3, 3), num_dense_rows=0)
    logits = np.array([1.5, 0.0, 0.7, 0.0, 2.0, 0.0])  # rows 1, 3, 5 untouched (order statistics)
    touched = torch.tensor([r for r in (0, 2, 4) if bool(shard.is_own(torch.tensor([r])))])
    gen = torch.Generator().manual_seed(1000 + rank)
    n, k, counts = 4000, 2, {}
    for _ in range(n):
        sel = sharded_gumbel_topk(touched, torch.tensor(logits[touched.numpy()], dtype=torch.float32), shard,
                                  k=k, generator=gen)
        counts[tuple(sel.tolist())] = counts.get(tuple(sel.tolist()), 0) + 1
    if rank == 0:
        assert _chi2_p(counts, ordered_law(logits, k), n) > 1e-3
        assert _chi2_p(counts, ordered_law(2 * logits, k), n) < 1e-6  # negative control: a factor-2 error is caught

    # ---- 3. noise once per selected row at sigma·Δ₂ (exponential selection, MLP rows from rank 0)
    single, sharded = single_and_sharded(data, mcfg, rank, WORLD)
    selector = make_selector(ExponentialSelectionConfig(k=10, epsilon=1.0, score_clip=0.05),
                             num_rows=single.num_rows)
    batch = split.batch(torch.arange(40))
    zs, spend_s = [], None
    with torch.inference_mode():
        loss_d, local = sharded.per_sample_row_grads(batch)
        for t in range(40):
            kw = dict(batch_size=40, sampling_rate=0.1, clip1=0.4, clip2=None, selector=selector, ctx=ctx,
                      layout=RowBlocks(sharded.shard, shared=torch.Generator().manual_seed(t)))
            loud = dp_step(local, noise_multiplier=2.0, generator=torch.Generator().manual_seed(10_000 * rank + t),
                           **kw)
            quiet = dp_step(local, noise_multiplier=1e-9, generator=torch.Generator().manual_seed(10_000 * rank + t),
                            **kw)
            assert torch.equal(loud.selected, quiet.selected) and loud.selected.numel() == 10 + single.num_dense_rows
            zs.append(gathered(loud.grad) - gathered(quiet.grad))
            zs[-1] = zs[-1][loud.selected] / (2.0 * 0.4 / 40)
        _, g = single.per_sample_row_grads(batch)
        spend_s = dp_step(g, batch_size=40, sampling_rate=0.1, clip1=0.4, clip2=None, noise_multiplier=2.0,
                          selector=selector, ctx=ctx, generator=torch.Generator()).spend
    assert loud.spend == spend_s
    if rank == 0:
        z = torch.stack(zs)  # [40, k + A, D]
        emb, mlp = z[:, :10].flatten().numpy(), z[:, 10:].flatten().numpy()
        for part in (emb, mlp):
            assert abs(part.std() - 1) < 0.12 and stats.kstest(part, "norm").pvalue > 1e-3, part.std()
        assert math.isfinite(float(loss_d.sum()))

    # ---- 4. a NaN / inf in one sample's rows on ONE rank (or in its replicated MLP part) zeroes that sample on
    # every rank, as in a single process: same selection and update as dp_step, finite, counted
    single, sharded = single_and_sharded(data, mcfg, rank, WORLD)
    owner1 = shard_of(single, 1, WORLD)
    selector = make_selector(UniformSelectionConfig(k=7), num_rows=single.num_rows)
    batch = split.batch(torch.arange(40))
    with torch.inference_mode():
        _, g = single.per_sample_row_grads(batch)
        _, local = sharded.per_sample_row_grads(batch)
    sample, lsample = g.sample_ids(), local.sample_ids()
    on1 = (g.rows < single.num_rows) & owner1.is_own(g.rows.clamp(max=single.num_rows - 1))  # rank 1's rows
    j = int(sample[on1][0])
    r = int(g.rows[on1 & (sample == j)][0])
    for bad, in_mlp in ((float("nan"), False), (float("-inf"), False), (float("inf"), True)):
        gv, lv = g.values.clone(), local.values.clone()
        if in_mlp:  # sample j's last MLP row, on both ranks (the replicas)
            gv[int(g.offsets[j + 1]) - 1, 0] = bad
            lv[int(local.offsets[j + 1]) - 1, 0] = bad
        else:
            gv[(sample == j) & (g.rows == r), 1] = bad
            lv[(lsample == j) & (local.rows == r), 1] = bad  # on rank 1 only
        kw = dict(batch_size=40, sampling_rate=0.1, clip1=0.4, clip2=0.05, noise_multiplier=1e-7, selector=selector,
                  ctx=ctx)
        res_s = dp_step(type(g)(**{**g.__dict__, "values": gv}), generator=torch.Generator().manual_seed(3), **kw)
        res_d = dp_step(type(local)(**{**local.__dict__, "values": lv}), generator=torch.Generator().manual_seed(
            100 + rank), layout=RowBlocks(sharded.shard, shared=torch.Generator().manual_seed(3)), **kw)
        assert torch.isfinite(res_d.grad.values).all() and torch.isfinite(res_s.grad.values).all()
        assert torch.equal(res_d.selected, res_s.selected)
        torch.testing.assert_close(gathered(res_d.grad), res_s.grad.to_dense(), rtol=1e-4, atol=1e-7)
        assert int(res_s.stats.nonfinite) == 1 and int(res_d.stats.nonfinite) == 1

    # ---- 5. public rows on row blocks (both ranks own some): with sigma -> 0, the same update as one process on the
    # same selected rows, for the exponential mechanism (blockwise merge) and contribution thresholding (gathered,
    # normalised over every shard: the very selection of one process with the shared seed)
    public = torch.tensor([0, 5, single.num_rows - 1])
    for sel_cfg in (ExponentialSelectionConfig(k=6, epsilon=1.0, score_clip=0.05),
                    GaussianThresholdSelectionConfig(sigma=1e-3, threshold=0.5)):
        kw = dict(batch_size=40, sampling_rate=0.1, clip1=0.4, clip2=0.05, noise_multiplier=1e-7, ctx=ctx)
        selector = make_selector(sel_cfg, num_rows=single.num_rows)
        res_d = dp_step(local, selector=selector, public_rows=public, generator=torch.Generator().manual_seed(
            3 + rank), layout=RowBlocks(sharded.shard, shared=torch.Generator().manual_seed(3)), **kw)
        emb = res_d.selected[res_d.selected < single.num_rows]
        assert bool(torch.isin(public, emb).all()) and emb.numel() > public.numel()
        ref = dp_step(g, selector=_Nothing(), public_rows=emb.sort().values, generator=torch.Generator(), **kw)
        torch.testing.assert_close(gathered(res_d.grad), ref.grad.to_dense(), rtol=1e-4, atol=1e-7)
        if sel_cfg.name == "gaussian_threshold":
            res_s = dp_step(g, selector=selector, public_rows=public, generator=torch.Generator().manual_seed(3),
                            **kw)
            assert torch.equal(res_d.selected, res_s.selected)
    dist.destroy_process_group()


def test_two_processes_match_single_process():
    from widedp.distributed.ranks import free_port

    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)
