"""The optimizer ``PrivacyEngine.make_private`` returns: the DP step behind torch's optimizer protocol."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from widedp.api.engine import PrivacyEngine


class DPOptimizer:
    """The optimizer ``make_private`` returns: ``step()`` runs the DP step on the per-sample gradients recorded by the
    last forward + ``backward``; everything else is the original optimizer's (``original_optimizer``; attach LR
    schedulers to it)."""

    def __init__(self, engine: PrivacyEngine, original: torch.optim.Optimizer) -> None:
        self.engine, self.original_optimizer = engine, original

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.original_optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("DPOptimizer.step: closures are not supported (one forward + backward per step)")
        self.engine._step_recorded()

    def state_dict(self) -> dict[str, Any]:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.original_optimizer.load_state_dict(state)
