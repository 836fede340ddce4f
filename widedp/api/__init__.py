"""Train your own wide model with DP-sparse steps: ``PrivacyEngine(...).make_private(model, optimizer, loader)``.

See ``widedp.api.engine`` for the protocol, ``widedp.api.capture`` for which modules are supported and how
per-sample gradients are recorded, ``widedp.api.update`` for how your optimizer maps to table-row optimizers.
"""

from widedp.api.capture import IdOutOfRangeError, UnsupportedModelError
from widedp.api.engine import BudgetExhausted, DPOptimizer, PrivacyEngine, selection_config
from widedp.api.loader import PoissonLoader
from widedp.api.per_sample import Layout

__all__ = [
    "BudgetExhausted",
    "DPOptimizer",
    "IdOutOfRangeError",
    "Layout",
    "PoissonLoader",
    "PrivacyEngine",
    "UnsupportedModelError",
    "selection_config",
]
