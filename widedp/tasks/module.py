"""``task: module``: a user's ``nn.Module`` and datasets (``widedp.config.module``) trained by the one loop.

    widedp train configs/module_example.yaml --out runs/mine
    widedp train --resume runs/mine
    widedp epsilon configs/module_example.yaml

The model's per-sample row gradients come from ``widedp.api`` (``Capture`` hooks, ``losses_and_rows``), the DP
update from its ``Updater`` (table rows: widedp's row optimizer ``train.optimizer``; dense layers: torch SGD or
Adam with ``train.lr``, ``betas``, ``eps``): a run trains what ``PrivacyEngine.make_private`` trains, with the
loop's checkpoints, journal, budget stop, summary and resume. Checkpoints and ``widedp export --format torch`` hold
the module's own ``state_dict``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import default_collate

from widedp.accounting.statement import UnitFacts
from widedp.api.capture import Capture, IdOutOfRangeError, UnsupportedModelError
from widedp.api.coupling import check_batch_coupling
from widedp.api.per_sample import Layout, empty_rows, losses_and_rows
from widedp.api.update import Updater
from widedp.config import Config
from widedp.dp.rowgrads import PerSampleRows, SparseRows
from widedp.errors import ConfigError
from widedp.tasks.base import LoopTask
from widedp.tasks.protocol import Built

NOT_COVERED = ("anything data.factory or model.factory compute from the private data outside the training steps "
               "(e.g. a vocabulary, an id -> row mapping, the split)",)


def resolve(key: str, ref: str, *, takes: tuple[str, ...] | None = None) -> Callable[..., Any]:
    """The function ``ref`` (``package.module:function``) names; one-line ConfigError naming ``key`` otherwise
    (also when it cannot be called with the positional arguments ``takes``)."""
    mod_name, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except Exception as e:  # ModuleNotFoundError, or the module failed while importing
        raise ConfigError(f"{key}: cannot import {mod_name!r} ({type(e).__name__}: {_first_line(e)}; is it "
                          "installed or on PYTHONPATH?)") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: module {mod_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{key}: {ref} is a {type(obj).__name__}, not a function or class")
    if takes is not None:
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):  # a builtin without a signature: trusted
            return obj
        try:
            sig.bind(*takes)
        except TypeError:
            raise ConfigError(f"{key}: {ref}{sig} cannot be called as f({', '.join(takes)})") from None
    return obj


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else ""


def call(key: str, ref: str, kwargs: dict[str, Any]) -> Any:
    """``resolve(key, ref)(**kwargs)``; an exception inside it is a one-line ConfigError naming ``key``."""
    fn = resolve(key, ref)
    try:
        return fn(**kwargs)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{key}: {ref}(**{key.split('.')[0]}.kwargs) failed: {type(e).__name__}: "
                          f"{_first_line(e)}") from None


def _to(batch: Any, device: torch.device) -> Any:
    """``batch`` with its tensors (in tuples, lists, dicts, or objects with ``.to``, e.g. a KJT) on ``device``."""
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(x, device) for x in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch.to(device) if hasattr(batch, "to") else batch


class DatasetSplit:
    """A map-style dataset as a split of the loop: ``batch(idx)`` collates items ``idx`` (None for an empty
    Poisson batch) and moves them to ``device``."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any], device: torch.device) -> None:
        self.dataset, self.collate, self.device = dataset, collate, device

    def __len__(self) -> int:
        return len(self.dataset)

    def batch_of_items(self, ids: list[int]) -> Callable[[list[int]], Any]:
        """positions -> the batch of those of items ``ids``, fetched once (randomness of ``__getitem__`` frozen)."""
        if hasattr(self.dataset, "__getitems__"):  # it may compute over the items it fetches: call it per sub-batch
            return lambda pos: self.batch(torch.tensor([ids[p] for p in pos], dtype=torch.long))
        items = [self.dataset[i] for i in ids]
        return lambda pos: _to(self.collate([items[p] for p in pos]), self.device)

    def batch(self, idx: Tensor) -> Any:
        ids = idx.tolist()
        if not ids:
            return None
        get = getattr(self.dataset, "__getitems__", None)
        items = get(ids) if get is not None else [self.dataset[i] for i in ids]
        b = self.collate(items)
        return b if self.device.type == "cpu" else _to(b, self.device)


class ModuleModel:
    """The user's module as the loop's model: ``model(batch) -> [B]`` per-sample losses, ``per_sample_row_grads``
    (by ``widedp.api``'s hooks, attached on first use) and ``num_rows`` (the rows of its tables); ``state_dict``,
    ``parameters``, ``train`` / ``eval`` are the module's own."""

    def __init__(self, module: nn.Module, loss: Callable[[nn.Module, Any], Tensor] | None,
                 train: DatasetSplit | None = None) -> None:
        self.module, self._loss, self._train = module, loss, train
        self._capture: Capture | None = None
        self._checked = train is None  # the coupling check runs once, on the train split's first items

    def __call__(self, batch: Any) -> Tensor:
        loss = self.module(batch) if self._loss is None else self._loss(self.module, batch)
        key = "model.factory (its forward)" if self._loss is None else "model.loss"
        if not isinstance(loss, Tensor) or loss.dim() != 1:
            raise ConfigError(f"{key}: must return the [B] per-sample losses (reduction='none'), got "
                              f"{tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__}")
        if not loss.is_floating_point():
            raise ConfigError(f"{key}: must return floating-point per-sample losses, got {loss.dtype}")
        return loss

    def parameters(self) -> Any:
        return self.module.parameters()

    def state_dict(self) -> dict[str, Tensor]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Tensor]) -> Any:
        return self.module.load_state_dict(state)

    def train(self, mode: bool = True) -> ModuleModel:
        self.module.train(mode)
        return self

    def eval(self) -> ModuleModel:
        return self.train(False)

    @property
    def layout(self) -> Layout:
        """The row space (``widedp.api.per_sample.Layout``); hooks the module the first time."""
        if self._capture is None:
            try:
                self._capture = Capture(self.module)
            except UnsupportedModelError as e:
                raise ConfigError(f"model.factory: {e}") from None
            self._layout = Layout.of(self._capture.tables, self._capture.dense_params)
        return self._layout

    @property
    def num_rows(self) -> int:
        return self.layout.table_rows

    def check_samples(self) -> None:
        """Once, on the train split's first items: refuse samples coupled by a batch statistic
        (``widedp.api.coupling``); the per-batch interaction check runs with every ``losses_and_rows``."""
        if self._checked or self._train is None:
            return
        split, lay = self._train, self.layout
        assert self._capture is not None
        with torch.inference_mode(False), torch.enable_grad():
            try:
                check_batch_coupling(self._capture, lay, self, split.batch_of_items(list(range(min(len(split), 16)))),
                                     min(len(split), 16))
            except UnsupportedModelError as e:
                raise ConfigError(f"model.factory: {e}") from None
            except IdOutOfRangeError as e:
                raise ConfigError(f"data.factory: {e}") from None
        self._checked = True

    def per_sample_row_grads(self, batch: Any) -> tuple[Tensor, PerSampleRows]:
        """([B] losses, per-sample rows over the tables then the dense rows); runs autograd even when called in
        ``torch.inference_mode``."""
        lay, device = self.layout, self.layout.tables[0].weight.device
        if batch is None:  # an empty Poisson batch: its step is noise only
            return torch.zeros(0, device=device), empty_rows(lay, device)
        assert self._capture is not None
        self.check_samples()
        with torch.inference_mode(False), torch.enable_grad():
            try:
                return losses_and_rows(self._capture, lay, self, batch)
            except UnsupportedModelError as e:
                raise ConfigError(f"model.factory: {e}") from None
            except IdOutOfRangeError as e:
                raise ConfigError(f"data.factory: {e}") from None


class ModuleUpdate:
    """The DP update of a ``ModuleModel``: ``widedp.api.update.Updater`` (table rows by ``train.optimizer``, dense
    layers by torch SGD / Adam)."""

    def __init__(self, cfg: Config, model: ModuleModel) -> None:
        tc = cfg.train
        params = list(model.parameters())
        dense: torch.optim.Optimizer = (torch.optim.SGD(params, lr=tc.lr) if tc.optimizer == "sgd" else
                                        torch.optim.Adam(params, lr=tc.lr, betas=tc.betas, eps=tc.eps))
        self.updater = Updater(model.layout, dense, tc.optimizer)

    def step(self, grad: SparseRows) -> None:
        with torch.inference_mode(False):  # parameters and optimizer state stay normal tensors
            self.updater.apply(grad)

    def state_dict(self) -> dict[str, Any]:
        return {"tables": self.updater.state_dict(), "dense": self.updater.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updater.load_state_dict(state["tables"])
        self.updater.optimizer.load_state_dict(state["dense"])


def _splits(value: Any) -> Sequence[Any]:
    if isinstance(value, dict) and set(value) >= {"train", "valid", "test"}:
        value = (value["train"], value["valid"], value["test"])
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise ConfigError(f"data.factory: must return (train, valid, test) datasets or a dict with those keys, got "
                          f"{type(value).__name__}")
    for name, ds in zip(("train", "valid", "test"), value):
        if not (hasattr(ds, "__len__") and (hasattr(ds, "__getitem__") or hasattr(ds, "__getitems__"))):
            raise ConfigError(f"data.factory: the {name} dataset ({type(ds).__name__}) has no len() and [i]")
    if len(value[0]) == 0:
        raise ConfigError("data.factory: the train dataset is empty")
    return value


class ModuleTask(LoopTask):
    name = "module"

    def check(self, cfg: Config, *, private: bool) -> None:
        if not private and cfg.train.optimizer == "sparse_adam":
            raise ConfigError("train.optimizer: sparse_adam is not available for task module; use sgd or adam")

    def build(self, cfg: Config, out: Path, *, device: torch.device, data: Any = None, noise_seed: int | None = None,
              resumed: bool = False) -> Built:
        d, m = cfg.data, cfg.model
        collate = resolve("data.collate", d.collate, takes=("items",)) if d.collate is not None else default_collate
        sets = _splits(data if data is not None else call("data.factory", d.factory, d.kwargs))
        splits = {k: DatasetSplit(s, collate, device) for k, s in zip(("train", "valid", "test"), sets)}
        with torch.random.fork_rng():  # the init is public: seeded by train.seed, the global RNG left as it was
            torch.manual_seed(cfg.train.seed)
            module = call("model.factory", m.factory, m.kwargs)
        if not isinstance(module, nn.Module):
            raise ConfigError(f"model.factory: must return a torch.nn.Module, got {type(module).__name__}")
        loss = resolve("model.loss", m.loss, takes=("model", "batch")) if m.loss is not None else None
        return Built(splits, ModuleModel(module.to(device), loss, splits["train"]))

    def privacy(self, cfg: Config) -> UnitFacts:
        return UnitFacts("training example (one item of the train dataset)", NOT_COVERED)

    def row_optimizer(self, cfg: Config, model: ModuleModel) -> ModuleUpdate:
        model.check_samples()  # the DP run's model is checked before anything is spent
        return ModuleUpdate(cfg, model)


TASK = ModuleTask()
