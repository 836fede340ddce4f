"""widedp's front door: DP-sparse training of your own wide model.

    engine = widedp.PrivacyEngine(selection={"name": "exponential", "k": 64, "epsilon": 0.05, "score_clip": 0.05},
                                  clip1=1.0, clip2=1.0, target_epsilon=3.0, delta=1e-5)
    model, optimizer, loader = engine.make_private(model, optimizer, data_loader, epochs=2,
                                                   loss_fn=per_sample_loss, loss_reduction="sum")
    for epoch in range(2):
        for batch in loader:                       # Poisson batches, q = batch_size / len(dataset)
            loss = per_sample_loss(batch)          # [B]: reduction="none"
            loss.sum().backward()                  # one backward: per-sample gradients are recorded by hooks
            optimizer.step()                       # the DP step (widedp.dp.step.dp_step) and the updates
    print(engine.statement().text)                 # (ε, δ) for adding/removing one training example [PLD]

or, without the optimizer protocol, ``engine.step(batch, loss_fn)`` (loss_fn(batch) -> [B] losses).

Each sample's loss must depend on that sample alone (no batch norm — refused —, no in-batch negatives, no batch
statistic: the first batch is checked, ``widedp.api.coupling``; ``loss_fn`` lets the ``optimizer.step()`` loop run
that check) and every trainable parameter must be read inside its module's forward; a dense parameter whose
per-sample gradients do not add up to its gradient, a table read outside its lookup, or a buffer written by the
forward in training mode stops the step with an error.

Every step is ``dp_step`` on the batch's per-sample row gradients (``widedp.api.capture`` / ``per_sample``): clip
each sample at S1 over all it touched (its table rows and the dense layers), select table rows privately among ALL
rows, clip at S2, Gaussian noise on the selected rows and on every dense parameter; the ledger records what it
spent (PLD accountant). Checkpoints: ``model.state_dict()``, ``optimizer.state_dict()`` and ``engine.state_dict()``
(step, ledger, table optimizer state; never a seed) go anywhere; ``engine.save_private(dir)`` writes the secret
seeds and generator state to ``dir/private/`` (mode 0700) — never share it. To resume: rebuild, ``make_private``,
load the three state dicts, then ``engine.load_private(dir)``: the run replays exactly (tested). Without the private
state a resumed run draws fresh secret randomness; the ledger still counts every step up to the checkpoint, but
anything you released from steps after the checkpoint stays spent too (add it with ``engine.ledger.add``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from widedp import accounting
from widedp.accounting.statement import SIZE_NOT_COVERED, PrivacyStatement
from widedp.api.capture import Capture
from widedp.api.coupling import UNCHECKED, FirstStepChecks, random_state
from widedp.api.engine_state import EngineState
from widedp.api.loader import PoissonLoader
from widedp.api.optimizer import DPOptimizer
from widedp.api.per_sample import Layout, batch_size_of, collect, empty_rows, losses_and_rows
from widedp.api.sharded_engine import DMPModel, is_dmp
from widedp.api.update import Updater
from widedp.config import SELECTIONS, DPConfig, SelectionConfig
from widedp.dp import rng
from widedp.dp.rowgrads import PerSampleRows
from widedp.dp.sampling import PoissonSampler
from widedp.dp.selection import SelectionContext, make_selector
from widedp.dp.step import SINGLE_PROCESS, StepStats, dp_step
from widedp.errors import ConfigError
from widedp.run import plan

UNIT_NAMES = {"example": "training example"}


class BudgetExhausted(RuntimeError):
    """The next step would spend more than ``target_epsilon``."""


def selection_config(selection: SelectionConfig | dict[str, Any] | str) -> SelectionConfig:
    """A ``widedp.config`` selection dataclass from itself, a dict ``{"name": ..., **fields}`` or a name."""
    if isinstance(selection, tuple(SELECTIONS.values())):
        return selection  # type: ignore[return-value]
    d = {"name": selection} if isinstance(selection, str) else dict(selection)
    name = d.pop("name", None)
    if name not in SELECTIONS:
        raise ConfigError(f"selection: name must be one of {', '.join(SELECTIONS)}, got {name!r}")
    try:
        return SELECTIONS[name](**d)
    except TypeError as e:
        raise ConfigError(f"selection ({name}): {e}") from None


class PrivacyEngine(EngineState):
    """DP-sparse training of a wide model (see the module docstring).

    Args:
        selection: required: the row selection: a ``widedp.config`` selection dataclass, or a dict like
            ``{"name": "exponential", "k": 64, "epsilon": 0.05, "score_clip": 0.05}`` (``uniform``, ``sparse_vector``,
            ``gaussian_threshold``, ``random_sparsification``, ``all`` = DP-SGD; fields as in ``dp.selection``).
        clip1: required: S1, each sample's L2 clip over everything it touched. clip2: S2, the selected gradient's
            (None: none).
        noise_multiplier: σ, relative to min(S1/b, 2·S2); or None with ``target_epsilon``: σ is calibrated so that
            the planned run (``epochs``) spends at most ``target_epsilon``.
        target_epsilon: also stops the run before a step would spend more (``BudgetExhausted``).
        delta: δ. accountant: ``pld`` (headline) or ``rdp``.
        privacy_unit: what one item of your dataset is ("example", "user", ...): the ε protects one such item.
        secure_rng: False (tests, debugging) derives sampling, selection and noise from ``seed``: NOT private, and
            ``statement()`` says so.
        sampling_rate: q, fixed here (an epoch = round(1/q) steps); None = batch_size / len(dataset), which uses the
            data's size (the statement lists it as not covered).
        noise: ``gaussian`` (default) | ``secure``: floating-point-safe discrete Gaussian noise on a grid (as
            ``dp.noise``; needs ``accountant="rdp"``).
        allow_large_delta: accept a ``delta`` at or above 1/n for n training items (refused otherwise: such a δ
            is met by publishing each item in the clear with probability δ).
    """

    def __init__(self, *, selection: SelectionConfig | dict[str, Any] | str | None = None, clip1: float | None = None,
                 clip2: float | None = None, noise_multiplier: float | None = None,
                 target_epsilon: float | None = None, delta: float = 1e-5, privacy_unit: str = "example",
                 accountant: str = "pld", secure_rng: bool = True, seed: int = 0, sampling_rate: float | None = None,
                 noise: Literal["gaussian", "secure"] = "gaussian", allow_large_delta: bool = False) -> None:
        if selection is None:  # (required: None only to say so in words)
            raise TypeError('PrivacyEngine: pass selection=, the row selection: {"name": "all"} is DP-SGD (every row), '
                            'or e.g. {"name": "exponential", "k": 64, "epsilon": 0.05, "score_clip": 0.05}')
        if clip1 is None:
            raise TypeError("PrivacyEngine: pass clip1=, S1: each sample's L2 clip over everything it touched "
                            "(e.g. clip1=1.0)")
        if noise_multiplier is None and target_epsilon is None:
            raise ConfigError("PrivacyEngine: give noise_multiplier, target_epsilon, or both")
        sigma = 1.0 if noise_multiplier is None else noise_multiplier  # 1.0: a placeholder until calibrated
        self._dp = DPConfig(clip1=clip1, clip2=clip2, noise_multiplier=sigma, delta=delta,
                            accountant=accountant, target_epsilon=target_epsilon,
                            rng="secure" if secure_rng else "reproducible", selection=selection_config(selection),
                            sampling_rate=sampling_rate, noise=noise, allow_large_delta=allow_large_delta)
        self._sigma_given = noise_multiplier is not None
        self.privacy_unit = privacy_unit
        self._seeds = rng.new_seeds(mode=self._dp.rng, seed=seed)
        if not secure_rng:
            warnings.warn("PrivacyEngine(secure_rng=False): the randomness is derived from `seed`: NOT private",
                          stacklevel=2)
        self.ledger = accounting.Ledger()
        self.steps = 0
        self.stopped_by_budget = False
        self.last_stats: StepStats | None = None
        self._capture: Capture | None = None
        self._last_private: int = -1
        self._issued: tuple[int, int] | None = None  # (step, B) of the batch the Poisson loader last yielded
        self._loss_fn: Any = None
        self._checks: FirstStepChecks | None = None  # the first steps' checks (``widedp.api.coupling``)
        self._dmp: DMPModel | None = None  # a torchrec DistributedModelParallel model (``widedp.api.sharded``)

    # --------------------------------------------------------------------------------------------------- setup

    def make_private(self, model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: Any, *,
                     epochs: int | None = None,
                     loss_fn: Callable[[Any], Tensor] | None = None, loss_reduction: Literal["sum", "mean"] = "sum",
                     table_optimizer: str | None = None, check_independence: bool = True,
                     ) -> tuple[nn.Module, DPOptimizer, PoissonLoader]:
        """Hook ``model``, wrap ``optimizer``, and replace ``data_loader`` by Poisson batches of its dataset.

        Args:
            model: any nn.Module whose wide parts are nn.Embedding / nn.EmbeddingBag / torchrec
                EmbeddingBagCollection / EmbeddingCollection; returned as is (hooks attached).
            optimizer: a torch optimizer over ``model.parameters()``: it updates the dense layers with the noisy
                gradient; tables get widedp's row optimizer (``widedp.api.update``).
            data_loader: a DataLoader over a map-style dataset; its ``batch_size`` is b, the expected batch size.
            epochs: required: the planned run (calibration, the loader's length, the selection's epoch schedule).
            loss_fn: batch -> [B] per-sample losses, as your loop computes them. Needed by the ``optimizer.step()``
                loop: its first step checks with it that samples do not interact (``widedp.api.coupling``) and that
                the backward matches ``loss_reduction``; without it that step refuses. (``engine.step(batch,
                loss_fn)`` takes it per step.)
            loss_reduction: what your ``loss.backward()`` runs on: ``sum`` (recommended) or ``mean`` of the [B]
                losses; the first step refuses a backward of the other one.
            table_optimizer: ``sgd`` | ``lazy_adam`` | ``adam`` (None: from ``optimizer``'s type).
            check_independence: False skips the first steps' checks (for a pipeline with randomness the checks cannot
                replay); the statement then lists "samples' independence not checked".
        """
        if self._capture is not None:
            raise RuntimeError("make_private: this engine already trains a model; make a new PrivacyEngine")
        if epochs is None:  # (required: None only to say so in words)
            raise TypeError("make_private: pass epochs=, the planned run's length in epochs (it sets the loader's "
                            "length, sigma's calibration and the budget), e.g. epochs=2")
        if epochs < 1 or loss_reduction not in ("sum", "mean"):
            raise ConfigError(f"make_private: epochs must be >= 1 and loss_reduction sum or mean, got {epochs}, "
                              f"{loss_reduction!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError(f"make_private: loss_fn must be a function batch -> [B] losses, got {type(loss_fn)}")
        dataset, b = data_loader.dataset, data_loader.batch_size
        n = len(dataset)
        if not isinstance(b, int) or not 1 <= b <= n:
            raise ConfigError(f"make_private: data_loader.batch_size must be an int in [1, {n}] (the expected Poisson "
                              f"batch size), got {b!r}")
        self._dmp = DMPModel.of(model, dataset, batch_size=b) if is_dmp(model) else None
        if self._dmp is not None:
            self._seeds = self._dmp.seeds_from_rank0(self._seeds)
        capture = Capture(model) if self._dmp is None else self._dmp.capture()
        try:
            self._setup(capture, optimizer, n=n, b=b, epochs=epochs, table_optimizer=table_optimizer)
        except BaseException:
            capture.remove()
            raise
        self._capture, self._mean, self._loss_fn = capture, loss_reduction == "mean", loss_fn
        loader = PoissonLoader(self, dataset, data_loader.collate_fn)
        self._checks = FirstStepChecks(capture, self.layout, n=n, fetch_items=loader.fetch_items,
                                       collate=data_loader.collate_fn, fetch=loader._fetch,
                                       batched=hasattr(dataset, "__getitems__"), enabled=check_independence,
                                       reduce=None if self._dmp is None else self._dmp.dense_total)
        return model, DPOptimizer(self, optimizer), loader

    def _setup(self, capture: Capture, optimizer: torch.optim.Optimizer, *, n: int, b: int, epochs: int,
               table_optimizer: str | None) -> None:
        """Row space, update, sampling, selection, σ (calibrated when asked) and the budget cap."""
        dmp = self._dmp
        self.layout = Layout.of(capture.tables if dmp is None else dmp.table_list, capture.dense_params)
        self._updater = (Updater(self.layout, optimizer, table_optimizer) if dmp is None
                         else dmp.updater(self.layout, optimizer, table_optimizer))
        self._updater.clear_grads()  # gradients from before make_private are not this run's
        b = b if dmp is None else b * dmp.world  # a DMP loader's batch_size is each rank's: b is all ranks'
        self.n, self.batch_size, self.epochs = n, b, epochs
        if self._dp.delta >= 1 / n and not self._dp.allow_large_delta:
            raise ConfigError(f"make_private: delta={self._dp.delta:g} is not below 1/n = {1 / n:.3g} for n = {n:,} "
                              f"training items: publishing each {self.privacy_unit} in the clear with probability δ "
                              "meets it; pass a smaller delta, or allow_large_delta=True")
        self.sampling_rate = plan.sampling_rate(self._dp, b, n)
        self.steps_per_epoch = plan.steps_per_epoch(b, n, rate=self._dp.sampling_rate)
        self.total_steps = epochs * self.steps_per_epoch
        self._selector = make_selector(self._dp.selection, num_rows=self.layout.table_rows)
        at = {"num_rows": self.layout.table_rows, "batch_size": b, "n": n}  # the privacy plan, as a run's
        if not self._sigma_given:
            self._dp = dataclasses.replace(plan.calibrated(dataclasses.replace(self._dp, calibrate="noise_multiplier"),
                                                           steps=self.total_steps, **at), calibrate="none")
        self.budget_steps = plan.budget_steps(self._dp, plan.step_spend(self._dp, **at))
        self._device = self.layout.tables[0].weight.device
        self._start_randomness(self._seeds)

    def _start_randomness(self, seeds: rng.RunSeeds) -> None:
        self._seeds = seeds
        self._sampler = PoissonSampler(self.n, sampling_rate=self.sampling_rate, seed=seeds.sampling)
        if self._dmp is None:
            self._noise = rng.generator(seeds.noise, self._device)
        else:  # each rank's own generator (its rows' keys and noise), and one every rank shares
            self._noise, self._shared = self._dmp.generators(seeds.noise, self._device)

    @property
    def noise_multiplier(self) -> float:
        """σ (calibrated by ``make_private`` when only ``target_epsilon`` was given)."""
        return self._dp.noise_multiplier

    def remove_hooks(self) -> None:
        """Detach the engine from the model (no more recording or id checks)."""
        if self._capture is not None:
            self._capture.remove()

    # ---------------------------------------------------------------------------------------------------- steps

    def budget_exhausted(self) -> bool:
        """Would the next step spend more than ``target_epsilon``?"""
        return self.budget_steps is not None and self.ledger.steps >= self.budget_steps

    def batch_indices(self, step: int) -> list[int]:
        """The dataset indices of step ``step``'s Poisson batch (a pure function of the secret seed and the step)."""
        return self._sampler.batch(step).tolist()

    def local_items(self, indices: list[int]) -> list[int]:
        """This process's part of a batch's ``indices`` (all of them on one process; on a DMP model, the
        contiguous part [B·r/W, B·(r+1)/W) of rank r of W)."""
        return indices if self._dmp is None else self._dmp.local_items(indices)

    def per_sample_grads(self, batch: Any, loss_fn: Any) -> tuple[Tensor, PerSampleRows]:
        """([B] losses, each sample's gradient over ``self.layout``'s rows) from one forward and one backward of
        ``loss_fn(batch)`` ([B] per-sample losses), without stepping. The first call checks that samples do not
        interact (``widedp.api.coupling``) on the loader's last batch, or on the dataset's first items."""
        cap = self._ready()
        assert self._checks is not None
        self._checks.coupling(loss_fn)
        return losses_and_rows(cap, self.layout, loss_fn, batch,
                               reduce=None if self._dmp is None else self._dmp.dense_total)

    def step(self, batch: Any, loss_fn: Any) -> Tensor:
        """One DP step on ``batch`` (from the loader): loss_fn(batch) -> [B] per-sample losses. Returns them."""
        self._check_budget()
        issued = self._take_issued()
        rng = random_state(self._device)
        loss, g = self.per_sample_grads(batch, loss_fn)
        self._check_size(issued, g.batch_size)
        assert self._checks is not None
        self._checks.replay(g, loss_fn, rng, what="engine.step", reduction=None)
        self._dp_update(g)
        return loss

    def _step_recorded(self) -> None:
        """``optimizer.step()``: the DP step on what the last forward + backward recorded."""
        cap = self._ready()
        try:
            self._check_budget()
            issued = self._take_issued()
            b = batch_size_of(cap.records)
            self._check_size(issued, b)
            checks = self._checks
            assert checks is not None
            if not (checks.coupling_done and checks.replay_done) and self._loss_fn is None:
                raise RuntimeError("optimizer.step(): pass make_private(..., loss_fn=per_sample_loss) (batch -> [B] "
                                   "losses): the first step checks with it that samples do not interact and that "
                                   "the backward matches loss_reduction (this step is not taken)")
            checks.coupling(self._loss_fn)
            g = collect(cap, self.layout, batch=b, scale=float(b) if self._mean else 1.0,
                        reduce=None if self._dmp is None else self._dmp.dense_total)
            checks.replay(g, self._loss_fn, None, what="optimizer.step()", reduction="mean" if self._mean else "sum")
        except Exception:
            cap.clear()  # a refused step's records must not join the next step's
            self._updater.clear_grads()
            raise
        self._dp_update(g)

    def _issue(self, step: int, items: list[int], batch: Any, every: list[int] | None = None) -> None:
        """The loader yields step ``step``'s Poisson ``batch`` of ``items``: the one batch the next step may use.
        ``every``: all processes' items (DMP), whose first ones every rank checks alike (its passes are
        collectives)."""
        self._issued = (step, len(items))
        assert self._checks is not None
        self._checks.issue(items if every is None else every, batch, self._device)

    def _take_issued(self) -> int:
        """The size of the batch the loader issued for this step; refuses a step on any other batch (the
        accountant's q assumes the loader's Poisson batches: a shuffled fixed-size batch is not covered)."""
        issued, self._issued = self._issued, None
        if issued is None or issued[0] != self.steps:
            raise RuntimeError(f"step {self.steps}: no batch from the loader that make_private returned is waiting "
                               "for this step; the ε assumes its Poisson batches, so iterate that loader (not your "
                               "DataLoader) and take one DP step per batch")
        return issued[1]

    def _check_size(self, issued: int, size: int) -> None:
        if size != issued:
            raise RuntimeError(f"step {self.steps}: the step saw {size} samples, the loader's batch has {issued} "
                               "items; each item must be one sample of the forward (the privacy unit is one item)")

    def empty_step(self) -> None:
        """The step of an empty Poisson batch: no data, the same selection and noise, the same spend."""
        self._check_budget()
        self._dp_update(empty_rows(self.layout, self._device))

    def _ready(self) -> Capture:
        if self._capture is None:
            raise RuntimeError("call engine.make_private(model, optimizer, data_loader, epochs=...) first")
        return self._capture

    def _check_budget(self) -> None:
        if self.budget_exhausted():
            self.stopped_by_budget = True
            raise BudgetExhausted(f"step {self.steps}: the next step would exceed target_epsilon="
                                  f"{self._dp.target_epsilon} (spent: ε={self.epsilon():.4g})")

    def _dp_update(self, g: PerSampleRows) -> None:
        dp = self._dp
        epoch = min(self.steps // self.steps_per_epoch, self.epochs - 1)
        with torch.no_grad():
            layout = SINGLE_PROCESS
            if self._dmp is not None:  # the global batch's rows this rank owns, and its own samples' dense rows
                g, layout = self._dmp.global_rows(g, self.layout.always_rows), self._dmp.layout(self._shared)
            res = dp_step(g, batch_size=self.batch_size, sampling_rate=self.sampling_rate, clip1=dp.clip1,
                          clip2=dp.clip2, noise_multiplier=dp.noise_multiplier, selector=self._selector,
                          ctx=SelectionContext(epoch=epoch, num_epochs=self.epochs), generator=self._noise,
                          always_rows=self.layout.always_rows, noise=dp.noise, layout=layout)
            self._updater.apply(res.grad)
        self.ledger.add(res.spend)
        self.steps += 1
        self.last_stats = res.stats

    # ------------------------------------------------------------------------------------------------- privacy

    def epsilon(self, delta: float | None = None) -> float:
        """ε spent so far at ``delta`` (default: the engine's δ), by the engine's accountant."""
        return accounting.epsilon(self.ledger, delta=self._dp.delta if delta is None else delta,
                                  accountant=self._dp.accountant)

    def statement(self) -> PrivacyStatement:
        """The guarantee so far, with its unit and accountant; NOT PRIVATE with ``secure_rng=False``."""
        unit = UNIT_NAMES.get(self.privacy_unit, self.privacy_unit)
        reason = "" if self._seeds.private else ("secure_rng=False: sampling, selection and noise are derived from "
                                                  "the public seed given to PrivacyEngine")
        return PrivacyStatement(self.epsilon(), self._dp.delta, unit, accountant=self._dp.accountant.upper(),
                                not_covered=(() if self._dp.sampling_rate is not None else (SIZE_NOT_COVERED,))
                                + (() if self._checks is None or self._checks.enabled else (UNCHECKED,)),
                                private=self._seeds.private, reason=reason,
                                extra={"noise_multiplier": self.noise_multiplier, "steps": self.steps,
                                       "sampling_rate": self.sampling_rate, "selection": self._dp.selection.name,
                                       **({} if self._dmp is None else self._dmp.describe())})
