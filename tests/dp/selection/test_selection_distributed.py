"""Count and contribution scores over row-sharded tables (two gloo processes): Gaussian thresholding and the sparse
vector on count scores select exactly what a single-process dp_step selects with the same seed (each row's count is
exact on its owner; a contribution's normaliser is all_reduced), with the same spend."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

WORLD = 2


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    from distributed_toy import single_and_sharded, tiny_recsys

    from widedp.config import GaussianThresholdSelectionConfig, SparseVectorSelectionConfig
    from widedp.distributed.ranks import init_process_group
    from widedp.dp.layout import RowBlocks
    from widedp.dp.selection import SelectionContext, make_selector
    from widedp.dp.step import dp_step

    init_process_group(rank, WORLD, port=port, backend="gloo")
    ctx = SelectionContext(epoch=0, num_epochs=1)
    data, split, mcfg = tiny_recsys()
    single, sharded = single_and_sharded(data, mcfg, rank, WORLD)
    cfgs = (GaussianThresholdSelectionConfig(sigma=0.5, threshold=1.5),
            SparseVectorSelectionConfig(epsilon=5.0, threshold=4.0, cutoff=6, score="count", score_clip=40.0))
    for sel_cfg in cfgs:
        selector = make_selector(sel_cfg, num_rows=single.num_rows)
        picked = 0
        for t in range(4):
            batch = split.batch(torch.arange(40 * t, 40 * t + 40))
            kw = dict(batch_size=40, sampling_rate=0.1, clip1=0.4, clip2=0.05, noise_multiplier=1.0,
                      selector=selector, ctx=ctx)
            with torch.inference_mode():
                _, g = single.per_sample_row_grads(batch)
                res_s = dp_step(g, generator=torch.Generator().manual_seed(10 + t), **kw)
                _, local = sharded.per_sample_row_grads(batch)
                res_d = dp_step(local, generator=torch.Generator().manual_seed(100 + rank),
                                layout=RowBlocks(sharded.shard, shared=torch.Generator().manual_seed(10 + t)), **kw)
            assert torch.equal(res_d.selected, res_s.selected), sel_cfg.name
            assert res_d.spend == res_s.spend
            picked += res_s.selected.numel() - single.num_dense_rows
        assert picked > 0, sel_cfg.name  # the scores were not all below the threshold
    import torch.distributed as dist

    dist.destroy_process_group()


def test_count_and_contribution_scores_across_shards():
    from widedp.distributed.ranks import free_port

    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)
