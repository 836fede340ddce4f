"""The DP-SGD baseline (``dp.engine: opacus``): Opacus 1.6 ``PrivacyEngine`` on the task's Opacus model
(``OpacusCBOW`` for the CBOW, ``widedp.tasks.cbow``), driven by the same loop as widedp's engines.

What is Opacus' and what is ours:

- Opacus: per-sample gradients (``grad_sample_mode="hooks"`` on ``nn.Embedding`` only — the layers where Opacus is
  correct, see ``widedp.models.cbow_opacus``), flat clipping at ``dp.clip1``, Gaussian noise ``dp.noise_multiplier
  * clip1`` on every coordinate, division by the expected batch size b, Poisson sampling through its
  ``DPDataLoader``, and the reported epsilon (its PRV accountant when ``dp.accountant: pld``, its RDP accountant
  otherwise; ``epsilon_rdp`` is always its RDP accountant).
- Ours: the sampling rate is set to exactly q = b/n and the divisor to exactly b (Opacus derives both from
  ``len(data_loader)``, which rounds), the same init as widedp's model for the same seed, the same evaluation (the
  task's model holding the same weights), the spent-budget journal, calibration and the budget stop
  (``widedp.run.trainers.private``: the same Gaussian spend as widedp's ``selection: all``, so both engines get the
  same sigma), and ``epsilon_widedp`` (our accountant on the same steps) as a cross-check.

Randomness: the sampling and noise generators are seeded as widedp's (secret by default, ``widedp.dp.rng``); their
seeds and states live only in ``RUN/private/``. Resume: Opacus' batch sampler cannot replay the lost steps exactly,
so every step the journal reserved stays spent, in our ledger and in Opacus' accountant history alike.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from opacus import PrivacyEngine
from opacus.accountants import RDPAccountant
from opacus.data_loader import DPDataLoader
from torch.utils.data import DataLoader

from widedp import accounting
from widedp.accounting import statement
from widedp.accounting.parts import Costs
from widedp.accounting.registry import ACCOUNTANTS
from widedp.config import Config
from widedp.dp import rng, units
from widedp.errors import ConfigError
from widedp.run.trainers.base import Drawn, Report, StepOutput
from widedp.run.trainers.private import PrivateTrainer
from widedp.tasks.protocol import Built, Task

OPTIMIZERS = ("sgd", "adam")
F = TypeVar("F", bound=Callable[..., Any])


def as_is(batch: Any) -> Any:
    """The collate function of a dataset whose ``__getitems__`` already returns a batch."""
    return batch


def _quiet(fn: F) -> F:
    """Opacus' advice to use its secure RNG (our generators are seeded from the OS CSPRNG, dp.rng), and torch's note
    that the backward hooks fire on an integer-input Embedding: both expected, both noise in every run's output."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Secure RNG turned off")
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]


@dataclass(frozen=True)
class OpacusParts:
    """What the Opacus baseline engine trains: ``module`` (``module(*items) -> [B]`` losses, Opacus-hookable layers
    only), the train split as a map-style ``dataset`` whose ``__getitems__`` returns a tuple of tensors, and
    ``sync(module)``: the task's model with the module's weights (for evaluation)."""

    module: torch.nn.Module
    dataset: Any
    sync: Callable[[torch.nn.Module], Any]


def _cbow_parts(cfg: Config, built: Built) -> OpacusParts:
    """``OpacusCBOW`` (``nn.Embedding`` only) with the built CBOW's weights; evaluation copies them back."""
    from widedp.models.cbow_opacus import OpacusCBOW
    from widedp.tasks.cbow import SplitDataset

    model = built.model

    def sync(module: torch.nn.Module) -> Any:
        model.load_state_dict(module.state_dict())
        return model

    return OpacusParts(OpacusCBOW.from_cbow(model), SplitDataset(built.splits["train"]), sync)


#: The tasks the Opacus baseline trains, and how it adapts each one's built model and data.
OPACUS_PARTS: dict[str, Callable[[Config, Built], OpacusParts]] = {"cbow": _cbow_parts}


def opacus_parts(cfg: Config, built: Built) -> OpacusParts:
    """The Opacus module and dataset of ``cfg.task``, or a ConfigError naming the tasks it trains."""
    adapt = OPACUS_PARTS.get(cfg.task)
    if adapt is None:
        raise ConfigError(f"dp.engine: opacus is the DP-SGD baseline of task {', '.join(OPACUS_PARTS)}; task "
                          f"{cfg.task} trains with dp.engine: widedp")
    return adapt(cfg, built)


def check_opacus_config(cfg: Config) -> None:
    """ConfigError unless ``cfg`` is a DP-SGD config Opacus runs as widedp would."""
    dp = cfg.dp
    if dp is None or dp.engine != "opacus":
        raise ConfigError("dp.engine: the Opacus engine needs a dp: section with engine: opacus")
    if dp.preselect is not None:
        raise ConfigError("dp.preselect: the one-shot row pre-selection needs dp.engine: widedp (Opacus noises "
                          "every row of every layer)")
    if dp.selection.name != "all":
        raise ConfigError(f"dp.selection.name: opacus runs DP-SGD only (all), not {dp.selection.name!r}")
    if dp.clip2 is not None:
        raise ConfigError("dp.clip2: must be null with dp.engine: opacus (Opacus' DP-SGD has no second clip)")
    if cfg.train.optimizer not in OPTIMIZERS:
        raise ConfigError(f"train.optimizer: {cfg.train.optimizer!r} is not available with dp.engine: opacus "
                          f"(expected one of {', '.join(OPTIMIZERS)})")
    if not units.is_per_sample(cfg) or getattr(cfg.data, "vocabulary", "") == "dp":
        raise ConfigError("dp.engine: opacus trains per (target, context) pair with the top-V or a file "
                          "vocabulary; privacy units and data.vocabulary: dp need dp.engine: widedp")


def opacus_epsilons(history: list[tuple[float, float, int]], delta: float) -> dict[str, float | None]:
    """Opacus' RDP and PRV epsilons of an accountant history [(sigma, q, steps)]; PRV None where it fails."""
    if not history:
        return {"rdp": 0.0, "prv": 0.0}
    rdp = RDPAccountant()
    rdp.history = list(history)
    try:  # Opacus' PRV through the accountant registry's adapter (widedp.accounting.opacus_prv)
        prv: float | None = ACCOUNTANTS["opacus_prv"].epsilon([(Costs(q=q, sigma=s), n) for s, q, n in history],
                                                               delta)
    except Exception:  # PRV's domain heuristics fail at extreme settings; RDP stays available
        prv = None
    return {"rdp": float(rdp.get_epsilon(delta)), "prv": prv}


def zero_nonfinite_samples(model: torch.nn.Module) -> int:
    """Zero every per-sample gradient (``p.grad_sample``, all parameters) of a sample with a NaN/inf anywhere, before
    Opacus clips: as in widedp's step, such a sample contributes zero, and no non-finite value reaches the noise.
    Returns how many samples were zeroed."""
    grads = [p.grad_sample for p in model.parameters() if getattr(p, "grad_sample", None) is not None]
    if not grads:
        return 0
    bad = torch.zeros(grads[0].shape[0], dtype=torch.bool, device=grads[0].device)
    for g in grads:
        bad |= ~torch.isfinite(g.reshape(g.shape[0], -1)).all(dim=1)
    if bad.any():
        for g in grads:
            g[bad] = 0
    return int(bad.sum())


def _endless(loader: DataLoader) -> Iterator[Any]:
    while True:
        yield from loader


class OpacusTrainer(PrivateTrainer):
    """Opacus' DP-SGD step (module docstring)."""

    def __init__(self, cfg: Config, out: Path, *, device: torch.device, resumed: bool) -> None:
        check_opacus_config(cfg)
        super().__init__(cfg, out, device=device, resumed=resumed)

    @_quiet
    def setup(self, built: Built, task: Task) -> None:
        cfg, tc = self.cfg, self.cfg.train
        parts = opacus_parts(cfg, built)
        self.facts = statement.for_config(task.privacy(cfg), cfg)
        self.module, self._sync = parts.module, parts.sync
        n, b = len(parts.dataset), tc.batch_size
        self._plan(num_rows=built.model.num_rows, n=n)
        dp, q = self.dp, self.sampling_rate
        if tc.optimizer == "sgd":
            self.optimizer: torch.optim.Optimizer = torch.optim.SGD(self.module.parameters(), lr=tc.lr)
        else:
            self.optimizer = torch.optim.Adam(self.module.parameters(), lr=tc.lr, betas=tc.betas, eps=tc.eps)
        self.sample_gen = rng.generator(self.seeds.sampling)
        self.engine = PrivacyEngine(accountant="rdp")
        self._gsm, self._dp_opt, _ = self.engine.make_private(
            module=self.module, optimizer=self.optimizer,
            data_loader=DataLoader(parts.dataset, batch_size=b, collate_fn=as_is),
            noise_multiplier=dp.noise_multiplier, max_grad_norm=dp.clip1, poisson_sampling=True,
            noise_generator=self.noise_gen, grad_sample_mode="hooks", loss_reduction="mean",
        )
        # Opacus derives q = 1/len(loader) and the divisor int(n q) from a rounded length: set both exactly.
        self._loader = DPDataLoader(parts.dataset, sample_rate=q, collate_fn=as_is, generator=self.sample_gen)
        self._dp_opt.expected_batch_size = b
        self._dp_opt.attach_step_hook(self.engine.accountant.get_optimizer_hook_fn(sample_rate=q))
        self._batches: Iterator[Any] | None = None
        self._nonfinite = 0

    def start(self) -> dict[str, Any]:
        out = super().start()
        out["dp"]["engine"] = "opacus"
        return out

    def sample(self, step: int) -> Drawn:
        if self._batches is None:  # (after a resume has restored the sampling generator)
            self._batches = _endless(self._loader)
        items = tuple(x.to(self.device, non_blocking=True) for x in next(self._batches))
        return Drawn(items, items[0].shape[0])

    @_quiet
    def step(self, drawn: Drawn, epoch: int) -> StepOutput:
        self._dp_opt.zero_grad(set_to_none=True)
        loss = self._gsm(*drawn.batch)
        (loss.sum() / max(drawn.samples, 1)).backward()  # loss_reduction="mean": Opacus rescales by the batch size
        self._nonfinite += zero_nonfinite_samples(self.module)
        self._dp_opt.step()
        self.ledger.add(self.spend)
        return StepOutput(torch.where(torch.isfinite(loss), loss, 0.0).detach().sum())

    def interval_stats(self, steps: int, step: int) -> dict[str, Any]:
        count, self._nonfinite = self._nonfinite, 0
        return self._nonfinite_stats(count, step)

    def eval_model(self) -> Any:
        return self._sync(self.module)

    def _epsilons(self) -> tuple[dict[str, float | None], float, str]:
        """Opacus' epsilons, the headline one (as the summary's) and its accountant (prv | rdp)."""
        e = opacus_epsilons(self.engine.accountant.history, self.dp.delta)
        use_prv = self.dp.accountant == "pld" and e["prv"] is not None
        return e, float(e["prv"] if use_prv else e["rdp"]), "prv" if use_prv else "rdp"  # type: ignore[arg-type]

    def epsilons(self) -> dict[str, Any]:
        if not self.engine.accountant.history:
            return {}
        e, headline, acct = self._epsilons()
        return {"epsilon": headline, "epsilon_accountant": acct, "epsilon_rdp": e["rdp"]}

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "ledger": self.ledger.to_json(),
                "opacus_history": [[float(s), float(r), int(k)] for s, r, k in self.engine.accountant.history]}

    def _reseed(self) -> None:
        super()._reseed()
        rng.seed_generator(self.sample_gen, self.seeds.sampling)

    def load_state_dict(self, ckpt: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(ckpt["optimizer"])
        step = ckpt["step"]
        states = rng.load_states(self.out, step, names=("noise", "sampling"))  # (a damaged file: ConfigError)
        if states is not None:
            path = rng.state_path(self.out, step)
            rng.restore(self.noise_gen, states["noise"], path)
            rng.restore(self.sample_gen, states["sampling"], path)
        else:  # never restart the generators from the seeds: that redraws step 0's batch and noise
            self._restart_randomness(step)
        history = [(float(s), float(r), int(k)) for s, r, k in ckpt["opacus_history"]]
        checkpointed = accounting.Ledger.from_json(ckpt["ledger"])
        # (Opacus' batches are never replayed: journaled steps after the checkpoint stay spent, state or not)
        self.ledger = self._resumed_ledger(ckpt, replayable=False,
                                           lost=None if states is not None else str(rng.state_path(self.out, step)))
        if self.ledger.steps > checkpointed.steps:  # journaled steps after the checkpoint stay spent
            history.append((self.dp.noise_multiplier, self.sampling_rate, self.ledger.steps - checkpointed.steps))
        self.engine.accountant.history = history

    def save_private(self, step: int, *, best: dict[str, Any] | None = None) -> None:
        rng.save_states(self.out, step, {"noise": self.noise_gen.get_state(), "sampling": self.sample_gen.get_state()})

    def report(self, *, stopped: bool) -> Report:
        dp = self.dp
        e, headline, acct = self._epsilons()
        st = statement.for_run(self.facts, epsilon=headline, delta=dp.delta, accountant=f"Opacus {acct.upper()}",
                               private_rng=self.seeds.private)
        section = {"engine": "opacus", **self._dp_summary(stopped=stopped), "epsilon": headline,
                   "epsilon_rdp": e["rdp"], "epsilon_prv": e["prv"],
                   "epsilon_widedp": accounting.epsilon(self.ledger, delta=dp.delta, accountant=dp.accountant)
                   if self.ledger.steps else 0.0,
                   "opacus_history": [list(h) for h in self.engine.accountant.history]}
        title = f"DP-SGD (Opacus), σ={dp.noise_multiplier:.3g}\nε={headline:.3g}, δ={dp.delta:g} per {st.unit}"
        return Report(st, section, title)
