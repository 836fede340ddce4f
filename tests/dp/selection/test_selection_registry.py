"""A new selection mechanism whose privacy loss is an existing kind is its selector class, its config class and one
line in ``widedp.config.SELECTIONS``: the config loader, ``make_selector``, the plan and the step take it as is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from widedp.config import SELECTIONS, config_from_dict
from widedp.dp.rowgrads import PerSampleRows
from widedp.dp.selection import SelectionContext, make_selector
from widedp.dp.selection.base import sample_distinct
from widedp.dp.spend import FreeSpend, Spend
from widedp.dp.step import dp_step
from widedp.run import plan


@dataclass(frozen=True)
class EveryOtherSelector:
    """Toy: every other row, or ``k`` random rows of them (data-independent, free)."""

    k: int
    score_clip: float | None = None
    score_kind: str = "none"

    @classmethod
    def from_config(cls, cfg: Any, *, num_rows: int) -> EveryOtherSelector:
        return cls(k=min(cfg.k, (num_rows + 1) // 2))

    def spend(self) -> Spend:
        return FreeSpend("every_other")

    def select(self, touched: Tensor, scores: Tensor, *, selectable_rows: int, score_sensitivity: float,
               ctx: SelectionContext, generator: torch.Generator) -> Tensor:
        pick = sample_distinct(self.k, (selectable_rows + 1) // 2, exclude=touched.new_zeros(0), generator=generator,
                               device=touched.device)
        return pick * 2


@dataclass(frozen=True)
class EveryOtherConfig:
    name: Literal["every_other"] = "every_other"
    selector: ClassVar[str] = f"{__name__}:EveryOtherSelector"
    k: int = 3


def test_a_new_selection_is_its_two_classes_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(SELECTIONS, "every_other", EveryOtherConfig)  # the one line
    cfg = config_from_dict({"dp": {"selection": {"name": "every_other", "k": 2}, "noise_multiplier": 1.0}})
    sel = make_selector(cfg.dp.selection, num_rows=10)
    assert sel == EveryOtherSelector(k=2)
    assert plan.step_spend(cfg.dp, num_rows=10, batch_size=4, n=100).parts[1] == FreeSpend("every_other")
    g = PerSampleRows(values=torch.ones(3, 2), rows=torch.tensor([1, 4, 7]), offsets=torch.tensor([0, 1, 2, 3]),
                      num_rows=10)
    res = dp_step(g, batch_size=4, sampling_rate=0.04, clip1=1.0, clip2=None, noise_multiplier=1.0, selector=sel,
                  ctx=SelectionContext(epoch=0, num_epochs=1), generator=torch.Generator().manual_seed(0))
    assert res.selected.numel() == 2 and bool((res.selected % 2 == 0).all())
