"""widedp: differentially private training of wide models (embedding tables) with sparse DP row selection.

The public API, imported on first use (``import widedp`` stays light)::

    engine = widedp.PrivacyEngine(selection=..., clip1=..., clip2=..., noise_multiplier=... | target_epsilon=...)
    model, optimizer, loader = engine.make_private(model, optimizer, data_loader, epochs=..., loss_fn=per_sample_loss)

``PrivacyEngine`` and its errors live in ``widedp.api``; ``dp_step`` (the pure DP step) in ``widedp.dp.step``, on
``PerSampleRows`` (``widedp.dp.rowgrads``).
"""

from __future__ import annotations

import importlib
from typing import Any

#: the version (the one source: pyproject.toml reads it; ``widedp --version`` prints it; every privacy statement records
#: it as ``widedp_version``)
__version__ = "0.1.0"

__all__ = ["BudgetExhausted", "IdOutOfRangeError", "PerSampleRows", "PrivacyEngine", "UnsupportedModelError", "dp_step"]

_HOME = {"BudgetExhausted": "widedp.api", "IdOutOfRangeError": "widedp.api", "PrivacyEngine": "widedp.api",
         "UnsupportedModelError": "widedp.api", "PerSampleRows": "widedp.dp.rowgrads", "dp_step": "widedp.dp.step"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'widedp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
