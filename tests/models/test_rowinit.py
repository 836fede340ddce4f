"""``widedp.models.rowinit``: a block of rows drawn piecewise equals, bit for bit, the rows of the whole-table draw,
and leaves the generator where the whole draw leaves it; the ``normal_`` rule its docstring states."""

from __future__ import annotations

import pytest
import torch

from widedp.models import rowinit
from widedp.models.rowinit import uniform_rows_


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("keep", [(0, 37), (0, 0), (5, 6), (13, 29), (29, 37)])
def test_uniform_rows_equal_the_whole_table_draw(monkeypatch, dtype, keep):
    monkeypatch.setattr(rowinit, "CHUNK", 11)  # many chunks, ending mid-row
    whole_gen = torch.Generator().manual_seed(7)
    whole = torch.empty(37, 5, dtype=dtype).uniform_(-0.3, 0.3, generator=whole_gen)
    gen = torch.Generator().manual_seed(7)
    lo, hi = keep
    block = uniform_rows_(torch.full((hi - lo, 5), float("nan"), dtype=dtype), first=lo, num_rows=37, bound=0.3,
                          generator=gen)
    assert torch.equal(block, whole[lo:hi])
    assert torch.equal(gen.get_state(), whole_gen.get_state())  # the next table's draw starts where it should


def test_uniform_rows_of_consecutive_tables_share_one_generator():
    """Two tables drawn from one generator (as a recommender's): each rank's blocks of both equal the whole draws."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.empty(10, 3).uniform_(-1, 1, generator=g), torch.empty(7, 3).uniform_(-2, 2, generator=g)
    for lo_a, hi_a, lo_b, hi_b in ((0, 4, 0, 3), (4, 7, 3, 5), (7, 10, 5, 7)):
        g = torch.Generator().manual_seed(1)
        got_a = uniform_rows_(torch.empty(hi_a - lo_a, 3), first=lo_a, num_rows=10, bound=1.0, generator=g)
        got_b = uniform_rows_(torch.empty(hi_b - lo_b, 3), first=lo_b, num_rows=7, bound=2.0, generator=g)
        assert torch.equal(got_a, a[lo_a:hi_a]) and torch.equal(got_b, b[lo_b:hi_b])


def test_uniform_rows_refuse_rows_outside_the_table_and_non_contiguous_blocks():
    with pytest.raises(ValueError, match=r"rows \[8, 12\) are not rows of a table of 10"):
        uniform_rows_(torch.empty(4, 2), first=8, num_rows=10, bound=1.0, generator=torch.Generator())
    with pytest.raises(ValueError, match="contiguous"):
        uniform_rows_(torch.empty(2, 4).t(), first=0, num_rows=10, bound=1.0, generator=torch.Generator())


@pytest.mark.parametrize(("pieces", "equal"), [((48, 52), True), ((16, 64, 20), True), ((50, 50), False),
                                               ((96, 4), False)])
def test_normal_pieces_equal_the_whole_draw_only_on_16_element_boundaries(pieces, equal):
    """The rule of the module docstring (no table is drawn from ``normal_``; this pins why pieces would not do)."""
    whole = torch.empty(100).normal_(generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    drawn = torch.cat([torch.empty(n).normal_(generator=g) for n in pieces])
    assert torch.equal(drawn, whole) is equal
