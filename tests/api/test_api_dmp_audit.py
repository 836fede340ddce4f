"""Regression tests for defects an audit found in ``make_private`` on a torchrec ``DistributedModelParallel`` model
(2 gloo processes: ``_leak`` and ``_empty_share`` run among ``test_api_dmp.py``'s tasks, checked by ``check_leak``
and ``check_empty``); each failed before its fix.

- a table's weight read outside its lookup (here a data_parallel table, as a tied output layer would) gets a
  gradient that no check sees on DMP; ``apply_dense`` then steps it with the user's optimizer: a non-private
  update of the table (the one-process engine refuses the same model);
- a rank whose share of a non-empty Poisson batch is empty (likely when the global batch is smaller than the
  world) crashes in the sharded capture's pre-hook (``kjt.to_dict()`` on a stride-0 KJT), although torchrec itself
  runs such a forward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchrec")

N = 48


def _tied_loss(model, weight):
    """Per-sample BCE of the model's logit plus the tags' bag of ``weight`` rows (a read outside the lookup)."""

    def lf(b):
        kjt, y = b
        jt = kjt["tags"]
        own = F.embedding_bag(jt.values(), weight, jt.offsets()[:-1], mode="sum").sum(1)
        return F.binary_cross_entropy_with_logits(model(kjt) + own, y, reduction="none")

    return lf


def _leak(world: int) -> dict:
    """σ and S1 ~ 0: the DP update is ~1e-9, so a table that moves was moved by something else."""
    from api_toys import interactions
    from dmp_toy import collate, held, sharded
    from torch.utils.data import DataLoader

    import widedp
    from widedp.api.capture import UnsupportedModelError

    dmp, _ = sharded("mix", world)
    weight = dmp.module.ebc.embedding_bags["t_tags"].weight  # data_parallel: the whole table on every rank
    lf = _tied_loss(dmp, weight)
    eng = widedp.PrivacyEngine(selection="all", clip1=1e-9, noise_multiplier=1e-9, secure_rng=False)
    dmp, dopt, loader = eng.make_private(dmp, torch.optim.SGD(dmp.parameters(), lr=1.0),
                                         DataLoader(interactions(N, seed=0), batch_size=4, collate_fn=collate),
                                         epochs=1, loss_fn=lf, check_independence=False)
    before = {t.table.name: t.local.view.detach().clone() for t in held(dmp)}
    try:
        for i, batch in enumerate(loader):
            if i >= 3:
                break
            lf(batch).sum().backward()
            dopt.step()
    except UnsupportedModelError as e:
        return {"refused": str(e)}
    return {"moved": {t.table.name: float((t.local.view.detach() - before[t.table.name]).abs().max())
                      for t in held(dmp)}}


def _empty_share(world: int) -> dict:
    """Per-rank batch_size 1 (global b = 2): step 1's Poisson batch (seed 3) has one item, so rank 0's share is
    empty; 6 steps must equal the one-process engine's at b = 2."""
    from api_toys import interactions
    from dmp_toy import held, sharded

    data = interactions(N, seed=0)
    dmp, ref = sharded("mix", world)
    common = dict(selection="all", clip1=1.0, noise_multiplier=1e-9, secure_rng=False, seed=3, accountant="rdp")
    try:
        eng = _train(dmp, data, batch_size=1, **common)
    except Exception as e:  # (the defect: recorded, then this process exits)
        return {"error": f"{type(e).__name__}: {e}"}
    _train(ref, data, batch_size=world, **common)
    sizes = [len(eng.batch_indices(s)) for s in range(6)]
    full = {n: m.weight for n, m in ref.ebc.embedding_bags.named_children()}
    worst = 0.0
    for t in held(dmp):
        (r0, r1), (c0, c1) = t.local.rows, t.local.cols
        worst = max(worst, float((t.local.view.detach() - full[t.table.name.split(".")[-1]][r0:r1, c0:c1])
                                 .abs().max()))
    return {"diff": worst, "sizes": sizes}


def _train(model, data, *, batch_size, **engine):
    """README's loop, 6 DP steps (the first-step checks off: this model has none of what they look for)."""
    from dmp_toy import collate, loss_fn
    from torch.utils.data import DataLoader

    import widedp

    eng = widedp.PrivacyEngine(**engine)
    lf = loss_fn(model)
    model, dopt, loader = eng.make_private(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                           DataLoader(data, batch_size=batch_size, collate_fn=collate), epochs=1,
                                           loss_fn=lf, check_independence=False)
    for i, batch in enumerate(loader):
        if i >= 6:
            break
        lf(batch).sum().backward()
        dopt.step()
    return eng


def test_one_process_refuses_a_table_read_outside_its_lookup() -> None:
    """The reference behaviour: the one-process engine refuses the same model (``check_tables_untouched``)."""
    from api_toys import interactions
    from dmp_toy import ClickModel, collate
    from torch.utils.data import DataLoader

    import widedp
    from widedp.api.capture import UnsupportedModelError

    torch.manual_seed(0)
    model = ClickModel()
    lf = _tied_loss(model, model.ebc.embedding_bags["t_tags"].weight)
    eng = widedp.PrivacyEngine(selection="all", clip1=1.0, noise_multiplier=1.0, secure_rng=False)
    model, dopt, loader = eng.make_private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                           DataLoader(interactions(N, seed=0), batch_size=8, collate_fn=collate),
                                           epochs=1, loss_fn=lf, check_independence=False)
    batch = next(iter(loader))
    lf(batch).sum().backward()
    with pytest.raises(UnsupportedModelError, match="outside its lookup"):
        dopt.step()


def check_leak(leak: dict) -> None:
    """``_leak``'s result on one rank (``tests/api/test_api_dmp.py`` runs it among its 2-process tasks)."""
    if "refused" in leak:
        assert "outside" in leak["refused"], leak
    else:  # the DP update is ~1e-9: any larger move is the user's optimizer on the non-private .grad
        assert max(leak["moved"].values()) < 1e-6, leak


def check_empty(res: dict) -> None:
    """``_empty_share``'s result on one rank."""
    assert "error" not in res, res["error"]
    assert min(res["sizes"]) < 2, res  # the run did have a step whose share was empty on some rank
    assert res["diff"] < 1e-6, res
