"""CBOW loss, log_prob, closed-form per-sample row gradients, sparse training."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from widedp.dp.rowgrads import coalesce
from widedp.models.cbow import CBOW, CBOWBatch

torch.set_num_threads(1)


def _model(V: int, D: int, tied: bool, *, sparse: bool = False, seed: int = 0) -> CBOW:
    g = torch.Generator().manual_seed(seed)
    m = CBOW(V, D, tied=tied, sparse=sparse, generator=g).double()
    with torch.no_grad():  # O(1) rows so that sigma() is far from 0 and 1 and every term matters
        for _, w in m.row_tables():
            w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float64))
    return m


def _batch(V: int, B: int, C: int, K: int, *, pad: bool, seed: int = 1) -> CBOWBatch:
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(V, (B, C), generator=g)
    if pad:
        ctx[torch.rand(B, C, generator=g) < 0.4] = -1
        ctx[0, :] = -1  # an empty context
        ctx[1, :] = 2  # a repeated context id
    return CBOWBatch(torch.randint(V, (B,), generator=g), ctx, torch.randint(V, (B, K), generator=g))


def test_loss_by_hand_three_words():
    m = CBOW(3, 2, tied=True, sparse=False).double()
    w = torch.tensor([[1.0, 0.5], [0.2, -1.0], [-0.3, 0.4]], dtype=torch.float64)
    with torch.no_grad():
        m.input.weight.copy_(w)
    b = CBOWBatch(torch.tensor([0]), torch.tensor([[1, 2]]), torch.tensor([[2, 1]]))
    h = (w[1] + w[2]) / 2
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expect = -math.log(sig(w[0] @ h)) - math.log(sig(-(w[2] @ h))) - math.log(sig(-(w[1] @ h)))
    assert m(b).item() == pytest.approx(expect, rel=1e-12)
    assert m.per_sample_row_grads(b)[0].item() == pytest.approx(expect, rel=1e-12)
    # untied: the output table is used for target and negatives
    mu = CBOW(3, 2, tied=False, sparse=False).double()
    with torch.no_grad():
        mu.input.weight.copy_(w)
        mu.output.weight.copy_(w.flip(0))
    o = w.flip(0)
    expect = -math.log(sig(o[0] @ h)) - math.log(sig(-(o[2] @ h))) - math.log(sig(-(o[1] @ h)))
    assert mu(b).item() == pytest.approx(expect, rel=1e-12)


@pytest.mark.parametrize("tied", [True, False])
def test_log_prob_is_a_softmax(tied):
    m = _model(7, 3, tied)
    ctx = torch.tensor([[1, -1, 4], [6, 6, 6], [0, -1, -1]])
    lp = m.log_prob(ctx)
    assert lp.shape == (3, 7)
    torch.testing.assert_close(lp.exp().sum(1), torch.ones(3, dtype=torch.float64))
    w_in = m.input.weight.detach()
    w_out = w_in if tied else m.output.weight.detach()
    h = torch.stack([(w_in[1] + w_in[4]) / 2, w_in[6], w_in[0]])
    z = h @ w_out.t()
    torch.testing.assert_close(lp.exp(), z.exp() / z.exp().sum(1, keepdim=True))


def _brute_force(m: CBOW, b: CBOWBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample loss [B] and dense gradient [B, R, D] by autograd, one sample at a time."""
    losses, grads = [], []
    for j in range(len(b)):
        one = CBOWBatch(b.target[j : j + 1], b.context[j : j + 1], b.negatives[j : j + 1])
        m.zero_grad()
        loss = m(one).sum()
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([w.grad for _, w in m.row_tables()]))
    return torch.stack(losses), torch.stack(grads)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("shape", ["pair", "bag"])
def test_per_sample_row_grads_match_autograd(tied, shape):
    V, B, K = 6, 12, 5  # tiny V: repeated negatives and negative == context/target are frequent
    m = _model(V, 3, tied)
    C = 1 if shape == "pair" else 4
    b = _batch(V, B, C, K, pad=shape == "bag")
    loss_ref, dense_ref = _brute_force(m, b)
    with torch.inference_mode():
        loss, psr = m.per_sample_row_grads(b)
    assert psr.num_rows == m.num_rows == (V if tied else 2 * V)
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(psr.to_dense(), dense_ref, rtol=0, atol=1e-6)
    n_pairs = int((b.context >= 0).sum()) + B * (1 + K)
    assert psr.rows.numel() < n_pairs - B  # the batch really has duplicate rows within samples to merge
    # coalesced: grouped by sample, rows unique and sorted within a sample, exactly the rows the sample touches
    assert psr.offsets[0] == 0 and psr.offsets[-1] == psr.rows.numel()
    shift = 0 if tied else V
    for j in range(B):
        rows = psr.rows[psr.offsets[j] : psr.offsets[j + 1]]
        ctx = b.context[j][b.context[j] >= 0]
        touched = torch.cat([ctx, b.target[j : j + 1] + shift, b.negatives[j] + shift]).unique()
        assert torch.equal(rows, touched)
    # same result as the shared reference coalesce applied to the uncoalesced pairs (values compared densely)
    s = psr.sample_ids()
    ref = coalesce(psr.values, psr.rows, s, B, psr.num_rows)
    assert torch.equal(ref.rows, psr.rows) and torch.equal(ref.offsets, psr.offsets)


def test_per_sample_row_grads_float32_and_empty_batch():
    m = CBOW(50, 8, tied=True, generator=torch.Generator().manual_seed(0))
    b = _batch(50, 0, 1, 3, pad=False)
    loss, psr = m.per_sample_row_grads(b)
    assert loss.shape == (0,) and psr.rows.numel() == 0 and psr.offsets.tolist() == [0]
    b = _batch(50, 7, 1, 3, pad=False)
    loss, psr = m.per_sample_row_grads(b)
    assert psr.values.dtype == torch.float32 and not psr.values.requires_grad
    torch.testing.assert_close(loss, m(b).detach())


@pytest.mark.parametrize("tied", [True, False])
def test_sparse_forward_gradients_equal_dense(tied):
    V = 6
    dense = _model(V, 3, tied, sparse=False)
    sparse = _model(V, 3, tied, sparse=True)
    b = _batch(V, 9, 4, 3, pad=True)
    dense(b).mean().backward()
    sparse(b).mean().backward()
    for (_, wd), (_, ws) in zip(dense.row_tables(), sparse.row_tables()):
        assert ws.grad.is_sparse
        torch.testing.assert_close(ws.grad.to_dense(), wd.grad)  # tied: both uses of the one table summed


def _ring_clusters(V: int, group: int, K: int, n: int, g: torch.Generator) -> CBOWBatch:
    """Context: another word of the target's group; negatives: uniform over words other than the target."""
    t = torch.randint(V, (n,), generator=g)
    c = (t // group) * group + (t % group + torch.randint(1, group, (n,), generator=g)) % group
    neg = (t.unsqueeze(1) + torch.randint(1, V, (n, K), generator=g)) % V
    return CBOWBatch(t, c.unsqueeze(1), neg)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("opt", ["sgd", "sparse_adam"])
def test_sparse_training_lowers_the_loss(tied, opt):
    V, D, K = 30, 8, 4
    g = torch.Generator().manual_seed(0)
    m = CBOW(V, D, tied=tied, sparse=True, generator=g)
    o = torch.optim.SGD(m.parameters(), lr=2.0) if opt == "sgd" else torch.optim.SparseAdam(m.parameters(), lr=0.05)
    ev = _ring_clusters(V, 5, K, 2000, torch.Generator().manual_seed(9))
    with torch.no_grad():
        before = m(ev).mean().item()
    assert before == pytest.approx((K + 1) * math.log(2), abs=0.05)  # near-zero init
    for _ in range(200):
        o.zero_grad()
        m(_ring_clusters(V, 5, K, 32, g)).mean().backward()
        o.step()
    with torch.no_grad():
        after = m(ev).mean().item()
    # Tied, random negatives cannot all get a negative score (their mean dot product is >= -|w|^2 / (V - 1)), so
    # only the positive term can fall: the floor is about K log 2 = 2.77. Untied reaches ~1.0 here.
    if tied:
        assert after < before - 0.25
    else:
        assert after < 0.5 * before


def test_layout_and_init():
    V, D = 40, 10
    t = CBOW(V, D, tied=True, init_scale=0.5, generator=torch.Generator().manual_seed(0))
    u = CBOW(V, D, tied=False, init_scale=0.5, generator=torch.Generator().manual_seed(0))
    assert t.num_rows == V and u.num_rows == 2 * V
    assert [(o, tuple(w.shape)) for o, w in t.row_tables()] == [(0, (V, D))]
    assert [(o, tuple(w.shape)) for o, w in u.row_tables()] == [(0, (V, D)), (V, (V, D))]
    assert t.row_tables()[0][1] is t.input.weight and t.out_weight is t.input.weight
    assert u.row_tables()[1][1] is u.output.weight
    assert sum(p.numel() for p in t.parameters()) == V * D  # the paper's V x D parameters
    w = t.input.weight.detach()
    assert w.abs().max() <= 0.5 / D and w.abs().max() > 0.4 / D  # U(-0.5/D, 0.5/D)
    assert torch.equal(u.output.weight.detach(), torch.zeros(V, D))
    again = CBOW(V, D, tied=True, init_scale=0.5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.input.weight, t.input.weight)
    assert isinstance(t.input, nn.EmbeddingBag) and t.input.mode == "mean" and t.input.sparse


def test_batch_to_device():
    b = _batch(5, 3, 2, 2, pad=False).to("cpu")
    assert len(b) == 3 and b.context.shape == (3, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tied", [True, False])
def test_per_sample_row_grads_on_cuda(tied):
    m = _model(6, 3, tied)
    b = _batch(6, 10, 4, 5, pad=True)
    loss, psr = m.per_sample_row_grads(b)
    loss_c, psr_c = m.to("cuda").per_sample_row_grads(b.to("cuda"))
    torch.testing.assert_close(loss_c.cpu(), loss)
    assert torch.equal(psr_c.rows.cpu(), psr.rows) and torch.equal(psr_c.offsets.cpu(), psr.offsets)
    torch.testing.assert_close(psr_c.values.cpu(), psr.values)
