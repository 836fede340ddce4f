"""Two CPU processes (gloo): the row-sharded CBOW (``widedp.models.cbow_sharded``) against the single-process CBOW.

- loss and per-sample gradients: the rows of both ranks together equal ``CBOW.per_sample_row_grads`` (pair and
  padded multi-word contexts, tied and untied tables, repeated negatives);
- one ``dp_step`` on ``RowBlocks`` with every row selected and sigma = 0 equals the single-process update
  (the S1 clip sees each sample's whole gradient across shards).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _batch(v: int, b: int, c: int, k: int, seed: int):
    from widedp.models.cbow import CBOWBatch

    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(v, (b, c), generator=g)
    if c > 1:
        ctx[torch.rand(b, c, generator=g) < 0.3] = -1
    neg = torch.randint(v, (b, k), generator=g)
    neg[:, -1] = neg[:, 0]  # a repeated negative
    return CBOWBatch(torch.randint(v, (b,), generator=g), ctx, neg)


def _gather_rows(g, num_rows: int) -> torch.Tensor:
    dense = g.to_dense()
    dist.all_reduce(dense)
    return dense


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    from widedp.config import AllRowsConfig
    from widedp.distributed.ranks import init_process_group
    from widedp.dp.layout import RowBlocks
    from widedp.dp.selection import SelectionContext, make_selector
    from widedp.dp.step import dp_step
    from widedp.models.cbow import CBOW
    from widedp.models.cbow_sharded import ShardedCBOW, cbow_shard

    init_process_group(rank, WORLD, port=port, backend="gloo")
    torch.set_default_dtype(torch.float64)
    for tied, c in ((False, 1), (False, 4), (True, 3)):
        model = CBOW(11, 5, tied=tied, generator=torch.Generator().manual_seed(1))
        if not tied:
            with torch.no_grad():
                model.output.weight.normal_(generator=torch.Generator().manual_seed(2))
        shard = cbow_shard(model, rank, WORLD)
        sharded = ShardedCBOW(model, shard)
        batch = _batch(11, 6, c, 3, seed=3)
        loss_ref, ref = model.per_sample_row_grads(batch)
        loss, mine = sharded.per_sample_row_grads(batch)
        torch.testing.assert_close(loss, loss_ref)
        torch.testing.assert_close(sharded(batch), loss_ref)
        assert bool(shard.is_own(mine.rows).all())
        torch.testing.assert_close(_gather_rows(mine, model.num_rows), ref.to_dense())

        sel = AllRowsConfig()
        kw = dict(batch_size=4.0, sampling_rate=0.5, clip1=0.05, clip2=None, noise_multiplier=0.0,
                  ctx=SelectionContext(epoch=0, num_epochs=1))
        want = dp_step(ref, selector=make_selector(sel, num_rows=model.num_rows), generator=torch.Generator(), **kw)
        got = dp_step(mine, selector=make_selector(sel, num_rows=shard.num_rows), generator=torch.Generator(),
                      layout=RowBlocks(shard, shared=torch.Generator()), **kw)
        full = torch.zeros(model.num_rows, 5)
        full[got.grad.rows] = got.grad.values
        dist.all_reduce(full)
        ref_full = torch.zeros(model.num_rows, 5)
        ref_full[want.grad.rows] = want.grad.values
        torch.testing.assert_close(full, ref_full)
        assert got.spend == want.spend
    dist.destroy_process_group()


def test_sharded_cbow_matches_single_process():
    from widedp.distributed.ranks import free_port

    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)
