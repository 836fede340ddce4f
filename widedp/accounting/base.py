"""What an accountant is: a small class that turns a composition of steps, each reduced to its ``Costs``
(``widedp.accounting.parts``), into ε at δ for add/remove adjacency (the max over both directions).

``widedp.accounting.registry.ACCOUNTANTS`` holds one instance of each by name; adding an accountant is a file with a
subclass and one line there. The front door (``widedp.accounting.accountant``) and calibration
(``widedp.accounting.calibrate``) only ever call these methods: no branch on an accountant's name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from widedp.accounting.parts import Costs


class Accountant(ABC):
    """An ε accountant.

    Attributes:
        name: its key in the registry (``dp.accountant``).
        headline: a valid upper bound for every step widedp emits: it may calibrate, stop and head a run (False: a
            baseline, e.g. Opacus' PRV for DP-SGD alone).
        discrete_noise: it accounts for discrete Gaussian noise (``dp.noise: secure``).
        start_from: a cheaper accountant whose answer seeds calibration and the budget search (None: a default).
        max_epsilon: the largest target ε calibration and the budget search solve for (None: any); a higher
            ``dp.target_epsilon`` is refused in one line (e.g. the PLD's grid would not fit in memory).
        method: how it works, in one line (``report``'s ``method``).
    """

    name: ClassVar[str]
    headline: ClassVar[bool] = True
    discrete_noise: ClassVar[bool] = True
    start_from: ClassVar[str | None] = None
    max_epsilon: ClassVar[float | None] = None
    method: ClassVar[str] = ""

    def refusal(self, costs: Costs) -> str | None:
        """Why this accountant cannot account for a step of ``costs`` (None: it can)."""
        if costs.discrete and not self.discrete_noise:
            return f"dp.accountant: {self.name} does not cover dp.noise: secure (discrete Gaussian noise)"
        return None

    @abstractmethod
    def epsilon(self, runs: Sequence[tuple[Costs, int]], delta: float) -> float:
        """ε at ``delta`` of ``count`` steps of each ``(Costs, count)`` (add/remove, max over the directions)."""
