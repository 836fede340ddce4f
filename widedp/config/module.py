"""``task: module``: your own ``nn.Module`` and datasets, named by import path, trained by ``widedp train``.

Read by ``widedp.config`` (``TASK_SECTIONS["module"]``)::

    task: module
    data:
      factory: mypkg.data:splits       # f(**kwargs) -> (train, valid, test) map-style datasets, or a dict of them
      kwargs: {num_users: 200}         # keyword arguments of the factory (plain YAML values)
      collate: mypkg.data:collate      # optional: a list of items -> one batch (default: torch's default_collate)
    model:
      factory: mypkg.models:Recommender  # f(**kwargs) -> torch.nn.Module (a class is a factory too)
      kwargs: {dim: 16}
      loss: mypkg.models:per_sample_loss # optional: loss(model, batch) -> [B] per-sample losses (reduction="none");
                                         # without it model(batch) must return them
    train: {...}                       # as for every task (train.optimizer sgd | adam non-private; sgd | lazy_adam |
    dp: {...}                          # adam with DP: table rows by widedp, dense layers by torch.optim SGD / Adam)

The model is trained as ``widedp.PrivacyEngine.make_private`` trains it (``widedp.api``: its wide parts are
``nn.Embedding`` / ``nn.EmbeddingBag`` / torchrec tables, every other trainable layer is dense and noised as
always-selected rows); the factory runs under ``torch.manual_seed(train.seed)`` (its init is public). epsilon
protects one item of the train dataset. The modules must be importable (installed, or on ``PYTHONPATH``); they
are imported when a run or ``widedp epsilon`` starts, never when the config is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from widedp.errors import ConfigError

_REF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def check_ref(key: str, ref: str | None, *, required: bool = True) -> None:
    """``ref`` must read ``package.module:function`` (a dotted attribute after the colon is allowed)."""
    if ref is None and not required:
        return
    if not isinstance(ref, str) or not _REF.match(ref):
        raise ConfigError(f"{key}: expected 'package.module:function', got {ref!r}")


@dataclass(frozen=True)
class _Factory:
    """A section naming a factory (``factory``, its ``kwargs``) and one optional helper function (``_helper``)."""

    factory: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)
    _section, _helper = "", ""

    def __post_init__(self) -> None:
        check_ref(f"{self._section}.factory", self.factory)
        check_ref(f"{self._section}.{self._helper}", getattr(self, self._helper), required=False)


@dataclass(frozen=True)
class ModuleDataConfig(_Factory):
    """Args: factory: ``pkg.module:function`` returning the train, valid and test datasets (a 3-tuple or a dict
    with those keys; each has ``len()`` and ``[i]``, or ``__getitems__``). kwargs: its keyword arguments.
    collate: ``pkg.module:function`` making a batch of a list of items (None: ``default_collate``)."""

    collate: str | None = None
    _section, _helper = "data", "collate"


@dataclass(frozen=True)
class ModuleModelConfig(_Factory):
    """Args: factory: ``pkg.module:function`` returning the ``torch.nn.Module``. kwargs: its keyword arguments.
    loss: ``pkg.module:function``, ``loss(model, batch) -> [B]`` per-sample losses (None: ``model(batch)`` returns
    them)."""

    loss: str | None = None
    _section, _helper = "model", "loss"


DATA_CONFIG = ModuleDataConfig
MODEL_CONFIG = ModuleModelConfig
DATA_PRESETS: dict[str, dict[str, Any]] = {}
