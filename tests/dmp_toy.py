"""A torchrec model sharded by ``DistributedModelParallel`` on gloo processes, for ``tests/api/test_api_dmp.py``: the
model, its plans, a one-process reference with the same weights, and the training loop of README's torchrec example.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader

FEATURES = {"user": 7, "item": 9, "tags": 5}
DIMS = {"user": 8, "item": 8, "tags": 4}  # torchrec's fused CPU kernels need multiples of 4 columns per slice


class ClickModel(nn.Module):
    """EBC (user SUM, item SUM, tags MEAN) + a 2-layer MLP -> one logit per sample."""

    def __init__(self) -> None:
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        super().__init__()
        pooling = {"user": PoolingType.SUM, "item": PoolingType.SUM, "tags": PoolingType.MEAN}
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name=f"t_{f}", embedding_dim=DIMS[f], num_embeddings=n, feature_names=[f],
                               pooling=pooling[f]) for f, n in FEATURES.items()])
        self.mlp = nn.Sequential(nn.Linear(sum(DIMS.values()), 6), nn.ReLU(), nn.Linear(6, 1))

    def forward(self, kjt: Any) -> Tensor:
        return self.mlp(self.ebc(kjt).values()).squeeze(1)


class CoupledClickModel(ClickModel):
    """``ClickModel`` whose pooled embeddings are centred over the batch: a batch statistic that couples samples."""

    def forward(self, kjt: Any) -> Tensor:
        x = self.ebc(kjt).values()
        return self.mlp(x - x.mean(0, keepdim=True)).squeeze(1)


def collate(items: Sequence[dict[str, Any]]) -> tuple[Any, Tensor]:
    """Items of ``api_toys.interactions`` -> (KJT user/item/tags, labels [B]); an empty list gives an empty batch."""
    from torchrec import KeyedJaggedTensor

    keys = list(FEATURES)
    values = torch.tensor([v for f in keys for it in items for v in it[f]], dtype=torch.long)
    lengths = torch.tensor([len(it[f]) for f in keys for it in items], dtype=torch.long)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths, stride=len(items))
    return kjt, torch.tensor([float(it["label"]) for it in items])


def plan(kind: str, model: ClickModel, world: int) -> dict[str, Any]:
    """DMP keyword arguments: ``default`` (torchrec's planner), ``tw`` (table-wise), ``mix`` (t_user column-wise over
    ranks 0 and 1, t_item table-wise on the last rank, t_tags data-parallel)."""
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    if kind == "default":
        return {}
    per = ({"t_user": table_wise(rank=0), "t_item": table_wise(rank=1), "t_tags": table_wise(rank=world - 1)}
           if kind == "tw" else
           {"t_user": column_wise(ranks=[0, 1]), "t_item": table_wise(rank=world - 1), "t_tags": data_parallel()})
    mp = construct_module_sharding_plan(model.ebc, per_param_sharding=per, local_size=world, world_size=world,
                                        device_type="cpu")
    return {"plan": ShardingPlan({"ebc": mp})}


def sharded(kind: str, world: int, cls: type[ClickModel] = ClickModel) -> tuple[nn.Module, ClickModel]:
    """(the DMP model, an unsharded copy with the same weights): torchrec initialises its shards afresh, so the
    reference's weights are copied into them."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from widedp.api.sharded import discover, sharded_modules

    torch.manual_seed(0)
    model = cls()
    ref = copy.deepcopy(model)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[EmbeddingBagCollectionSharder()],
                                   **plan(kind, model, world))
    full = {n: m.weight for n, m in ref.ebc.embedding_bags.named_children()}
    for t in discover(sharded_modules(dmp.module), rank=dist.get_rank(), world=world):
        if t.local is not None:
            (r0, r1), (c0, c1) = t.local.rows, t.local.cols
            with torch.no_grad():
                t.local.view.copy_(full[t.table.name.split(".")[-1]][r0:r1, c0:c1])
    return dmp, ref


def loss_fn(model: nn.Module, scale: float = 1.0) -> Callable[[Any], Tensor]:
    return lambda b: scale * F.binary_cross_entropy_with_logits(model(b[0]), b[1], reduction="none")


def train(model: nn.Module, data: Sequence[Any], *, batch_size: int, steps: int, scale: float = 1.0,
          **engine: Any) -> Any:
    """README's loop: ``steps`` DP steps of ``model`` (Poisson batches of expected size ``batch_size`` per
    process); returns the engine."""
    import widedp

    lr = engine.pop("lr", 0.5)
    eng = widedp.PrivacyEngine(**engine)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    lf = loss_fn(model, scale)
    model, dopt, loader = eng.make_private(model, opt, DataLoader(data, batch_size=batch_size, collate_fn=collate),
                                           epochs=1, loss_fn=lf)
    for i, batch in enumerate(loader):
        if i >= steps:
            break
        lf(batch).sum().backward()
        dopt.step()
    return eng


def held(dmp: nn.Module) -> list[Any]:
    """This rank's ``ShardedTable``s that hold a slice."""
    from widedp.api.sharded import discover, sharded_modules

    return [t for t in discover(sharded_modules(dmp.module), rank=dist.get_rank(), world=dist.get_world_size())
            if t.local is not None]


def join(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)  # torchrec's planner and DDP notes
