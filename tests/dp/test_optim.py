"""Row optimizers vs torch.optim references."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from widedp.dp.optim import make_row_optimizer
from widedp.dp.rowgrads import SparseRows
from widedp.errors import ConfigError

torch.set_num_threads(1)
D = 4


def _tables(n: tuple[int, ...] = (10,), seed: int = 0) -> list[tuple[int, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out, off = [], 0
    for k in n:
        out.append((off, torch.randn(k, D, generator=g, dtype=torch.float64)))
        off += k
    return out


def _grad(rows: list[int], num_rows: int, g: torch.Generator) -> SparseRows:
    r = torch.tensor(rows, dtype=torch.long)
    return SparseRows(rows=r, values=torch.randn(len(rows), D, generator=g, dtype=torch.float64), num_rows=num_rows)


def _feed_sparse(opt: torch.optim.Optimizer, p: torch.Tensor, grad: SparseRows, offset: int = 0) -> None:
    idx = (grad.rows - offset).unsqueeze(0)
    p.grad = torch.sparse_coo_tensor(idx, grad.values, p.shape, check_invariants=True)
    opt.step()


def test_sgd_is_the_obvious_update_on_two_tables():
    tables = _tables((6, 5))
    before = [w.clone() for _, w in tables]
    opt = make_row_optimizer("sgd", tables, lr=0.1)
    g = torch.Generator().manual_seed(1)
    grad = _grad([7, 1, 10, 4], 11, g)  # rows 1, 4 in table 0; 7 -> 1 and 10 -> 4 in table 1
    opt.step(grad)
    dense = grad.to_dense()
    expect = torch.cat(before) - 0.1 * dense
    got = torch.cat([w for _, w in tables])
    torch.testing.assert_close(got, expect, rtol=0, atol=1e-15)
    untouched = (dense == 0).all(1)
    assert torch.equal(got[untouched], torch.cat(before)[untouched])  # bit-identical


@pytest.mark.parametrize(
    ("betas", "steps"),
    [((0.8, 0.95), 6), ((0.5, 0.6), 120), ((0.9, 1 - 1e-8), 4)],  # bias table; past its end; pow fallback
)
def test_lazy_adam_all_rows_every_step_equals_adam(betas, steps):
    (_, w), = _tables((8,))
    ref = nn.Parameter(w.clone())
    torch_opt = torch.optim.Adam([ref], lr=0.01, betas=betas, eps=1e-6)
    opt = make_row_optimizer("lazy_adam", [(0, w)], lr=0.01, betas=betas, eps=1e-6)
    assert (opt._table is None) == (betas[1] > 0.9999)
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        grad = _grad(torch.randperm(8, generator=g).tolist(), 8, g)  # any order
        opt.step(grad)
        ref.grad = grad.to_dense()
        torch_opt.step()
    torch.testing.assert_close(w, ref.detach(), rtol=1e-12, atol=1e-14)


def test_dense_adam_equals_adam_with_zero_gradient_elsewhere():
    tables = _tables((6, 5))
    refs = [nn.Parameter(w.clone()) for _, w in tables]
    torch_opt = torch.optim.Adam(refs, lr=0.05)
    opt = make_row_optimizer("adam", tables, lr=0.05)
    g = torch.Generator().manual_seed(3)
    for i, rows in enumerate(([0, 7], [2], [9, 3, 10], [7])):
        grad = _grad(rows, 11, g)
        opt.step(grad)
        dense = grad.to_dense()
        refs[0].grad, refs[1].grad = dense[:6], dense[6:]
        torch_opt.step()
        if i == 1:
            row0 = tables[0][1][0].clone()
    for (_, w), r in zip(tables, refs):
        torch.testing.assert_close(w, r.detach(), rtol=1e-12, atol=1e-14)
    # row 0 keeps moving on its decaying moments after its last gradient (step 1); lazy Adam would freeze it
    assert (tables[0][1][0] - row0).abs().min() > 1e-3


def test_lazy_adam_matches_sparse_adam_on_a_fixed_row_set():
    # eps ~ 0: SparseAdam adds eps before bias correction, Adam after; with the same rows every step the
    # per-row step counts equal SparseAdam's global count, so the two must agree.
    (_, w), = _tables((9,))
    before = w.clone()
    emb = nn.Embedding(9, D, sparse=True, dtype=torch.float64)
    with torch.no_grad():
        emb.weight.copy_(w)
    sparse_adam = torch.optim.SparseAdam(emb.parameters(), lr=0.02, eps=1e-30)
    opt = make_row_optimizer("lazy_adam", [(0, w)], lr=0.02, eps=1e-30)
    g = torch.Generator().manual_seed(4)
    for _ in range(5):
        grad = _grad([6, 1, 3], 9, g)
        opt.step(grad)
        _feed_sparse(sparse_adam, emb.weight, grad)
    torch.testing.assert_close(w, emb.weight.detach(), rtol=1e-12, atol=1e-14)
    others = [0, 2, 4, 5, 7, 8]
    assert torch.equal(w[others], before[others])  # bit-identical


def test_lazy_adam_counts_steps_per_row():
    # Reference for per-row semantics: one SparseAdam per row, stepped only when that row is given.
    n = 5
    (_, w), = _tables((n,))
    embs = []
    for r in range(n):
        e = nn.Embedding(1, D, sparse=True, dtype=torch.float64)
        with torch.no_grad():
            e.weight.copy_(w[r : r + 1])
        embs.append((e, torch.optim.SparseAdam(e.parameters(), lr=0.02, eps=1e-30)))
    whole = nn.Embedding(n, D, sparse=True, dtype=torch.float64)
    with torch.no_grad():
        whole.weight.copy_(w)
    global_sparse_adam = torch.optim.SparseAdam(whole.parameters(), lr=0.02, eps=1e-30)
    opt = make_row_optimizer("lazy_adam", [(0, w)], lr=0.02, eps=1e-30)
    g = torch.Generator().manual_seed(5)
    schedule = [[0], [0, 2], [0], [0, 2, 4], [4, 0], [1]]  # rows 1, 4 first given late
    for rows in schedule:
        grad = _grad(rows, n, g)
        opt.step(grad)
        _feed_sparse(global_sparse_adam, whole.weight, grad)
        for r, v in zip(grad.rows.tolist(), grad.values):
            e, o = embs[r]
            _feed_sparse(o, e.weight, SparseRows(torch.tensor([0]), v.unsqueeze(0), 1))
    ref = torch.cat([e.weight.detach() for e, _ in embs])
    torch.testing.assert_close(w, ref, rtol=1e-12, atol=1e-14)
    assert torch.equal(opt.state_dict()["steps.0"], torch.tensor([5, 1, 2, 0, 2]))
    # The difference from SparseAdam: row 1 is first given at step 6. Lazy Adam takes a full first step (lr per
    # coordinate); SparseAdam's single counter gives lr * sqrt(1 - b2^6) / (1 - b1^6) * (1 - b1) / sqrt(1 - b2).
    w0 = _tables((n,))[0][1][1]
    first_step_lazy = (w[1] - w0).abs()
    first_step_global = (whole.weight.detach()[1] - w0).abs()
    torch.testing.assert_close(first_step_lazy, torch.full((D,), 0.02, dtype=torch.float64))
    expect = 0.02 * (1 - 0.999**6) ** 0.5 / (1 - 0.9**6) * 0.1 / 0.001**0.5  # = 0.0104
    torch.testing.assert_close(first_step_global, torch.full((D,), expect, dtype=torch.float64))


@pytest.mark.parametrize("name", ["sgd", "lazy_adam", "adam"])
def test_state_dict_round_trip(name):
    tables_a = _tables((6, 5))
    tables_b = [(off, w.clone()) for off, w in tables_a]
    a = make_row_optimizer(name, tables_a, lr=0.03)
    g = torch.Generator().manual_seed(6)
    grads = [_grad(rows, 11, g) for rows in ([1, 8], [2, 3], [8], [0, 10], [5])]
    for grad in grads[:3]:
        a.step(grad)
    buf = io.BytesIO()
    torch.save({"opt": a.state_dict(), "tables": [w for _, w in tables_a]}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    for (_, w), saved in zip(tables_b, ck["tables"]):
        w.copy_(saved)
    b = make_row_optimizer(name, tables_b, lr=0.03)
    b.load_state_dict(ck["opt"])
    for grad in grads[3:]:
        a.step(grad)
        b.step(grad)
    for (_, wa), (_, wb) in zip(tables_a, tables_b):
        assert torch.equal(wa, wb)


@pytest.mark.parametrize("name", ["sgd", "lazy_adam"])
def test_unselected_rows_bit_identical(name):
    tables = [(off, w.float()) for off, w in _tables((50, 40))]
    before = torch.cat([w for _, w in tables]).clone()
    opt = make_row_optimizer(name, tables, lr=0.1)
    g = torch.Generator().manual_seed(7)
    given = set()
    for _ in range(4):
        rows = torch.randperm(90, generator=g)[:7].tolist()
        given.update(rows)
        opt.step(SparseRows(torch.tensor(rows), torch.randn(7, D, generator=g), 90))
    after = torch.cat([w for _, w in tables])
    others = sorted(set(range(90)) - given)
    assert torch.equal(after[others], before[others])
    assert not torch.equal(after[sorted(given)], before[sorted(given)])


def test_empty_step_is_a_no_op():
    tables = [(off, w.float()) for off, w in _tables((5, 5))]
    before = [w.clone() for _, w in tables]
    opt = make_row_optimizer("lazy_adam", tables, lr=0.1)
    opt.step(SparseRows(torch.zeros(0, dtype=torch.long), torch.zeros(0, D), 10))
    assert all(torch.equal(w, b) for (_, w), b in zip(tables, before))


def test_bad_inputs_raise_config_error():
    tables = _tables((4,))
    with pytest.raises(ConfigError, match="train.optimizer"):
        make_row_optimizer("sparse_adam", tables, lr=0.1)
    with pytest.raises(ConfigError, match="train.lr"):
        make_row_optimizer("sgd", tables, lr=0.0)
    lazy = make_row_optimizer("lazy_adam", tables, lr=0.1)
    dense = make_row_optimizer("adam", tables, lr=0.1)
    with pytest.raises(ConfigError, match="optimizer state"):
        lazy.load_state_dict(dense.state_dict())
    with pytest.raises(ValueError, match="adjacent"):
        make_row_optimizer("sgd", [(0, torch.zeros(3, D)), (4, torch.zeros(3, D))], lr=0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["sgd", "lazy_adam", "adam"])
def test_cuda_matches_cpu(name):
    cpu = _tables((6, 5))
    gpu = [(off, w.cuda()) for off, w in cpu]
    a = make_row_optimizer(name, cpu, lr=0.03)
    b = make_row_optimizer(name, gpu, lr=0.03)
    g = torch.Generator().manual_seed(8)
    for rows in ([1, 8], [2, 3, 10], [8]):
        grad = _grad(rows, 11, g)
        a.step(grad)
        b.step(SparseRows(grad.rows.cuda(), grad.values.cuda(), grad.num_rows))
    for (_, wc), (_, wg) in zip(cpu, gpu):
        torch.testing.assert_close(wg.cpu(), wc, rtol=1e-12, atol=1e-14)
