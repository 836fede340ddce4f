"""Non-private training: autograd and ``train.optimizer`` (a torch optimizer) on shuffled batches (no ``dp:``)."""

from __future__ import annotations

from typing import Any

import torch

from widedp.accounting.statement import for_run
from widedp.config import Config
from widedp.dp.sampling import ShuffledBatches
from widedp.errors import ConfigError
from widedp.run import plan
from widedp.run.trainers.base import Drawn, Report, StepOutput
from widedp.tasks.protocol import Built, Task

OPTIMIZERS = ("sgd", "adam", "sparse_adam")


class NonPrivateTrainer:
    """Each step: the mean of the batch's per-sample losses, ``backward``, the optimizer's step. Nothing is spent."""

    dp = None
    prefix_seed = None
    unit_info = None
    is_writer = True

    def __init__(self, cfg: Config, *, device: torch.device) -> None:
        tc = cfg.train
        if tc.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer: {tc.optimizer!r} is not available for non-private training "
                              f"(expected one of {', '.join(OPTIMIZERS)})")
        if tc.optimizer == "sparse_adam" and not getattr(cfg.model, "sparse", True):
            raise ConfigError("train.optimizer: sparse_adam needs model.sparse: true")
        self.cfg, self.device = cfg, device

    def setup(self, built: Built, task: Task) -> None:
        tc = self.cfg.train
        self.module = self._model = built.model
        self.facts = task.privacy(self.cfg)
        self._split = built.splits["train"]
        n = len(self._split)
        self.optimizer = task.optimizer(self.cfg, self.module)
        self._sampler = ShuffledBatches(n, batch_size=tc.batch_size, seed=tc.seed, device=self.device)
        self.per_epoch, self.total = self._sampler.steps_per_epoch, plan.total_steps(self.cfg, n)

    def start(self) -> dict[str, Any]:
        return {"dp": None}

    def sample(self, step: int) -> Drawn:
        idx = self._sampler.batch(step)
        return Drawn(self._split.batch(idx), idx.numel())

    def step(self, drawn: Drawn, epoch: int) -> StepOutput:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.module(drawn.batch)
        loss.mean().backward()
        self.optimizer.step()
        return StepOutput(loss.detach().sum())

    def interval_stats(self, steps: int, step: int) -> dict[str, Any]:
        return {}

    def eval_model(self) -> Any:
        return self._model

    def epsilons(self) -> dict[str, Any]:
        return {}

    def exhausted(self) -> bool:
        return False

    def reserve(self, steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, ckpt: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(ckpt["optimizer"])

    def save_private(self, step: int, *, best: dict[str, Any] | None = None) -> None:
        pass

    def prune_private(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass

    def report(self, *, stopped: bool) -> Report:
        return Report(for_run(self.facts, epsilon=None, delta=None, accountant="", private_rng=True), None,
                      "non-private")
