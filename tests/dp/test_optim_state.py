"""``RowOptimizer.state_tensors``: the state itself (a sharded checkpoint writes and loads it in place, with no copy
of the optimizer state), where ``state_dict`` gives clones."""

from __future__ import annotations

import pytest
import torch

from widedp.dp.optim import make_row_optimizer


@pytest.mark.parametrize("name", ["lazy_adam", "adam"])
def test_state_tensors_are_the_state_and_state_dict_copies_it(name):
    opt = make_row_optimizer(name, [(0, torch.zeros(5, 3)), (5, torch.zeros(4, 3))], lr=0.1)
    live, copy = opt.state_tensors(), opt.state_dict()
    assert list(live) == list(copy) and live
    for k, t in live.items():
        assert torch.equal(t, copy[k]) and t.data_ptr() != copy[k].data_ptr()
        t.fill_(1)  # written in place (as a checkpoint load does): the optimizer's own state changed
        assert bool((opt.state_dict()[k] == 1).all())
